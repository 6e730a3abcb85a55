"""Time and peak memory of reading a long sound file the way ``elx generate --audio`` does (issue 42 item 4).

    python tools/measure_audio.py 600 --rate 44100        # 10 min of 16-bit mono 44.1 kHz audio
    python tools/measure_audio.py 3600 --rate 44100 --features

Writes a WAV of a 440 Hz tone plus noise (in a child process, so that its buffers do not count), then in a fresh
child reads it with ``load_clip`` (blocks, soxr to 16 kHz) and, with ``--features``, computes the long-form log-mel
features; prints the wall times and the child's peak RSS (``ru_maxrss``, what ``/usr/bin/time -v`` reports).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

WRITE = """
import sys, wave, numpy as np
seconds, rate, path = float(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
rng, total, done = np.random.default_rng(0), int(seconds * rate), 0
with wave.open(path, "wb") as out:
    out.setnchannels(1); out.setsampwidth(2); out.setframerate(rate)
    while done < total:
        n = min(rate * 60, total - done)
        x = 0.3 * np.sin(2 * np.pi * 440 * np.arange(done, done + n) / rate) + 0.05 * rng.standard_normal(n)
        out.writeframes(np.clip(np.round(x * 32767), -32768, 32767).astype("<i2").tobytes())
        done += n
"""

READ = """
import resource, sys, time
from elx.runners.inputs.audio import LogMelExtractor, features_from_audio, load_clip
extractor, started = LogMelExtractor(), time.perf_counter()
clip = load_clip(sys.argv[1], extractor, long_form=True)
read = time.perf_counter() - started
line = f"read + resample to 16 kHz: {read:.1f} s ({clip.size} samples)"
if sys.argv[2] == "1":
    started = time.perf_counter()
    features = features_from_audio(extractor, [clip], long_form=True)["input_features"]
    line += f"; long-form features {list(features.shape)}: {time.perf_counter() - started:.1f} s"
print(f"{line}; peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("seconds", type=float)
    parser.add_argument("--rate", type=int, default=44100)
    parser.add_argument("--features", action="store_true", help="also the long-form log-mel features")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="elx-audio-") as scratch:
        path = Path(scratch) / "clip.wav"
        subprocess.run([sys.executable, "-c", WRITE, str(args.seconds), str(args.rate), str(path)], check=True)
        print(f"{args.seconds:.0f} s of {args.rate} Hz 16-bit mono ({path.stat().st_size / 1e6:.0f} MB):")
        return subprocess.run([sys.executable, "-c", READ, str(path), "1" if args.features else "0"]).returncode


if __name__ == "__main__":
    sys.exit(main())
