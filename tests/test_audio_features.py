"""Whisper log-mel features in numpy (``elx.runners.inputs.audio``): bit-equal to transformers' extractor.

The reference is ``WhisperFeatureExtractor(...)(audio, sampling_rate=16000, return_tensors="np")``
on HF's numpy path (``tests.hf_reference.hf_numpy_features``).  Every comparison is exact
(``np.array_equal`` on float32, after checking dtype and shape), never a tolerance.  Also: the
settings read from saved configs as transformers reads them, the one-line errors, and a
subprocess proving that ``elx.runners.inputs.audio`` runs with torch and transformers unimportable.
"""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import WhisperFeatureExtractor
from transformers.audio_utils import mel_filter_bank, window_function

from elx.runners.inputs.audio import (LogMelExtractor, features_from_audio, features_from_files, hann_window,
                           load_feature_extractor, slaney_mel_filters)
from elx.runners.errors import ElxError
from tests.hf_reference import hf_numpy_features

REPO = Path(__file__).resolve().parents[1]
N_SAMPLES = 480000  # 30 s at 16 kHz
_HF = {}


def hf_extractor(feature_size: int = 80, **settings_) -> WhisperFeatureExtractor:
    key = (feature_size, tuple(sorted(settings_.items())))
    if key not in _HF:
        _HF[key] = WhisperFeatureExtractor(feature_size=feature_size, **settings_)
    return _HF[key]


def ours_for(hf: WhisperFeatureExtractor) -> LogMelExtractor:
    return LogMelExtractor.from_config(hf.to_dict())


def assert_bit_equal(got: np.ndarray, want: np.ndarray):
    assert got.dtype == want.dtype == np.float32 and got.shape == want.shape, (got.dtype, got.shape, want.shape)
    diff = float(np.abs(got.astype(np.float64) - want.astype(np.float64)).max())
    assert np.array_equal(got, want), f"max abs diff {diff}"
    assert got.tobytes() == want.tobytes()  # same bits, zeros' signs included


def check(audio: list, feature_size: int = 80, **settings_):
    hf = hf_extractor(feature_size, **settings_)
    want = hf_numpy_features(hf, audio).input_features
    assert_bit_equal(features_from_audio(ours_for(hf), audio)["input_features"], want)


def noise(n: int, amplitude: float = 0.1, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(n) * amplitude).astype(np.float32)


def tone(n: int, hz: float = 440.0, amplitude: float = 0.5) -> np.ndarray:
    return (amplitude * np.sin(2 * np.pi * hz * np.arange(n) / 16000)).astype(np.float32)


def write_float_wav(path: Path, samples: np.ndarray, rate: int = 16000):
    data = samples.astype("<f4").tobytes()
    fmt = struct.pack("<HHIIHH", 3, 1, rate, rate * 4, 4, 32)
    chunks = b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data
    path.write_bytes(b"RIFF" + struct.pack("<I", 4 + len(chunks)) + b"WAVE" + chunks)


# ----------------------------------------------------------------------------- building blocks


@pytest.mark.parametrize("feature_size", [80, 128])
def test_mel_filters_and_window_byte_identical(feature_size):
    want = mel_filter_bank(num_frequency_bins=201, num_mel_filters=feature_size, min_frequency=0.0,
                           max_frequency=8000.0, sampling_rate=16000, norm="slaney", mel_scale="slaney")
    got = slaney_mel_filters(400, feature_size, 16000)
    assert got.dtype == want.dtype == np.float64 and got.shape == want.shape == (201, feature_size)
    assert got.tobytes() == want.tobytes()
    assert hann_window(400).tobytes() == window_function(400, "hann").tobytes()


# ----------------------------------------------------------------------------- fixed cases


@pytest.mark.parametrize("feature_size", [80, 128])
@pytest.mark.parametrize("case", ["short", "exactly_30s", "one_sample", "silence", "silence_30s", "tone",
                                  "loud", "tiny", "frame_edges", "batch"])
def test_fixed_cases_bit_equal(feature_size, case):
    audio = {
        "short": [noise(16000)],
        "exactly_30s": [noise(N_SAMPLES, 0.3, seed=1)],
        "one_sample": [np.array([0.5], np.float32)],
        "silence": [np.zeros(32000, np.float32)],
        "silence_30s": [np.zeros(N_SAMPLES, np.float32)],
        "tone": [tone(40000)],
        "loud": [noise(24000, 8.0, seed=2)],
        "tiny": [noise(20000, 1e-7, seed=3)],
        "frame_edges": [noise(n, seed=n) for n in (2, 199, 200, 201, 399, 400, 401, 159, 160, 161)],
        "batch": [noise(16000 * 3, seed=4), tone(777), np.zeros(10, np.float32), noise(N_SAMPLES, 0.05, seed=5),
                  noise(123457, 0.7, seed=6)],
    }[case]
    check(audio, feature_size)


def test_float64_and_list_input_rounded_to_float32_like_hf():
    samples = np.random.default_rng(7).standard_normal(5000) * 0.2  # float64: HF casts to float32 first
    hf = hf_extractor(80)
    want = hf_numpy_features(hf, [samples, list(samples[:300])]).input_features
    assert_bit_equal(features_from_audio(ours_for(hf), [samples, list(samples[:300])])["input_features"], want)


def test_other_settings_left_padding_and_attention_mask():
    """Non-default hop/n_fft/chunk (n_samples not a multiple of hop), left padding, a padding value, truncation."""
    settings_ = dict(hop_length=150, n_fft=512, chunk_length=5, padding_side="left", padding_value=0.25)
    hf = hf_extractor(64, **settings_)
    ours = ours_for(hf)
    assert (ours.n_samples, ours.nb_max_frames, ours.padding_side) == (80000, 533, "left")
    audio = [noise(30000), noise(80000, seed=1), noise(90000, seed=2), noise(1, seed=3)]  # 90000: truncated
    want = hf_numpy_features(hf, audio, return_attention_mask=True)
    assert_bit_equal(ours(audio), want.input_features)
    mask = ours.attention_mask([len(a) for a in audio])
    assert mask.dtype == want.attention_mask.dtype and np.array_equal(mask, want.attention_mask)


@pytest.mark.parametrize("feature_size", [80, 128])
def test_attention_mask_default_settings(feature_size):
    hf = hf_extractor(feature_size)
    audio = [noise(n, seed=n) for n in (1, 159, 160, 161, 16000, N_SAMPLES)]
    want = hf_numpy_features(hf, audio, return_attention_mask=True)
    assert np.array_equal(ours_for(hf).attention_mask([len(a) for a in audio]), want.attention_mask)
    assert want.attention_mask.dtype == np.int32


# ----------------------------------------------------------------------------- property


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.one_of(st.integers(1, 2000), st.integers(1, N_SAMPLES)), min_size=1, max_size=3),
       log_amplitude=st.floats(-6.0, 1.0), seed=st.integers(0, 2 ** 32 - 1),
       feature_size=st.sampled_from([80, 128]), kind=st.sampled_from(["noise", "tone", "dc"]))
def test_property_bit_equal(lengths, log_amplitude, seed, feature_size, kind):
    rng = np.random.default_rng(seed)
    amplitude = 10.0 ** log_amplitude
    audio = []
    for n in lengths:
        if kind == "noise":
            audio.append((rng.standard_normal(n) * amplitude).astype(np.float32))
        elif kind == "tone":
            audio.append(tone(n, float(rng.uniform(20, 7900)), amplitude))
        else:
            audio.append(np.full(n, amplitude, np.float32))
    check(audio, feature_size)


# ----------------------------------------------------------------------------- configs


def test_config_from_saved_feature_extractor(tmp_path):
    saved = WhisperFeatureExtractor(feature_size=128, padding_value=0.5, hop_length=200, chunk_length=20)
    saved.save_pretrained(tmp_path)
    assert (tmp_path / "preprocessor_config.json").is_file()
    ours = LogMelExtractor.from_folder(tmp_path)
    assert ours == LogMelExtractor(feature_size=128, sampling_rate=16000, hop_length=200, chunk_length=20, n_fft=400,
                                   padding_value=0.5, padding_side="right")
    assert (ours.n_samples, ours.nb_max_frames) == (saved.n_samples, saved.nb_max_frames) == (320000, 1600)
    loaded = WhisperFeatureExtractor.from_pretrained(str(tmp_path), local_files_only=True)
    audio = [noise(5000), noise(320000, seed=1)]
    assert_bit_equal(ours(audio), hf_numpy_features(loaded, audio).input_features)


def test_config_nested_in_processor_config_wins(tmp_path):
    """A processor's save_pretrained writes processor_config.json {"feature_extractor": {...}}; HF prefers it."""
    WhisperFeatureExtractor(feature_size=80).save_pretrained(tmp_path)
    nested = WhisperFeatureExtractor(feature_size=128).to_dict()
    (tmp_path / "processor_config.json").write_text(json.dumps({"feature_extractor": nested,
                                                                 "processor_class": "WhisperProcessor"}))
    hf = WhisperFeatureExtractor.from_pretrained(str(tmp_path), local_files_only=True)
    assert hf.feature_size == LogMelExtractor.from_folder(tmp_path).feature_size == 128
    (tmp_path / "preprocessor_config.json").unlink()
    assert LogMelExtractor.from_folder(tmp_path).feature_size == 128


def test_features_from_files_export_folder(tmp_path):
    """A WAV file in an export-like folder (tokenizer/ holds the config), 16 kHz and resampled 8 kHz."""
    WhisperFeatureExtractor(feature_size=128).save_pretrained(tmp_path / "tokenizer")
    write_float_wav(tmp_path / "a.wav", noise(16000 * 2))
    write_float_wav(tmp_path / "b.wav", tone(8000, 300.0), rate=8000)
    got = features_from_files(tmp_path, [tmp_path / "a.wav", tmp_path / "b.wav"])["input_features"]
    from elx.runners.inputs.audio import read_audio, resample

    samples = [read_audio(tmp_path / "a.wav")[0], resample(*read_audio(tmp_path / "b.wav"), 16000)]
    assert_bit_equal(got, hf_numpy_features(hf_extractor(128), samples).input_features)


# ----------------------------------------------------------------------------- streamed reading, resampling, blocks


def write_pcm16_wav(path: Path, samples: np.ndarray, rate: int, channels: int = 1):
    data = np.clip(np.round(samples * 32767), -32768, 32767).astype("<i2").tobytes()
    fmt = struct.pack("<HHIIHH", 1, channels, rate, rate * 2 * channels, 2 * channels, 16)
    chunks = b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data
    path.write_bytes(b"RIFF" + struct.pack("<I", 4 + len(chunks)) + b"WAVE" + chunks)


@pytest.mark.parametrize("block", [1, 7, 1000])
def test_log_mel_in_blocks_is_the_one_shot_computation(block, monkeypatch):
    """Issue 42 item 4: long clips' STFT and mel sums run a block of frames at a time; every remainder (1 frame up)
    gives the bits of the one-shot computation (HF's numpy path), edges (reflect padding) included."""
    from elx.runners.inputs import audio

    ours = LogMelExtractor()
    for n in (16000 * 2 + 77, 16000 * 2, 500, 161):
        clip = noise(n, seed=n)
        whole = audio.log_mel(audio.power_spectrogram(clip, ours.n_fft, ours.hop_length, ours.window),
                              ours.mel_filters)
        monkeypatch.setattr(audio, "FRAMES_PER_BLOCK", block)
        got = audio.log_mel_spectrogram(clip, ours.n_fft, ours.hop_length, ours.window, ours.mel_filters)
        monkeypatch.undo()
        assert_bit_equal(got, whole)
        assert_bit_equal(ours.features(clip), audio.whisper_scale(whole))


def test_long_44k_file_streamed_resampled_and_featured_as_hf(tmp_path, monkeypatch):
    """A 45 s 44.1 kHz stereo WAV, read in blocks, resampled with soxr on the way (``load_clip``): the samples are
    ``resample(read_audio(...))``'s, and its long-form features over several 4096-frame blocks are HF's numpy
    extractor's on them (truncation=False, padding="longest"), bit for bit."""
    from elx.runners.inputs import audio

    monkeypatch.setattr(audio, "BLOCK_FRAMES", 100_003)  # many read blocks, none aligned with anything
    left, right = noise(44100 * 45, seed=1), tone(44100 * 45) * 0.5
    path = tmp_path / "long44k.wav"
    write_pcm16_wav(path, np.stack([left, right], 1).reshape(-1), 44100, channels=2)
    samples, rate = audio.read_audio(path)
    assert rate == 44100 and samples.size == 44100 * 45
    ours = LogMelExtractor()
    clip = audio.load_clip(path, ours, long_form=True)
    assert np.array_equal(clip, audio.resample(samples, 44100, 16000))
    assert clip.size == audio.resampled_length(samples.size, 44100, 16000) == 16000 * 45
    features = features_from_audio(ours, [clip, noise(16000 * 3)], long_form=True)
    want = hf_numpy_features(hf_extractor(), [clip, noise(16000 * 3)], truncation=False, padding="longest",
                             return_attention_mask=True)
    assert features["input_features"].shape[-1] > audio.FRAMES_PER_BLOCK  # two blocks, the second a remainder
    assert_bit_equal(features["input_features"], want["input_features"])
    assert features["attention_mask"].tolist() == want["attention_mask"].tolist()


@pytest.mark.parametrize("rate", [8000, 11025, 22050, 32000, 44100, 48000, 7919])
def test_resampled_length_is_known_from_the_header(rate):
    """The CLI decides from a header whether a clip exceeds 30 s (long-form, timestamps on): the count it computes
    is the resampler's."""
    from elx.runners.inputs.audio import resample, resampled_length

    for n in (1, 2, 3, rate * 30 - 1, rate * 30, rate * 30 + 1, 123_457):
        assert resample(noise(n, seed=n), rate, 16000).size == resampled_length(n, rate, 16000), n


def test_reading_and_resampling_hold_a_few_blocks_beside_the_result(tmp_path):
    """Before, 10 min of 44.1 kHz audio went through one FFT of the whole file (68 s, ~600 MiB); now the file is
    read and resampled block by block: the peak of numpy's allocations stays within the 16 kHz result and a few
    blocks (tracemalloc sees numpy's buffers; no timing)."""
    import tracemalloc

    from elx.runners.inputs import audio

    path = tmp_path / "two-minutes.wav"
    write_pcm16_wav(path, noise(44100 * 120, seed=3), 44100)  # 10.6 MB on disk, 1.92 M samples at 16 kHz
    tracemalloc.start()
    try:
        clip = audio.load_clip(path, LogMelExtractor(), long_form=True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert clip.size == 16000 * 120
    assert peak < clip.nbytes + 8 * audio.BLOCK_FRAMES * 4, (peak, clip.nbytes)  # the one-shot FFT needed ~20x


# ----------------------------------------------------------------------------- errors


def _one_line(err) -> str:
    text = str(err.value)
    assert "\n" not in text
    return text


def test_errors(tmp_path):
    with pytest.raises(ElxError, match="no tokenizer/ folder") as err:
        load_feature_extractor(tmp_path)
    _one_line(err)
    (tmp_path / "tokenizer").mkdir()
    with pytest.raises(ElxError, match="no feature extractor config") as err:
        load_feature_extractor(tmp_path)
    _one_line(err)
    config = tmp_path / "tokenizer" / "preprocessor_config.json"
    config.write_text("{not json")
    with pytest.raises(ElxError, match="cannot read") as err:
        load_feature_extractor(tmp_path)
    _one_line(err)
    base = WhisperFeatureExtractor().to_dict()
    bad = [(dict(dither=1e-4), "dither"), (dict(feature_extractor_type="ClapFeatureExtractor"), "ClapFeature"),
           (dict(n_samples=1000), "n_samples is 1000"), (dict(hop_length=0), "positive integer"),
           (dict(feature_size=80.5), "positive integer"), (dict(padding_side="middle"), "padding_side")]
    for change, message in bad:
        config.write_text(json.dumps({**base, **change}))
        with pytest.raises(ElxError, match=message) as err:
            load_feature_extractor(tmp_path)
        _one_line(err)
    ours = LogMelExtractor()
    with pytest.raises(ElxError, match="lasts 30.0 s; elx transcribes up to 30 s") as err:
        features_from_audio(ours, [noise(16000), np.zeros(N_SAMPLES + 1, np.float32)], ["ok.wav", "long.wav"])
    assert "long.wav" in _one_line(err)
    with pytest.raises(ElxError, match="no audio given"):
        features_from_audio(ours, [])
    with pytest.raises(ElxError, match="mono"):
        features_from_audio(ours, [np.zeros((100, 2), np.float32)])


# ----------------------------------------------------------------------------- no torch, no transformers

_BLOCKED = """
import importlib.abc, sys

class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers"):
            raise ImportError(f"{name} is blocked in this test")
        return None

sys.meta_path.insert(0, Blocked())
"""


def test_runs_without_torch_and_transformers(tmp_path):
    """``elx.runners.inputs.audio`` turns a WAV in an export-like folder into features with torch/transformers unimportable."""
    WhisperFeatureExtractor(feature_size=80).save_pretrained(tmp_path / "export" / "tokenizer")
    samples = noise(16000 * 3, seed=11)
    write_float_wav(tmp_path / "clip.wav", samples)
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_BLOCKED)
    script = textwrap.dedent(f"""
        import sys
        for name in ("torch", "transformers"):
            try:
                __import__(name)
            except ImportError:
                pass
            else:
                raise SystemExit(name + " imported despite the block")
        import numpy as np
        from elx.runners.inputs.audio import features_from_files
        features = features_from_files({str(tmp_path / 'export')!r}, [{str(tmp_path / 'clip.wav')!r}])
        np.save({str(tmp_path / 'features.npy')!r}, features["input_features"])
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers"))
        assert not loaded, loaded
        print("ok")
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hook), str(REPO)])}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]
    want = hf_numpy_features(hf_extractor(80), [samples]).input_features
    assert_bit_equal(np.load(tmp_path / "features.npy"), want)
