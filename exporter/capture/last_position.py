"""Pick the last position before the LM head, not after it: an exact rewrite of every exported graph.

The graph wrappers return ``logits[:, -1, :]`` (``exporter/capture/wrappers.py``, ``exporter/capture/decoder_only.py``),
which the exporter writes as ``Gather(MatMul(X, W), -1, axis=1)`` with X [rows, t, d] and W [d, V] (a
constant, or the Transpose of one).
The head is per position, so ``MatMul(Gather(X, -1, axis=1), W)`` computes the same numbers, and:

* at a decoder step (t = 1) the Gather that copied the [rows, 1, V] logits into [rows, V] disappears:
  at t5-small dims, batch 32, beam 4, it took 9.8 ms of a 72 ms step on this CPU (11% of the
  decoder graph's node time, ONNX Runtime's profiler), a copy of 16 MB at 1.6 GB/s;
* over a prompt (t > 1: a decoder-only prefill, Whisper's forced prefix) the head runs on one
  position per row instead of t.

Per-position ops between the head and the Gather move with it: Add/Sub/Mul/Div with a constant that
broadcasts alike over [rows, V] and [rows, t, V] (a scalar, [V] or [1, V]: BART's final logits bias,
a logit scale).  Anything else leaves the graph as it is.  The export's verification against PyTorch
(``exporter/verification/verify.py``, 1e-4) runs on the rewritten graphs.
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
from onnx import helper, numpy_helper

from elx.exporter.capture.weights import values_of

PER_POSITION = ("Add", "Sub", "Mul", "Div")


def _constants(graph: onnx.GraphProto) -> dict:
    values = {t.name: values_of(t) for t in graph.initializer}  # views, not copies of the weights
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            values[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
    return values


def _axis(node: onnx.NodeProto) -> int:
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == "axis"), 0)


def _broadcasts_alike(value: np.ndarray) -> bool:
    """Whether ``value`` broadcasts with [rows, V] as with [rows, t, V] (same result per row)."""
    return value.ndim <= 1 or (value.ndim == 2 and value.shape[0] == 1)


def _is_matrix(name: str, producers, constants) -> bool:
    """A rank-2 constant, or the Transpose of one (a tied or large head the exporter did not fold)."""
    node = producers.get(name)
    if node is not None and node.op_type == "Transpose":
        name = node.input[0]
    value = constants.get(name)
    return value is not None and value.ndim == 2


def _head_chain(gather, producers, constants, uses) -> tuple | None:
    """(MatMul, per-position ops from the MatMul towards the Gather) or None when the pattern does not hold."""
    index = constants.get(gather.input[1])
    if index is None or index.ndim != 0 or int(index) != -1 or _axis(gather) != 1:
        return None
    chain, tensor = [], gather.input[0]
    while True:
        node = producers.get(tensor)
        if node is None or uses[tensor] != 1:
            return None
        if node.op_type == "MatMul":
            return (node, chain[::-1]) if _is_matrix(node.input[1], producers, constants) else None
        if node.op_type not in PER_POSITION:
            return None
        data = [i for i in node.input if i not in constants]
        if len(data) != 1 or not all(_broadcasts_alike(constants[i]) for i in node.input if i in constants):
            return None
        chain.append(node)
        tensor = data[0]


def select_before_head(model: onnx.ModelProto) -> int:
    """Rewrite every ``Gather(head(X), -1, axis=1)`` of ``model`` in place; returns how many were rewritten."""
    graph = model.graph
    producers = {out: node for node in graph.node for out in node.output}
    uses = Counter(name for node in graph.node for name in node.input)
    uses.update(out.name for out in graph.output)
    constants = _constants(graph)
    rewritten = 0
    for gather in [n for n in graph.node if n.op_type == "Gather"]:
        found = _head_chain(gather, producers, constants, uses)
        if found is None:
            continue
        matmul, chain = found
        index_name, picked = f"{gather.name}_last_index", f"{gather.name}_last_position"
        graph.initializer.append(numpy_helper.from_array(np.array(-1, dtype=np.int64), index_name))
        position = list(graph.node).index(matmul)
        graph.node.insert(position, helper.make_node("Gather", [matmul.input[0], index_name], [picked],
                                                     name=f"{gather.name}_before_head", axis=1))
        stale = {matmul.output[0], *(node.output[0] for node in chain)}
        matmul.input[0] = picked
        (chain[-1] if chain else matmul).output[0] = gather.output[0]
        graph.node.remove(gather)
        kept = [vi for vi in graph.value_info if vi.name not in stale and vi.name != gather.output[0]]
        del graph.value_info[:]
        graph.value_info.extend(kept)
        rewritten += 1
    return rewritten
