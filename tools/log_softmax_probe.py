"""How close can numpy get to ``torch.log_softmax``'s float32 rounding on this CPU?  (issue 10, open item)

HF's beam search ranks ``log_softmax(logits)`` in float32; where two final scores are a few ulps
apart, elx's numpy log-softmax can order them differently.  For a row x, torch's CPU kernel computes
``(x - max) - L`` with ``L = log(sum(exp(x - max)))``, so ``L`` alone decides whether elx can match:
``L = -log_softmax(x)[argmax]`` exactly, which this probe reads from torch and compares with:

* ``numpy``: ``np.log(np.exp(x - m).sum())`` in float32 (what elx does today);
* ``emulated``: the kernel as the AVX512 build runs it: Sleef's ``expf_u10`` algorithm (Cody-Waite
  reduction, degree-6 polynomial, FMA emulated through float64), the 16-lane accumulation of
  ``vec::map_reduce_all`` (lane i sums elements i, i+16, ...), the halving tree of the final
  in-register reduction (lanes i + i+8, then +4, +2, +1), and a correctly rounded log.

``torch.exp`` itself is not the reference: on tensors it runs MKL's VML, not the kernel's Sleef exp.

    python tools/log_softmax_probe.py [--rows 400] [--vocab 32128] [--scale 3]
"""
from __future__ import annotations

import argparse

import numpy as np

F32 = np.float32
LOG2E = F32(1.442695040888963407359924681001892137426645954152985934135449406931)
LN2_HI, LN2_LO = F32(0.693145751953125), F32(1.428606765330187045e-06)
POLY = [F32(c) for c in (0.000198527617612853646278381, 0.00139304355252534151077271, 0.00833336077630519866943359,
                         0.0416664853692054748535156, 0.166666671633720397949219, 0.5)]
LANES = 16  # AVX512; 8 on an AVX2 build


def fma(a, b, c) -> np.ndarray:
    """float32 fused multiply-add through float64 (the product is exact; the sum rounds twice, rarely visible)."""
    return (np.float64(1) * a * b + c).astype(F32)


def sleef_expf(d: np.ndarray) -> np.ndarray:
    d = d.astype(F32)
    q = np.rint(d * LOG2E).astype(F32)
    s = fma(q, -LN2_HI, d)
    s = fma(q, -LN2_LO, s)
    u = np.full_like(d, POLY[0])
    for c in POLY[1:]:
        u = fma(u, s, c)
    u = F32(1) + fma(s * s, u, s)
    u = np.ldexp(u, q.astype(np.int32)).astype(F32)
    return np.where(d < -104, F32(0), u).astype(F32)


def lane_sum(values: np.ndarray, lanes: int = LANES) -> np.ndarray:
    """Row sums in the kernel's order (vocabularies that are a multiple of ``lanes``)."""
    if values.shape[-1] % lanes:
        raise SystemExit(f"--vocab must be a multiple of {lanes} for this probe")
    acc = values[..., :lanes].copy()
    for start in range(lanes, values.shape[-1], lanes):
        acc = (acc + values[..., start:start + lanes]).astype(F32)
    while acc.shape[-1] > 1:
        half = acc.shape[-1] // 2
        acc = (acc[..., :half] + acc[..., half:]).astype(F32)
    return acc[..., 0]


def main() -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=400)
    parser.add_argument("--vocab", type=int, default=32128)
    parser.add_argument("--scale", type=float, default=3.0, help="logits ~ N(0, scale²)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    x = (np.random.default_rng(args.seed).standard_normal((args.rows, args.vocab)) * args.scale).astype(F32)
    reference = -torch.log_softmax(torch.from_numpy(x), -1).numpy()[np.arange(args.rows), x.argmax(-1)]
    shifted = (x - x.max(-1, keepdims=True)).astype(F32)
    numpy_l = np.log(np.exp(shifted).sum(-1, dtype=F32))
    emulated_l = np.log(lane_sum(sleef_expf(shifted)).astype(np.float64)).astype(F32)
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{args.rows} rows × {args.vocab}")
    for name, value in (("numpy", numpy_l), ("emulated", emulated_l)):
        print(f"{name:9s} L differs from torch's in {(value != reference).mean():.1%} of rows")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
