"""The float32 log-softmax of the beam search, rounded as HF rounds it (issue 10).

HF's beam search ranks ``nn.functional.log_softmax(logits.float())``: on the CPU, PyTorch's
vectorized kernel computes ``(x − m) − L`` per row, with m = max x and L = log Σ exp(x − m) summed
in 8 or 16 lanes with Sleef's exp and log.  numpy's ``log(sum(exp(x − m)))`` is as accurate (a few
float32 ulps) but not bit-equal: L differs by an ulp in about 0.2% of rows.  Where two beam scores
are within that ulp, the rounding decides their order and so the tokens.  Measured on seeded
differential runs: 5 of 3,000 search examples returned other rows than HF with numpy's rounding,
none with PyTorch's.

So the search uses PyTorch's own kernel where PyTorch imports (it is, wherever HF ``generate``
runs): bit for bit HF's log-probs on the same CPU, row by row (each row is computed alone, so the
batch size does not matter), and faster than numpy on a 128 × 32128 step here (in place 1.9 ms,
numpy 9.6 ms).  Without PyTorch the runtime still needs none: numpy, with the limit above.  (The first
search step imports torch, about a second, once per process.)
``ELX_LOG_SOFTMAX=numpy`` or ``=torch`` picks one explicitly (torch when it is missing: an error).  The same
choice decides the other host kernels whose rounding or random draws matter (``torch_module``): the sampling
warpers' softmax, sort and cumulative sums (``runners/search/processors/warpers.py``) and the sampling generator
(``runners/search/sampling.py``).

HF's own answer at such a near-tie depends on the CPU too (PyTorch's scalar, AVX2 and AVX-512
kernels round differently): elx matches HF on the machine it runs on.  The ``ngram`` pass applies
its log-softmax in the graph (ONNX Runtime's kernel), beside the graph's own float rounding.
"""
from __future__ import annotations

import os
from functools import lru_cache

import numpy as np

from elx.runners.errors import ElxError

KERNELS = ("torch", "numpy")
ENV = "ELX_LOG_SOFTMAX"


@lru_cache(maxsize=1)
def _torch():
    """The torch module, imported once; None where it is missing or cannot be imported."""
    try:
        import torch
    except Exception:  # noqa: BLE001 - not installed, or broken: the runtime goes on with numpy
        return None
    return torch


def numpy_log_softmax_(x: np.ndarray) -> np.ndarray:
    """In place, float32, last axis: ``x − m − log Σ exp(x − m)``."""
    x -= x.max(axis=-1, keepdims=True)
    x -= np.log(np.exp(x).sum(axis=-1, keepdims=True))
    return x


def torch_log_softmax_(x: np.ndarray) -> np.ndarray:
    """PyTorch's CPU kernel, the one HF's search calls; in place where ``x`` is a writable contiguous array.

    In place writes each row after reading it (max, then Σ exp, then x − m − L): the same values as a
    new tensor, bit for bit, and 1.9 ms instead of 5.2 ms on a 128 × 32128 step here (no fresh
    16 MB to fault in)."""
    torch = _torch()
    if not (x.flags.c_contiguous and x.flags.writeable):
        return torch.log_softmax(torch.from_numpy(np.ascontiguousarray(x)), dim=-1).numpy()
    tensor = torch.from_numpy(x)
    torch.log_softmax(tensor, dim=-1, out=tensor)
    return x


def kernel() -> str:
    """The kernel in use: ``$ELX_LOG_SOFTMAX`` if set, else torch where it imports, else numpy."""
    name = os.environ.get(ENV, "").strip().lower()
    if name and name not in KERNELS:
        raise ElxError(f"{ENV}={name!r} is not a log-softmax kernel: set it to one of {', '.join(KERNELS)}")
    if name == "numpy":
        return name
    if _torch() is None:
        if name == "torch":
            raise ElxError(f"{ENV}=torch but PyTorch cannot be imported: install torch, or set {ENV}=numpy")
        return "numpy"
    return "torch"


def log_softmax_function():
    """The row-wise float32 log-softmax in use (may overwrite and return its argument); resolve once per search."""
    return torch_log_softmax_ if kernel() == "torch" else numpy_log_softmax_


def numpy_softmax(x: np.ndarray) -> np.ndarray:
    """Row-wise float32 softmax (a new array): ``exp(x − m) / Σ exp(x − m)``."""
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def torch_softmax(x: np.ndarray) -> np.ndarray:
    """PyTorch's CPU softmax, the one HF's sampling and warpers call (a new array)."""
    return _torch().softmax(_torch().from_numpy(np.ascontiguousarray(x)), dim=-1).numpy()


def softmax_function():
    """The row-wise float32 softmax of the kernel in use (``kernel()``); resolve once per run."""
    return torch_softmax if kernel() == "torch" else numpy_softmax


def torch_module():
    """The torch module when the kernel in use is PyTorch's (``kernel()``), else None: the processors and the
    sampler compute with PyTorch's own kernels where HF does, bit for bit, and with numpy otherwise."""
    return _torch() if kernel() == "torch" else None


def log_softmax(x: np.ndarray) -> np.ndarray:
    """Row-wise float32 log-softmax of a 2-D array as HF's search computes it; may overwrite and return ``x``."""
    return log_softmax_function()(x)
