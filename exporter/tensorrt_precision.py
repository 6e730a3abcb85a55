"""fp16 engines: which parts run in fp16 and which stay fp32 is decided here, in the ONNX graph.

TensorRT for RTX builds only strongly typed networks (every layer computes in the type of its
tensors; there is no "allow fp16" builder flag), and elx builds NVIDIA TensorRT's networks the same
way, so an fp16 engine is an fp32 graph with chosen parts rewritten to fp16.  The rule:

* **fp16**: MatMuls with a constant weight (attention projections, cross K/V, EL's per-head W_K/W_V,
  feed-forward input, lm_head): the weight is stored in fp16 (half the bytes every decoder step
  streams) and the activation is cast to fp16 in front of the MatMul and back to fp32 after it.
* **fp32, everything else**: residual stream, layer/RMS norms, softmax and log-softmax, attention
  scores and probabilities·V (activation × activation MatMuls, T5 has no 1/√d scaling), position bias,
  masks, biases, the caches and every graph input and output (the engines' IO match the manifest), and
  embedding tables (a Gather reads only the rows it needs: fp16 there would shrink the file, not the
  bytes a step reads).
* **fp32 by exception**: T5's feed-forward output projection ``wo`` (HF keeps it in fp32 too,
  ``_keep_in_fp32_modules``; its fp16 output overflows on trained T5 checkpoints), recognised as a
  weight MatMul whose reduction dimension is none of d_model, heads·d_kv, d_kv (it is d_ff); and slim's
  W_KV products (constants named ``*_W_KV*`` by ``exporter/passes/slim.py`` / ``slim_cross.py``): W_KV
  amplifies rounding by up to cond(W_K).

Verification (``verify``): the converted graphs against the fp32 ones on ONNX Runtime (CPU), max abs
step output difference relative to the largest |output|; refused above ``RELATIVE_TOLERANCE`` or on
any inf/nan the fp32 graphs do not have.  The per-reason counts and the measured error go into the
manifest's ``engines.fp16``.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from runners.errors import ElxError
from runners.manifest import Manifest

from .onnx_export import save_model
from .tensorrt_verify import with_files
from .verify import verify_rewrite

RELATIVE_TOLERANCE = 2e-2


def _keep_fp32(node, weight: np.ndarray, family: str, dims: dict) -> str | None:
    if "W_KV" in node.input[1]:
        return "slim W_KV product"
    if family == "t5" and weight.ndim >= 2:
        reduction = weight.shape[-2]
        if reduction not in (dims["d_model"], dims["num_heads"] * dims["d_kv"], dims["d_kv"]):
            return "T5 feed-forward output (wo)"
    return None


def to_fp16(model: onnx.ModelProto, family: str, dims: dict) -> tuple[onnx.ModelProto, dict]:
    """Rewrite ``model`` in place by the rule above; returns it and the counts per decision."""
    graph = model.graph
    weights = {t.name: t for t in graph.initializer}
    half_weights: dict[str, str] = {}
    half_inputs: dict[str, str] = {}
    new_initializers, nodes, counts = [], [], Counter()
    for node in graph.node:
        weight = weights.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 else None
        if weight is None or weight.data_type != TensorProto.FLOAT:
            if node.op_type == "MatMul":
                counts["fp32: activation x activation"] += 1
            nodes.append(node)
            continue
        value = numpy_helper.to_array(weight)
        reason = _keep_fp32(node, value, family, dims)
        if reason:
            counts[f"fp32: {reason}"] += 1
            nodes.append(node)
            continue
        counts["fp16: weight MatMul"] += 1
        if weight.name not in half_weights:
            half_weights[weight.name] = f"{weight.name}/fp16"
            new_initializers.append(numpy_helper.from_array(value.astype(np.float16), half_weights[weight.name]))
        source = node.input[0]
        if source not in half_inputs:
            half_inputs[source] = f"{source}/fp16"
            nodes.append(helper.make_node("Cast", [source], [half_inputs[source]], f"{source}/to_fp16",
                                          to=TensorProto.FLOAT16))
        out = node.output[0]
        nodes.append(helper.make_node("MatMul", [half_inputs[source], half_weights[weight.name]], [f"{out}/fp16"],
                                      node.name))
        nodes.append(helper.make_node("Cast", [f"{out}/fp16"], [out], f"{out}/to_fp32", to=TensorProto.FLOAT))
    used = {name for node in nodes for name in node.input}
    kept = [t for t in graph.initializer if t.name in used]
    del graph.node[:]
    graph.node.extend(nodes)
    del graph.initializer[:]
    graph.initializer.extend(kept + new_initializers)
    return model, dict(sorted(counts.items()))


def convert(manifest: Manifest, sources: dict[str, Path], folder: Path) -> tuple[dict[str, Path], dict]:
    """fp16 versions of the ONNX files ``sources`` (graph → path) in ``folder``, with counts per graph."""
    out, counts = {}, {}
    for graph, source in sources.items():
        model = onnx.load(str(source))
        model, counts[graph] = to_fp16(model, manifest.family, manifest.dims)
        folder.mkdir(parents=True, exist_ok=True)
        out[graph] = folder / f"{Path(source).stem}.fp16.onnx"
        save_model(model, out[graph])
    return out, counts


def verify(manifest: Manifest, converted: dict[str, Path]) -> dict:
    """fp16 graphs (``converted``: graph → ORT-runnable file) against the export's fp32 ones."""
    measured = verify_rewrite(manifest, with_files(manifest, converted))
    diff, scale = measured["max_abs_logits_diff"], measured["max_abs_reference"]
    relative = diff / max(scale, 1e-30)
    report = {"max_abs_logits_diff": diff, "max_abs_logits": scale, "relative_diff": relative,
              "relative_tolerance": RELATIVE_TOLERANCE}
    if not relative <= RELATIVE_TOLERANCE:
        raise ElxError(f"fp16 engines would change the step outputs by {diff:.3g} (relative {relative:.3g} > "
                       f"{RELATIVE_TOLERANCE}); build with --precision fp32")
    return report
