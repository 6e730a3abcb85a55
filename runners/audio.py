"""Audio files → Whisper's log-mel ``input_features``, offline.

``features_from_files(folder, files)`` reads each file (WAV: 8/16/24/32-bit PCM or 32/64-bit
float, mono or multi-channel averaged to mono; other formats through ``soundfile`` when it is
installed), resamples to the feature extractor's rate (16 kHz) with a band-limited FFT
resampler when needed, and runs the ``WhisperFeatureExtractor`` saved in the export's
``tokenizer/`` folder (``elx export`` saves the source's processor there), giving
``{"input_features": float32 [B, mel bins, frames]}`` — exactly what HF's processor gives, so
elx and HF ``generate`` see the same features.

Whisper transcribes 30 s per segment; elx runs short-form only and refuses longer audio rather
than cutting it (HF switches to its long-form algorithm there).
"""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from runners.errors import ElxError

TOKENIZER_DIR = "tokenizer"
_PCM, _FLOAT, _EXTENSIBLE = 1, 3, 0xFFFE


def _parse_wav(data: bytes, name: str) -> tuple[np.ndarray, int]:
    if len(data) < 12 or data[:4] not in (b"RIFF", b"RIFX") or data[8:12] != b"WAVE":
        raise ElxError(f"{name} is not a WAV file (no RIFF/WAVE header)")
    if data[:4] == b"RIFX":
        raise ElxError(f"{name}: big-endian WAV (RIFX) is not supported; convert it to a standard WAV")
    fmt, payload, offset = None, None, 12
    while offset + 8 <= len(data):
        chunk, size = data[offset: offset + 4], struct.unpack("<I", data[offset + 4: offset + 8])[0]
        body = data[offset + 8: offset + 8 + size]
        if chunk == b"fmt ":
            fmt = body
        elif chunk == b"data":
            payload = body
            if fmt is not None:
                break
        offset += 8 + size + (size & 1)
    if fmt is None or len(fmt) < 16 or payload is None:
        raise ElxError(f"{name} is a truncated or malformed WAV file (no fmt/data chunk)")
    tag, channels, rate, _, block, bits = struct.unpack("<HHIIHH", fmt[:16])
    if tag == _EXTENSIBLE and len(fmt) >= 26:
        tag = struct.unpack("<H", fmt[24:26])[0]  # the sub-format GUID starts with the format tag
    if channels < 1 or rate < 1 or block < 1:
        raise ElxError(f"{name}: invalid WAV header ({channels} channels, {rate} Hz)")
    width = block // channels
    usable = len(payload) - len(payload) % block
    raw = payload[:usable]
    if tag == _PCM and width == 1:
        samples = (np.frombuffer(raw, np.uint8).astype(np.float32) - 128.0) / 128.0
    elif tag == _PCM and width == 2:
        samples = np.frombuffer(raw, "<i2").astype(np.float32) / 32768.0
    elif tag == _PCM and width == 3:
        b = np.frombuffer(raw, np.uint8).reshape(-1, 3).astype(np.int32)
        value = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        samples = (np.where(value >= 1 << 23, value - (1 << 24), value)).astype(np.float32) / float(1 << 23)
    elif tag == _PCM and width == 4:
        samples = (np.frombuffer(raw, "<i4").astype(np.float64) / 2.0 ** 31).astype(np.float32)
    elif tag == _FLOAT and width == 4:
        samples = np.frombuffer(raw, "<f4").astype(np.float32)
    elif tag == _FLOAT and width == 8:
        samples = np.frombuffer(raw, "<f8").astype(np.float32)
    else:
        raise ElxError(f"{name}: unsupported WAV encoding (format tag {tag}, {bits} bits); use PCM or float WAV")
    return samples.reshape(-1, channels).mean(axis=1, dtype=np.float32), int(rate)


def read_audio(path) -> tuple[np.ndarray, int]:
    """A sound file as float32 mono samples and its sampling rate; one-line ElxError when unreadable."""
    path = Path(path)
    if not path.is_file():
        raise ElxError(f"audio file {path} does not exist")
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ElxError(f"cannot read {path} ({err.strerror or type(err).__name__})")
    if data[:4] in (b"RIFF", b"RIFX"):
        samples, rate = _parse_wav(data, str(path))
    else:
        try:
            import soundfile
        except ImportError:
            raise ElxError(f"{path} is not a WAV file; convert it to WAV (or pip install soundfile for other formats)")
        try:
            samples, rate = soundfile.read(str(path), dtype="float32", always_2d=True)
        except Exception as err:  # noqa: BLE001 - soundfile raises its own error types
            raise ElxError(f"cannot decode {path} ({str(err).splitlines()[0] if str(err) else type(err).__name__})")
        samples = samples.mean(axis=1, dtype=np.float32)
    if samples.size == 0:
        raise ElxError(f"{path} holds no audio samples")
    if not np.all(np.isfinite(samples)):
        raise ElxError(f"{path} holds non-finite samples (NaN or inf)")
    return samples, rate


def resample(audio: np.ndarray, rate: int, target: int) -> np.ndarray:
    """Band-limited resampling through the spectrum; 100 ms of zero padding avoids wrap-around."""
    if rate == target or audio.size == 0:
        return audio.astype(np.float32)
    pad = rate // 10
    padded = np.pad(audio.astype(np.float64), pad)
    out_len = int(round(padded.size * target / rate))
    spectrum = np.fft.rfft(padded)[: out_len // 2 + 1]
    result = np.fft.irfft(spectrum, out_len) * (out_len / padded.size)
    trim = int(round(pad * target / rate))
    return result[trim: out_len - trim].astype(np.float32)


def load_feature_extractor(folder):
    """The ``WhisperFeatureExtractor`` saved in ``folder/tokenizer`` by ``elx export``."""
    path = Path(folder) / TOKENIZER_DIR
    if not path.is_dir():
        raise ElxError(f"{folder} has no {TOKENIZER_DIR}/ folder with a feature extractor; export from a Whisper "
                       "folder that has preprocessor_config.json (e.g. one written by 'elx import-ct2')")
    from transformers import WhisperFeatureExtractor

    try:
        return WhisperFeatureExtractor.from_pretrained(str(path), local_files_only=True)
    except Exception as err:  # noqa: BLE001 - missing or unreadable preprocessor config
        first = str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
        raise ElxError(f"cannot load the feature extractor in {path} ({first}); re-run 'elx export'")


def features_from_audio(extractor, audio: list, names: list | None = None) -> dict:
    """16 kHz float32 arrays → ``{"input_features": [B, mel bins, frames]}`` (short-form only)."""
    names = names or [f"audio {i}" for i in range(len(audio))]
    limit = int(extractor.n_samples)
    for samples, name in zip(audio, names):
        if len(samples) > limit:
            raise ElxError(f"{name} lasts {len(samples) / extractor.sampling_rate:.1f} s; elx transcribes up to "
                           f"{limit / extractor.sampling_rate:.0f} s per file (Whisper short-form): split it")
    features = extractor([np.asarray(a, np.float32) for a in audio], sampling_rate=extractor.sampling_rate,
                         return_tensors="np").input_features
    return {"input_features": np.ascontiguousarray(features, dtype=np.float32)}


def features_from_files(folder, files) -> dict:
    """Sound files → Whisper ``input_features`` [B, 80, 3000] with the export's feature extractor."""
    files = [files] if isinstance(files, (str, Path)) else list(files)
    if not files:
        raise ElxError("no audio files given")
    extractor = load_feature_extractor(folder)
    audio = []
    for file in files:
        samples, rate = read_audio(file)
        audio.append(resample(samples, rate, int(extractor.sampling_rate)))
    return features_from_audio(extractor, audio, [str(f) for f in files])
