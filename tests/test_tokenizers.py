"""Issue 39 parts 2 and 3: every tokenizer a checkpoint ships works at run time (no PyTorch, no transformers), and
language codes (``src_lang`` / ``tgt_lang``) do what HF does.

The tokenizers are real slow-tokenizer folders trained here with SentencePiece (``tests/tokenizer_folders.py``):
Marian (source.spm + target.spm + vocab.json), M2M100, NLLB, mBART, mBART-50, T5, Pegasus, Llama.  The runtime's
``Text`` is held to HF's own tokenizer on strings hypothesis draws; a Marian export takes ``--text``; ``src_lang``
/ ``tgt_lang`` give HF generate's tokens with HF's tokenizer set the same way (NLLB in CI, the others with
``ELX_LONG_TESTS=1``); what cannot be converted is said in one note and recorded as ``has_tokenizer: false``.
"""
from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from elx.exporter.tokenizer.check import check, id_rows, sample_texts
from elx.exporter.tokenizer.export import export_tokenizer
from elx.runners.errors import ElxError
from elx.runners.inputs.text import Text
from elx.runners.manifest import Manifest
from tests.conftest import LONG
from tests.tokenizer_folders import make_folder

pytestmark = pytest.mark.usefixtures("one_torch_thread")
CONVERTED = ("marian", "m2m100", "nllb", "mbart", "mbart50", "t5", "pegasus", "llama")
_TOKENIZERS = {}


@pytest.fixture(scope="module")
def tokenizer_root(tmp_path_factory):
    return tmp_path_factory.mktemp("tokenizers")


def _exported_tokenizer(root, family: str):
    """(HF's tokenizer, the runtime's Text, the export record) of ``family``'s slow folder, exported once."""
    if family not in _TOKENIZERS:
        from transformers import AutoConfig, AutoTokenizer

        source = make_folder(root / "sources", family, with_model=False)
        out = root / "exports" / family
        out.mkdir(parents=True)
        exported = export_tokenizer(str(source), out, AutoConfig.from_pretrained(source).vocab_size)
        _TOKENIZERS[family] = (AutoTokenizer.from_pretrained(source), Text.load(out), exported)
    return _TOKENIZERS[family]


@pytest.mark.parametrize("family", CONVERTED)
def test_export_checks_the_runtime_tokenizer_against_hf(tokenizer_root, family):
    """The export keeps the tokenizer only after every text and id row gave HF's answer, and records the counts."""
    hf, text, exported = _exported_tokenizer(tokenizer_root, family)
    assert exported.has_tokenizer and not exported.notes, exported.notes
    counts = exported.record["check"]
    assert counts["texts"] >= 300 and counts["id_rows"] == 200
    assert counts["encode_identical"] == counts["decode_identical"] == counts["texts"]
    assert counts["id_rows_identical"] == counts["id_rows"]
    assert exported.record["runtime"] == ("pieces" if family in ("marian", "m2m100") else "tokenizer.json")


def _strings(hf):
    vocabulary = sorted(w.replace("▁", "") for w in hf.get_vocab())[:400]
    specials = list(hf.all_special_tokens) + list(getattr(hf, "supported_language_codes", []))
    piece = st.one_of(st.text(st.characters(blacklist_categories=("Cs",)), max_size=5), st.sampled_from(vocabulary),
                      st.sampled_from(specials), st.sampled_from([" ", "  ", "\n", "\t", " \u00a0", "e\u0301", "😀"]))
    return st.lists(piece, max_size=10).map("".join)


@pytest.mark.parametrize("family", CONVERTED)
@settings(max_examples=40 * (10 if LONG else 1), deadline=None, derandomize=not LONG, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_runtime_encodes_and_decodes_as_hf(tokenizer_root, family, data):
    """Drawn strings (any characters, vocabulary words, special tokens, language codes, whitespace runs) encode to
    HF's ids and decode to HF's text; drawn id rows (any id of the vocabulary) decode to HF's text."""
    hf, text, _ = _exported_tokenizer(tokenizer_root, family)
    string = data.draw(_strings(hf), label="text")
    ids = list(hf(string)["input_ids"])
    assert text.encode([string])[0] == ids
    assert text.decode([ids])[0] == hf.decode(ids, skip_special_tokens=True)
    vocabulary = sorted(set(text.tokenizer.get_vocab(with_added_tokens=True).values()))
    row = data.draw(st.lists(st.sampled_from(vocabulary), min_size=1, max_size=16), label="ids")
    assert text.decode([row])[0] == hf.decode(row, skip_special_tokens=True)


def test_a_wrong_runtime_tokenizer_is_caught(tokenizer_root):
    """The check is not vacuous: Marian's runtime form without its final strip decodes otherwise than HF."""
    hf, text, _ = _exported_tokenizer(tokenizer_root, "marian")
    from dataclasses import replace

    wrong = Text(text.tokenizer, False, replace(text.rules, decode=replace(text.rules.decode, strip=False)))
    vocabulary = sorted(set(text.tokenizer.get_vocab(with_added_tokens=True).values()))
    counts, difference = check(hf, wrong, sample_texts(list(hf.get_vocab()), [], []), id_rows(vocabulary))
    assert difference is not None and "where HF gives" in difference
    assert counts["id_rows_identical"] < counts["id_rows"]


def test_marian_encodes_with_the_source_model_and_decodes_the_target_vocabulary(tokenizer_root):
    """Marian: pieces of source.spm looked up in vocab.json, '>>deu<<' starting a text is one token, a character
    source.spm does not know is looked up by its text (vocab.json has it from target.spm), and a piece only
    target.spm has decodes (HF's answers, and the ones the runtime gives)."""
    from tests.tokenizer_folders import TARGET_ONLY

    hf, text, exported = _exported_tokenizer(tokenizer_root, "marian")
    ids = text.encode([">>deu<< kalo mi"])[0]
    assert ids == hf(">>deu<< kalo mi")["input_ids"] and ids[0] == hf.convert_tokens_to_ids(">>deu<<")
    unknown_to_source = f"ka {TARGET_ONLY[0]}{TARGET_ONLY[0]} {TARGET_ONLY[1]}"
    ids = text.encode([unknown_to_source])[0]
    assert ids == hf(unknown_to_source)["input_ids"]
    assert hf.convert_tokens_to_ids(TARGET_ONLY[1]) in ids and hf.unk_token_id in ids  # a run of two: unknown
    import sentencepiece

    source = sentencepiece.SentencePieceProcessor(model_file=str(tokenizer_root / "sources" / "marian" / "source.spm"))
    target_only = [t for t, i in hf.get_vocab().items() if source.piece_to_id(t) == source.unk_id() and
                   t.startswith("▁") and len(t) > 2]
    assert target_only, "the two SentencePiece models share every piece: nothing tested"
    row = [hf.convert_tokens_to_ids(target_only[0]), 0]
    assert text.decode([row])[0] == hf.decode(row, skip_special_tokens=True) == target_only[0][1:]


# -- what cannot be converted: one note, has_tokenizer false ------------------------------------------------------

def test_an_unconvertible_tokenizer_is_a_note_and_no_tokenizer(tmp_path):
    """ByT5's tokenizer (a Python class transformers has no converter for): the export says so in one line,
    records the note and ``has_tokenizer: false``, and leaves no tokenizer the runtime would read."""
    from elx.exporter.export import copy_tokenizer
    from elx.exporter.progress import Progress

    source = make_folder(tmp_path / "sources", "byt5", with_model=False)
    out = tmp_path / "out"
    out.mkdir()
    data = {"dims": {"vocab_size": 384}}
    stream = io.StringIO()
    assert copy_tokenizer(str(source), out, data, Progress("elx export", progress="plain", stream=stream)) is False
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("elx: note: the tokenizer was not exported for run time: "
                                                   "ByT5Tokenizer has no conversion")
    assert data["has_tokenizer"] is False and "no conversion" in data["tokenizer"]["note"]
    assert Text.load(out) is None and "languages" not in data


def test_a_tokenizer_transformers_cannot_load_is_a_note(tmp_path):
    """FSMT's tokenizer needs sacremoses; where transformers cannot load it, the export says why in one note."""
    from transformers import FSMTConfig

    source = tmp_path / "fsmt"
    source.mkdir()
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3, "a</w>": 4}
    for name in ("vocab-src.json", "vocab-tgt.json"):
        (source / name).write_text(json.dumps(vocab))
    (source / "merges.txt").write_text("a b</w> 10\n")
    (source / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "FSMTTokenizer",
                                                              "langs": ["en", "de"]}))
    FSMTConfig(langs=["en", "de"], src_vocab_size=5, tgt_vocab_size=5).save_pretrained(source)
    try:
        import sacremoses  # noqa: F401
    except ImportError:
        exported = export_tokenizer(str(source), tmp_path / "out", 5)
        assert not exported.has_tokenizer and len(exported.notes) == 1
        assert exported.notes[0].startswith("the tokenizer was not exported: transformers cannot load it (")
    else:  # transformers loads it: FSMT's Moses pre-tokenization has no converter
        exported = export_tokenizer(str(source), tmp_path / "out", 5)
        assert not exported.has_tokenizer and "FSMTTokenizer has no conversion" in exported.notes[0]


# -- languages: the manifest's table ------------------------------------------------------------------------------

@pytest.mark.parametrize("family, code, token, target, source", [
    ("nllb", "deu_Latn", "deu_Latn", "forced_bos_token_id", {"prefix": ["language"], "suffix": [2]}),
    ("mbart50", "de_DE", "de_DE", "forced_bos_token_id", {"prefix": ["language"], "suffix": [2]}),
    ("mbart", "de_DE", "de_DE", "decoder_start_token_id", {"prefix": [], "suffix": [2, "language"]}),
    ("m2m100", "de", "__de__", "forced_bos_token_id", {"prefix": ["language"], "suffix": [2]}),
    ("marian", ">>deu<<", ">>deu<<", "text_prefix", None),
])
def test_language_tables(tokenizer_root, family, code, token, target, source):
    """Each family's codes as its HF tokenizer names them, the id HF uses for each (HF's own lookup), the target
    side, and the source template measured on HF (checked for every code)."""
    hf, _, exported = _exported_tokenizer(tokenizer_root, family)
    table = exported.languages
    assert table["codes"][code] == hf.convert_tokens_to_ids(token) and table["target"] == target
    assert table.get("source") == source
    if source is not None:
        assert table["source_checked"] == 3 * len(table["codes"]) and table["default_source"] == hf.src_lang


@pytest.mark.parametrize("family", ["t5", "pegasus", "llama"])
def test_families_without_languages_have_no_table(tokenizer_root, family):
    assert _exported_tokenizer(tokenizer_root, family)[2].languages is None


# -- end to end: exports ------------------------------------------------------------------------------------------

_EXPORTS = {}


def _export(root, family: str):
    """(HF model folder, export folder) of ``family``, with a tiny random model (std 0.06: log-probs spread like a
    trained model's, rows robust), exported once per module."""
    if family not in _EXPORTS:
        from elx.exporter.export import export_model

        source = make_folder(root / "models", family, init_std=0.06)
        _EXPORTS[family] = source, export_model(str(source), root / "model-exports" / family, quiet=True)
    return _EXPORTS[family]


def _hf(source):
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    return AutoTokenizer.from_pretrained(source), AutoModelForSeq2SeqLM.from_pretrained(source).eval()


def _hf_generate(model, tokenizer, texts, **options):
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        return model.generate(**batch, **options).numpy()


TEXTS = ["Hello world, kalo mi.", "Straße 12 日本 😀 the end", "ba"]
RUN = dict(num_beams=3, max_new_tokens=8)


def test_marian_export_takes_text_and_decodes_as_hf(tokenizer_root, capsys):
    """A Marian folder as save_pretrained writes it (source.spm, target.spm, vocab.json, no tokenizer.json):
    ``elx generate --text`` encodes, generates and decodes as HF's MarianTokenizer and generate do; ``--tgt-lang
    deu`` starts the text with ``>>deu<<`` (HF's ``">>deu<< text"``)."""
    from elx.cli import run as elx_run

    source, export = _export(tokenizer_root, "marian")
    manifest = Manifest.load(export)
    assert manifest.data["has_tokenizer"] and manifest.data["tokenizer"]["runtime"] == "pieces"
    tokenizer, model = _hf(source)
    for extra, texts in (([], TEXTS[:2]), (["--tgt-lang", "deu"], [f">>deu<< {t}" for t in TEXTS[:2]])):
        args = [a for t in TEXTS[:2] for a in ("--text", t)]
        capsys.readouterr()
        assert elx_run(["generate", str(export), *args, "--num-beams", "3", "--max-new-tokens", "8",
                        "--format", "jsonl", *extra]) == 0
        rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        hf = _hf_generate(model, tokenizer, texts, **RUN)
        assert [r["tokens"] for r in rows] == [_unpadded(row, model.config.pad_token_id) for row in hf.tolist()]
        assert [r["text"] for r in rows] == tokenizer.batch_decode(hf, skip_special_tokens=True)


def _unpadded(row, pad):
    """HF's row less the padding after its EOS (elx's JSON rows are each sequence's own tokens)."""
    while len(row) > 1 and row[-1] == pad:
        row = row[:-1]
    return row


def _check_languages(root, family: str, src_lang, tgt_lang):
    """Generator.generate(text, src_lang, tgt_lang) against HF: tokenizer.src_lang = src_lang, then generate with
    the target as HF's docs say (forced_bos_token_id / get_lang_id / decoder_start_token_id / '>>deu<< text')."""
    from elx.runners.generate import Generator

    source, export = _export(root, family)
    tokenizer, model = _hf(source)
    generator = Generator.from_folder(export, threads=1)
    out = generator.generate(text=TEXTS, src_lang=src_lang, tgt_lang=tgt_lang, **RUN)
    texts, options = TEXTS, {}
    if src_lang is not None:
        tokenizer.src_lang = src_lang
    if family == "marian":
        texts = [f">>{tgt_lang}<< {t}" for t in TEXTS]
    elif family == "m2m100":
        options["forced_bos_token_id"] = tokenizer.get_lang_id(tgt_lang)
    elif family == "mbart":
        options["decoder_start_token_id"] = tokenizer.convert_tokens_to_ids(tgt_lang)
    else:
        options["forced_bos_token_id"] = tokenizer.convert_tokens_to_ids(tgt_lang)
    hf = _hf_generate(model, tokenizer, texts, **RUN, **options)
    np.testing.assert_array_equal(out.sequences, hf)
    assert out.text == tokenizer.batch_decode(hf, skip_special_tokens=True)
    if options:
        (name, value), = options.items()
        assert (out.sequences[:, 0 if name == "decoder_start_token_id" else 1] == value).all()
    if src_lang is not None:  # the source's language token is where HF puts it, and changes the ids
        ids = generator.encoder_inputs(text=TEXTS[:1], languages=None)["input_ids"][0].tolist()
        from elx.runners.inputs.languages import choose

        chosen = generator.encoder_inputs(text=TEXTS[:1], languages=choose(generator.manifest, src_lang))
        assert chosen["input_ids"][0].tolist() == tokenizer(TEXTS[0])["input_ids"] != ids


def test_nllb_languages_are_hf_languages(tokenizer_root):
    _check_languages(tokenizer_root, "nllb", "deu_Latn", "fra_Latn")


@pytest.mark.skipif(not LONG, reason="CI runs test_nllb_languages_are_hf_languages of this kind; set ELX_LONG_TESTS=1")
@pytest.mark.parametrize("family, src_lang, tgt_lang", [("mbart50", "de_DE", "fr_XX"), ("m2m100", "de", "fr"),
                                                        ("mbart", "de_DE", "ro_RO"), ("marian", None, "fra")])
def test_languages_are_hf_languages(tokenizer_root, family, src_lang, tgt_lang):
    _check_languages(tokenizer_root, family, src_lang, tgt_lang)


# -- refusals -------------------------------------------------------------------------------------------------

def test_unknown_codes_are_refused_with_close_matches(tokenizer_root, capsys):
    from elx.cli import run as elx_run
    from elx.runners.generate import Generator

    _, export = _export(tokenizer_root, "nllb")
    generator = Generator.from_folder(export, threads=1)
    with pytest.raises(ElxError, match=r"unknown tgt_lang 'deu_latn' .*close matches: deu_Latn"):
        generator.generate(text="hi", tgt_lang="deu_latn", max_new_tokens=2)
    with pytest.raises(ElxError, match=r"unknown src_lang 'english' .*202 codes"):
        generator.generate(text="hi", src_lang="english", max_new_tokens=2)
    with pytest.raises(ElxError, match=r"src_lang is written into the text's tokens: pass text, or"):
        generator.generate(input_ids=[[5, 6, 2]], src_lang="deu_Latn", max_new_tokens=2)
    with pytest.raises(ElxError, match=r"tgt_lang sets forced_bos_token_id \(to \d+ for "
                                       r".deu_Latn.\), which the call also gives as 5"):
        generator.generate(text="hi", tgt_lang="deu_Latn", forced_bos_token_id=5, max_new_tokens=2)
    capsys.readouterr()
    assert elx_run(["generate", str(export), "--text", "hi", "--tgt-lang", "fra_latn"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("elx: error: unknown --tgt-lang 'fra_latn'") and \
        "fra_Latn" in err[0]


@pytest.mark.parametrize("family", ["t5", "llama"])
def test_language_options_on_families_without_languages_are_refused(exported, family, capsys):
    """T5 and Llama have no language codes: src_lang / tgt_lang are refused in one line (Python and CLI)."""
    from elx.cli import run as elx_run
    from elx.runners.generate import Generator

    folder = exported(family)
    with pytest.raises(ElxError, match=r"tgt_lang needs language codes, and this model's tokenizer "
                                       "has none"):
        Generator.from_folder(folder, threads=1).generate(input_ids=[[5, 6, 7]], tgt_lang="de", max_new_tokens=2)
    capsys.readouterr()
    assert elx_run(["generate", str(folder), "--input-ids", "5 6 7", "--src-lang", "en"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [err[0]] and err[0].startswith("elx: error: --src-lang needs language codes")


def test_marian_refuses_a_source_language_and_a_target_without_text(tokenizer_root, capsys):
    from elx.cli import run as elx_run

    _, export = _export(tokenizer_root, "marian")
    capsys.readouterr()
    assert elx_run(["generate", str(export), "--text", "hi", "--src-lang", "en"]) == 2
    assert "its codes name the target language: use --tgt-lang" in capsys.readouterr().err
    assert elx_run(["generate", str(export), "--input-ids", "5 6 0", "--tgt-lang", "deu"]) == 2
    assert "--tgt-lang of this Marian model is written into the text's tokens: pass --text," in capsys.readouterr().err
    assert elx_run(["compare", str(export), "--tgt-lang", "deu"]) == 2
    assert capsys.readouterr().err.startswith("elx: error: elx compare draws random input ids")
    from elx.runners.generate import Generator

    with pytest.raises(ElxError, match="stop_strings are not supported yet for this export's tokenizer"):
        Generator.from_folder(export, threads=1).generate(text="hi", stop_strings=["x"], max_new_tokens=2)


def test_the_manifest_records_the_tables_and_refuses_damaged_ones(tokenizer_root):
    """The export's tokenizer and languages sections pass the manifest schema; a language id past the vocabulary,
    a template naming no id and a negative count are refused in one line naming the field."""
    from elx.runners.manifest_schema import check as check_manifest

    _, export = _export(tokenizer_root, "nllb")
    data = json.loads((export / "manifest.json").read_text())
    check_manifest(data, "manifest.json")
    assert data["has_tokenizer"] and data["tokenizer"]["class"] == "NllbTokenizer"
    for path, value, message in [
            (("languages", "codes", "deu_Latn"), 10 ** 6, "languages.codes.deu_Latn is 1000000, not an id in the "
                                                         "vocabulary"),
            (("languages", "source", "prefix"), ["lang"], r"languages.source.prefix\[0\] is a str \('lang'\), not "
                                                          "a token id or 'language'"),
            (("tokenizer", "check", "texts"), -1, "tokenizer.check.texts is -1, not a non-negative integer")]:
        damaged = json.loads(json.dumps(data))
        *parents, last = path
        node = damaged
        for key in parents:
            node = node[key]
        node[last] = value
        with pytest.raises(ElxError, match=message):
            check_manifest(damaged, "manifest.json")


def test_compare_takes_a_target_language(tokenizer_root, capsys):
    from elx.cli import run as elx_run

    _, export = _export(tokenizer_root, "nllb")
    capsys.readouterr()
    assert elx_run(["compare", str(export), "--tgt-lang", "fra_Latn", "--batch-size", "2", "--max-new-tokens", "4",
                    "--threads", "1"]) == 0
    assert "2/2 sequences identical to HF generate" in capsys.readouterr().out


def test_the_marian_export_runs_without_torch_or_transformers(tokenizer_root, tmp_path):
    """The runtime side of the pieces form (tokenizers only): text in, language prefix, text out."""
    from tests.test_runtime_imports import _run

    _, export = _export(tokenizer_root, "marian")
    proc = _run(tmp_path, """
        import sys, elx
        out = elx.Generator.from_folder(sys.argv[1]).generate(text=["Hello world", "kalo"], tgt_lang="deu",
                                                              max_new_tokens=4)
        assert len(out.text) == 2 and "torch" not in sys.modules and "transformers" not in sys.modules
        print("ok")
        """, str(export))
    assert proc.returncode == 0, proc.stderr
