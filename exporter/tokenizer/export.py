"""Every tokenizer a checkpoint ships, as files the torch-free runtime reads, checked against HF before they are kept.

The runtime (``runners/inputs/text.py``) reads ``tokenizer/tokenizer.json`` with the ``tokenizers`` library and
``tokenizer/elx_text.json`` (``runners/inputs/text_rules.py``).  What the export writes there depends on the
tokenizer transformers loads from the checkpoint:

* a ``tokenizers``-backed class (T5, Pegasus, mBART / mBART-50, NLLB, Llama, Whisper, GPT-2, ...; transformers 5
  builds them from ``spiece.model`` / ``sentencepiece.bpe.model`` / ``tokenizer.model`` itself): its
  ``tokenizer.json`` as ``save_pretrained`` writes it;
* a Python class with a converter in ``transformers.convert_slow_tokenizer``: the converter's ``tokenizer.json``;
* MarianMT and M2M100 (Python classes, no converter: SentencePiece pieces looked up in ``vocab.json``): the
  SentencePiece model as a ``tokenizers`` pipeline built by transformers' own ``SpmConverter``
  (``build_tokenizer_from_spm_proto``, the model's normalizer spec, every piece between added tokens prefixed
  as SentencePiece does), the vocabulary as HF's ``convert_tokens_to_ids`` maps piece strings, the ids HF adds
  around a text, and a ``tokenizer.json`` holding each id's token as HF decodes it (Marian: the target side)
  and a SentencePiece decoder;
* anything else (FSMT's Moses pre-tokenization, ByT5's bytes, a class transformers cannot load): nothing; one
  note says why.

What HF's ``decode`` does past the tokenizers decoder is recorded too: the Python classes strip the text,
``clean_up_tokenization`` applies or not, WhisperTokenizer drops a ``<|startofprev|>`` prompt and timestamps.

Then ``exporter/tokenizer/check.py`` holds the runtime's ``Text`` to HF's ``tokenizer(text)`` and
``tokenizer.decode(ids, skip_special_tokens=True)`` on a few hundred strings and id rows.  One difference and
the runtime files are removed (a feature extractor, which ``--audio`` reads, stays): the manifest says
``has_tokenizer: false`` and the note names the first difference.  The language codes are read from the same
tokenizer (``exporter/tokenizer/languages.py``).
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from elx.runners.inputs.text import TOKENIZER_DIR, Text
from elx.runners.inputs.text_rules import PIECES_FILE, RULES_FILE, SOURCE_VOCAB_FILE
from elx.exporter.tokenizer.check import check, id_rows, sample_texts

TOKENIZER_NAMES = ("tokenizer.json", "tokenizer_config.json", "spiece.model", "vocab.json", "sentencepiece.bpe.model",
                   "source.spm", "tokenizer.model", "vocab-src.json", "preprocessor_config.json")
# Python tokenizers that are SentencePiece pieces looked up in a vocabulary: the source model's file, and
# whether a leading ">>xx<<" language code is one token (MarianTokenizer.remove_language_code)
PIECE_TOKENIZERS = {"MarianTokenizer": (lambda hf: hf.spm_files[0], True),
                    "M2M100Tokenizer": (lambda hf: hf.spm_file, False)}


class NotConvertible(Exception):
    """No exact runtime form of this tokenizer (the message says why)."""


@dataclass
class TokenizerExport:
    has_tokenizer: bool = False
    record: dict | None = None  # the manifest's "tokenizer" section
    languages: dict | None = None  # the manifest's "languages" section
    notes: list = field(default_factory=list)


def export_tokenizer(model_folder: str | None, folder: Path, vocab_size: int | None = None) -> TokenizerExport:
    """Save the source's tokenizer (or processor) into ``folder/tokenizer``, add what the runtime needs, check it,
    and read its language codes; ``vocab_size``: the model's output vocabulary (the ids generation can emit; None:
    the ids the tokenizer names)."""
    result = TokenizerExport()
    if not model_folder or not any((Path(model_folder) / n).is_file() for n in TOKENIZER_NAMES):
        return result
    target = folder / TOKENIZER_DIR
    hf, load_error = _save_hf(model_folder, target)
    if hf is None:
        if load_error:
            note = f"transformers cannot load it ({load_error})"
            result.record = {"note": note}
            result.notes.append(f"the tokenizer was not exported: {note}; generate from --input-ids")
        return result
    name = type(hf).__name__
    from elx.exporter.tokenizer.languages import language_table

    text = None
    try:
        runtime = write_runtime_files(hf, target, vocab_size)
        text = Text.load(folder)
        ids = sorted(set(text.tokenizer.get_vocab(with_added_tokens=True).values()))
        specials = [t for t in hf.all_special_tokens if isinstance(t, str)]
        counts, difference = check(hf, text, sample_texts(list(hf.get_vocab()), specials, _codes(hf)), id_rows(ids))
        if difference is not None:
            raise NotConvertible(f"{name}'s runtime form {difference} ({_failed(counts)})")
        result.has_tokenizer = True
        result.record = {"class": name, "runtime": runtime, "check": counts}
    except Exception as why:  # noqa: BLE001 - whatever goes wrong here costs the tokenizer, never the export
        if not isinstance(why, NotConvertible):
            why = NotConvertible(f"its conversion failed ({_said(why)})")
        _remove_runtime_files(model_folder, target)
        text = None
        result.record = {"class": name, "note": str(why)}
        result.notes.append(f"the tokenizer was not exported for run time: {why}; generate from --input-ids (the "
                            "graphs are fine)")
    try:
        result.languages = language_table(hf, text)
    except Exception as why:  # noqa: BLE001 - the codes are an extra: an error here leaves them out, said once
        result.notes.append(f"the language codes of {name} were not read ({_said(why)}); --src-lang / --tgt-lang "
                            "will be refused")
    return result


def _said(err: Exception) -> str:
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0][:120]}" if lines else type(err).__name__


def _failed(counts: dict) -> str:
    checks = 2 * counts["texts"] + counts["id_rows"]
    same = counts["encode_identical"] + counts["decode_identical"] + counts["id_rows_identical"]
    return f"{checks - same} of {checks} checks differ"


def _codes(hf) -> list[str]:
    codes = getattr(hf, "supported_language_codes", None) or []
    return [c for c in codes if isinstance(c, str)]


def _save_hf(model_folder: str, target: Path):
    """Save the processor / tokenizer / feature extractor as HF does; return (the tokenizer or None, why not)."""
    from transformers import AutoFeatureExtractor, AutoProcessor, AutoTokenizer

    error = None
    for loader in (AutoProcessor, AutoTokenizer, AutoFeatureExtractor):
        try:
            loaded = loader.from_pretrained(model_folder, local_files_only=True)
        except Exception as err:  # noqa: BLE001 - a loader that does not apply: try the next
            if loader is AutoTokenizer:
                error = str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
            continue
        loaded.save_pretrained(target)
        tokenizer = getattr(loaded, "tokenizer", loaded)
        if hasattr(tokenizer, "decode") and hasattr(tokenizer, "convert_tokens_to_ids"):
            return tokenizer, None
        if loader is AutoProcessor:
            continue  # a processor without a tokenizer: try the tokenizer alone
        return None, error if loader is AutoFeatureExtractor else None
    return None, error


def _remove_runtime_files(model_folder: str, target: Path) -> None:
    """Take the tokenizer out; keep a feature extractor (Whisper's ``--audio`` reads it from ``tokenizer/``)."""
    shutil.rmtree(target, ignore_errors=True)
    from transformers import AutoFeatureExtractor

    try:
        AutoFeatureExtractor.from_pretrained(model_folder, local_files_only=True).save_pretrained(target)
    except Exception:  # noqa: BLE001 - no feature extractor: nothing to keep
        pass


def write_runtime_files(hf, target: Path, vocab_size: int | None) -> str:
    """Write ``tokenizer.json`` and ``elx_text.json`` for ``hf``; return how the runtime encodes
    (``tokenizer.json`` or ``pieces``); ``NotConvertible`` when no exact form exists."""
    name = type(hf).__name__
    rules = {"format": 1, "decode": {"clean_up": _clean_up(hf)}}
    if name == "WhisperTokenizer":  # WhisperTokenizer.decode: the prompt before the start token, timestamps' text
        rules["decode"]["drop_prompt"] = [hf.convert_tokens_to_ids("<|startofprev|>"),
                                          hf.convert_tokens_to_ids("<|startoftranscript|>")]
        rules["decode"]["remove_pattern"] = hf.timestamp_pat.pattern
    if getattr(hf, "is_fast", False) and hasattr(hf, "backend_tokenizer"):
        if not (target / "tokenizer.json").is_file():
            hf.backend_tokenizer.save(str(target / "tokenizer.json"))
        runtime = "tokenizer.json"
    elif name in PIECE_TOKENIZERS:
        spm_file, language_prefix = PIECE_TOKENIZERS[name]
        rules["encoder"] = _piece_files(hf, Path(spm_file(hf)), language_prefix, target, vocab_size)
        rules["decode"]["strip"] = True  # convert_tokens_to_string strips the SentencePiece text
        runtime = "pieces"
    else:
        from transformers.convert_slow_tokenizer import SLOW_TO_FAST_CONVERTERS, convert_slow_tokenizer

        if name not in SLOW_TO_FAST_CONVERTERS:
            raise NotConvertible(f"{name} has no conversion to the tokenizers library (transformers has no converter "
                                 "for it)")
        try:
            convert_slow_tokenizer(hf).save(str(target / "tokenizer.json"))
        except Exception as err:  # noqa: BLE001 - the converter's own refusal
            raise NotConvertible(f"transformers' converter for {name} failed ({_said(err)})")
        runtime = "tokenizer.json"
    (target / RULES_FILE).write_text(json.dumps(rules, ensure_ascii=False), encoding="utf-8")
    return runtime


def _clean_up(hf) -> bool:
    """Whether HF's decode applies ``clean_up_tokenization`` (a tokenizers-backed class skips it for BPE models)."""
    wanted = bool(getattr(hf, "clean_up_tokenization_spaces", False))
    if wanted and getattr(hf, "is_fast", False) and type(hf.backend_tokenizer.model).__name__ == "BPE":
        return bool(getattr(hf, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False))
    return wanted


def _piece_files(hf, spm_file: Path, language_prefix: bool, target: Path, vocab_size: int | None) -> dict:
    """The encoder of a pieces-and-vocabulary tokenizer (``runners/inputs/text_rules.py``'s ``PieceEncoder``) and
    ``tokenizer.json`` as its decoder; returns the ``encoder`` section of ``elx_text.json``."""
    from tokenizers import AddedToken, Tokenizer, decoders
    from tokenizers.models import WordLevel
    from transformers.convert_slow_tokenizer import SpmConverter, import_protobuf

    if getattr(hf, "split_special_tokens", False):
        raise NotConvertible(f"{type(hf).__name__} splits its special tokens (split_special_tokens), which the runtime "
                             "does not do")
    for token in hf._added_tokens_decoder.values():
        if token.lstrip or token.rstrip or token.single_word:
            raise NotConvertible(f"the added token {token.content!r} strips spaces or matches single words, which the "
                                 "runtime's split does not do")
    proto = import_protobuf().ModelProto()
    proto.ParseFromString(spm_file.read_bytes())
    if proto.trainer_spec.model_type == 1:  # unigram
        vocab = [(p.piece, p.score) for p in proto.pieces]
    elif proto.trainer_spec.model_type == 2:  # BPE
        vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    else:
        raise NotConvertible(f"{spm_file.name} is a SentencePiece model of type {proto.trainer_spec.model_type} "
                             "(only unigram and BPE convert)")
    pieces = SpmConverter.build_tokenizer_from_spm_proto(proto, vocab, legacy=True)
    if pieces is None:
        raise NotConvertible(f"transformers cannot build a tokenizers pipeline from {spm_file.name}")
    pieces.save(str(target / PIECES_FILE))
    unk = hf.convert_tokens_to_ids(hf.unk_token)
    # the strings HF's convert_tokens_to_ids maps to a known id: vocabulary, added tokens, language tokens
    candidates = set(hf.get_vocab()) | set(getattr(hf, "encoder", {})) | set(getattr(hf, "lang_token_to_id", {}))
    candidates |= {p.piece for p in proto.pieces}
    lookup = {}
    for token in sorted(candidates):
        index = hf.convert_tokens_to_ids(token)
        if isinstance(index, int) and (index != unk or token == hf.unk_token):
            lookup[token] = index
    (target / SOURCE_VOCAB_FILE).write_text(json.dumps(lookup, ensure_ascii=False), encoding="utf-8")
    # decoding: each id's token as HF names it (Marian: the target vocabulary), skipped when special, then the
    # SentencePiece text (▁ for spaces; "strip" in elx_text.json)
    names = {}
    named = [*hf.get_vocab().values(), *getattr(hf, "lang_token_to_id", {}).values(),
             *(i for i in getattr(hf, "decoder", {}) if isinstance(i, int))]  # Marian's target ids, M2M100's
    for index in range(max(vocab_size or 0, max(named) + 1)):
        try:
            token = hf.convert_ids_to_tokens(index)
        except (IndexError, KeyError, ValueError):
            break
        if isinstance(token, str) and token not in names:
            names[token] = index
    decoder = Tokenizer(WordLevel(names, unk_token=str(hf.unk_token)))
    steps = [decoders.Replace("▁", " ")] + ([decoders.ByteFallback()] if proto.trainer_spec.byte_fallback else [])
    decoder.decoder = decoders.Sequence([*steps, decoders.Fuse()])
    decoder.add_special_tokens([AddedToken(hf.convert_ids_to_tokens(i), special=True, normalized=False)
                                for i in sorted(set(hf.all_special_ids))])
    decoder.save(str(target / "tokenizer.json"))
    marker = -7  # build_inputs_with_special_tokens around one marker id: the ids HF adds before and after a text
    around = list(hf.build_inputs_with_special_tokens([marker]))
    at = around.index(marker)
    return {"pieces": PIECES_FILE, "piece_unk": int(proto.trainer_spec.unk_id), "vocab": SOURCE_VOCAB_FILE,
            "unk_id": int(unk), "added": {t: int(i) for t, i in hf._added_tokens_encoder.items()},
            "language_prefix": language_prefix, "prefix": around[:at], "suffix": around[at + 1:]}
