"""One trace instead of torch.onnx's two (``exporter/capture/one_pass.py``, issue 41).

A graph traced in one pass straight to ATen IR must hold the same operators and compute the same numbers as the
graph torch.onnx's standard two passes give, and a one pass that fails must leave the standard trace to run.  Every
export of the suite runs the one pass and is verified against PyTorch; these tests check that the one pass is what
ran, and the fallback.  No timing is asserted.
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest


@pytest.fixture(scope="module")
def qwen3():
    """Tied head (a weight with two names), q/k norms, GQA, RoPE: the decoder-only pieces in one small model."""
    import torch

    from elx.exporter.families.catalog import family_for_architecture
    from tests.conftest import BUILDERS

    torch.manual_seed(0)
    model = BUILDERS["qwen3"]().eval()
    return model, family_for_architecture(type(model).__name__)


def _traced(spec, monkeypatch, fail_one_pass: bool):
    """``trace(spec)`` with ``torch.export._trace._export`` watched: the ``pre_dispatch`` of each call (True: the
    standard capture, whose ``run_decompositions`` traces again; False: the one pass)."""
    from torch.export import _trace

    from elx.exporter.capture.onnx_export import trace

    calls, standard = [], _trace._export

    def watched(*args, pre_dispatch=False, **kwargs):
        calls.append(pre_dispatch)
        if fail_one_pass and not pre_dispatch:
            raise RuntimeError("the one pass fails here")
        return standard(*args, pre_dispatch=pre_dispatch, **kwargs)

    monkeypatch.setattr(_trace, "_export", watched)
    model = trace(spec)
    monkeypatch.setattr(_trace, "_export", standard)
    return model, calls


def _run(model, feeds):
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def test_one_pass_runs_and_its_graph_computes_what_the_two_pass_graph_computes(qwen3, monkeypatch):
    """The prefill graph of a 2-layer Qwen3, traced in one pass, then with the one pass failing (the standard two
    passes run instead): same operators, the same outputs bit for bit on prompts of other shapes than the trace's."""
    import torch

    from elx.exporter.capture.decoder_only import _prefill_spec

    model, family = qwen3
    monkeypatch.setenv("ELX_ONE_PASS_TRACE", "1")
    one, one_calls = _traced(_prefill_spec(model, family), monkeypatch, fail_one_pass=False)
    two, two_calls = _traced(_prefill_spec(model, family), monkeypatch, fail_one_pass=True)
    assert one_calls == [False], one_calls
    # the one pass failed, then the standard capture ran (torch.onnx's strict strategy may run between)
    assert two_calls[0] is False and two_calls[-1] is True and all(two_calls[1:]), two_calls

    assert Counter(n.op_type for n in one.graph.node) == Counter(n.op_type for n in two.graph.node)
    assert [o.name for o in one.graph.output] == [o.name for o in two.graph.output]
    generator = torch.Generator().manual_seed(1)
    for batch, width in ((1, 5), (3, 9)):
        ids = torch.randint(3, model.config.vocab_size, (batch, width), generator=generator).numpy()
        mask = np.ones((batch, width), dtype=np.int64)
        mask[1:, :2] = 0
        positions = np.maximum(mask.cumsum(-1) - 1, 0) * mask
        feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": positions}
        for a, b in zip(_run(one, feeds), _run(two, feeds)):
            assert a.shape == b.shape
            np.testing.assert_array_equal(a, b)


def test_the_standard_trace_when_the_one_pass_is_off(qwen3, monkeypatch):
    """``ELX_ONE_PASS_TRACE=0``: torch.onnx's two passes, as before (the escape hatch and the measurements' baseline)."""
    from elx.exporter.capture import one_pass

    monkeypatch.setenv("ELX_ONE_PASS_TRACE", "0")
    assert not one_pass.enabled()
    with one_pass.aten_in_one_trace() as traced:
        import torch.export

        from torch.onnx._internal.exporter import _fx_passes
        assert torch.export.export.__module__ == "torch.export"
        assert _fx_passes.decompose_with_registry.__module__.endswith("_fx_passes")
    assert traced == []
