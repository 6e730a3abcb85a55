"""``--pass el-self``: EL-attention for decoder self-attention (Yan et al., seed 000, §3.1-3.2, App. B).

Math, in the paper's notation.  X_{1..t} ∈ R^{t×D} are the inputs of one decoder row's
self-attention (the layer-normed states, one per generated position), h heads of width d_k
(h·d_k need not equal D).  Standard self-attention of head i at the newest positions x is

    q_i = x·W_Q,i + b_Q,i        K_i = X·W_K,i + b_K,i        V_i = X·W_V,i + b_V,i
    s_i = c·q_i·K_iᵀ + B_i + M        o_i = softmax(s_i)·V_i        out = [o_1 … o_h]·W_O + b_O

with the scale c (BART/Whisper: d_k^-1/2, applied to q or to the scores; T5: 1), B_i T5's
relative position bias and M the causal mask.  Caching K and V costs 2·h·d_k numbers per
position and layer.  EL-attention caches X instead and moves W_K, W_V to the other side
(Appendix B, eq. 7-9, with K = V = X):

    s_i = c·(q_i·W_K,iᵀ)·X_{1..t}ᵀ + B_i + M          (q_i·b_K,iᵀ is one constant per query row:
    o_i = (softmax(s_i)·X_{1..t})·W_V,i + b_V,i        softmax ignores it, so b_K drops out;
                                                      b_V,i passes through, rows of P sum to 1)

One [rows, t, D] cache per layer instead of two [rows, h, t, d_k]: D/(2·h·d_k) of the self
cache.  No matrix is inverted (unlike ``slim``): every product is a regrouping of the original
ones, so the result is exact up to rounding on any weights (see Rounding below; no conditioning
enters).  The price is h× more attention FLOPs (scores and values run at width D per head
instead of d_k), as for ``el``.

Pattern (by structure; the manifest names the cache inputs/outputs), per decoder layer:
    x ─MatMul(W_K)[+b_K]─Reshape─Transpose(0,2,1,3)─┐
    past K ──────────────────────────────────────── Concat(axis -2) ─→ present K
    x ─MatMul(W_V)[+b_V]─Reshape─Transpose(0,2,1,3)─┐                  (same x: the layer-normed input)
    past V ──────────────────────────────────────── Concat(axis -2) ─→ present V
    present K ─Transpose(0,1,3,2)─→ MatMul(q, ·) ─[Mul/Div scalar, Add (bias, mask)]*─ Softmax(-1)
    ─→ MatMul(·, present V)
q is the [rows, h, t, d_k] query exactly as the graph builds it (with its scaling, if any).
Besides these, past and present K/V may only feed Shape ops (they read the X cache instead).

Rewrite (the cache layout is ``past_hidden.{i}.decoder`` [rows, P, D], seq_axis 1):
    X_all = Concat(past_hidden, x; axis 1) ─→ present_hidden
    q [R, h, t, d_k] → [h, R·t, d_k] · W_Kᵀ [h, d_k, D] → [R, h·t, D] · X_allᵀ → [R, h, t, S]
    which replaces MatMul(q, Kᵀ): scaling, position bias, mask and Softmax stay as exported;
    P [R, h, t, S] → [R, h·t, S] · X_all → [h, R·t, D] · W_V [h, D, d_k] (+ b_V) → [R, h, t, d_k]
    which replaces MatMul(P, V); the head merge and W_O stay as exported.
All heads of a row share one product with X_all (the cache is read once per step, §3.1.1), and
each head's W_K, W_V is read once per step for all rows (one [R·t, ·] product per head).

Rounding.  Every product regroups the original's sums, but the score sum changes: the original
adds d_k terms q_c·K_c, EL-attention D terms q̃_j·X_j, and the layer-normed X of trained models
carries a few large outlier features, so Σ_j |q̃_j·X_j| can exceed Σ_c |q_c·K_c| (whisper-base
decoder layer 1 on speech: 11.7 against 3.5) and the fp32 accumulation of the scores rounds
more.  Measured on whisper-base, speech, teacher-forced (``tools/whisper_el_self_report.py``):
max abs logits diff to a float64 PyTorch reference 7.5e-5 for the baseline export, 1.55e-4 with
``el-self``, 7.7e-5 with ``--pass el-self=fp64``, which accumulates that one product
(q_i·W_K,iᵀ)·Xᵀ in float64 (Cast of q̃ and X, a double MatMul, Cast back; the cache stays
fp32).  Tokens are identical to HF ``generate`` either way; fp64 costs step time (measured by
``tools/measure_el_self.py``) and is not for engines without float64 (TensorRT).

Verification: the rewritten folder against the original through the runner's backend at several
(batch, beam, source, past, step) shapes; the random pasts come from random states X (the
original's K = X·W_K + b_K and V = X·W_V + b_V, the rewrite's cache X itself), since independent
random K and V are not representable by an X cache.  The states are drawn as the layer norm
shapes them, X = γ ⊙ n + β with n ~ N(0, 1) and the norm's own γ, β (T5: γ only), so that the
outlier features of real weights are present (whisper-base: 9.0e-5 instead of 3.5e-5 with
X ~ N(0, 1)).  Nothing is written when the max abs logits diff exceeds 1e-4.  ``slim`` replaces
the same cache and is refused together with it.

Decoder-only exports (GPT-2: a fused QKV projection, found by ``qkv.py``; the prompt's X shared
by the beams): ``el_self_decoder_only.py``, which uses the matching and rewriting helpers below.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from elx.runners.errors import ElxError
from elx.runners.manifest import Manifest

from elx.exporter.passes import catalog
from elx.exporter.passes.catalog import FP64  # --pass el-self=fp64: the scores product (q_i·W_K,iᵀ)·Xᵀ accumulates in float64
from elx.exporter.passes.rewrite import Builder, commit, constant_value, load_graph, pass_file, producer, refuse_twice, save_graph
from elx.exporter.passes import slim
from elx.exporter.passes.qkv import head_projection
from elx.exporter.passes.slim import self_layers as cache_pairs
from elx.exporter.passes.slim_math import Projection, Unfit

SPEC = catalog.EL_SELF  # name, order (after el, slim-cross, slim; before ngram), argument, conflicts, refusals
NAME, CONFLICTS, parse_argument = SPEC.name, SPEC.conflicts, SPEC.parse

PAST = "past_hidden.{}.decoder"
PRESENT = "present_hidden.{}.decoder"
SCORE_OPS = ("Mul", "Div", "Add")


@dataclass
class SelfLayer(slim.SelfLayer):
    """slim's layer (cache names, K/V projections, the P·V MatMul) plus what EL-attention rewrites."""

    qk: gs.Node | None = None  # MatMul(q, present Kᵀ)
    norm: tuple | None = None  # (γ, β) of the layer norm producing x, when it has constant ones
    names: tuple = (PAST, PRESENT)  # the X cache's input and output names, formatted with the index

    @property
    def past(self) -> str:
        return self.names[0].format(self.index)

    @property
    def present(self) -> str:
        return self.names[1].format(self.index)


# -- matching --------------------------------------------------------------------------------------

def self_layers(manifest: Manifest) -> list[SelfLayer]:
    """Key/value pairs of the manifest's ``cache.self`` (``past_key_values.{i}.decoder.key|value``), as slim finds them."""
    return [SelfLayer(p.index, p.key_input, p.key_output, p.value_input, p.value_output) for p in cache_pairs(manifest)]


def _projection(tensor, d_model: int, heads: int, d_kv: int) -> Projection:
    """The head-split projection x·W (+ b) (its own, or a slice of a fused QKV one), with W [D, h·d_k] as this
    pass needs it (bias kept in float32)."""
    found = head_projection(tensor)
    if found.w.shape != (d_model, heads * d_kv):
        raise Unfit(f"{tensor.name} is not a projection x·W (+ b) with a constant [{d_model}, {heads * d_kv}] W")
    bias = None if found.b is None else found.b.astype(np.float32)
    return Projection(found.x, np.asarray(found.w), bias, found.chain)


def _norm_of(x, d_model: int) -> tuple | None:
    """(γ, β) when ``x`` = LayerNormalization(·, γ, β) or T5's RMS norm γ ⊙ (·): used to draw realistic states."""
    node = producer(x)
    if node is None:
        return None
    if node.op == "LayerNormalization" and len(node.inputs) >= 2:
        scale = constant_value(node.inputs[1])
        shift = constant_value(node.inputs[2]) if len(node.inputs) > 2 else np.zeros(d_model)
        if scale is not None and shift is not None and scale.shape == shift.shape == (d_model,):
            return np.asarray(scale, np.float64), np.asarray(shift, np.float64)
    if node.op == "Mul":
        for i in (0, 1):
            scale = constant_value(node.inputs[i])
            if scale is not None and scale.shape == (d_model,):
                return np.asarray(scale, np.float64), np.zeros(d_model)
    return None


def _reader(tensor, what: str) -> gs.Node:
    """The one non-Shape consumer of ``tensor``."""
    users = [n for n in tensor.outputs if n.op != "Shape"]
    if len(users) != 1:
        raise Unfit(f"{what} feeds {[n.op for n in users]}, expected one attention MatMul (and Shape ops)")
    return users[0]


def match_projections(graph: gs.Graph, layer: SelfLayer, d_model: int, heads: int, d_kv: int) -> dict:
    """Bind ``layer``'s cache concats and K/V projections of one input x (and its norm); returns the graph's tensors."""
    tensors = graph.tensors()
    for name in (layer.key_input, layer.key_output, layer.value_input, layer.value_output):
        if name not in tensors:
            raise Unfit(f"{name} is not in the decoder graph")
    for kind, past, present in (("k", layer.key_input, layer.key_output), ("v", layer.value_input, layer.value_output)):
        concat = producer(tensors[present])
        if concat is None or concat.op != "Concat" or len(concat.inputs) != 2 or concat.inputs[0] is not tensors[past] \
                or concat.attrs.get("axis") not in (2, -2):
            raise Unfit(f"{present} is not Concat({past}, new) along the sequence axis of [rows, h, P, d_k]")
        if _reader(tensors[past], past) is not concat:
            raise Unfit(f"{past} feeds more than its concat (and Shape ops)")
        setattr(layer, kind, _projection(concat.inputs[1], d_model, heads, d_kv))
    if layer.k.x is not layer.v.x:
        raise Unfit("K and V project different inputs")
    layer.norm = _norm_of(layer.k.x, d_model)
    return tensors


def scores_matmul(keys, what: str) -> gs.Node:
    """The MatMul(q, Kᵀ) that ``keys`` [R, h, S, d_k] feed through Transpose(0,1,3,2)."""
    transpose = _reader(keys, what)
    if transpose.op != "Transpose" or list(transpose.attrs.get("perm", [])) != [0, 1, 3, 2]:
        raise Unfit(f"{what} feeds a {transpose.op}, expected Transpose(0,1,3,2) into QKᵀ")
    qk = _reader(transpose.outputs[0], f"{what}ᵀ")
    if qk.op != "MatMul" or qk.inputs[1] is not transpose.outputs[0]:
        raise Unfit(f"{what}ᵀ does not feed a MatMul(q, {what}ᵀ)")
    return qk


def scaled_scores(scores, passes=()) -> tuple[float, object, gs.Node]:
    """Follow ``scores`` through a constant scalar scale and additive terms (bias, mask) and the ops in
    ``passes``: (the scale, the last tensor, the node it reaches).  Each addition leaves q·b_Kᵀ, one
    constant per query row, a constant per row."""
    scale, current = 1.0, scores
    node = _reader(current, "the scores")
    while node.op in (*SCORE_OPS, *passes):
        if node.op in SCORE_OPS:
            other = node.inputs[1] if node.inputs[0] is current else node.inputs[0]
            if node.op in ("Mul", "Div"):
                value = constant_value(other)
                if value is None or value.size != 1 or (node.op == "Div" and node.inputs[0] is not current):
                    raise Unfit(f"the scores are multiplied by something other than a constant scalar ({node.op})")
                scale = scale * float(value.reshape(())) if node.op == "Mul" else scale / float(value.reshape(()))
        current = node.outputs[0]
        node = _reader(current, "the scores")
    return scale, current, node


def is_key_softmax(node: gs.Node) -> bool:
    return node.op == "Softmax" and node.attrs.get("axis", -1) in (-1, 3)


def match(graph: gs.Graph, layer: SelfLayer, d_model: int, heads: int, d_kv: int) -> None:
    tensors = match_projections(graph, layer, d_model, heads, d_kv)
    qk = scores_matmul(tensors[layer.key_output], layer.key_output)
    # scores → Softmax only through a scalar scale and additive terms (bias, mask): each adds one
    # constant per query row to q·b_Kᵀ at most, which the Softmax removes
    _, _, node = scaled_scores(qk.outputs[0])
    if not is_key_softmax(node):
        raise Unfit(f"the scores reach a {node.op}, expected a Softmax over the keys")
    pv = _reader(tensors[layer.value_output], layer.value_output)
    if pv.op != "MatMul" or pv.inputs[1] is not tensors[layer.value_output] or pv.inputs[0] is not node.outputs[0]:
        raise Unfit(f"{layer.value_output} is not multiplied by this layer's attention probabilities")
    layer.qk, layer.pv = qk, pv


# -- rewriting ---------------------------------------------------------------------------------------

class _Consts:
    """Constants shared by all layers (one initializer each)."""

    def __init__(self, build: Builder, d_model: int, heads: int, d_kv: int):
        c = build.const
        self.heads_rows_d = c("h_minus1_D", np.array([heads, -1, d_model], np.int64))
        self.heads_rows_dk = c("h_minus1_dk", np.array([heads, -1, d_kv], np.int64))
        self.rows_stack_d = c("zero_minus1_D", np.array([0, -1, d_model], np.int64))
        self.d = c("D", np.array([d_model], np.int64))
        self.dk = c("dk", np.array([d_kv], np.int64))
        self.h = c("h", np.array([heads], np.int64))
        self.minus1 = c("minus1", np.array([-1], np.int64))
        self.idx_r_h_t = c("R_h_t", np.array([0, 1, 2], np.int64))
        self.idx_h_r_t = c("h_R_t", np.array([1, 0, 2], np.int64))
        self.idx_r = c("R", np.array([0], np.int64))
        self.idx_s = c("S", np.array([3], np.int64))
        self.axis0 = c("zero", np.array([0], np.int64))
        self.one = c("one", np.array([1], np.int64))
        self.two = c("two", np.array([2], np.int64))


def _rewrite_layer(build: Builder, k: _Consts, graph: gs.Graph, layer: SelfLayer, d_model: int, heads: int,
                   d_kv: int, wide: frozenset = frozenset()) -> tuple[gs.Variable, gs.Variable]:
    tag = f"layer{layer.index}"
    past = gs.Variable(layer.past, dtype=np.float32, shape=["rows", "past_sequence", d_model])
    present = gs.Variable(layer.present, dtype=np.float32,
                          shape=["rows", "past_sequence + decoder_sequence", d_model])
    graph.nodes.append(gs.Node("Concat", f"{NAME}/{tag}_cache", attrs={"axis": 1}, inputs=[past, layer.k.x],
                               outputs=[present]))
    w_k_t, w_v = head_weights(layer, d_model, heads, d_kv)
    _become(layer.qk, expanded_scores(build, k, layer.qk.inputs[0], present, w_k_t, tag, wide))
    _become(layer.pv, values_from_states(build, k, layer.pv.inputs[0], present, w_v, layer.v.b, tag, wide))
    return past, present


def head_weights(layer: SelfLayer, d_model: int, heads: int, d_kv: int) -> tuple[np.ndarray, np.ndarray]:
    """W_K,iᵀ [h, d_k, D] and W_V,i [h, D, d_k] of a matched layer, float32."""
    w_k_t = layer.k.w.reshape(d_model, heads, d_kv).transpose(1, 2, 0)
    w_v = layer.v.w.reshape(d_model, heads, d_kv).transpose(1, 0, 2)
    return np.ascontiguousarray(w_k_t, np.float32), np.ascontiguousarray(w_v, np.float32)


def expanded_scores(build: Builder, k: _Consts, q, x, w_k_t: np.ndarray, tag: str, wide: frozenset = frozenset()):
    """(q_i·W_K,iᵀ)·Xᵀ [R, h, t, S] for queries q [R, h, t, d_k] and states X [R, S, D]: each head's
    W_K,i is read once for all rows, and all heads of a row share one product with X."""
    op = build.op
    q_shape = op("Shape", [q], f"{tag}_q_shape")
    h_r_t = op("Gather", [q_shape, k.idx_h_r_t], f"{tag}_h_R_t", axis=0)
    qh = op("Transpose", [q], f"{tag}_q_by_head", perm=[1, 0, 2, 3])  # [h, R, t, d_k]
    qh = op("Reshape", [qh, k.heads_rows_dk], f"{tag}_q_h")  # [h, R·t, d_k]
    qe = op("MatMul", [qh, build.const(f"{tag}_W_K_T", w_k_t)], f"{tag}_q_expanded")
    qe = op("Reshape", [qe, op("Concat", [h_r_t, k.d], f"{tag}_h_R_t_D", axis=0)], f"{tag}_q_expanded4")
    qe = op("Transpose", [qe], f"{tag}_q_expanded_rows", perm=[1, 0, 2, 3])  # [R, h, t, D]
    qe = op("Reshape", [qe, k.rows_stack_d], f"{tag}_q_stacked")  # [R, h·t, D]
    if "scores" in wide:
        qe = op("Cast", [qe], f"{tag}_q64", to=onnx.TensorProto.DOUBLE)
        x = op("Cast", [x], f"{tag}_X64", to=onnx.TensorProto.DOUBLE)
    x_t = op("Transpose", [x], f"{tag}_X_T", perm=[0, 2, 1])  # [R, D, S]
    scores = op("MatMul", [qe, x_t], f"{tag}_scores")  # [R, h·t, S]
    if "scores" in wide:
        scores = op("Cast", [scores], f"{tag}_scores32", to=onnx.TensorProto.FLOAT)
    r_h_t = op("Gather", [q_shape, k.idx_r_h_t], f"{tag}_R_h_t", axis=0)
    return op("Reshape", [scores, op("Concat", [r_h_t, k.minus1], f"{tag}_R_h_t_S", axis=0)], f"{tag}_scores4")


def values_from_states(build: Builder, k: _Consts, probs, x, w_v: np.ndarray, b_v: np.ndarray | None, tag: str,
                       wide: frozenset = frozenset()):
    """(P_i·X)·W_V,i (+ b_V,i) [R, h, t, d_k] for probabilities P [R, h, t, S] and states X [R, S, D]."""
    op = build.op
    heads, _, d_kv = w_v.shape
    p_shape = op("Shape", [probs], f"{tag}_P_shape")
    p3_shape = op("Concat", [op("Gather", [p_shape, k.idx_r], f"{tag}_P_R", axis=0), k.minus1,
                             op("Gather", [p_shape, k.idx_s], f"{tag}_P_S", axis=0)], f"{tag}_R_ht_S", axis=0)
    p = op("Reshape", [probs, p3_shape], f"{tag}_P_stacked")  # [R, h·t, S]
    if "values" in wide:
        x64 = op("Cast", [x], f"{tag}_X64v", to=onnx.TensorProto.DOUBLE)
        ctx = op("MatMul", [op("Cast", [p], f"{tag}_P64", to=onnx.TensorProto.DOUBLE), x64], f"{tag}_PX64")
        ctx = op("Cast", [ctx], f"{tag}_PX", to=onnx.TensorProto.FLOAT)
    else:
        ctx = op("MatMul", [p, x], f"{tag}_PX")  # [R, h·t, D]
    p_r_h_t = op("Gather", [p_shape, k.idx_r_h_t], f"{tag}_P_R_h_t", axis=0)
    ctx = op("Reshape", [ctx, op("Concat", [p_r_h_t, k.d], f"{tag}_R_h_t_D", axis=0)], f"{tag}_PX4")
    ctx = op("Transpose", [ctx], f"{tag}_PX_by_head", perm=[1, 0, 2, 3])  # [h, R, t, D]
    ctx = op("Reshape", [ctx, k.heads_rows_d], f"{tag}_PX_h")  # [h, R·t, D]
    out = op("MatMul", [ctx, build.const(f"{tag}_W_V", w_v)], f"{tag}_values")
    if b_v is not None:
        out = op("Add", [out, build.const(f"{tag}_b_V", np.asarray(b_v, np.float32).reshape(heads, 1, d_kv))],
                 f"{tag}_values_b")
    p_h_r_t = op("Gather", [p_shape, k.idx_h_r_t], f"{tag}_P_h_R_t", axis=0)
    out = op("Reshape", [out, op("Concat", [p_h_r_t, k.dk], f"{tag}_h_R_t_dk", axis=0)], f"{tag}_values4")
    return op("Transpose", [out], f"{tag}_values_rows", perm=[1, 0, 2, 3])  # [R, h, t, d_k]


def _become(node: gs.Node, tensor) -> None:
    """``node``'s output keeps its name and consumers but now carries ``tensor`` (ORT folds the Identity)."""
    node.op, node.inputs, node.attrs = "Identity", [tensor], {}


def _redirect_shape_reads(build: Builder, k: _Consts, tensor, x) -> None:
    """Shape ops reading a K/V cache tensor [R, h, S, d_k] read the same sizes off X [R, S, D]."""
    readers = [n for n in tensor.outputs if n.op == "Shape"]
    if not readers:
        return
    x_shape = build.op("Shape", [x], "X_shape")
    rows = build.op("Slice", [x_shape, k.axis0, k.one], "rows")
    length = build.op("Slice", [x_shape, k.one, k.two], "length")
    full = build.op("Concat", [rows, k.h, length, k.dk], "kv_shape", axis=0)
    for node in readers:
        start, end = node.attrs.get("start", 0), node.attrs.get("end", 4)
        part = build.op("Slice", [full, build.const("start", np.array([start], np.int64)),
                                  build.const("end", np.array([end], np.int64))], "kv_shape_part")
        _become(node, part)


def rewrite(graph: gs.Graph, layers: list[SelfLayer], d_model: int, heads: int, d_kv: int,
            wide: frozenset = frozenset()) -> None:
    """Rewrite matched ``layers`` in ``graph``: their K/V cache inputs/outputs become X cache ones in place."""
    build = Builder(graph, NAME)
    consts = _Consts(build, d_model, heads, d_kv)
    tensors = graph.tensors()
    swap_in, swap_out = {}, {}
    for layer in layers:
        past, present = _rewrite_layer(build, consts, graph, layer, d_model, heads, d_kv, wide)
        for name in (layer.key_input, layer.value_input):
            _redirect_shape_reads(build, consts, tensors[name], past)
        for name in (layer.key_output, layer.value_output):
            _redirect_shape_reads(build, consts, tensors[name], present)
        swap_in[layer.key_input], swap_in[layer.value_input] = past, None
        swap_out[layer.key_output], swap_out[layer.value_output] = present, None
    graph.inputs = [swap_in.get(t.name, t) for t in graph.inputs if swap_in.get(t.name, t) is not None]
    graph.outputs = [swap_out.get(t.name, t) for t in graph.outputs if swap_out.get(t.name, t) is not None]
    graph.cleanup(remove_unused_graph_inputs=False)
    remaining = graph.tensors()
    left = sorted(name for name in {*swap_in, *swap_out} if name in remaining)
    if left:
        raise ElxError(f"pass {NAME} could not remove every use of {left[0]}; report this model")


# -- manifest, verification, apply -------------------------------------------------------------------

def _swap(entries: dict, layers: list[SelfLayer], new: dict) -> dict:
    """``entries`` (name → spec, ordered) with each layer's key entry replaced by ``new`` and the value dropped."""
    out = {}
    for name, spec in entries.items():
        if name in new:
            out.update(new[name])
        elif not any(name in (layer.value_input, layer.value_output) for layer in layers):
            out[name] = spec
    return out


def candidate(manifest: Manifest, graph_file: str, indices=None, wide: frozenset = frozenset()
              ) -> tuple[Manifest, list[SelfLayer]]:
    """A copy of ``manifest`` whose decoder (saved as ``graph_file``) caches X for the layers ``indices``
    (default: all).  Returns it and the matched layers (their projections, for ``consistent_past``)."""
    dims = manifest.dims
    d_model, heads, d_kv = dims["d_model"], dims["num_heads"], dims["d_kv"]
    layers = [layer for layer in self_layers(manifest) if indices is None or layer.index in indices]
    graph = load_graph(manifest, manifest.step)
    for layer in layers:
        try:
            match(graph, layer, d_model, heads, d_kv)
        except Unfit as why:
            raise ElxError(f"pass {NAME}: decoder self-attention layer {layer.index}: {why}; nothing was written")
    rewrite(graph, layers, d_model, heads, d_kv, wide)
    after = manifest.copy()
    step = after.graphs[after.step]
    step["external_data"] = save_graph(graph, after.folder, graph_file)
    step["file"] = graph_file
    past_shape = ["rows", "past_sequence", d_model]
    present_shape = ["rows", "past_sequence + decoder_sequence", d_model]
    step["inputs"] = _swap(step["inputs"], layers, {layer.key_input: {layer.past: {
        "dtype": "float32", "shape": past_shape, "from": f"cache:{layer.present}"}} for layer in layers})
    step["outputs"] = _swap(step["outputs"], layers, {layer.key_output: {layer.present: {
        "dtype": "float32", "shape": present_shape}} for layer in layers})
    entries = {e["input"]: e for e in after.cache_entries}
    entries = _swap(entries, layers, {layer.key_input: {layer.past: {
        "input": layer.past, "output": layer.present, "dtype": "float32", "shape": past_shape, "seq_axis": 1}}
        for layer in layers})
    after.data["cache"]["self"] = list(entries.values())
    return after, layers


def consistent_past(layers: list[SelfLayer], heads: int, d_kv: int, seed: int = 1):
    """``past_from`` for ``verify_rewrite``: random states X [R, P, D] become the rewrite's cache, and
    the original's K = X·W_K + b_K, V = X·W_V + b_V (overwritten in its past, in place; float64 products)."""

    def split(y: np.ndarray) -> np.ndarray:  # [R, P, h·d_k] → [R, h, P, d_k]
        rows, length, _ = y.shape
        return np.ascontiguousarray(y.reshape(rows, length, heads, d_kv).transpose(0, 2, 1, 3).astype(np.float32))

    def past_from(past: dict) -> dict:
        rng = np.random.default_rng(seed)
        out = dict(past)
        for layer in layers:
            rows, _, length, _ = past[layer.key_input].shape
            x = rng.standard_normal((rows, length, layer.k.w.shape[0]))
            if layer.norm is not None:  # as the layer norm shapes them: γ ⊙ n + β (outlier features included)
                x = x * layer.norm[0] + layer.norm[1]
            x = x.astype(np.float32)
            for name, proj in ((layer.key_input, layer.k), (layer.value_input, layer.v)):
                y = x.astype(np.float64) @ proj.w.astype(np.float64)
                past[name] = split(y if proj.b is None else y + proj.b)
            del out[layer.key_input], out[layer.value_input]
            out[layer.past] = x
        return out

    return past_from


def apply(folder: Path, manifest: Manifest, argument: str | None) -> dict:
    refuse_twice(manifest, NAME)
    argument = parse_argument(argument)
    wide = frozenset({"scores"}) if argument == FP64 else frozenset()
    applied = [name for name in manifest.pass_names() if name in CONFLICTS]
    if applied:
        raise ElxError(f"pass {NAME} replaces the self-attention K/V cache that {applied[0]} already shrank; "
                       f"use one of them (export again without --pass {applied[0]})")
    layers = self_layers(manifest)
    if not layers or len(layers) * 2 != len(manifest.cache_entries):
        raise ElxError(f"pass {NAME} needs a self-attention cache of key/value pairs per layer; this export has "
                       f"{[e['input'] for e in manifest.cache_entries][:4]} (slim or {NAME} applied?); "
                       "export again from the model")
    before = manifest.copy()
    decoder_only = not manifest.data.get("is_encoder_decoder", True)
    if decoder_only:  # the prompt part too (el_self_decoder_only.py)
        from elx.exporter.passes.el_self_decoder_only import candidate as decoder_only_candidate

        after, layers = decoder_only_candidate(manifest, wide)
    else:
        after, layers = candidate(manifest, pass_file(manifest.graphs[manifest.step]["file"], NAME), wide=wide)
    dims = manifest.dims
    try:
        report = commit(folder, before, after, past_from=consistent_past(layers, dims["num_heads"], dims["d_kv"]),
                        what=f"pass {NAME}")
    except Exception:
        _remove_new_files(folder, before, after)
        raise
    for key, value in after.data.items():  # the manifest is updated in place, as passes do
        if manifest.data.get(key) != value:
            manifest.data[key] = value
    d_model, heads, d_kv = dims["d_model"], dims["num_heads"], dims["d_kv"]
    ratio = d_model / (2 * heads * d_kv)
    record = {"name": NAME, "argument": argument or None, "layers": [layer.index for layer in layers],
              "scores_accumulate": "float64" if wide else "float32",
              "cache": f"{layers[0].names[0].format('{i}')} [rows, past_sequence, {d_model}] per layer instead of K "
                       f"and V [rows, {heads}, past_sequence, {d_kv}]",
              "self_cache_ratio": ratio}
    if decoder_only:
        record["prompt"] = after.data["cache"]["prompt"]["holds"] + f" instead of K and V [·, {heads}, ·, {d_kv}]"
        record["prompt_cache_ratio"] = ratio
    return {**record, **report}


def _remove_new_files(folder: Path, before: Manifest, after: Manifest) -> None:
    for file in set(after.graph_files()) - set(before.graph_files()):
        (Path(folder) / file).unlink(missing_ok=True)
