"""``elx.hf`` (issue 42 item 1): the drop-in for transformers' generation models, against the PyTorch model.

Tiny random models with tokenizers trained here (a Metaspace BPE for T5 and GPT-2, a byte-level Whisper tokenizer
with Whisper's special tokens): ``generate(**tokenizer(texts, return_tensors="pt", padding=True))`` greedy and
beam 4 on T5 (a row ends early: HF's padding after EOS), ``return_dict_in_generate`` outputs (scores, beam
indices), transformers' ``text-generation`` pipeline on GPT-2 (a left-padded batch) and ``automatic-speech-
recognition`` pipeline on Whisper with a feature extractor, each equal to the same pipeline on the PyTorch model;
``from_pretrained`` exporting once into its cache, refusing the wrong class, and ``save_pretrained`` round trips.
Each model is exported once per module, by ``from_pretrained`` itself.
"""
from __future__ import annotations

import json
import logging
import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import elx
from elx.exporter.verification.verify import logits_tolerance
from elx.runners.errors import ElxError
from tests.conftest import _t5, make_model_folder

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex bold jugglers near misty "
         "lakes").split()
TEXTS = ["the quick brown fox", "a lazy dog near misty lakes while seven wizards", "hex bold jugglers"]
WHISPER_SPECIAL = ["<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|translate|>", "<|transcribe|>",
                   "<|startoflm|>", "<|startofprev|>", "<|notimestamps|>"]  # <|notimestamps|> last: no timestamps


def _text_tokenizer():
    """A Metaspace BPE trained on made-up sentences: <pad> 0, </s> 1, <unk> 2 (T5's ids)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    corpus = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))) for _ in range(200)]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer, tokenizer.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=128, special_tokens=["<pad>", "</s>", "<unk>"])
    tokenizer.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def _whisper_tokenizer():
    """transformers' WhisperTokenizer over printable ASCII (byte-level, no merges) and Whisper's special tokens."""
    from transformers import WhisperTokenizer

    vocab = {c: i for i, c in enumerate(["Ġ"] + [chr(b) for b in range(33, 127)] + WHISPER_SPECIAL)}
    return WhisperTokenizer(vocab=vocab, merges=[], pad_token="<|endoftext|>",
                            additional_special_tokens=WHISPER_SPECIAL[1:])


def _t5_folder(root, vocab: int):
    """A one-layer T5 whose rows differ (seed 2, spread weights) and two of whose three rows end early (its EOS
    row scaled up; the head is tied, so the embedding too)."""
    torch.manual_seed(2)
    model = _t5(vocab_size=vocab, num_layers=1, num_decoder_layers=1, initializer_factor=5.0).eval()
    with torch.no_grad():
        model.lm_head.weight[1] *= 2.0
    model.save_pretrained(root / "t5")
    return root / "t5"


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """The HF folders, their PyTorch models, the tokenizers, and each loaded through ``from_pretrained`` (which
    exports it into a module-local cache)."""
    from transformers import (AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoModelForSpeechSeq2Seq,
                              WhisperFeatureExtractor)

    from elx.hf import ElxModelForCausalLM, ElxModelForSeq2SeqLM, ElxModelForSpeechSeq2Seq

    root = tmp_path_factory.mktemp("hf-dropin")
    text, speech = _text_tokenizer(), _whisper_tokenizer()
    vocab, start, end = len(speech), speech.convert_tokens_to_ids("<|startoftranscript|>"), speech.eos_token_id
    folders = {  # one layer each side; weights spread enough that the rows differ
        "t5": _t5_folder(root, len(text)),
        "gpt2": make_model_folder(root, "gpt2", vocab_size=len(text), n_layer=1, bos_token_id=1, eos_token_id=1,
                                  initializer_range=0.2),
        "whisper": make_model_folder(root, "whisper", vocab_size=vocab, encoder_layers=1, decoder_layers=1,
                                     decoder_start_token_id=start, eos_token_id=end, pad_token_id=end,
                                     bos_token_id=end, init_std=0.3),
    }
    cache = root / "cache"
    return {
        "folders": folders, "cache": cache, "text": text, "speech": speech,
        "features": WhisperFeatureExtractor(feature_size=80),
        "hf": {"t5": AutoModelForSeq2SeqLM.from_pretrained(folders["t5"]).eval(),
               "gpt2": AutoModelForCausalLM.from_pretrained(folders["gpt2"]).eval(),
               "whisper": AutoModelForSpeechSeq2Seq.from_pretrained(folders["whisper"]).eval()},
        "elx": {"t5": ElxModelForSeq2SeqLM.from_pretrained(folders["t5"], cache_dir=cache, progress=False),
                "gpt2": ElxModelForCausalLM.from_pretrained(folders["gpt2"], cache_dir=cache, progress=False),
                "whisper": ElxModelForSpeechSeq2Seq.from_pretrained(folders["whisper"], cache_dir=cache,
                                                                    progress=False)},
    }


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records = []

    def emit(self, record):
        self.records.append(record)


def _batch(assets, padding_side: str = "right"):
    tokenizer = assets["text"]
    tokenizer.padding_side = padding_side
    return tokenizer(TEXTS, return_tensors="pt", padding=True)


@pytest.mark.parametrize("options", [dict(max_new_tokens=12), dict(num_beams=4, max_new_tokens=12),
                                     dict(num_beams=4, num_return_sequences=2, max_new_tokens=12, length_penalty=0.5)],
                         ids=["greedy", "beam4", "beam4-2-returned"])
def test_seq2seq_generate_is_hf(assets, options):
    """``model.generate(**tokenizer(texts, return_tensors="pt", padding=True), ...)``: HF's LongTensor, same shape,
    padding after an early EOS and order of returned sequences."""
    batch = _batch(assets)
    expected = assets["hf"]["t5"].generate(**batch, **options)
    got = assets["elx"]["t5"].generate(**batch, **options)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.int64 and got.device == torch.device("cpu")
    assert got.shape == expected.shape and torch.equal(got, expected)
    assert (got[:, 1:-1] == 1).any(), "no row stopped early: the test would not see HF's padding after EOS"
    assert len({tuple(row) for row in got.tolist()}) > 1


def test_inputs_as_numpy_lists_and_positional(assets):
    """The main input positionally (HF's ``inputs``), as numpy arrays or lists, gives the same tensor."""
    batch, model = _batch(assets), assets["elx"]["t5"]
    expected = assets["hf"]["t5"].generate(**batch, max_new_tokens=6)
    assert torch.equal(model.generate(batch["input_ids"], attention_mask=batch["attention_mask"], max_new_tokens=6),
                       expected)
    assert torch.equal(model.generate(input_ids=batch["input_ids"].numpy(), attention_mask=batch["attention_mask"]
                                      .tolist(), max_new_tokens=6), expected)


@pytest.mark.parametrize("family,options", [
    ("t5", dict(num_beams=4, output_scores=True, output_logits=True)),
    ("t5", dict(num_beams=3, num_return_sequences=2)),  # no output_scores: HF gives no sequences_scores
    ("t5", dict(output_scores=True)),
    ("gpt2", dict(num_beams=2, output_scores=True)),
    ("gpt2", dict(output_logits=True)),
], ids=["t5-beam4-scores-logits", "t5-beam3-2-returned", "t5-greedy-scores", "gpt2-beam2-scores", "gpt2-greedy-logits"])
def test_return_dict_in_generate_is_hf(assets, family, options):
    """HF's output class and fields: sequences, sequences_scores, per-step scores / logits, beam_indices."""
    batch = _batch(assets, "left" if family == "gpt2" else "right")
    options = dict(max_new_tokens=7, return_dict_in_generate=True, **options)
    if family == "gpt2":
        options["pad_token_id"] = assets["text"].pad_token_id
    expected = assets["hf"][family].generate(**batch, **options)
    got = assets["elx"][family].generate(**batch, **options)
    assert type(got) is type(expected)
    assert set(got.keys()) == set(expected.keys()) - {"cache"}
    assert torch.equal(got.sequences, expected.sequences)
    for name in ("sequences_scores", "beam_indices"):
        if name in expected.keys():
            assert got[name].dtype == expected[name].dtype and got[name].shape == expected[name].shape, name
            assert torch.allclose(got[name].double(), expected[name].double(), atol=1e-4), name
    for name in ("scores", "logits"):
        if name in expected.keys():
            assert len(got[name]) == len(expected[name])
            for step, (ours, theirs) in enumerate(zip(got[name], expected[name])):
                finite = torch.isfinite(theirs)
                assert torch.equal(torch.isfinite(ours), finite), (name, step)
                # the fp32 bar of elx's own checks at this step's magnitude (verify.logits_tolerance): the one-layer
                # T5's logits reach 180, where 1e-4 is 7 ulps (measured 2.2e-4 at M = 75 on an AMD EPYC VM)
                bar = logits_tolerance(float(theirs[finite].abs().max()))
                assert torch.allclose(ours[finite], theirs[finite], atol=bar, rtol=0.0), (name, step)


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(beams=st.integers(1, 4), returned=st.integers(1, 2), ngram=st.sampled_from([0, 2]),
       new=st.integers(3, 10), changed=st.booleans())
def test_drawn_settings_are_hf(assets, beams, returned, ngram, new, changed):
    """Drawn generation settings on both families, given as keywords or (``changed``) by editing
    ``model.generation_config``, which HF reads as the call's defaults."""
    returned = min(returned, beams)
    options = dict(num_beams=beams, num_return_sequences=returned, no_repeat_ngram_size=ngram, max_new_tokens=new)
    for family, side in (("t5", "right"), ("gpt2", "left")):
        batch, hf, ours = _batch(assets, side), assets["hf"][family], assets["elx"][family]
        extra = {"pad_token_id": assets["text"].pad_token_id} if family == "gpt2" else {}
        if changed:
            saved = hf.generation_config.to_dict(), ours.generation_config.to_dict()
            for config in (hf.generation_config, ours.generation_config):
                config.update(**options)
            try:
                expected, got = hf.generate(**batch, **extra), ours.generate(**batch, **extra)
            finally:
                hf.generation_config.update(**saved[0])
                ours.generation_config.update(**saved[1])
        else:
            expected, got = hf.generate(**batch, **options, **extra), ours.generate(**batch, **options, **extra)
        assert torch.equal(got, expected), (family, options)


@pytest.mark.parametrize("options", [dict(max_new_tokens=8),  # the pipeline's own default: sampling, temperature 0.7
                                     dict(do_sample=False, max_new_tokens=8),
                                     dict(do_sample=False, num_beams=3, max_new_tokens=8),
                                     dict(do_sample=False, max_new_tokens=8, return_full_text=False)],
                         ids=["sampled", "greedy", "beam3", "new-text"])
def test_text_generation_pipeline_is_hf(assets, options):
    """``pipeline("text-generation", model=ElxModelForCausalLM...)`` on a batch the pipeline left-pads gives the
    PyTorch pipeline's outputs (sampling: the same draws after the same ``torch.manual_seed``), and no error is
    logged about the class."""
    from transformers import pipeline

    prompts = ["the quick brown fox", "a lazy dog near misty lakes while", "hex"]
    outputs, logged = [], _Records()
    logger = logging.getLogger("transformers.pipelines.base")  # transformers' loggers do not propagate to the root
    logger.addHandler(logged)
    try:
        for model in (assets["hf"]["gpt2"], assets["elx"]["gpt2"]):
            generator = pipeline("text-generation", model=model, tokenizer=assets["text"], device="cpu")
            torch.manual_seed(0)
            outputs.append(generator(prompts, batch_size=3, **options))
    finally:
        logger.removeHandler(logged)
    assert not [r for r in logged.records if r.levelno >= logging.ERROR]
    assert outputs[1] == outputs[0]
    texts = [row[0]["generated_text"] for row in outputs[1]]
    assert len(set(texts)) == 3 and all(texts)


def test_chat_pipeline_is_hf(assets):
    """Conversations through the tokenizer's chat template (the pipeline prompts with ``apply_chat_template``)."""
    from transformers import pipeline

    tokenizer = assets["text"]
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    chats = [[{"role": "user", "content": "the quick brown fox"}],
             [{"role": "system", "content": "hex"}, {"role": "user", "content": "a lazy dog near misty lakes"}]]
    outputs = [pipeline("text-generation", model=model, tokenizer=tokenizer, device="cpu")(
        chats, batch_size=2, do_sample=False, num_beams=2, max_new_tokens=6)
        for model in (assets["hf"]["gpt2"], assets["elx"]["gpt2"])]
    assert outputs[1] == outputs[0]
    assert outputs[1][1][0]["generated_text"][-1]["role"] == "assistant"


@pytest.mark.parametrize("options", [dict(generate_kwargs={"max_new_tokens": 8}),  # the pipeline's beam 5
                                     dict(generate_kwargs={"max_new_tokens": 8, "num_beams": 1})],
                         ids=["beam5", "greedy"])
def test_speech_recognition_pipeline_is_hf(assets, options):
    """``pipeline("automatic-speech-recognition", model=ElxModelForSpeechSeq2Seq...)`` with a Whisper feature
    extractor and tokenizer: the PyTorch pipeline's transcriptions of the same (random) audio."""
    from transformers import pipeline

    rng = np.random.default_rng(0)
    audio = [rng.standard_normal(16000 * seconds).astype(np.float32) * 0.1 for seconds in (1, 2)]
    outputs = []
    for model in (assets["hf"]["whisper"], assets["elx"]["whisper"]):
        recognizer = pipeline("automatic-speech-recognition", model=model, tokenizer=assets["speech"],
                              feature_extractor=assets["features"], device="cpu")
        outputs.append(recognizer([a.copy() for a in audio], batch_size=2, **options))
    assert outputs[1] == outputs[0]
    assert all(row["text"] for row in outputs[1])


def test_speech_generate_is_hf(assets):
    """``generate(input_features=...)`` on Whisper: HF's Whisper generate's tensor."""
    rng = np.random.default_rng(1)
    features = assets["features"]([rng.standard_normal(16000).astype(np.float32)] * 2, sampling_rate=16000,
                                  return_tensors="pt").input_features
    for options in (dict(max_new_tokens=6), dict(max_new_tokens=6, num_beams=3)):
        expected = assets["hf"]["whisper"].generate(input_features=features, **options)
        assert torch.equal(assets["elx"]["whisper"].generate(features, **options), expected)


def test_from_pretrained_exports_once(assets, monkeypatch):
    """The second ``from_pretrained`` of the same folder loads the cached export without exporting again."""
    from elx.hf import ElxModelForSeq2SeqLM

    calls = []
    monkeypatch.setattr(elx, "export", lambda *a, **k: calls.append(a) or pytest.fail("exported again"))
    first = assets["elx"]["t5"]
    again = ElxModelForSeq2SeqLM.from_pretrained(assets["folders"]["t5"], cache_dir=assets["cache"])
    assert calls == [] and again.folder == first.folder and again.folder.parent == assets["cache"]
    assert sorted(p.name for p in assets["cache"].iterdir() if p.is_dir()) == sorted(
        m.folder.name for m in assets["elx"].values())
    # the export folder itself loads directly, and with export=False
    direct = ElxModelForSeq2SeqLM.from_pretrained(first.folder, export=False)
    assert direct.folder == first.folder and calls == []
    batch = _batch(assets)
    assert torch.equal(direct.generate(**batch, max_new_tokens=5), first.generate(**batch, max_new_tokens=5))


def test_cache_key_follows_the_source_contents(assets, tmp_path):
    """The cache key hashes the source folder's files: the same contents elsewhere give the same key, one changed
    byte another one."""
    import shutil

    from elx.hf import source_digest

    copy = tmp_path / "copy"
    shutil.copytree(assets["folders"]["t5"], copy)
    assert source_digest(copy, tmp_path / "c") == source_digest(assets["folders"]["t5"], tmp_path / "c")
    config = json.loads((copy / "generation_config.json").read_text())
    (copy / "generation_config.json").write_text(json.dumps({**config, "max_length": 7}))
    assert source_digest(copy, tmp_path / "c") != source_digest(assets["folders"]["t5"], tmp_path / "c")


def test_config_and_attributes(assets):
    """``config`` and ``generation_config`` are the source's; the attributes pipelines read are there."""
    for family in ("t5", "gpt2", "whisper"):
        hf, ours = assets["hf"][family], assets["elx"][family]
        assert ours.config.to_dict() == hf.config.to_dict()
        assert ours.generation_config.to_diff_dict() == hf.generation_config.to_diff_dict()
        assert ours.main_input_name == hf.main_input_name
        assert ours.can_generate() and ours.device == torch.device("cpu") and ours.eval() is ours
        assert ours.to("cpu") is ours and ours.to(torch.float32) is ours
    assert repr(assets["elx"]["t5"]).startswith("ElxModelForSeq2SeqLM(Generator(")
    assert elx.hf.ElxModelForCausalLM is type(assets["elx"]["gpt2"])


@pytest.mark.parametrize("cls,family,use", [("ElxModelForCausalLM", "t5", "ElxModelForSeq2SeqLM"),
                                            ("ElxModelForSeq2SeqLM", "whisper", "ElxModelForSpeechSeq2Seq"),
                                            ("ElxModelForSpeechSeq2Seq", "gpt2", "ElxModelForCausalLM")])
def test_wrong_class_is_refused(assets, monkeypatch, cls, family, use):
    """The wrong class for the folder's family: one ``ElxError`` line naming the class to use, for the export folder
    and for the transformers folder (before any export)."""
    import elx.hf

    monkeypatch.setattr(elx, "export", lambda *a, **k: pytest.fail("exported a model of the wrong family"))
    for folder in (assets["elx"][family].folder, assets["folders"][family]):
        with pytest.raises(ElxError, match=f"elx.hf.{use}.from_pretrained") as err:
            getattr(elx.hf, cls).from_pretrained(folder, cache_dir=assets["cache"])
        assert "\n" not in str(err.value)


def test_bad_calls_are_refused(assets):
    """Unknown keywords and options elx does not run: one ``ElxError`` line, as elx.Generator refuses them."""
    from elx.hf import ElxModelForSeq2SeqLM

    model, batch = assets["elx"]["t5"], _batch(assets)
    for call, match in ((lambda: model.generate(**batch, max_new_tokenz=3), "unknown generation option"),
                        (lambda: model.generate(**batch, output_attentions=True), "attentions"),
                        (lambda: model.generate(**batch, text=["x"]), "elx.Generator"),
                        (lambda: model.generate(batch["input_ids"], input_ids=batch["input_ids"]), "once"),
                        (lambda: model(**batch), "generate"),
                        (lambda: model.to(torch.float16), "precision"),
                        (lambda: ElxModelForSeq2SeqLM.from_pretrained(assets["folders"]["t5"], export=False),
                         "not an elx export"),
                        (lambda: ElxModelForSeq2SeqLM.from_pretrained(model.folder, passes="el"), "passes"),
                        (lambda: ElxModelForSeq2SeqLM.from_pretrained(model.folder, dtype="auto"), "dtype"),
                        (lambda: ElxModelForSeq2SeqLM.from_pretrained(model.folder / "missing"), "neither")):
        with pytest.raises(ElxError, match=match) as err:
            call()
        assert "\n" not in str(err.value)


def test_save_pretrained_round_trip(assets, tmp_path):
    """``save_pretrained(dir)`` then ``from_pretrained(dir)``: the same tokens, config and generation config (with
    a change made to it before saving), and a second save into the same folder works."""
    from elx.hf import ElxModelForSeq2SeqLM

    model, batch = assets["elx"]["t5"], _batch(assets)
    saved = tmp_path / "saved"
    model.save_pretrained(saved)
    model.save_pretrained(saved)
    reloaded = ElxModelForSeq2SeqLM.from_pretrained(saved)
    assert reloaded.folder == saved and (saved / "config.json").is_file()
    assert {**reloaded.config.to_dict(), "_name_or_path": ""} == {**model.config.to_dict(), "_name_or_path": ""}
    assert reloaded.name_or_path == str(saved)
    assert torch.equal(reloaded.generate(**batch, num_beams=2, max_new_tokens=6),
                       assets["hf"]["t5"].generate(**batch, num_beams=2, max_new_tokens=6))
    reloaded.generation_config.max_new_tokens = 4
    reloaded.save_pretrained(saved)  # into its own folder: the configs only
    again = ElxModelForSeq2SeqLM.from_pretrained(saved)
    assert again.generation_config.max_new_tokens == 4 and again.generate(**batch).shape[1] == 5


def test_config_without_config_json(assets, tmp_path):
    """An export folder as ``elx export`` writes it (no transformers configs): ``config`` is the source's, found
    through the manifest's source record, else rebuilt from the manifest (class, vocabulary, special tokens);
    ``generation_config`` is the manifest's, which the search applies."""
    import shutil

    from elx.hf import ElxModelForSeq2SeqLM

    hf, batch, bare = assets["hf"]["t5"], _batch(assets), tmp_path / "bare"
    shutil.copytree(assets["elx"]["t5"].folder, bare,
                    ignore=shutil.ignore_patterns("config.json", "generation_config.json"))
    model = ElxModelForSeq2SeqLM.from_pretrained(bare)
    assert {**model.config.to_dict(), "_name_or_path": ""} == {**hf.config.to_dict(), "_name_or_path": ""}
    public = (lambda config: {k: v for k, v in config.to_diff_dict().items() if not k.startswith("_")})
    assert public(model.generation_config) == public(hf.generation_config)
    manifest = json.loads((bare / "manifest.json").read_text())
    manifest["source"].update(path=str(tmp_path / "gone"), model=str(tmp_path / "gone"))
    (bare / "manifest.json").write_text(json.dumps(manifest))
    model = ElxModelForSeq2SeqLM.from_pretrained(bare)
    assert type(model.config) is type(hf.config) and model.config.vocab_size == hf.config.vocab_size
    assert (model.config.eos_token_id, model.config.pad_token_id, model.config.decoder_start_token_id) == (1, 0, 0)
    assert torch.equal(model.generate(**batch, num_beams=2, max_new_tokens=5),
                       hf.generate(**batch, num_beams=2, max_new_tokens=5))


def test_export_force_replaces_a_saved_folder(assets, tmp_path):
    """``elx export --force`` may replace a folder ``save_pretrained`` wrote: its ``config.json`` and
    ``generation_config.json`` count as elx's; anything else still makes it refuse."""
    from elx.exporter.atomic import check_output

    saved = tmp_path / "saved"
    assets["elx"]["t5"].save_pretrained(saved)
    check_output(saved, force=True)
    (saved / "notes.txt").write_text("mine")
    with pytest.raises(ElxError, match="notes.txt"):
        check_output(saved, force=True)
