"""Whisper as HF's ``WhisperGenerationMixin.generate`` runs it beyond one plain search: timestamps, long-form audio
(> 30 s, the sequential algorithm), language detection and temperature fallback (``runners/whisper_longform.py``).

Every check compares with HF ``generate`` on a tiny random Whisper with a real-sized timestamp range (1501
timestamp tokens after ``<|notimestamps|>``, so that windows seek as with openai's checkpoints) and an
openai-style multilingual generation config: the sequences, and the segments (start, end, tokens, idxs) HF
returns with ``return_segments``.  The timestamp processor and the segment cut are also drawn by hypothesis
against HF's own functions.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elx.cli import main as elx_main
from elx.runners.errors import ElxError
from elx.runners.generate import Generator

SOT, EOS = 3, 2
LANGS = {"<|en|>": 10, "<|fr|>": 11, "<|de|>": 12}
TASKS = {"translate": 20, "transcribe": 21}
WINDOW = 3000
HYPOTHESIS = settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
LONG = os.environ.get("ELX_LONG_TESTS") == "1"


def _generation_config(no_timestamps: int) -> dict:
    """openai-style multilingual rules, with token ids inside the random model's vocabulary."""
    return dict(decoder_start_token_id=SOT, eos_token_id=EOS, pad_token_id=EOS, max_length=24, is_multilingual=True,
                lang_to_id=LANGS, task_to_id=TASKS, no_timestamps_token_id=no_timestamps,
                forced_decoder_ids=[[1, None], [2, TASKS["transcribe"]]], return_timestamps=False,
                max_initial_timestamp_index=50, suppress_tokens=[5, 6], begin_suppress_tokens=[EOS])


def _session_whisper(exported, model_folders, no_timestamps: int):
    """(HF model, elx generator) of the session's random Whisper (vocabulary 128) under a multilingual generation
    config with ``<|notimestamps|>`` at ``no_timestamps``.  No export of its own: the generation config lives in
    the manifest, edited here as HF's is."""
    from transformers import WhisperForConditionalGeneration

    from elx.runners.generate import make_backend
    from elx.runners.manifest import Manifest
    from elx.runners.model import Model

    config = _generation_config(no_timestamps)
    manifest = Manifest.load(exported("whisper")).copy()
    manifest.data["generation_defaults"].update(config)
    model = WhisperForConditionalGeneration.from_pretrained(model_folders["whisper"]).eval()
    for key, value in config.items():
        setattr(model.generation_config, key, value)
    return model, Generator(Model(manifest, make_backend(manifest)))


@pytest.fixture(scope="module")
def stamped(exported, model_folders):
    """67 timestamp tokens (0 to 1.32 s): a window seeks by at most 132 frames when it ends in a timestamp pair,
    so the clips here are short (attention_mask), a few windows each."""
    return _session_whisper(exported, model_folders, 60)


@pytest.fixture(scope="module")
def unstamped(exported, model_folders):
    """``<|notimestamps|>`` is the last id: no timestamp tokens, one window per item (detection, fallback)."""
    return _session_whisper(exported, model_folders, 127)


@pytest.fixture(scope="module")
def openai_range(tmp_path_factory):
    """(HF model, elx generator) of a random Whisper with openai's timestamp range (1501 tokens, 0 to 30 s), so
    that windows seek as with real checkpoints; its own export (~90 s): ELX_LONG_TESTS=1 only."""
    import torch
    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

    from elx.exporter.export import export_model

    if not LONG:
        pytest.skip("exports a model of its own (~90 s): set ELX_LONG_TESTS=1")
    no_timestamps = 150
    root = tmp_path_factory.mktemp("whisper-stamps")
    folder = root / "hf"
    torch.manual_seed(1)
    model = WhisperForConditionalGeneration(WhisperConfig(
        vocab_size=no_timestamps + 1 + 1501, d_model=32, encoder_layers=1, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_target_positions=64, decoder_start_token_id=SOT, eos_token_id=EOS, pad_token_id=EOS, bos_token_id=EOS,
        begin_suppress_tokens=None, suppress_tokens=None)).eval()
    with torch.no_grad():  # a livelier decoder than the default init
        model.proj_out.weight.normal_(0, 0.6)
    model.save_pretrained(folder)
    config = json.loads((folder / "generation_config.json").read_text())
    config.pop("_from_model_config", None)
    config.update(_generation_config(no_timestamps))
    (folder / "generation_config.json").write_text(json.dumps(config))
    WhisperFeatureExtractor(feature_size=80).save_pretrained(folder)
    export = export_model(str(folder), root / "export", quiet=True)
    return WhisperForConditionalGeneration.from_pretrained(folder).eval(), Generator.from_folder(export)


def _features(batch: int, frames: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, 80, frames)).astype(np.float32)


def _hf(model, features, seed=None, **options):
    import torch

    if seed is not None:
        torch.manual_seed(seed)
    if "attention_mask" in options:
        options["attention_mask"] = torch.from_numpy(options["attention_mask"])
    with torch.no_grad():
        return model.generate(torch.from_numpy(features), return_segments=True, **options)


def _same(hf, elx):
    """HF's sequences and segments (start, end, tokens, idxs) equal elx's."""
    assert elx.sequences.tolist() == hf["sequences"].tolist()
    assert len(elx.segments) == len(hf["segments"])
    for theirs, ours in zip(hf["segments"], elx.segments):
        assert [(float(s["start"]), float(s["end"]), s["tokens"].tolist(), tuple(s["idxs"])) for s in theirs] == \
            [(s["start"], s["end"], s["tokens"].tolist(), tuple(s["idxs"])) for s in ours]


@pytest.fixture
def sampled_tries(monkeypatch):
    """Counts the loop's searches that sampled (the fallback's tries above temperature 0)."""
    from elx.runners import whisper_longform

    counted = []
    search = whisper_longform._Run.search

    def counting(self, features, prompt, settings):
        counted.append(settings.do_sample)
        return search(self, features, prompt, settings)

    monkeypatch.setattr(whisper_longform._Run, "search", counting)
    return lambda: sum(counted)


def _run(stamped, features, seed=None, **options):
    model, generator = stamped
    hf = _hf(model, features, seed=seed, **options)
    if "attention_mask" in options:
        options["attention_mask"] = np.asarray(options["attention_mask"])
    elx = generator.generate(input_features=features, return_segments=True, seed=seed, **options)
    _same(hf, elx)
    return elx


def _clips(stamped, lengths, features_seed=1, **options):
    """Batched long-form (features just over one window, so HF reads each clip's length from attention_mask):
    clips of ``lengths`` frames, a few windows each."""
    frames = WINDOW + 1
    mask = np.zeros((len(lengths), frames), dtype=np.int64)
    for i, length in enumerate(lengths):
        mask[i, :length] = 1
    features = (_features(len(lengths), frames, features_seed) * mask[:, None, :]).astype(np.float32)
    return _run(stamped, features, attention_mask=mask, **options)


@pytest.mark.parametrize("options", [dict(language="fr"), dict(language="de", num_beams=2),
                                     dict(language="en", task="translate", max_new_tokens=5)],
                         ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_long_form_timestamps(stamped, options):
    """HF's sequential algorithm with timestamps: the processor, the cut after timestamp pairs, each clip's seek
    and time offset, clips leaving the batch as they end."""
    elx = _clips(stamped, [420, 250, 330], return_timestamps=True, **options)
    assert any((s["tokens"] > 60).any() for item in elx.segments for s in item)  # timestamps were made
    assert max(len(item) for item in elx.segments) > 1  # cut into segments


def test_language_detection(unstamped):
    """No language on a multilingual model: HF's detect_language, per item, then the detected prompt."""
    import torch

    model, generator = unstamped
    features = _features(4, WINDOW, 2)
    with torch.no_grad():
        expected = model.detect_language(torch.from_numpy(features)).tolist()
    from elx.runners.whisper_longform import _Run, detect_language

    run = _Run(generator, generator.settings(), {}, False)
    assert detect_language(run, features).tolist() == expected
    _run(unstamped, features)
    _run(unstamped, features[:2], task="translate", num_beams=2)


@pytest.mark.parametrize("options", [dict(language="fr", compression_ratio_threshold=1.3),
                                     dict(language="fr", logprob_threshold=-1.0),
                                     dict(compression_ratio_threshold=1.8, logprob_threshold=-1.5)],
                         ids=["compression", "logprob", "both-detect"])
def test_temperature_fallback_seeded(unstamped, sampled_tries, options):
    """Temperature fallback with seeded draws: the same tries, draws and tokens as HF after torch.manual_seed."""
    _run(unstamped, _features(3, WINDOW, 3), seed=11, temperature=(0.0, 0.2, 0.6, 1.0), **options)
    assert sampled_tries() > 0  # the thresholds sent rows to the sampling tries


def test_fallback_with_timestamps(stamped, sampled_tries):
    """Fallback inside the long-form loop: beam search at 0, sampling after (num_beams stays 1 then, as in HF)."""
    _clips(stamped, [300, 380], seed=4, temperature=(0.0, 0.5, 1.0), compression_ratio_threshold=1.1, num_beams=2,
           return_timestamps=True)
    assert sampled_tries() > 0


def test_single_temperature_samples(unstamped):
    """HF Whisper samples exactly when the temperature is > 0 (do_sample follows it)."""
    _run(unstamped, _features(2, WINDOW, 4), seed=5, temperature=0.7, language="de")


@pytest.mark.parametrize("options", [dict(), dict(language="fr", num_beams=3),
                                     dict(language="de", temperature=(0.0, 0.4, 0.8), compression_ratio_threshold=1.5,
                                          logprob_threshold=-2.0, num_beams=1)],
                         ids=["detect", "beam3", "fallback"])
def test_openai_range_long_form(openai_range, options):
    """ELX_LONG_TESTS=1: openai's timestamp range (windows seek up to 30 s), full lengths, 70 s of features."""
    frames = 2 * WINDOW + 1000
    mask = np.ones((2, frames), dtype=np.int64)
    mask[1, WINDOW + 1700:] = 0
    features = (_features(2, frames, 5) * mask[:, None, :]).astype(np.float32)
    _run(openai_range, features, seed=3, attention_mask=mask, return_timestamps=True, **options)
    _run(openai_range, features[:1, :, :WINDOW], seed=3, **{**options, "return_timestamps": True})  # short-form


def test_loop_refusals(stamped):
    _, generator = stamped
    long = _features(2, WINDOW + 10, 0)
    cases = [(dict(input_features=long, return_timestamps=True), "attention_mask"),
             (dict(input_features=long[:1], return_timestamps=False), "long-form"),
             (dict(input_features=long[:1, :, :WINDOW], condition_on_prev_tokens=True), "condition_on_prev_tokens"),
             (dict(input_features=long[:1, :, :WINDOW], no_speech_threshold=0.6), "no_speech_threshold"),
             (dict(input_features=long[:1, :, :WINDOW], temperature=(0.0, -1.0)), "temperature"),
             (dict(input_features=long[:1, :, :WINDOW], logprob_threshold=-1.0, num_beams=2), "beam"),
             (dict(input_features=long[:1, :, :WINDOW], return_timestamps=True, output_scores=True,
                   return_dict_in_generate=True), "return_dict_in_generate")]
    for options, message in cases:
        with pytest.raises(ElxError, match=message):
            generator.generate(**options)


# ----------------------------------------------------------------------------- drawn against HF's functions

@st.composite
def _stamp_case(draw):
    no_ts = draw(st.integers(4, 12))
    vocab = no_ts + 1 + draw(st.integers(2, 10))
    begin = draw(st.integers(1, 3))
    rows = draw(st.integers(1, 3))
    length = draw(st.integers(0, 6))
    token = st.one_of(st.integers(0, no_ts), st.integers(no_ts + 1, vocab - 1))
    tokens = [[draw(st.integers(0, vocab - 1)) for _ in range(begin)] + [draw(token) for _ in range(length)]
              for _ in range(rows)]
    seed = draw(st.integers(0, 2 ** 16))
    scores = np.random.default_rng(seed).standard_normal((rows, vocab)).astype(np.float32) * draw(
        st.sampled_from([0.5, 3.0]))
    return no_ts, begin, np.asarray(tokens, dtype=np.int64), scores, draw(st.sampled_from([None, 0, 2])), \
        draw(st.integers(0, 3))


@HYPOTHESIS
@given(_stamp_case())
def test_timestamp_processor_matches_hf(case):
    import torch
    from transformers import GenerationConfig
    from transformers.generation.logits_process import WhisperTimeStampLogitsProcessor

    from elx.runners.whisper_timestamps import TimestampRules

    no_ts, begin, tokens, scores, max_initial, eos = case
    config = GenerationConfig(eos_token_id=eos, no_timestamps_token_id=no_ts, max_initial_timestamp_index=max_initial)
    expected = WhisperTimeStampLogitsProcessor(config, begin_index=begin)(torch.from_numpy(tokens),
                                                                          torch.from_numpy(scores.copy())).numpy()
    got = TimestampRules(no_ts, eos or None, begin, max_initial)(tokens, scores.copy())  # HF: eos or bos (None)
    np.testing.assert_array_equal(got, expected)


@HYPOTHESIS
@given(st.lists(st.one_of(st.integers(0, 9), st.integers(10, 30)), min_size=1, max_size=12),
       st.integers(0, 5000), st.integers(1, 3000), st.integers(1, 5))
def test_segment_cut_matches_hf(tokens, seek, frames, prompt_len):
    import torch
    from transformers.models.whisper.generation_whisper import WhisperGenerationMixin

    from elx.runners.whisper_timestamps import cut_segments

    begin = 10
    sequence = torch.tensor(tokens)
    offset = torch.tensor([seek], dtype=torch.float64) * 0.02 / 2
    expected, advance = WhisperGenerationMixin._retrieve_segment(
        seek_sequence=sequence, seek_outputs=[None], time_offset=offset, timestamp_begin=begin,
        seek_num_frames=torch.tensor([frames]), time_precision=0.02, time_precision_features=0.01, input_stride=2,
        prev_idx=0, idx=0, return_token_timestamps=False, decoder_input_ids=torch.zeros((1, prompt_len)))
    got, moved = cut_segments(np.asarray(tokens), begin, seek * 0.02 / 2, frames, prompt_len)
    assert moved == int(advance)
    assert [(float(s["start"]), float(s["end"]), s["tokens"].tolist(), tuple(s["idxs"])) for s in expected] == \
        [(s["start"], s["end"], s["tokens"].tolist(), tuple(s["idxs"])) for s in got]


def test_timestamp_processor_eos_zero_pinned():
    """Found by hypothesis: HF's processor bans ``[:eos or bos]`` after a single timestamp; an EOS of 0 without a
    BOS bans the whole row (a slice to None)."""
    from elx.runners.whisper_timestamps import TimestampRules

    scores = np.zeros((1, 7), dtype=np.float32)
    out = TimestampRules(4, None, 1, None)(np.array([[0, 0, 5]]), scores)
    assert np.isneginf(out).all()


def test_long_audio_files(exported, model_folders, tmp_path, capsys):
    """A WAV over 30 s: HF's long-form features and attention_mask (truncation=False, padding="longest"), then
    ``elx generate --audio ... --return-timestamps`` prints the loop's rows and segments."""
    import shutil

    from transformers import WhisperFeatureExtractor

    from elx.runners.inputs.audio import features_from_files

    from tests.hf_reference import hf_numpy_features
    from tests.tools_loader import load_tool

    speech = load_tool("speech")
    folder = tmp_path / "export"
    shutil.copytree(exported("whisper"), folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["generation_defaults"].update(_generation_config(127))  # no timestamp tokens: one window per 30 s
    (folder / "manifest.json").write_text(json.dumps(manifest))
    extractor = WhisperFeatureExtractor(feature_size=80)
    extractor.save_pretrained(folder / "tokenizer")
    rng = np.random.default_rng(0)
    clips = [rng.standard_normal(16000 * 33 + 77).astype(np.float32) * 0.1,
             rng.standard_normal(16000 * 4).astype(np.float32) * 0.1]
    paths = [tmp_path / "long.wav", tmp_path / "short.wav"]
    for path, clip in zip(paths, clips):
        speech.write_wav(path, clip, 16000)
    ours = features_from_files(folder, paths, long_form=True)
    theirs = hf_numpy_features(extractor, [speech.read_wav(path)[0] for path in paths], truncation=False,
                               padding="longest", return_attention_mask=True)
    assert ours["attention_mask"].tolist() == theirs["attention_mask"].tolist()
    assert np.array_equal(ours["input_features"], theirs["input_features"])  # HF's numpy path, bit for bit
    argv = ["generate", str(folder), "--audio", str(paths[0]), "--audio", str(paths[1]), "--language", "fr",
            "--max-new-tokens", "4"]
    # this generation config says return_timestamps: false, so HF's generate refuses the long-form features until
    # return_timestamps=True is passed; from Python elx refuses the same way, the CLI passes it (as --help says)
    with pytest.raises(ElxError, match="return_timestamps=True"):
        Generator.from_folder(folder).generate(audio=[str(p) for p in paths], language="fr", max_new_tokens=4)
    expected = Generator.from_folder(folder).generate(audio=[str(p) for p in paths], language="fr", max_new_tokens=4,
                                                      return_timestamps=True)
    for extra in ([], ["--return-timestamps"]):
        assert elx_main([*argv, *extra]) == 0
        printed = capsys.readouterr().out.splitlines()
        rows = [line for line in printed if line.startswith("input ")]
        assert [[int(t) for t in row.split(": ", 1)[1].split()] for row in rows] == expected.sequences.tolist()
        assert sum(line.startswith("  [") for line in printed) == sum(len(item) for item in expected.segments)
    assert expected.segments[0][-1]["start"] >= 30.0  # the long clip's second window
    assert elx_main([*argv, "--no-return-timestamps"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "long.wav lasts 33.0 s" in err[0] and "drop --no-return-timestamps" in err[0], err
    # jsonl: each row's segments with start, end and text; the tokens are the rows above
    assert elx_main([*argv, "--format", "jsonl"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["tokens"] for line in lines] == expected.sequences.tolist()
    for line, item in zip(lines, expected.segments):
        assert [(s["start"], s["end"]) for s in line["segments"]] == [
            (round(float(s["start"]), 3), round(float(s["end"]), 3)) for s in item]
    # subtitles: one file per run; the cues are the segments (texts: this export has no tokenizer, so none)
    assert elx_main([*argv, "--format", "srt"]) == 2
    assert "one --audio file" in capsys.readouterr().err
