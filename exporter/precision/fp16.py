"""fp16: which parts of a graph compute in fp16 and which stay fp32, decided here once.

One rule for ``elx export --precision fp16`` (``exporter/precision/fp16_export.py``) and
``elx build-engine --precision fp16`` (``exporter/tensorrt/precision.py``).  The graphs are exported,
rewritten by passes and verified in fp32 first; the rule then rewrites the finished fp32 graphs:

* **fp16**: MatMuls with a constant weight (attention projections, cross K/V, EL's per-head W_K/W_V,
  feed-forward input, lm_head; a ``Gemm`` on a constant weight, GPT-2's ``Conv1D``, is first rewritten
  as such a MatMul and an fp32 bias ``Add``, ``gemms_to_matmuls``): the weight is stored in fp16 (half the bytes every decoder step
  streams), the activation is cast to fp16 in front of the MatMul and the result back to fp32 after
  it (accumulation is the kernel's: fp32 on the GPU's fp16 GEMMs).
* **fp32, everything else**: residual stream, layer/RMS norms, softmax and log-softmax, attention
  scores and probabilities·V (activation × activation MatMuls; T5 has no 1/√d scaling), position bias,
  masks, biases, logits (HF's searches run in fp32), and embedding tables (a Gather reads only the
  rows it needs: fp16 there would shrink the file, not the bytes a step reads).
* **fp32 by exception**: T5's feed-forward output projection ``wo`` (HF keeps it in fp32 too,
  ``_keep_in_fp32_modules``; its fp16 output overflows on trained T5 checkpoints), recognised as a
  weight MatMul whose reduction dimension is none of d_model, heads·d_kv, d_kv (it is d_ff); slim's
  W_KV products (constants named ``*_W_KV*`` by ``exporter/passes/slim.py`` / ``slim_cross.py``); and
  the projection that produces a slim K-only cache or state (``Boundary.exact_outputs``): V is
  recomputed as K·W_KV, so any rounding of K, of W_K or of x·W_K reaches V amplified by up to
  cond(W_K) (hundreds to thousands on t5-small dims: fp16 there would make V wrong, not rounded).
* **Graph boundary** (exports; engines keep every IO fp32): graph inputs and outputs named in
  ``Boundary.half_inputs`` / ``half_outputs`` are fp16 at the graph's edge: cast to fp32 right after
  entering, to fp16 right before leaving, and the graph's own readers of an fp16 output read it back
  from fp16 (Cast16 → Cast32), so a step computes with exactly the values it stores and the next
  step reads.  Exports put the self-attention cache and the per-input state (cross K/V, EL's
  encoder output, or a decoder-only prefill's prompt K/V) there; slim's K-only entries stay fp32
  (above), and so do a decoder-only prefill's logits (the first step's scores, ``first_step_scores``).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from elx.runners.manifest import Manifest

PASS_THROUGH = ("Reshape", "Transpose", "Squeeze", "Unsqueeze", "Identity", "Concat", "Add", "Cast")
HALF, FLOAT = TensorProto.FLOAT16, TensorProto.FLOAT


@dataclass(frozen=True)
class Boundary:
    """What a graph's edge holds in fp16, and which outputs must be computed without fp16 rounding."""

    half_inputs: frozenset = frozenset()
    half_outputs: frozenset = frozenset()
    exact_outputs: frozenset = frozenset()  # slim K-only caches/state: their producing projection stays fp32


def _exact_projections(graph: onnx.GraphProto, outputs, weights: dict) -> set[int]:
    """Indices of the weight MatMuls whose result reaches ``outputs`` through shape ops, bias adds and
    the cache concat (``x·W_K (+b) → head split → Concat(past, ·)``)."""
    made_by = {out: i for i, node in enumerate(graph.node) for out in node.output}
    found, seen, stack = set(), set(), list(outputs)
    while stack:
        tensor = stack.pop()
        index = made_by.get(tensor)
        if index is None or index in seen:
            continue
        seen.add(index)
        node = graph.node[index]
        if node.op_type == "MatMul" and node.input[1] in weights:
            found.add(index)
        elif node.op_type in PASS_THROUGH:
            stack.extend(node.input[:1] if node.op_type == "Reshape" else [i for i in node.input if i not in weights])
    return found


def _keep_fp32(node, weight: np.ndarray, family: str, dims: dict, exact: bool) -> str | None:
    if "W_KV" in node.input[1]:
        return "slim W_KV product"
    if exact:
        return "slim key projection"
    if family == "t5" and weight.ndim >= 2:
        reduction = weight.shape[-2]
        if reduction not in (dims["d_model"], dims["num_heads"] * dims["d_kv"], dims["d_kv"]):
            return "T5 feed-forward output (wo)"
    return None


def _cast(source: str, target: str, to: int) -> onnx.NodeProto:
    return helper.make_node("Cast", [source], [target], f"{target}/cast", to=to)


def _set_half(values, names) -> None:
    for value in values:
        if value.name in names:
            if value.type.tensor_type.elem_type != FLOAT:
                raise ValueError(f"{value.name} is not float32; only float32 graph IO can be stored in fp16")
            value.type.tensor_type.elem_type = HALF


def _attribute(node, name: str, default):
    found = next((a for a in node.attribute if a.name == name), None)
    return default if found is None else helper.get_attribute_value(found)


def gemms_to_matmuls(model: onnx.ModelProto, folder=None) -> int:
    """Rewrite in place each ``Gemm`` on a constant fp32 weight (GPT-2's ``Conv1D`` exports as one) as a
    ``MatMul`` on that weight (transposed once here where ``transB``) followed by an ``Add`` of the bias, so
    that the precision rules, which read weight MatMuls, see it.  Only the plain form (alpha = beta = 1, A not
    transposed) is rewritten; the sum is the same, its rounding order in fp32 may differ by an ulp.  Returns
    how many were rewritten.  A weight stored outside the graph is read from ``folder``."""
    from elx.exporter.capture.shared_weights import values

    graph = model.graph
    weights = {t.name: t for t in graph.initializer}
    nodes, added, rewritten = [], [], 0
    for node in graph.node:
        weight = weights.get(node.input[1]) if node.op_type == "Gemm" else None
        if (weight is None or weight.data_type != FLOAT or _attribute(node, "alpha", 1.0) != 1.0
                or _attribute(node, "beta", 1.0) != 1.0 or _attribute(node, "transA", 0)):
            nodes.append(node)
            continue
        name = weight.name
        if _attribute(node, "transB", 0):
            name = f"{weight.name}/transposed"
            if name not in weights:
                weights[name] = numpy_helper.from_array(np.ascontiguousarray(values(weight, folder).T), name)
                added.append(weights[name])
        bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
        out = node.output[0]
        product = f"{out}/matmul" if bias else out
        matmul = helper.make_node("MatMul", [node.input[0], name], [product], node.name or f"{out}/gemm")
        matmul.metadata_props.extend(node.metadata_props)  # the module path (int8's per-layer rule reads it)
        nodes.append(matmul)
        if bias:
            nodes.append(helper.make_node("Add", [product, bias], [out], f"{out}/gemm_bias"))
        rewritten += 1
    if rewritten:
        del graph.node[:]
        graph.node.extend(nodes)
        graph.initializer.extend(added)
        used = {name for node in graph.node for name in node.input}
        for tensor in [t for t in graph.initializer if t.name not in used]:
            graph.initializer.remove(tensor)
    return rewritten


def to_fp16(model: onnx.ModelProto, family: str, dims: dict, boundary: Boundary = Boundary()) -> tuple[
        onnx.ModelProto, dict]:
    """Rewrite ``model`` in place by the rule above; returns it and the number of MatMuls per decision."""
    gemms_to_matmuls(model)
    graph = model.graph
    weights = {t.name: t for t in graph.initializer}
    exact = _exact_projections(graph, boundary.exact_outputs, weights)
    half_in = [i.name for i in graph.input if i.name in boundary.half_inputs]
    half_out = {o.name for o in graph.output if o.name in boundary.half_outputs}
    _set_half(graph.input, half_in)
    _set_half(graph.output, half_out)
    read = {name: f"{name}/fp32" for name in half_in} | {name: f"{name}/stored" for name in half_out}
    read_back = {name for node in graph.node for name in node.input if name in half_out}
    nodes = [_cast(name, read[name], FLOAT) for name in half_in]
    half_weights, half_activations, new_initializers, counts = {}, {}, [], Counter()
    for index, node in enumerate(graph.node):
        node.input[:] = [read.get(name, name) for name in node.input]
        produced = list(node.output)
        node.output[:] = [f"{name}/fp32" if name in half_out else name for name in node.output]
        nodes.extend(_matmul(node, index in exact, weights, family, dims, half_weights, half_activations,
                             new_initializers, counts))
        for name in produced:
            if name in half_out:
                nodes.append(_cast(f"{name}/fp32", name, HALF))
                if name in read_back:
                    nodes.append(_cast(name, read[name], FLOAT))
    used = {name for node in nodes for name in node.input}
    kept = [t for t in graph.initializer if t.name in used]
    boundary_names = set(half_in) | half_out
    info = [v for v in graph.value_info if v.name not in boundary_names]
    del graph.node[:], graph.initializer[:], graph.value_info[:]
    graph.node.extend(nodes)
    graph.initializer.extend(kept + new_initializers)
    graph.value_info.extend(info)
    return model, dict(sorted(counts.items()))


def _matmul(node, exact: bool, weights: dict, family: str, dims: dict, half_weights: dict, half_activations: dict,
            new_initializers: list, counts: Counter) -> list:
    """``node`` as it stays, or its fp16 version with the casts around it."""
    weight = weights.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 else None
    if weight is None or weight.data_type != FLOAT:
        if node.op_type == "MatMul":
            counts["fp32: activation x activation"] += 1
        return [node]
    value = numpy_helper.to_array(weight)
    reason = _keep_fp32(node, value, family, dims, exact)
    if reason:
        counts[f"fp32: {reason}"] += 1
        return [node]
    counts["fp16: weight MatMul"] += 1
    out = []
    if weight.name not in half_weights:
        half_weights[weight.name] = f"{weight.name}/fp16"
        new_initializers.append(numpy_helper.from_array(value.astype(np.float16), half_weights[weight.name]))
    source = node.input[0]
    if source not in half_activations:
        half_activations[source] = f"{source}/fp16"
        out.append(helper.make_node("Cast", [source], [half_activations[source]], f"{source}/to_fp16", to=HALF))
    result = node.output[0]
    out.append(helper.make_node("MatMul", [half_activations[source], half_weights[weight.name]], [f"{result}/fp16"],
                                node.name))
    out.append(helper.make_node("Cast", [f"{result}/fp16"], [result], f"{result}/to_fp32", to=FLOAT))
    return out


def half_weight_names(model: onnx.ModelProto) -> set[str]:
    return {t.name for t in model.graph.initializer if t.data_type == HALF}


# -- which boundary tensors: decided from the manifest ----------------------------------------------

def exact_entries(manifest: Manifest) -> set[str]:
    """Sources (``<graph>:<output>``) that stay fp32: slim's K-only caches and slim-cross's K-only state.

    A key whose value twin is gone from the step's inputs is read as K·W_KV (see the module doc)."""
    inputs = manifest.graphs[manifest.step]["inputs"]
    exact = set()
    for name, spec in inputs.items():
        if name.endswith(".key") and name[: -len("key")] + "value" not in inputs:
            exact.add(_source(manifest, spec["from"]))
    return exact


def _source(manifest: Manifest, source: str) -> str:
    """A step input's source as ``<graph>:<output>`` (a cache entry is the step's own output)."""
    return f"{manifest.step}:{source.partition(':')[2]}" if source.startswith("cache:") else source


def boundaries(manifest: Manifest) -> dict[str, Boundary]:
    """Per graph: an fp16 export's fp16 IO (the stage outputs, i.e. the per-input state, and the self-attention
    cache, with the inputs they feed; not the exact ones) and the outputs that must stay exact (engines, whose
    IO stay fp32, use only these)."""
    exact = exact_entries(manifest)
    stages = set(manifest.stages)
    half_sources = {f"{g}:{o}" for g in stages for o, spec in manifest.graphs[g]["outputs"].items()
                    if spec.get("dtype", "float32") == "float32"}
    half_sources |= {f"{manifest.step}:{e['output']}" for e in manifest.cache_entries}
    half_sources -= exact
    half_sources.discard(manifest.data.get("first_step_scores"))  # a decoder-only prefill's logits: fp32 scores
    out = {}
    for name in [*manifest.stages, manifest.step]:
        spec = manifest.graphs[name]
        inputs = {inp for inp, s in spec["inputs"].items() if _source(manifest, s["from"]) in half_sources}
        outputs = {o for o in spec["outputs"] if f"{name}:{o}" in half_sources}
        exact_here = {src.partition(":")[2] for src in exact if src.partition(":")[0] == name}
        out[name] = Boundary(frozenset(inputs), frozenset(outputs), frozenset(exact_here))
    return out
