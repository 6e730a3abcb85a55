"""HF ``generate`` on one of PyTorch's CPU kernel sets, in a child process (the differential test's helper).

PyTorch picks its vectorized CPU kernels (``default`` scalar, ``avx2``, ``avx512``) once, at start-up,
from ``ATEN_CPU_CAPABILITY``; their float32 roundings differ by an ulp here and there (log-softmax sums
its exps in 1, 8 or 16 lanes).  Where two beam scores are that close, HF's own tokens depend on the CPU
it runs on.  ``hf_on_cpu_kernels`` asks a child per kernel set for HF's answer on the same model.

    python -m tests.hf_on_cpu_kernel < example.pickle > answer.pickle
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
KERNELS = ("default", "avx2", "avx512")


def hf_on_cpu_kernels(family: str, seed: int, config: dict, inputs: dict, options: dict,
                      skip: str = "") -> dict[str, np.ndarray]:
    """HF ``generate(use_cache=False)`` of ``build_fp64(family, seed, config)`` per kernel set this CPU
    has, but ``skip`` (a capability already run): {capability as PyTorch reports it: sequences}."""
    example = pickle.dumps((family, seed, config, inputs, options))
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    answers = {}
    for kernel in (k for k in KERNELS if k != skip.lower()):
        done = subprocess.run([sys.executable, "-m", "tests.hf_on_cpu_kernel"], input=example,
                              capture_output=True, env={**env, "ATEN_CPU_CAPABILITY": kernel}, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"HF on the {kernel} kernels failed: {done.stderr.decode()[-2000:]}")
        capability, sequences = pickle.loads(done.stdout)
        if capability != skip:  # a kernel set the CPU lacks falls back to one it has
            answers[capability] = sequences
    return answers


def main() -> None:
    import torch

    from exporter.compare import _hf_generate
    from tests.differential import build_fp64, hf_reference_options

    torch.set_num_threads(1)  # as the differential test runs HF
    family, seed, config, inputs, options = pickle.loads(sys.stdin.buffer.read())
    model = build_fp64(family, seed, config)
    sequences = _hf_generate(model, inputs, hf_reference_options(model, options))
    sys.stdout.buffer.write(pickle.dumps((torch.backends.cpu.get_cpu_capability(), sequences)))


if __name__ == "__main__":
    main()
