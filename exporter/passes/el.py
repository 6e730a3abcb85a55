"""``--pass el``: EL-attention for cross-attention (Yan et al., seed 000, §3, Appendix A/B).

Math, in the paper's notation.  H ∈ R^{N×D} is the encoder output of one input sequence, x the
decoder state of one query row, h heads of width d_k.  Standard cross-attention of head i is

    q_i = x·W_Q,i + b_Q,i          K_i = H·W_K,i + b_K,i          V_i = H·W_V,i + b_V,i
    o_i = softmax(s·q_i·K_iᵀ + mask)·V_i          out = [o_1 … o_h]·W_O + b_O

with the scale s (BART/Whisper: d_k^-1/2; T5: 1).  EL-attention moves the projections to the
query side, so every layer and every beam reads the one shared H:

    q̃_i = q_i·W_K,iᵀ ∈ R^D                      (b_K,i drops out: q_i·b_K,iᵀ is constant
    o_i = (softmax(s·q̃_i·Hᵀ + mask)·H)·W_V,i + b_V,i       along the keys, softmax ignores it;
                                                  b_V,i passes through because rows of P sum to 1)

For a batch item, the queries of all its beams, steps and heads are stacked into one
[beam·t·h, D] block and multiplied once with Hᵀ: [B, beam·t·h, D] × [B, D, N].  W_Q·W_K,iᵀ and
W_V,i·W_O are NOT pre-multiplied (that would multiply weights and FLOPs by h).

Pattern (found by structure, per decoder input fed by the ``cross_kv`` graph):
    K_in ─Transpose→ MatMul(q…, ·) ─[Mul/Div scale]→ [Add mask] → Softmax → MatMul(·, V_in)
    q… = shape ops over q_lin = x·W_Q (+b_Q);  context ─shape ops→ MatMul(·, W_O)
    K_in/V_in come from ``cross_kv``: H·W_K (+b_K) and H·W_V (+b_V) → Reshape → Transpose.

Rewrite: q_lin → per-head ·W_K,iᵀ → stack → ·Hᵀ → scale → +mask → softmax → ·H → per-head
·W_V,i (+b_V,i) → context into the original W_O MatMul.  The cross K/V inputs disappear; the
decoder takes ``encoder_hidden_states`` [B, N, D] (from the encoder) once per batch item, and
the ``cross_kv`` graph is no longer run: there is no cross-attention cache at all.

Verification: the rewritten folder against the original on random inputs at several
(batch, beam, source, past, step) shapes through the runner's backend; nothing is written
unless the max abs logits diff is ≤ 1e-4 (fp32).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx_graphsurgeon as gs

from elx.runners.manifest import Manifest

from elx.runners.errors import ElxError
from elx.exporter.passes.rewrite import (Builder, commit, constant_value, linear_before, load_graph, only_consumer, pass_file,
                      refuse_twice, save_graph, through_shape_ops_down, through_shape_ops_up)
from elx.exporter.passes.catalog import EL as SPEC  # name, order, argument, conflicts, refusals

NAME, parse_argument = SPEC.name, SPEC.parse
ENCODER_INPUT = "encoder_hidden_states"


@dataclass
class CrossAttention:
    """One matched cross-attention layer of the decoder graph."""

    q_lin: gs.Variable  # x·W_Q (+ b_Q), [rows, t, h·d_k]
    score_ops: list  # [(op, constant)] applied to the scores before the mask (scaling)
    mask: gs.Tensor | None  # additive mask [B, 1, 1, N]
    out_proj: gs.Node  # MatMul(context, W_O)
    key_input: str
    value_input: str


def _match_layer(graph: gs.Graph, key_input: str, value_input: str) -> CrossAttention:
    tensors = graph.tensors()
    qk, _ = through_shape_ops_down(tensors[key_input])
    if qk.op != "MatMul":
        raise ElxError(f"cross-attention pattern not found: {key_input} does not feed a QKᵀ MatMul")
    q_lin = through_shape_ops_up(qk.inputs[0])
    score_ops, mask, current = [], None, qk.outputs[0]
    node = only_consumer(current, "QKᵀ scores")
    while node.op in ("Mul", "Div", "Add"):
        other = node.inputs[1] if node.inputs[0] is current else node.inputs[0]
        value = constant_value(other)
        if node.op in ("Mul", "Div") and value is not None and value.size == 1 and \
                (node.op == "Mul" or node.inputs[0] is current):
            score_ops.append((node.op, value.reshape(())))
        elif node.op == "Add" and mask is None:
            mask = other
        else:
            raise ElxError(f"cross-attention pattern not found: unexpected {node.op} on the scores of {key_input}")
        current = node.outputs[0]
        node = only_consumer(current, "attention scores")
    if node.op != "Softmax":
        raise ElxError(f"cross-attention pattern not found: no Softmax after the scores of {key_input}")
    pv = only_consumer(node.outputs[0], "attention probabilities")
    if pv.op != "MatMul" or through_shape_ops_up(pv.inputs[1]).name != value_input:
        raise ElxError(f"cross-attention pattern not found: the probabilities of {key_input} do not meet {value_input}")
    out_proj, _ = through_shape_ops_down(pv.outputs[0])
    if out_proj.op != "MatMul" or constant_value(out_proj.inputs[1]) is None:
        raise ElxError(f"cross-attention pattern not found: no output projection after {value_input}")
    return CrossAttention(q_lin, score_ops, mask, out_proj, key_input, value_input)


def _cross_projections(cross: gs.Graph) -> dict:
    """``present.{i}.encoder.key|value`` → (W [D, h·d_k], b or None), read from the cross_kv graph."""
    out = {}
    for tensor in cross.outputs:
        out[tensor.name] = linear_before(through_shape_ops_up(tensor))
    return out


class _Shared:
    """Tensors all rewritten layers share: H, Hᵀ, the [B, -1, D] shape, the [B, 1, N] masks."""

    def __init__(self, build: Builder, d_model: int):
        self.build = build
        self.enc = gs.Variable(ENCODER_INPUT, dtype=np.float32, shape=["batch", "encoder_sequence", d_model])
        self.enc_t = build.op("Transpose", [self.enc], "enc_T", perm=[0, 2, 1])
        batch = build.op("Shape", [self.enc], "batch", start=0, end=1)
        self.stack_shape = build.op("Concat", [batch, build.const("minus1_D", np.array([-1, d_model], np.int64))],
                                    "stack_shape", axis=0)
        self._masks = {}

    def mask3(self, mask4):
        if mask4.name not in self._masks:  # [B, 1, 1, N] → [B, 1, N]
            self._masks[mask4.name] = self.build.op("Squeeze", [mask4, self.build.const("axis1", np.array([1]))],
                                                    "mask3")
        return self._masks[mask4.name]


def _replace_shape_reads(build: Builder, shared: _Shared, graph: gs.Graph, names: set, heads: int, d_kv: int):
    """Shape ops that read a cross K/V input ([B, h, N, d_k]) read the same sizes off H ([B, N, D])."""
    tensors = graph.tensors()
    full = None
    for name in names:
        for node in list(tensors[name].outputs):
            if node.op != "Shape":
                continue
            if full is None:
                enc_shape = build.op("Shape", [shared.enc], "enc_shape")
                b = build.op("Slice", [enc_shape, build.const("s0", np.array([0])), build.const("e1", np.array([1]))])
                n = build.op("Slice", [enc_shape, build.const("s1", np.array([1])), build.const("e2", np.array([2]))])
                full = build.op("Concat", [b, build.const("h", np.array([heads], np.int64)), n,
                                           build.const("dk", np.array([d_kv], np.int64))], "cross_shape", axis=0)
            start, end = node.attrs.get("start", 0), node.attrs.get("end", 4)
            sliced = build.op("Slice", [full, build.const("start", np.array([start])),
                                        build.const("end", np.array([end]))], "cross_shape_part")
            node.op, node.inputs, node.attrs = "Identity", [sliced], {}


def _rewrite_layer(build: Builder, shared: _Shared, layer: CrossAttention, w_k, w_v, b_v, heads: int, d_kv: int):
    d_model = w_k.shape[0]
    wk_t = w_k.reshape(d_model, heads, d_kv).transpose(1, 2, 0)  # [h, d_k, D]: W_K,iᵀ
    wv = w_v.reshape(d_model, heads, d_kv).transpose(1, 0, 2)  # [h, D, d_k]: W_V,i
    op, const = build.op, build.const
    q = op("Reshape", [layer.q_lin, const("q_heads", np.array([0, 0, heads, d_kv], np.int64))], "q4")
    q = op("Transpose", [q], "q_by_head", perm=[2, 0, 1, 3])  # [h, rows, t, d_k]
    q = op("Reshape", [q, const("q_flat", np.array([heads, -1, d_kv], np.int64))], "q_h")  # [h, rows·t, d_k]
    q = op("MatMul", [q, const("W_K_T", wk_t.astype(np.float32))], "q_expanded")  # [h, rows·t, D]
    q = op("Transpose", [q], "q_rows", perm=[1, 0, 2])  # [rows·t, h, D]
    q = op("Reshape", [q, shared.stack_shape], "q_stacked")  # [B, beam·t·h, D]
    scores = op("MatMul", [q, shared.enc_t], "scores")  # [B, beam·t·h, N]
    for kind, value in layer.score_ops:
        scores = op(kind, [scores, const("scale", value.astype(np.float32))], "scaled")
    if layer.mask is not None:
        scores = op("Add", [scores, shared.mask3(layer.mask)], "masked")
    probs = op("Softmax", [scores], "probs", axis=-1)
    ctx = op("MatMul", [probs, shared.enc], "context")  # [B, beam·t·h, D]
    ctx = op("Reshape", [ctx, const("ctx_heads", np.array([-1, heads, d_model], np.int64))], "ctx3")
    ctx = op("Transpose", [ctx], "ctx_by_head", perm=[1, 0, 2])  # [h, rows·t, D]
    ctx = op("MatMul", [ctx, const("W_V", wv.astype(np.float32))], "values")  # [h, rows·t, d_k]
    if b_v is not None:
        ctx = op("Add", [ctx, const("b_V", b_v.reshape(heads, 1, d_kv).astype(np.float32))], "values_b")
    ctx = op("Transpose", [ctx], "values_rows", perm=[1, 0, 2])  # [rows·t, h, d_k]
    q_shape = op("Shape", [layer.q_lin], "q_shape")
    ctx = op("Reshape", [ctx, q_shape], "context_flat")  # [rows, t, h·d_k]
    layer.out_proj.inputs[0] = ctx


def _layer_inputs(manifest: Manifest) -> list[tuple[str, str, str, str]]:
    """(key input, value input, key source, value source) per layer, from the manifest."""
    inputs = manifest.graphs[manifest.step]["inputs"]
    cross = {name: spec["from"] for name, spec in inputs.items() if spec["from"].startswith("cross_kv:")}
    keys = sorted((n for n in cross if n.endswith(".key")), key=lambda n: int(n.split(".")[1]))
    pairs = []
    for key in keys:
        value = key[: -len("key")] + "value"
        if value not in cross:
            raise ElxError(f"pass el needs cross-attention keys and values; {value} is missing (slim-cross applied?)")
        pairs.append((key, value, cross[key].partition(":")[2], cross[value].partition(":")[2]))
    return pairs


def apply(folder: Path, manifest: Manifest, argument: str | None) -> dict:
    refuse_twice(manifest, NAME)
    parse_argument(argument)
    if "slim-cross" in manifest.pass_names():
        raise ElxError("pass el removes the cross-attention cache that slim-cross shrinks; use one of them")
    pairs = _layer_inputs(manifest)
    if not pairs or "cross_kv" not in manifest.graphs:
        raise ElxError("pass el needs a decoder with cross-attention; this export has none")
    before = manifest.copy()
    dims = manifest.dims
    heads, d_kv, d_model = dims["num_heads"], dims["d_kv"], dims["d_model"]
    decoder, projections = load_graph(manifest, manifest.step), _cross_projections(load_graph(manifest, "cross_kv"))
    build = Builder(decoder, "el")
    shared = _Shared(build, d_model)
    _replace_shape_reads(build, shared, decoder, {n for pair in pairs for n in pair[:2]}, heads, d_kv)
    layers = [_match_layer(decoder, key, value) for key, value, _, _ in pairs]  # match all before rewriting
    for layer, (_, _, key_src, value_src) in zip(layers, pairs):
        (w_k, _b_k), (w_v, b_v) = projections[key_src], projections[value_src]
        _rewrite_layer(build, shared, layer, w_k, w_v, b_v, heads, d_kv)
    removed = {name for pair in pairs for name in pair[:2]}
    decoder.inputs = [t for t in decoder.inputs if t.name not in removed]
    insert_at = 2 if any(t.name == "encoder_attention_mask" for t in decoder.inputs) else 1
    decoder.inputs.insert(insert_at, shared.enc)
    decoder.cleanup(remove_unused_graph_inputs=False)
    leftovers = [t.name for t in decoder.tensors().values() if t.name in removed]
    if leftovers:
        raise ElxError(f"pass el could not remove every use of the cross cache ({leftovers[0]}); report this model")

    graph_file = pass_file(manifest.graphs[manifest.step]["file"], NAME)
    step = manifest.graphs[manifest.step]
    step["external_data"] = save_graph(decoder, folder, graph_file)
    step["file"] = graph_file
    step["inputs"] = {n: s for n, s in step["inputs"].items() if n not in removed}
    step["inputs"][ENCODER_INPUT] = {"dtype": "float32", "shape": ["batch", "encoder_sequence", d_model],
                                     "from": "encoder:last_hidden_state"}
    manifest.data["stages"] = [s for s in manifest.stages if s != "cross_kv"]
    del manifest.data["graphs"]["cross_kv"]
    manifest.data["cache"]["cross"] = {"kind": "none", "note": "EL-attention reads the encoder output directly"}
    report = commit(folder, before, manifest, what="pass el")
    return {"name": NAME, "layers": len(layers), **report}
