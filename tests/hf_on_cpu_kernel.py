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
    for kernel in (k for k in available_kernels() if k != skip.lower()):
        done = subprocess.run([sys.executable, "-m", "tests.hf_on_cpu_kernel"], input=example,
                              capture_output=True, env={**env, "ATEN_CPU_CAPABILITY": kernel}, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"HF on the {kernel} kernels failed: {done.stderr.decode()[-2000:]}")
        capability, sequences = pickle.loads(done.stdout)
        answers[capability] = sequences
    return answers


def available_kernels() -> tuple[str, ...]:
    """The kernel sets this CPU runs: up to the one PyTorch picked for this process.  PyTorch does not fall
    back from a set the CPU lacks: ``ATEN_CPU_CAPABILITY=avx512`` on an AVX2-only CPU dies of SIGILL."""
    import torch

    own = torch.backends.cpu.get_cpu_capability().lower()
    return KERNELS[:KERNELS.index(own) + 1] if own in KERNELS else KERNELS[:1]


def main() -> None:
    import torch

    from tests.differential import build_fp64, hf_search

    torch.set_num_threads(1)  # as the differential test runs HF
    family, seed, config, inputs, options = pickle.loads(sys.stdin.buffer.read())
    model = build_fp64(family, seed, config)
    sequences, _ = hf_search(model, inputs, options, model.config.vocab_size)  # issue 25's specs built, seeded
    sys.stdout.buffer.write(pickle.dumps((torch.backends.cpu.get_cpu_capability(), sequences)))


if __name__ == "__main__":
    main()
