"""The K-only math of slim attention (Graef & Wasielewski, seed 002, §4): V from K through W_KV = W_K⁻¹·W_V.

With W_K square and invertible, X = (K − b_K)·W_K⁻¹, hence V_i = (K − b_K)·W_KV,i + b_V,i with
W_KV,i = W_K⁻¹·W_V,i ∈ R^{d×d_k}; because every row of the attention probabilities sums to 1,

    o_i = softmax_i · V_i = (softmax_i · K)·W_KV,i + c_i,        c_i = b_V,i − b_K·W_KV,i.

This module computes W_KV (float64 ``np.linalg.solve``, stored float32, never fp16), judges
whether a layer can be rewritten exactly (square, non-singular, cond(W_K) ≤ ``COND_LIMIT``) and
measures the K→V reconstruction error in fp32 and with fp16 caches/weights.  The graph side is
in ``slim.py``; the search for the layers that break the tolerance in ``culprits.py``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_graphsurgeon as gs

COND_LIMIT = 1e6  # fp32 rounding of K (2^-24 relative) may grow by cond(W_K): 1e6 → up to ~6% of |V|
RECON_SAMPLES = 256
FP16_NOTE = "W_KV is stored in float32; an fp16 engine must compute P·K and ·W_KV in fp32"


class Unfit(Exception):
    """A layer the pass cannot rewrite exactly; ``str`` is the reason."""


# -- weights: W_KV, conditioning, reconstruction error -------------------------------------------

@dataclass
class Projection:
    """``out`` = x·W (+ b), then the head split ``chain`` (Reshape, Transpose) up to the cached tensor."""

    x: gs.Tensor
    w: np.ndarray  # [d, h·d_k] (ONNX MatMul layout: x·W)
    b: np.ndarray | None
    chain: list  # the shape nodes from the projection to the head-split tensor, in order


@dataclass
class Analysis:
    w_kv: np.ndarray | None = None  # [h, d, d_k] float32
    c: np.ndarray | None = None  # [h, 1, d_k] float32, or None when both biases are absent/zero
    stats: dict = field(default_factory=dict)
    problem: str | None = None


def check_square(w_k: np.ndarray, w_v: np.ndarray, heads: int, d_kv: int) -> None:
    d, e = w_k.shape
    if w_v.shape != w_k.shape:
        raise Unfit(f"W_K {list(w_k.shape)} and W_V {list(w_v.shape)} differ in shape")
    if d != e or e != heads * d_kv:
        raise Unfit(f"non-square W_K [{d}, {e}] (num_heads·d_kv = {heads * d_kv} ≠ d_model = {d}); "
                    "V cannot be recomputed from K")


def condition(w_k: np.ndarray) -> float:
    """2-norm condition number of W_K in float64 (inf when singular)."""
    s = np.linalg.svd(np.asarray(w_k, np.float64), compute_uv=False)
    if s[-1] <= s[0] * w_k.shape[0] * np.finfo(np.float64).eps:
        return float("inf")
    return float(s[0] / s[-1])


def kv_weights(w_k, b_k, w_v, b_v, heads: int, d_kv: int) -> tuple[np.ndarray, np.ndarray | None]:
    """W_KV,i = W_K⁻¹·W_V,i stacked [h, d, d_k] and c_i = b_V,i − b_K·W_KV,i [h, 1, d_k], float32."""
    w_k64, w_v64 = np.asarray(w_k, np.float64), np.asarray(w_v, np.float64)
    d = w_k64.shape[0]
    w_kv = np.linalg.solve(w_k64, w_v64)  # [d, h·d_k]
    c = np.zeros(d) if b_v is None else np.asarray(b_v, np.float64).copy()
    if b_k is not None:
        c -= np.asarray(b_k, np.float64) @ w_kv
    stacked = w_kv.reshape(d, heads, d_kv).transpose(1, 0, 2)
    bias = None if not c.any() else c.reshape(heads, 1, d_kv).astype(np.float32)
    return np.ascontiguousarray(stacked.astype(np.float32)), bias


def reconstruction_errors(w_k, b_k, w_v, b_v, w_kv, c, seed: int = 0, samples: int = RECON_SAMPLES) -> dict:
    """Max abs error of V rebuilt from K (one-hot probabilities) on random states X ~ N(0, 1).

    ``fp32``: K as the graph computes it in fp32, ·W_KV fp32; ``fp16_cache``: K rounded to fp16
    (an fp16 cache), W_KV fp32; ``fp16_weights``: W_KV rounded to fp16 too (why it stays fp32).
    ``*_baseline`` are the rounding errors of the V cache the baseline keeps, for scale.
    """
    d = w_k.shape[0]
    x = np.random.default_rng(seed).standard_normal((samples, d))
    zero = np.zeros(d)
    b_k64 = zero if b_k is None else np.asarray(b_k, np.float64)
    b_v64 = zero if b_v is None else np.asarray(b_v, np.float64)
    v_true = x @ np.asarray(w_v, np.float64) + b_v64
    f32 = np.float32
    k32 = x.astype(f32) @ np.asarray(w_k, f32) + b_k64.astype(f32)
    v32 = x.astype(f32) @ np.asarray(w_v, f32) + b_v64.astype(f32)
    w_full = w_kv.transpose(1, 0, 2).reshape(d, d)  # [d, h·d_k]
    c_full = np.zeros(d, f32) if c is None else c.reshape(d)
    k16 = k32.astype(np.float16).astype(f32)

    def err(v) -> float | str:
        worst = float(np.abs(v.astype(np.float64) - v_true).max())
        return worst if np.isfinite(worst) else "inf"  # fp16 overflows for huge W_KV

    with np.errstate(over="ignore", invalid="ignore"):
        return {
            "v_max_abs": float(np.abs(v_true).max()),
            "fp32": err(k32 @ w_full + c_full),
            "fp32_baseline": err(v32),
            "fp16_cache": err(k16 @ w_full + c_full),
            "fp16_cache_baseline": err(v32.astype(np.float16)),
            "fp16_weights": err(k16 @ w_full.astype(np.float16).astype(f32) + c_full),
        }


def analyse(k: Projection, v: Projection, heads: int, d_kv: int) -> Analysis:
    """W_KV, c and the accuracy numbers of one layer; ``problem`` says why it cannot be rewritten."""
    out = Analysis()
    try:
        check_square(k.w, v.w, heads, d_kv)
    except Unfit as why:
        out.problem = str(why)
        return out
    cond = condition(k.w)
    out.stats["cond_W_K"] = cond if np.isfinite(cond) else "inf"
    if not np.isfinite(cond):
        out.problem = "W_K is singular (numerical rank < d_model); V cannot be recomputed from K"
        return out
    out.w_kv, out.c = kv_weights(k.w, k.b, v.w, v.b, heads, d_kv)
    out.stats["reconstruction_max_abs"] = reconstruction_errors(k.w, k.b, v.w, v.b, out.w_kv, out.c)
    out.stats["has_bias"] = {"k": k.b is not None, "v": v.b is not None}
    if cond > COND_LIMIT:
        out.problem = f"W_K is ill-conditioned (cond {cond:.3g} > {COND_LIMIT:g})"
    return out
