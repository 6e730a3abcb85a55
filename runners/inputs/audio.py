"""Audio files → Whisper's log-mel ``input_features``, offline, with numpy only.

``features_from_files(folder, files)`` reads each file (WAV: 8/16/24/32-bit PCM or 32/64-bit
float, mono or multi-channel averaged to mono; other formats through ``soundfile`` when it is
installed), resamples to the feature extractor's rate (16 kHz) with a band-limited FFT
resampler when needed, and computes Whisper's log-mel spectrogram with ``LogMelExtractor``,
whose settings come from the feature-extractor config that ``elx export`` saves in the export's
``tokenizer/`` folder.  The result, ``{"input_features": float32 [B, mel bins, frames]}``, is
bit-equal to transformers' ``WhisperFeatureExtractor(audio, sampling_rate=16000,
return_tensors="np")`` on its numpy path (the one it takes without torch; with torch installed
HF computes the STFT, mel product and log in float32 through ``torch.stft`` instead, which differs
by up to ~3e-5), so elx and HF ``generate`` see the same features.  Neither torch nor transformers is imported here.

Whisper transcribes 30 s per window.  A batch whose clips all fit one window gets the short-form features
(each clip padded to 30 s); a batch with a longer clip gets HF's long-form features (``long_form``:
``WhisperFeatureExtractor(..., truncation=False, padding="longest", return_attention_mask=True)``, every clip
padded to the longest, with the per-frame ``attention_mask`` HF's long-form ``generate`` reads each clip's
length from), which ``runners/whisper_longform.py`` transcribes window by window as HF does.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from elx.runners.errors import ElxError
from elx.runners.inputs.user_files import check_user_file, open_user_file

TOKENIZER_DIR = "tokenizer"
_PCM, _FLOAT, _EXTENSIBLE = 1, 3, 0xFFFE


@dataclass(frozen=True)
class AudioInfo:
    """What a sound file's header says: enough to refuse it (too long, an unsupported encoding) before reading it."""

    path: Path
    rate: int  # samples per second and channel
    frames: int  # samples per channel
    channels: int
    wav: tuple | None = None  # (format tag, bytes per sample, data offset, data bytes) of a WAV file; None: soundfile

    @property
    def seconds(self) -> float:
        return self.frames / self.rate


def _wav_info(handle, size: int, name: str, path: Path) -> AudioInfo:
    """The ``fmt`` and ``data`` chunks of a RIFF/WAVE file, read chunk header by chunk header (the samples stay on
    disk); a data chunk that claims more than the file holds (a cut file, a streamed header) ends at the file's end."""
    head = handle.read(12)
    if len(head) < 12 or head[:4] not in (b"RIFF", b"RIFX") or head[8:12] != b"WAVE":
        raise ElxError(f"{name} is not a WAV file (no RIFF/WAVE header)")
    if head[:4] == b"RIFX":
        raise ElxError(f"{name}: big-endian WAV (RIFX) is not supported; convert it to a standard WAV")
    fmt, data, offset = None, None, 12
    while offset + 8 <= size:
        handle.seek(offset)
        header = handle.read(8)
        if len(header) < 8:
            break
        chunk, length = header[:4], struct.unpack("<I", header[4:])[0]
        if chunk == b"fmt ":
            fmt = handle.read(min(length, 64))
        elif chunk == b"data":
            data = (offset + 8, max(0, min(length, size - offset - 8)))
            if fmt is not None:
                break
        offset += 8 + length + (length & 1)
    if fmt is None or len(fmt) < 16 or data is None:
        raise ElxError(f"{name} is a truncated or malformed WAV file (no fmt/data chunk)")
    tag, channels, rate, _, block, bits = struct.unpack("<HHIIHH", fmt[:16])
    if tag == _EXTENSIBLE and len(fmt) >= 26:
        tag = struct.unpack("<H", fmt[24:26])[0]  # the sub-format GUID starts with the format tag
    width = _check_format(name, tag, channels, rate, block, bits)
    return AudioInfo(path, int(rate), data[1] // block, channels, (tag, width, data[0], data[1] // block * block))


def _decode(raw: bytes, tag: int, width: int, channels: int) -> np.ndarray:
    """WAV sample bytes (whole frames) → float32 mono, channels averaged."""
    if tag == _PCM and width == 1:
        samples = (np.frombuffer(raw, np.uint8).astype(np.float32) - 128.0) / 128.0
    elif tag == _PCM and width == 2:
        samples = np.frombuffer(raw, "<i2").astype(np.float32) / 32768.0
    elif tag == _PCM and width == 3:
        b = np.frombuffer(raw, np.uint8).reshape(-1, 3).astype(np.int32)
        value = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        samples = (np.where(value >= 1 << 23, value - (1 << 24), value)).astype(np.float32) / float(1 << 23)
    elif tag == _PCM:
        samples = (np.frombuffer(raw, "<i4").astype(np.float64) / 2.0 ** 31).astype(np.float32)
    elif width == 4:
        samples = np.frombuffer(raw, "<f4").astype(np.float32)
    else:
        samples = np.frombuffer(raw, "<f8").astype(np.float32)
    return samples.reshape(-1, channels).mean(axis=1, dtype=np.float32)


_COMPRESSED = {2: "ADPCM", 6: "A-law", 7: "mu-law", 0x11: "IMA ADPCM", 0x55: "MP3"}
MIN_RATE, MAX_RATE = 1000, 768_000  # Hz: what audio files hold (telephony to studio); outside it a header is corrupt


def _check_format(name: str, tag: int, channels: int, rate: int, block: int, bits: int) -> int:
    """The bytes per sample of a WAV ``fmt`` chunk elx decodes (PCM 8/16/24/32-bit, float 32/64-bit), or a one-line
    ElxError saying exactly what is wrong with it."""
    if tag not in (_PCM, _FLOAT):
        kind = _COMPRESSED.get(tag, f"format tag {tag}")
        raise ElxError(f"{name}: {kind} WAV encoding is not supported; convert it to PCM or float WAV")
    kind = "PCM" if tag == _PCM else "float"
    if channels < 1:
        raise ElxError(f"{name}: malformed WAV header ({channels} channels)")
    if not MIN_RATE <= rate <= MAX_RATE:
        raise ElxError(f"{name}: malformed WAV header (sampling rate {rate} Hz, outside {MIN_RATE}-{MAX_RATE} Hz)")
    widths = (1, 2, 3, 4) if tag == _PCM else (4, 8)
    if bits < 1 or (bits + 7) // 8 not in widths:
        allowed = "8, 16, 24 or 32" if tag == _PCM else "32 or 64"
        raise ElxError(f"{name}: {bits}-bit {kind} samples are not supported ({kind} WAV of {allowed} bits is)")
    width = (bits + 7) // 8
    if block != channels * width:
        raise ElxError(f"{name}: malformed WAV header: block_align is {block} bytes, but {channels} channel(s) of "
                       f"{bits}-bit {kind} samples take {channels * width}; the file is damaged or mislabelled")
    return width


BLOCK_FRAMES = 1 << 19  # frames read, decoded and resampled at a time (12 s of 44.1 kHz): memory beside the result


def audio_info(path) -> AudioInfo:
    """The header of a sound file (WAV, or what ``soundfile`` reads when installed), without its samples; one-line
    ElxError when it is missing, no regular file, or not readable as audio."""
    path = Path(path)
    if not path.exists():
        raise ElxError(f"audio file {path} does not exist")
    with open_user_file(path, "audio file", limit=None) as handle:  # a regular file: no FIFO, device or folder
        magic = handle.read(4)
        if magic in (b"RIFF", b"RIFX"):
            handle.seek(0)
            info = _wav_info(handle, os.fstat(handle.fileno()).st_size, str(path), path)
        else:
            info = None
    if info is None:
        soundfile = _soundfile(path)
        try:
            found = soundfile.info(str(path))
        except Exception as err:  # noqa: BLE001 - soundfile raises its own error types
            raise ElxError(f"cannot decode {path} ({str(err).splitlines()[0] if str(err) else type(err).__name__})")
        info = AudioInfo(path, int(found.samplerate), int(found.frames), int(found.channels))
        if not MIN_RATE <= info.rate <= MAX_RATE or info.channels < 1:
            raise ElxError(f"{path}: malformed header ({info.rate} Hz, {info.channels} channels)")
    if info.frames == 0:
        raise ElxError(f"{path} holds no audio samples")
    return info


def _soundfile(path):
    try:
        import soundfile
    except ImportError:
        raise ElxError(f"{path} is not a WAV file; convert it to WAV (or pip install soundfile for other formats)")
    return soundfile


def audio_blocks(info: AudioInfo, frames: int | None = None):
    """The file's samples as float32 mono blocks of ``frames`` frames (the last one shorter), read as they are
    needed (default ``BLOCK_FRAMES``); a non-finite sample is refused in one line."""
    frames = BLOCK_FRAMES if frames is None else frames
    if info.wav is not None:
        tag, width, offset, size = info.wav
        block = width * info.channels
        with open_user_file(info.path, "audio file", limit=None) as handle:
            handle.seek(offset)
            left = size
            while left > 0:
                raw = handle.read(min(left, frames * block))
                raw = raw[: len(raw) - len(raw) % block]
                if not raw:
                    break
                left -= len(raw)
                yield _finite(_decode(raw, tag, width, info.channels), info.path)
        return
    soundfile = _soundfile(info.path)
    check_user_file(info.path, "audio file")
    try:
        with soundfile.SoundFile(str(info.path)) as sound:
            while True:
                samples = sound.read(frames, dtype="float32", always_2d=True)
                if not len(samples):
                    break
                yield _finite(samples.mean(axis=1, dtype=np.float32), info.path)
    except ElxError:
        raise
    except Exception as err:  # noqa: BLE001 - soundfile raises its own error types
        raise ElxError(f"cannot decode {info.path} ({str(err).splitlines()[0] if str(err) else type(err).__name__})")


def _finite(samples: np.ndarray, path) -> np.ndarray:
    if not np.all(np.isfinite(samples)):
        raise ElxError(f"{path} holds non-finite samples (NaN or inf)")
    return samples


def read_audio(path) -> tuple[np.ndarray, int]:
    """A sound file as float32 mono samples and its sampling rate; one-line ElxError when unreadable."""
    info = audio_info(path)
    if info.seconds > LONG_FORM_LIMIT:  # refused before a sample is read (a 2 GiB file of 16 kHz audio lasts 18 h)
        raise ElxError(f"{info.path} lasts {info.seconds:.1f} s; elx reads up to {LONG_FORM_LIMIT} s (4 h) of audio "
                       "per file: split it")
    return _gather(audio_blocks(info), info.frames), info.rate


def _gather(blocks, expected: int) -> np.ndarray:
    """Blocks of samples into one float32 array, written in place (no second copy of a long clip)."""
    out, used = np.empty(max(expected, 0), dtype=np.float32), 0
    for block in blocks:
        if used + block.size > out.size:  # more than the header said (a resampler's last samples)
            out = np.concatenate([out[:used], np.empty(max(block.size, out.size // 8), np.float32)])
        out[used: used + block.size] = block
        used += block.size
    return out[:used] if used < out.size else out


def resampled_blocks(blocks, rate: int, target: int):
    """Blocks at ``rate`` → blocks at ``target``: soxr's polyphase resampler (quality HQ), streamed, so that a long
    file never sits in memory at its own rate; the identity when the rates agree."""
    if rate == target:
        yield from blocks
        return
    try:
        import soxr
    except ImportError:
        raise ElxError(f"audio at {rate} Hz needs resampling to {target} Hz: pip install soxr (an elx dependency)")
    stream = soxr.ResampleStream(rate, target, 1, dtype="float32")
    for block in blocks:
        out = stream.resample_chunk(np.ascontiguousarray(block, dtype=np.float32), last=False)
        if out.size:
            yield out
    out = stream.resample_chunk(np.zeros(0, np.float32), last=True)
    if out.size:
        yield out


def resampled_length(frames: int, rate: int, target: int) -> int:
    """Samples ``resampled_blocks`` gives for ``frames`` samples at ``rate``: frames · target / rate rounded half up
    (soxr's count; tests/test_audio_features.py checks it), so that a header tells whether a clip fits 30 s."""
    return frames if rate == target else (2 * frames * target + rate) // (2 * rate)


def resample(audio: np.ndarray, rate: int, target: int) -> np.ndarray:
    """``audio`` at ``rate`` → float32 at ``target``, exactly as ``load_clip`` resamples a file of these samples (the
    same polyphase resampler over the same ``BLOCK_FRAMES`` blocks)."""
    audio = np.asarray(audio, dtype=np.float32)
    if rate == target or audio.size == 0:
        return audio.astype(np.float32)
    blocks = (audio[i: i + BLOCK_FRAMES] for i in range(0, audio.size, BLOCK_FRAMES))
    return _gather(resampled_blocks(blocks, rate, target), resampled_length(audio.size, rate, target))


# ----------------------------------------------------------------------------- log-mel numerics
# Each step follows transformers' numpy path (``WhisperFeatureExtractor._np_extract_fbank_features``
# with ``audio_utils.spectrogram`` and ``audio_utils.mel_filter_bank``) operation for operation,
# in the same dtypes, so that the features are bit-equal, not merely close.

MEL_F_MIN, MEL_F_MAX = 0.0, 8000.0  # Hz; HF fixes these for Whisper whatever the sampling rate
MEL_FLOOR = 1e-10  # power floor before log10 (-100 dB)
DYNAMIC_RANGE = np.float32(8.0)  # log10 units kept below the clip's maximum (80 dB)
_SLANEY_BREAK_HZ, _SLANEY_BREAK_MEL = 1000.0, 15.0  # 15 = 3 · 1000 / 200


def hz_to_mel(hz):
    """Slaney's mel scale (Auditory Toolbox, librosa ``htk=False``).

    m(f) = 3 f / 200 for f < 1000 Hz (linear, 200/3 Hz per mel), and above
    m(f) = 15 + ln(f / 1000) · 27 / ln 6.4 (logarithmic: 27 mels per factor 6.4).
    Scalars stay scalars (0-d float64), arrays are converted element-wise.
    """
    hz = np.asarray(hz, np.float64)
    mel = 3.0 * hz / 200.0
    high = hz >= _SLANEY_BREAK_HZ
    if mel.ndim == 0:
        return _SLANEY_BREAK_MEL + np.log(hz / _SLANEY_BREAK_HZ) * (27.0 / np.log(6.4)) if high else mel
    mel[high] = _SLANEY_BREAK_MEL + np.log(hz[high] / _SLANEY_BREAK_HZ) * (27.0 / np.log(6.4))
    return mel


def mel_to_hz(mel: np.ndarray) -> np.ndarray:
    """Inverse of ``hz_to_mel``: f = 200 m / 3 below 15 mels, f = 1000 · exp(ln 6.4 / 27 · (m − 15)) above."""
    mel = np.asarray(mel, np.float64)
    hz = 200.0 * mel / 3.0
    high = mel >= _SLANEY_BREAK_MEL
    hz[high] = _SLANEY_BREAK_HZ * np.exp((np.log(6.4) / 27.0) * (mel[high] - _SLANEY_BREAK_MEL))
    return hz


def slaney_mel_filters(n_fft: int, n_mels: int, sampling_rate: int, f_min: float = MEL_F_MIN,
                       f_max: float = MEL_F_MAX) -> np.ndarray:
    """Triangular mel filter bank with Slaney area normalisation, float64 [n_fft // 2 + 1, n_mels].

    The n_mels + 2 edges e_0 < … < e_{n+1} are equally spaced in mels from m(f_min) to m(f_max),
    then mapped back to Hz.  The FFT bins sit at f_k = k · (sr // 2) / (n_fft // 2).  Filter j rises
    from e_j to e_{j+1} and falls to e_{j+2}:

        w_kj = max(0, min((f_k − e_j) / (e_{j+1} − e_j), (e_{j+2} − f_k) / (e_{j+2} − e_{j+1})))

    and is scaled by 2 / (e_{j+2} − e_j) so that every filter has the same area (constant energy
    per channel).  Same as HF ``mel_filter_bank(norm="slaney", mel_scale="slaney")``.
    """
    bins = np.linspace(0, sampling_rate // 2, n_fft // 2 + 1)[:, None]
    edges = mel_to_hz(np.linspace(hz_to_mel(f_min), hz_to_mel(f_max), n_mels + 2))
    lower, center, upper = edges[:-2], edges[1:-1], edges[2:]
    rising = -(lower - bins) / (center - lower)  # = (f_k − e_j) / …, written so that zeros are −0.0 as in HF
    falling = (upper - bins) / (upper - center)
    return np.maximum(0.0, np.minimum(rising, falling)) * (2.0 / (upper - lower))


def hann_window(n: int) -> np.ndarray:
    """Periodic Hann window (as ``torch.hann_window``), float64: w_k = 0.5 − 0.5 cos(2πk / n), k = 0…n−1.

    Computed as the first n points of numpy's symmetric window of length n + 1, as HF does.
    """
    return np.hanning(n + 1)[:-1]


def power_spectrogram(waveform: np.ndarray, n_fft: int, hop_length: int, window: np.ndarray) -> np.ndarray:
    """|STFT|² of one waveform, float64 [frames, n_fft // 2 + 1], frames = 1 + len // hop_length (even n_fft).

    Centred frames: the waveform is reflect-padded by n_fft // 2 on each side (x_{−i} = x_i), so frame t
    covers padded samples [t·hop, t·hop + n_fft), centred on original sample t·hop.  Each frame is
    multiplied by the window in float64 and transformed with a real FFT, X_t[k] = Σ_n x_t[n] w[n] e^{−2πikn/N}.
    Like HF, the spectrum is stored as complex64 (rounding re and im to float32) before the magnitude
    |X| = hypot(re, im) is taken in float64 and squared.
    """
    padded = np.pad(waveform, n_fft // 2, mode="reflect").astype(np.float64)
    frames = np.lib.stride_tricks.sliding_window_view(padded, n_fft)[::hop_length]
    spectrum = np.fft.rfft(frames * window, axis=-1).astype(np.complex64)
    return np.abs(spectrum, dtype=np.float64) ** 2


def log_mel(power: np.ndarray, filters: np.ndarray) -> np.ndarray:
    """log10 of the mel energies, float32 [n_mels, frames]: log10(max(1e-10, Wᵀ P)) computed in float64.

    ``power`` is [frames, bins] and ``filters`` [bins, n_mels], both C-ordered: the product is taken as
    ``filters.T @ power.T``, the same transposed views HF hands to BLAS, so its sums run in HF's order.
    """
    return np.log10(np.maximum(MEL_FLOOR, np.dot(filters.T, power.T))).astype(np.float32)


def whisper_scale(log_spec: np.ndarray) -> np.ndarray:
    """Whisper's normalisation of one clip's log10 mel spectrogram (float32 throughout).

    The last frame (centred on the sample just past the clip) is dropped; values more than 8 below the
    clip's maximum are raised to max − 8 (an 80 dB range); then y = (x + 4) / 4, roughly within [−1, 1].
    """
    log_spec = log_spec[:, :-1]
    log_spec = np.maximum(log_spec, log_spec.max() - DYNAMIC_RANGE)
    return (log_spec + np.float32(4.0)) / np.float32(4.0)


FRAMES_PER_BLOCK = 4096  # STFT frames computed at a time (41 s of audio): a long clip's float64 temporaries stay small


def frame_count(samples: int, n_fft: int, hop_length: int) -> int:
    """STFT frames of a clip of ``samples`` samples, centred (reflect-padded by n_fft // 2 on each side)."""
    return (samples + 2 * (n_fft // 2) - n_fft) // hop_length + 1


def _reflect_padded(waveform: np.ndarray, pad: int, lo: int, hi: int) -> np.ndarray:
    """``np.pad(waveform, pad, mode="reflect")[lo:hi]``, built from the samples it needs (the whole clip is never
    copied): inside the clip a view; at an edge the reflection of enough samples there."""
    n = waveform.size
    start, stop = lo - pad, hi - pad  # in the clip's indices
    if start >= 0 and stop <= n:
        return waveform[start:stop]
    first = 0 if start < 0 else min(start, max(0, n - pad - 1))  # a right reflection reads pad + 1 samples
    last = n if stop > n else max(stop, min(n, pad + 1))  # a left one too
    piece = np.pad(waveform[first:last], (pad if start < 0 else 0, pad if stop > n else 0), mode="reflect")
    origin = first + pad - (pad if start < 0 else 0)  # the padded index of piece[0]
    return piece[lo - origin: hi - origin]


def log_mel_spectrogram(waveform: np.ndarray, n_fft: int, hop_length: int, window: np.ndarray, filters: np.ndarray,
                        frames: int | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """``log_mel(power_spectrogram(waveform, ...), filters)`` [n_mels, frames], computed ``FRAMES_PER_BLOCK`` frames
    at a time into ``out``: bit-equal to the one-shot computation (each frame's FFT, power and mel sums are its own:
    checked for block remainders of 1 frame up in tests/test_audio_features.py), with temporaries of one block.
    ``frames``: compute only the first ones (Whisper drops the last frame: ``whisper_scale``)."""
    pad = n_fft // 2
    frames = frame_count(waveform.size, n_fft, hop_length) if frames is None else frames
    out = np.empty((filters.shape[1], frames), dtype=np.float32) if out is None else out
    for first in range(0, frames, FRAMES_PER_BLOCK):
        last = min(frames, first + FRAMES_PER_BLOCK)
        piece = _reflect_padded(waveform, pad, first * hop_length, (last - 1) * hop_length + n_fft)
        view = np.lib.stride_tricks.sliding_window_view(piece.astype(np.float64), n_fft)[::hop_length]
        spectrum = np.fft.rfft(view * window, axis=-1).astype(np.complex64)
        out[:, first:last] = log_mel(np.abs(spectrum, dtype=np.float64) ** 2, filters)
    return out


def _scale_in_place(log_spec: np.ndarray) -> np.ndarray:
    """``whisper_scale`` on a spectrogram whose last frame was never computed, in place (the same float32 steps)."""
    np.maximum(log_spec, log_spec.max() - DYNAMIC_RANGE, out=log_spec)
    log_spec += np.float32(4.0)
    log_spec /= np.float32(4.0)
    return log_spec


# ----------------------------------------------------------------------------- the extractor

FEATURE_CONFIG = "preprocessor_config.json"
PROCESSOR_CONFIG = "processor_config.json"


@dataclass(frozen=True)
class LogMelExtractor:
    """Whisper's feature extractor: settings of ``WhisperFeatureExtractor`` and its numpy computation.

    ``extractor(audio)`` pads or truncates each 16 kHz clip to ``n_samples`` (30 s) and returns its
    log-mel spectrogram, float32 [B, feature_size, nb_max_frames].
    """

    feature_size: int = 80
    sampling_rate: int = 16000
    hop_length: int = 160
    chunk_length: int = 30
    n_fft: int = 400
    padding_value: float = 0.0
    padding_side: str = "right"
    mel_filters: np.ndarray = field(init=False, repr=False, compare=False)
    window: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "mel_filters", slaney_mel_filters(self.n_fft, self.feature_size, self.sampling_rate))
        object.__setattr__(self, "window", hann_window(self.n_fft))

    @property
    def n_samples(self) -> int:
        """Samples per segment: chunk_length · sampling_rate (480 000)."""
        return self.chunk_length * self.sampling_rate

    @property
    def nb_max_frames(self) -> int:
        """Feature frames per segment: n_samples // hop_length (3000)."""
        return self.n_samples // self.hop_length

    @classmethod
    def from_config(cls, config: dict, source: str = "the feature extractor config") -> "LogMelExtractor":
        """Settings from a ``WhisperFeatureExtractor`` config dict; one-line ElxError for what elx cannot honour.

        Absent keys take HF's defaults.  ``n_samples`` and ``nb_max_frames``, when present, must agree with
        the values HF derives from ``chunk_length``, ``sampling_rate`` and ``hop_length`` (HF recomputes them).
        """
        kind = config.get("feature_extractor_type", "WhisperFeatureExtractor")
        if kind != "WhisperFeatureExtractor":
            raise ElxError(f"{source} describes a {kind}; elx computes Whisper's log-mel features only")
        settings = {}
        for name in ("feature_size", "sampling_rate", "hop_length", "chunk_length", "n_fft"):
            value = config.get(name, getattr(cls, name))
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < 1:
                raise ElxError(f"{source}: {name} must be a positive integer, not {value!r}")
            settings[name] = int(value)
        padding_value = config.get("padding_value", cls.padding_value)
        if isinstance(padding_value, bool) or not isinstance(padding_value, (int, float)):
            raise ElxError(f"{source}: padding_value must be a number, not {padding_value!r}")
        padding_side = config.get("padding_side", cls.padding_side)
        if padding_side not in ("right", "left"):
            raise ElxError(f"{source}: padding_side must be 'right' or 'left', not {padding_side!r}")
        if config.get("dither", 0.0) not in (0, 0.0, None):
            raise ElxError(f"{source}: dither={config['dither']} adds random noise to the features; elx computes "
                           "them deterministically (set dither to 0.0)")
        extractor = cls(**settings, padding_value=float(padding_value), padding_side=padding_side)
        if extractor.n_fft // 2 >= extractor.n_samples:
            raise ElxError(f"{source}: n_fft {extractor.n_fft} does not fit a {extractor.n_samples}-sample segment")
        for name in ("n_samples", "nb_max_frames"):
            if name in config and config[name] != getattr(extractor, name):
                raise ElxError(f"{source}: {name} is {config[name]} but chunk_length, sampling_rate and hop_length "
                               f"give {getattr(extractor, name)}; fix the config")
        return extractor

    @classmethod
    def from_folder(cls, path) -> "LogMelExtractor":
        """The config in ``path`` as transformers finds it: the ``feature_extractor`` (or ``audio_processor``)
        entry of ``processor_config.json`` (what a processor's ``save_pretrained`` writes), else
        ``preprocessor_config.json`` (a feature extractor's own ``save_pretrained``)."""
        path = Path(path)
        config = None
        if (path / PROCESSOR_CONFIG).is_file():
            processor = _read_json(path / PROCESSOR_CONFIG)
            config = processor.get("feature_extractor", processor.get("audio_processor"))
            source = f"{path / PROCESSOR_CONFIG} (feature_extractor)"
        if config is None and (path / FEATURE_CONFIG).is_file():
            config, source = _read_json(path / FEATURE_CONFIG), str(path / FEATURE_CONFIG)
        if not isinstance(config, dict):
            raise ElxError(f"{path} has no feature extractor config ({FEATURE_CONFIG}, or {PROCESSOR_CONFIG} with a "
                           "feature_extractor entry); re-run 'elx export' from a Whisper folder that has one")
        return cls.from_config(config, source)

    def pad_or_trim(self, samples) -> np.ndarray:
        """One clip as float32 [n_samples]: cut after n_samples, else filled with padding_value on padding_side."""
        samples = np.asarray(samples, dtype=np.float32)
        if samples.ndim != 1:
            raise ElxError(f"audio must be mono (one dimension), not shaped {samples.shape}")
        samples = samples[: self.n_samples]
        segment = np.full(self.n_samples, self.padding_value, dtype=np.float32)
        if self.padding_side == "right":
            segment[: samples.size] = samples
        else:
            segment[self.n_samples - samples.size:] = samples
        return segment

    def features(self, segment: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Log-mel features of one padded segment (or a whole long clip), float32 [feature_size, frames - 1]: HF's
        spectrogram less its last frame, scaled (``whisper_scale``), computed block by block into ``out``."""
        segment = np.asarray(segment, dtype=np.float32)
        frames = frame_count(segment.size, self.n_fft, self.hop_length) - 1
        log_spec = log_mel_spectrogram(segment, self.n_fft, self.hop_length, self.window, self.mel_filters, frames,
                                       out)
        return _scale_in_place(log_spec)

    def __call__(self, audio: list) -> np.ndarray:
        """Clips at ``sampling_rate`` → float32 [B, feature_size, nb_max_frames], as HF's extractor with
        ``padding="max_length"``, ``truncation=True``."""
        return np.stack([self.features(self.pad_or_trim(samples)) for samples in audio])

    def long_form(self, audio: list) -> dict:
        """Clips of which one lasts over ``n_samples`` → ``input_features`` float32 [B, feature_size, frames] and
        ``attention_mask`` int64 [B, frames], as HF's extractor with ``truncation=False, padding="longest",
        return_attention_mask=True``: every clip right-padded to the longest (L samples, L // hop_length frames);
        a frame is 1 where it starts on a real sample."""
        longest = max(len(samples) for samples in audio)
        frames = frame_count(longest, self.n_fft, self.hop_length) - 1
        features = np.empty((len(audio), self.feature_size, frames), dtype=np.float32)
        for row, samples in zip(features, audio):
            samples = np.asarray(samples, dtype=np.float32)
            if samples.size < longest:  # right-padded to the longest (only the shorter clips are copied)
                samples = np.concatenate([samples, np.full(longest - samples.size, self.padding_value, np.float32)])
            self.features(samples, out=row)
        starts = np.arange(features.shape[-1]) * self.hop_length
        mask = np.stack([starts < len(samples) for samples in audio]).astype(np.int64)
        return {"input_features": features, "attention_mask": mask}

    def attention_mask(self, lengths) -> np.ndarray:
        """int32 [B, nb_max_frames]: 1 where a frame starts on a real sample, as HF's ``return_attention_mask=True``.

        HF takes the padded per-sample mask every hop_length samples (frame t ↔ sample t·hop) and drops the
        last entry when n_samples is not a multiple of hop_length.
        """
        starts = np.arange(self.nb_max_frames) * self.hop_length
        rows = []
        for length in lengths:
            length = min(int(length), self.n_samples)
            first = 0 if self.padding_side == "right" else self.n_samples - length
            rows.append((starts >= first) & (starts < first + length))
        return np.array(rows, dtype=np.int32).reshape(len(rows), self.nb_max_frames)


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ElxError(f"cannot read {path} ({str(err).splitlines()[0] if str(err) else type(err).__name__}); "
                       "re-run 'elx export'")
    if not isinstance(data, dict):
        raise ElxError(f"{path} does not hold a JSON object; re-run 'elx export'")
    return data


def load_feature_extractor(folder) -> LogMelExtractor:
    """The feature extractor settings saved in ``folder/tokenizer`` by ``elx export``."""
    path = Path(folder) / TOKENIZER_DIR
    if not path.is_dir():
        raise ElxError(f"{folder} has no {TOKENIZER_DIR}/ folder with a feature extractor; export from a Whisper "
                       "folder that has preprocessor_config.json (e.g. one written by 'elx import-ct2')")
    return LogMelExtractor.from_folder(path)


def features_from_audio(extractor: LogMelExtractor, audio: list, names: list | None = None,
                        long_form: bool = False) -> dict:
    """Clips at the extractor's rate (16 kHz) → ``{"input_features": float32 [B, mel bins, frames]}``.

    Without ``long_form`` a clip longer than ``n_samples`` (30 s) is refused, not cut; with it, a batch with
    such a clip gets HF's long-form features and ``attention_mask`` (``LogMelExtractor.long_form``).
    """
    if not len(audio):
        raise ElxError("no audio given")
    names = names or [f"audio {i}" for i in range(len(audio))]
    limit = extractor.n_samples
    if long_form and max(len(samples) for samples in audio) > limit:
        return extractor.long_form(audio)
    for samples, name in zip(audio, names):
        if len(samples) > limit:
            raise ElxError(f"{name} lasts {len(samples) / extractor.sampling_rate:.1f} s; elx transcribes up to "
                           f"{limit / extractor.sampling_rate:.0f} s per file (Whisper short-form): split it")
    return {"input_features": np.ascontiguousarray(extractor(audio), dtype=np.float32)}


LONG_FORM_LIMIT = 4 * 3600  # seconds: a longer file (or a header with a tiny rate) is refused before resampling


def check_duration(info: AudioInfo, extractor: LogMelExtractor, long_form: bool = False) -> None:
    """Refuse, from the header alone, a file longer than a segment (30 s; ``long_form``: ``LONG_FORM_LIMIT``): a long
    file, or a header with a tiny sampling rate, would take without bound."""
    limit = LONG_FORM_LIMIT if long_form else extractor.chunk_length
    if info.seconds > limit:
        how = "split it" if long_form else "transcribe it with timestamps (HF's long-form algorithm)"
        raise ElxError(f"{info.path} lasts {info.seconds:.1f} s; elx transcribes up to {limit} s per file here: {how}")


def load_clip(path, extractor: LogMelExtractor, long_form: bool = False) -> np.ndarray:
    """A sound file as float32 mono samples at the extractor's rate, read and resampled block by block
    (``resampled_blocks``: memory beside the result stays a few blocks, whatever the file's rate and length); one
    that lasts too long (``check_duration``) is refused before any sample is read."""
    info = audio_info(path)
    check_duration(info, extractor, long_form)
    target = extractor.sampling_rate
    expected = resampled_length(info.frames, info.rate, target)
    return _gather(resampled_blocks(audio_blocks(info), info.rate, target), expected)


def features_from_files(folder, files, long_form: bool = False) -> dict:
    """Sound files → Whisper ``input_features`` [B, mel bins, 3000] with the export's feature extractor; with
    ``long_form`` and a file over 30 s, HF's long-form features and ``attention_mask`` (``features_from_audio``)."""
    files = [files] if isinstance(files, (str, Path)) else list(files)
    if not files:
        raise ElxError("no audio files given")
    extractor = load_feature_extractor(folder)
    audio = [load_clip(file, extractor, long_form) for file in files]
    return features_from_audio(extractor, audio, [str(f) for f in files], long_form)
