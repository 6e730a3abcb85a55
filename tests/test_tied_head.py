"""A tied head's ``MatMul(x, Transpose(E))`` becomes ``Gemm(x, E, transB=1)`` (``exporter/capture/tied_head.py``):
the same logits, and only where it applies (a matrix ``x``, a transpose nothing else reads)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from elx.exporter.capture.tied_head import gemm_for_tied_head


def _graph(x_shape, other_reader=False, perm=(1, 0), output_transpose=False):
    rng = np.random.default_rng(0)
    embedding = rng.standard_normal((11, 6)).astype(np.float32)
    nodes = [helper.make_node("Transpose", ["E"], ["Et"], perm=list(perm), name="t"),
             helper.make_node("MatMul", ["x", "Et"], ["logits"], name="head")]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)]
    if other_reader:
        nodes.append(helper.make_node("Identity", ["Et"], ["again"]))
        outputs.append(helper.make_tensor_value_info("again", TensorProto.FLOAT, None))
    if output_transpose:
        outputs.append(helper.make_tensor_value_info("Et", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
                              outputs, [numpy_helper.from_array(embedding, "E")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def _run(model, x):
    import onnxruntime as ort

    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        ["logits"], {"x": x})[0]


def test_a_matrix_head_becomes_one_gemm_with_the_same_logits():
    model = _graph(["rows", 6])
    x = np.random.default_rng(1).standard_normal((3, 6)).astype(np.float32)
    before = _run(model, x)
    assert gemm_for_tied_head(model) == 1
    (node,) = model.graph.node
    assert node.op_type == "Gemm" and list(node.input) == ["x", "E"] and node.name == "head"
    assert helper.get_attribute_value(node.attribute[0]) == 1  # transB
    np.testing.assert_allclose(_run(model, x), before, rtol=0, atol=1e-6)


@pytest.mark.parametrize("case", [dict(x_shape=["rows", 2, 6]), dict(x_shape=["rows", 6], other_reader=True),
                                  dict(x_shape=["rows", 6], output_transpose=True),
                                  dict(x_shape=[6, 6], perm=(0, 1))],
                         ids=["3-d input", "transpose read twice", "transpose an output", "not a transpose"])
def test_where_it_does_not_apply_nothing_changes(case):
    model = _graph(**case)
    before = model.SerializeToString()
    assert gemm_for_tied_head(model) == 0
    assert model.SerializeToString() == before
