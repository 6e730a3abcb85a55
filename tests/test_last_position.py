"""``exporter/capture/last_position.py``: the last position is picked before the LM head; same logits, bit for bit."""
from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from elx.exporter.capture.last_position import select_before_head

D, V = 8, 24


def _head_graph(bias_shape=(V,), index=-1, axis=1, extra_use=False, transpose=False) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((V, D) if transpose else (D, V)).astype(np.float32)
    inits = [numpy_helper.from_array(weight, "W"), numpy_helper.from_array(np.array(index, np.int64), "idx"),
             numpy_helper.from_array(rng.standard_normal(bias_shape).astype(np.float32), "bias"),
             numpy_helper.from_array(np.float32(0.5), "scale")]
    nodes = [helper.make_node("Mul", ["X", "scale"], ["Xs"])]
    if transpose:
        nodes.append(helper.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0]))
    nodes += [helper.make_node("MatMul", ["Xs", "Wt" if transpose else "W"], ["h"]),
              helper.make_node("Add", ["h", "bias"], ["hb"]),
              helper.make_node("Gather", ["hb", "idx"], ["logits"], axis=axis)]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["r", V])]
    if extra_use:
        outputs.append(helper.make_tensor_value_info("h", TensorProto.FLOAT, ["r", "t", V]))
    graph = helper.make_graph(nodes, "head", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["r", "t", D])],
                              outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(["logits"], {"X": x})[0]


@pytest.mark.parametrize("bias_shape", [(V,), (1, V), ()])
@pytest.mark.parametrize("transpose", [False, True])
def test_rewritten_head_gives_the_same_logits(bias_shape, transpose):
    model = _head_graph(bias_shape, transpose=transpose)
    before = onnx.ModelProto()
    before.CopyFrom(model)
    assert select_before_head(model) == 1
    onnx.checker.check_model(model)
    ops = [n.op_type for n in model.graph.node]
    assert ops.index("Gather") < ops.index("MatMul"), ops  # the head now sees one position per row
    for t in (1, 4):
        x = np.random.default_rng(t).standard_normal((5, t, D)).astype(np.float32)
        assert np.array_equal(_run(model, x), _run(before, x))


@pytest.mark.parametrize("change", [dict(bias_shape=(1, 1, V)), dict(index=0), dict(axis=0), dict(extra_use=True)])
def test_what_does_not_commute_is_left_alone(change):
    """A bias that broadcasts differently, another position, another axis, a head output used elsewhere."""
    model = _head_graph(**change)
    before = model.SerializeToString()
    assert select_before_head(model) == 0
    assert model.SerializeToString() == before


@pytest.mark.parametrize("family", ["t5", "bart", "gpt2"])
def test_exports_pick_the_position_before_the_head(family, exported):
    """Every exported step (and prefill) graph has the rewrite, and the export's verification passed on it."""
    folder = exported(family)
    manifest = json.loads((folder / "manifest.json").read_text())
    steps = [name for name in manifest["graphs"] if name in ("decoder", "prefill")]
    for name in steps:
        graph = onnx.load(str(folder / manifest["graphs"][name]["file"]), load_external_data=False).graph
        assert any(n.name.endswith("_before_head") for n in graph.node if n.op_type == "Gather"), name
        last = [n for n in graph.node if "logits" in n.output][0]
        assert last.op_type != "Gather", (name, last.op_type)
    assert manifest["verification"]["export"]["max_abs_logits_diff"] <= 1e-4
