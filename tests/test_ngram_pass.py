"""``--pass ngram=N``: blocking inside the decoder graph (ONNX Runtime node), HF-identical generation."""
from __future__ import annotations

import shutil

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elx.runners.errors import ElxError
from elx.exporter.plugins.ngram import ORT_DOMAIN, ort_node
from elx.runners.search.ngram_reference import block_ngrams
from elx.exporter.verification.compare import compare
from elx.runners.manifest import Manifest


def _ort_session(n: int):
    import onnxruntime as ort
    from onnx import TensorProto, helper

    spec = ort_node(n)
    node = helper.make_node(spec.op_type, ["ids", "scores"], ["out"], domain=spec.domain, **spec.attrs)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["r", "l"]),
                                            helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["r", "v"])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["r", "v"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(ORT_DOMAIN, 1)],
                              ir_version=9)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


_SESSIONS = {}


@settings(max_examples=150, deadline=None)
@given(n=st.integers(1, 5), rows=st.integers(1, 5), length=st.integers(1, 40), alphabet=st.integers(2, 8),
       vocab=st.integers(8, 40), seed=st.integers(0, 2**31))
def test_ort_node_equals_reference(n, rows, length, alphabet, vocab, seed):
    rng = np.random.default_rng(seed)
    history = rng.integers(0, alphabet, size=(rows, length), dtype=np.int64)
    scores = rng.standard_normal((rows, vocab)).astype(np.float32)
    session = _SESSIONS.setdefault(n, _ort_session(n))
    out = session.run(None, {"ids": history, "scores": scores})[0]
    np.testing.assert_array_equal(out, block_ngrams(history, scores, n))


@pytest.mark.parametrize("family,passes,n", [("t5", "el,ngram=3", 3), ("bart", "ngram=2", 2)])
def test_graph_blocking_is_hf_identical(exported, family, passes, n, monkeypatch):
    from elx.runners.search import processors

    def host_blocking_must_not_run(self, tokens, scores):
        raise AssertionError("the runner blocked n-grams on the host although the graph does it")

    monkeypatch.setattr(processors.NoRepeatNGram, "__call__", host_blocking_must_not_run)
    folder = exported(family, passes)
    manifest = Manifest.load(folder)
    record = manifest.passes[-1]
    assert record["name"] == "ngram" and record["ngram_size"] == n and record["max_abs_logits_diff"] <= 1e-4
    assert sum(s["banned"] for s in record["shapes"]) > 0  # verification saw real bans
    for options in (dict(max_new_tokens=14), dict(num_beams=4, num_return_sequences=2, max_new_tokens=14),
                    dict(num_beams=3, early_stopping=True, max_new_tokens=12)):
        report = compare(folder, batch_size=3, input_length=10, seed=2, no_repeat_ngram_size=n, **options)
        assert report.all_identical, [(r.hf_tokens, r.elx_tokens) for r in report.rows if not r.identical]


@pytest.mark.parametrize("asked", [None, 0, 2, 4])
def test_run_gets_the_ngram_size_it_asks(exported, asked):
    """Issue 10: an ngram=3 export blocked 3-grams whatever the run asked.  Now the manifest says what the
    graph does, and a run asking another size (or none) reads the plain logits and blocks on the host."""
    folder = exported("t5", "el,ngram=3")
    step = Manifest.load(folder).graphs["decoder"]
    assert step["blocked"] == {"output": "log_probs", "ngram_size": 3, "log_softmax": True}
    assert step["logits"] == "logits" and {"logits", "log_probs"} <= set(step["outputs"])
    options = {} if asked is None else {"no_repeat_ngram_size": asked}
    for beams in (1, 4):
        report = compare(folder, batch_size=3, input_length=10, seed=2, num_beams=beams, max_new_tokens=14, **options)
        assert report.all_identical, [(r.hf_tokens, r.elx_tokens) for r in report.rows if not r.identical]
    if asked in (None, 0):  # the case that exposed the bug: without blocking the random model repeats itself
        tokens = [t for r in report.rows for t in zip(r.hf_tokens, r.hf_tokens[1:], r.hf_tokens[2:])]
        assert len(tokens) > len(set(tokens))


def test_tensorrt_sibling_graph(exported):
    folder = exported("bart", "ngram=2")
    step = Manifest.load(folder).graphs["decoder"]
    trt = onnx.load(str(folder / step["tensorrt_file"]))
    node = next(n for n in trt.graph.node if n.op_type == "NGramRepeatBlock")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert node.domain == "" and attrs == {"ngram_size": 2, "plugin_version": b"1", "plugin_namespace": b""}
    ort_graph = onnx.load(str(folder / step["file"]))
    assert any(n.op_type == "NGramRepeatBlock" and n.domain == ORT_DOMAIN for n in ort_graph.graph.node)
    assert step["inputs"]["decoder_input_ids_history"]["from"] == "step:history"


@pytest.mark.parametrize("argument,match", [(None, "n-gram size"), ("x", "n-gram size"), ("0", ">= 1")])
def test_bad_ngram_argument(tmp_path, exported, argument, match):
    from elx.exporter.passes import ngram

    folder = tmp_path / "f"
    shutil.copytree(exported("bart"), folder)
    with pytest.raises(ElxError, match=match):
        ngram.apply(folder, Manifest.load(folder), argument)


def test_ngram_twice_is_refused(tmp_path, exported):
    from elx.exporter.passes import ngram

    folder = tmp_path / "f"
    shutil.copytree(exported("bart", "ngram=2"), folder)
    with pytest.raises(ElxError, match="already applied"):
        ngram.apply(folder, Manifest.load(folder), "2")
