"""Offline synthetic speech for ASR checks: Debian's ``espeak-ng`` -> 16 kHz float32 mono.

``synthesize("The quick brown fox", "fox.wav")`` runs espeak-ng (``apt-get install espeak-ng``),
reads the 16-bit WAV it writes (22050 Hz), resamples it to 16 kHz with a band-limited FFT
resampler (numpy only), writes the 16 kHz result back to ``path`` and returns it.
"""
from __future__ import annotations

import shutil
import subprocess
import wave
from pathlib import Path

import numpy as np

SAMPLING_RATE = 16000
DEFAULT_VOICE = "en-us"
ESPEAK = "espeak-ng"


class SpeechError(RuntimeError):
    """Speech could not be synthesized (espeak-ng missing or failing)."""


def espeak_available() -> bool:
    """Whether the espeak-ng program is on PATH."""
    return shutil.which(ESPEAK) is not None


def synthesize(text: str, path: str | Path, voice: str = DEFAULT_VOICE, words_per_minute: int = 130) -> np.ndarray:
    """Speak ``text`` with espeak-ng; return 16 kHz mono float32 in [-1, 1] (also saved to ``path``)."""
    if not espeak_available():
        raise SpeechError("espeak-ng is not installed: run `apt-get install -y espeak-ng` (Debian/Ubuntu)")
    path = Path(path)
    command = [ESPEAK, "-v", voice, "-s", str(words_per_minute), "-w", str(path), text]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    if result.returncode != 0 or not path.is_file():
        message = (result.stderr or result.stdout).strip().splitlines()
        raise SpeechError(f"espeak-ng failed for voice {voice!r}: {message[0] if message else result.returncode}")
    audio, rate = read_wav(path)
    audio = resample(audio, rate, SAMPLING_RATE)
    write_wav(path, audio, SAMPLING_RATE)
    return audio


def read_wav(path: str | Path) -> tuple[np.ndarray, int]:
    """A 16-bit PCM WAV as float32 mono (channels averaged) and its sampling rate."""
    with wave.open(str(path), "rb") as handle:
        if handle.getsampwidth() != 2:
            raise SpeechError(f"{path}: only 16-bit PCM WAV is supported")
        frames = handle.readframes(handle.getnframes())
        channels, rate = handle.getnchannels(), handle.getframerate()
    samples = np.frombuffer(frames, dtype="<i2").astype(np.float32) / 32768.0
    return samples.reshape(-1, channels).mean(axis=1), rate


def write_wav(path: str | Path, audio: np.ndarray, rate: int) -> None:
    """Write float audio in [-1, 1] as 16-bit PCM mono."""
    pcm = np.clip(np.round(audio * 32767.0), -32768, 32767).astype("<i2")
    with wave.open(str(path), "wb") as handle:
        handle.setnchannels(1)
        handle.setsampwidth(2)
        handle.setframerate(rate)
        handle.writeframes(pcm.tobytes())


def resample(audio: np.ndarray, rate: int, target: int) -> np.ndarray:
    """Band-limited resampling through the spectrum; the signal is zero-padded to avoid wrap-around."""
    if rate == target or audio.size == 0:
        return audio.astype(np.float32)
    pad = rate // 10  # 100 ms of silence on each side
    padded = np.pad(audio.astype(np.float64), pad)
    out_len = int(round(padded.size * target / rate))
    spectrum = np.fft.rfft(padded)
    kept = spectrum[: out_len // 2 + 1]
    result = np.fft.irfft(kept, out_len) * (out_len / padded.size)
    trim = int(round(pad * target / rate))
    return result[trim : out_len - trim].astype(np.float32)
