"""``src_lang`` / ``tgt_lang`` (``--src-lang`` / ``--tgt-lang``): a language code → what HF does with it.

The export read each code's token id from HF's tokenizer and measured how HF uses it (the manifest's
``languages`` section, ``exporter/tokenizer/languages.py``): on the source side the ids around the text
(``tokenizer.src_lang = code``: NLLB, mBART-50 and M2M100 put the code first, mBART-cc25 after ``</s>``), on the
target side ``forced_bos_token_id`` (NLLB, mBART-50, M2M100), ``decoder_start_token_id`` (mBART-cc25) or the
code starting the text (multi-target Marian: ``">>deu<< text"``).  Codes are HF's (``deu_Latn``, ``de_DE``,
``de``, ``>>deu<<``; Marian's also without the brackets); an unknown one is refused in one line naming the
closest known codes.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field

from elx.runners.errors import ElxError
from elx.runners.wording import arg

LANGUAGE = "language"  # a template's place for the code's id (exporter/tokenizer/languages.py)


@dataclass(frozen=True)
class LanguageChoice:
    """What the chosen codes change: the ids around a source text, a code starting it, generate options."""
    specials: tuple | None = None  # (prefix ids, suffix ids) for Text.encode
    text_prefix: str | None = None  # Marian: the target code each text starts with
    options: dict = field(default_factory=dict)  # forced_bos_token_id or decoder_start_token_id

    @property
    def needs_text(self) -> bool:
        return self.specials is not None or self.text_prefix is not None

    def texts(self, texts: list[str]) -> list[str]:
        return [f"{self.text_prefix} {t}" for t in texts] if self.text_prefix else list(texts)

    def refuse_without_text(self):
        given = arg("src_lang") if self.specials is not None else f"{arg('tgt_lang')} of this Marian model"
        raise ElxError(f"{given} is written into the text's tokens: pass {arg('text')}, or put the language's token "
                       "in the input ids yourself")


def choose(manifest, src_lang: str | None = None, tgt_lang: str | None = None, options: dict | None = None):
    """The ``LanguageChoice`` for the codes given (None when neither is); ``options``: the call's generate options
    (a target option given both ways is refused)."""
    if src_lang is None and tgt_lang is None:
        return None
    table = manifest.data.get("languages")
    given = arg("src_lang" if src_lang is not None else "tgt_lang")
    if not table or not table.get("codes"):
        hint = f"; Whisper takes {arg('language')}" if "input_features" in manifest.encoder_inputs() else ""
        raise ElxError(f"{given} needs language codes, and this model's tokenizer has none ({manifest.family} export "
                       f"{manifest.folder}){hint}: drop it")
    codes = table["codes"]
    specials = text_prefix = None
    out = {}
    if src_lang is not None:
        source = table.get("source")
        if source is None:
            why = (f"its codes name the target language: use {arg('tgt_lang')}"
                   if table.get("target") == "text_prefix" else
                   "the export has no tokenizer for run time to put it in the text")
            raise ElxError(f"{arg('src_lang')} cannot be used with this model: {why}")
        index = codes[resolve(codes, src_lang, "src_lang")]
        specials = tuple([index if t == LANGUAGE else int(t) for t in source[side]] for side in ("prefix", "suffix"))
    if tgt_lang is not None:
        code = resolve(codes, tgt_lang, "tgt_lang")
        target = table["target"]
        if target == "text_prefix":
            text_prefix = code
        else:
            if (options or {}).get(target) is not None and options[target] != codes[code]:
                raise ElxError(f"{arg('tgt_lang')} sets {target} (to {codes[code]} for {code!r}), which the call "
                               f"also gives as {options[target]}: pass one of them")
            out[target] = codes[code]
    return LanguageChoice(specials, text_prefix, out)


def resolve(codes: dict, code: str, name: str) -> str:
    """``code`` as the table names it (Marian's ``deu`` is ``>>deu<<``); else one line with the close matches."""
    if code in codes:
        return code
    if f">>{code}<<" in codes:
        return f">>{code}<<"
    close = difflib.get_close_matches(code, list(codes), n=5, cutoff=0.6)
    if not close:  # case and brackets aside (DEU_latn, deu), then a few of the codes
        folded = {c.lower().strip("<>_"): c for c in codes}
        close = [folded[m] for m in difflib.get_close_matches(code.lower().strip("<>_"), list(folded), n=5,
                                                              cutoff=0.6)]
    known = f"close matches: {', '.join(close)}" if close else f"codes such as {', '.join(list(codes)[:6])}"
    raise ElxError(f"unknown {arg(name)} {code!r} for this model ({len(codes)} codes; {known})")
