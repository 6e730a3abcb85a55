"""The language codes of a translation tokenizer, read from transformers at export (the runtime has no transformers).

Each multilingual family names its languages in its own tokenizer and uses them its own way; the export writes
the manifest's ``languages`` section from HF's tokenizer so that ``--src-lang`` / ``--tgt-lang``
(``runners/inputs/languages.py``) do at run time what HF does:

* ``NllbTokenizer``: codes ``deu_Latn``; source ``[code] text </s>``; target ``forced_bos_token_id``.
* ``MBart50Tokenizer``: codes ``de_DE``; source ``[code] text </s>``; target ``forced_bos_token_id``.
* ``MBartTokenizer`` (cc25): codes ``de_DE``; source ``text </s> [code]``; target ``decoder_start_token_id``.
* ``M2M100Tokenizer``: codes ``de`` (token ``__de__``); source ``[code] text </s>``; target
  ``forced_bos_token_id`` (``get_lang_id``).
* ``MarianTokenizer`` (multi-target): codes ``>>deu<<`` (those in its vocabulary); no source code; the target's
  code starts the text.

The target sides are HF's documented calls (``generate(forced_bos_token_id=tokenizer.convert_tokens_to_ids(code))``,
M2M100's ``get_lang_id``, Marian's ``">>fra<< text"``) and mBART-cc25's ``decoder_start_token_id`` (as its
fine-tuned configs' ``task_specific_params`` set it, e.g. ``translation_en_to_ro``).  The source
side is not assumed but measured: for each code the export sets ``tokenizer.src_lang``, reads which ids HF puts
before and after a text, checks they form one template with the code's id in one place, and holds
the runtime's encoding under that template to HF's on a few strings per code.
"""
from __future__ import annotations

from elx.runners.inputs.languages import LANGUAGE  # the template's place for the code's id
_PROBE = "a b"
_STRINGS = ("Hello world.", "日本語 und Straße, 12 €", "")


def _nllb_codes(hf) -> dict:
    from transformers.models.nllb.tokenization_nllb import FAIRSEQ_LANGUAGE_CODES

    extra = [t for t in getattr(hf, "extra_special_tokens", None) or [] if isinstance(t, str)]
    names = [c for c in FAIRSEQ_LANGUAGE_CODES] + [t for t in extra if len(t) == 8 and t[3] == "_"]
    return {c: hf.convert_tokens_to_ids(c) for c in dict.fromkeys(names)}


# tokenizer class: (its codes → ids, how the target language is given, whether src_lang sets the source's token)
FAMILIES = {
    "NllbTokenizer": (_nllb_codes, "forced_bos_token_id", True),
    "MBart50Tokenizer": (lambda hf: dict(hf.lang_code_to_id), "forced_bos_token_id", True),
    "MBartTokenizer": (lambda hf: dict(hf.lang_code_to_id), "decoder_start_token_id", True),
    "M2M100Tokenizer": (lambda hf: {c: hf.get_lang_id(c) for c in hf.lang_code_to_id}, "forced_bos_token_id", True),
    "MarianTokenizer": (lambda hf: {c: hf.convert_tokens_to_ids(c) for c in hf.supported_language_codes},
                        "text_prefix", False),
}


def language_table(hf, text) -> dict | None:
    """The manifest's ``languages`` section for HF tokenizer ``hf`` (None: no language codes); ``text``: the
    runtime's ``Text`` of the export (None when it has none: the source side is then left out)."""
    family = FAMILIES.get(type(hf).__name__)
    if family is None:
        return None
    read_codes, target, has_source = family
    unk = hf.convert_tokens_to_ids(hf.unk_token) if hf.unk_token is not None else None
    codes = {str(c): int(i) for c, i in read_codes(hf).items() if isinstance(i, int) and i != unk}
    if not codes:
        return None
    table = {"tokenizer": type(hf).__name__, "codes": codes, "target": target}
    if has_source and text is not None:
        source, note = _source_side(hf, codes, text)
        table.update(source)
        if note:
            table["source_note"] = note
    return table


def _source_side(hf, codes: dict, text) -> tuple[dict, str | None]:
    """``{"source": {"prefix": [...], "suffix": [...]}, "default_source": code, "source_checked": n}`` measured
    on HF, or ({}, why not)."""
    default = hf.src_lang
    template, checked = None, 0
    try:
        for code, index in codes.items():
            hf.src_lang = code
            found = _template(hf, index)
            if found is None or (template is not None and found != template):
                return {}, f"the ids {type(hf).__name__} adds for src_lang={code!r} follow no one template"
            template = found
            for string in _STRINGS:
                specials = tuple([index if t == LANGUAGE else t for t in template[side]]
                                 for side in ("prefix", "suffix"))
                if text.encode([string], specials=specials)[0] != list(hf(string)["input_ids"]):
                    return {}, f"src_lang={code!r} encodes {string!r} otherwise than HF"
                checked += 1
    finally:
        hf.src_lang = default
    return {"source": template, "default_source": default, "source_checked": checked}, None


def _template(hf, index: int) -> dict | None:
    """The ids around a text's own, the code's id written as ``LANGUAGE`` (None: no single place for it)."""
    full = list(hf(_PROBE)["input_ids"])
    plain = list(hf(_PROBE, add_special_tokens=False)["input_ids"])
    starts = [i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain]
    if len(starts) != 1 or not plain:
        return None
    prefix, suffix = full[:starts[0]], full[starts[0] + len(plain):]
    if (prefix + suffix).count(index) != 1:
        return None
    return {side: [LANGUAGE if t == index else int(t) for t in ids] for side, ids in (("prefix", prefix),
                                                                                     ("suffix", suffix))}
