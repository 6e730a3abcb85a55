"""``--pass fused-norm``: each RMSNorm (and the residual Add before it) as one ONNX Runtime kernel.

Applied to exports conftest already makes (no new trace): Qwen2 per-beam (decoder-only, prefill and step graphs)
and T5 (encoder-decoder: encoder and decoder norms).  Held to: every RMSNorm rewritten, the verification recorded
within the export's tolerance, generation token-identical to HF ``generate``, a wrong kernel (ε x 10⁴) refused
with nothing written, models without RMSNorm and fp16 refused in one line (``tests/test_fast_refusals.py``), engine
builds refused.
"""
from __future__ import annotations

import onnx
import pytest

from elx.exporter.verification.compare import compare
from elx.runners.errors import ElxError
from elx.runners.manifest import Manifest

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def qwen2_norm(qwen2_exports, tmp_path_factory):
    from elx.exporter.export import apply_passes

    return apply_passes(qwen2_exports["per-beam"], tmp_path_factory.mktemp("norm") / "qwen2", "fused-norm", quiet=True)


@pytest.fixture(scope="module")
def t5_norm(exported):
    return exported("t5", "fused-norm")


def _ops(manifest: Manifest, name: str) -> list[str]:
    return [n.op_type for n in onnx.load(str(manifest.graph_path(name)), load_external_data=False).graph.node]


@pytest.mark.parametrize("which", ["qwen2_norm", "t5_norm"])
def test_every_rms_norm_is_one_kernel_and_verified(which, request):
    manifest = Manifest.load(request.getfixturevalue(which))
    record = next(p for p in manifest.passes if p["name"] == "fused-norm")
    assert 0 < record["max_abs_logits_diff"] <= record["tolerance"]
    for name, counts in record["graphs"].items():
        ops = _ops(manifest, name)
        assert "Pow" not in ops and "Reciprocal" not in ops  # every traced RMSNorm went into a kernel
        fused = ops.count("SimplifiedLayerNormalization") + ops.count("SkipSimplifiedLayerNormalization")
        assert fused == counts["norms"] > 0 and ops.count("SkipSimplifiedLayerNormalization") == counts["with_residual"]
    if which == "qwen2_norm":  # two norms a layer and the final one, in the prefill and the step graph alike
        layers = manifest.dims["num_decoder_layers"]
        assert record["graphs"] == {g: {"norms": 2 * layers + 1, "with_residual": 2 * layers}
                                    for g in ("prefill", "decoder")}
    else:
        assert set(record["graphs"]) >= {"encoder", "decoder"}


@pytest.mark.parametrize("which", ["qwen2_norm", "t5_norm"])
def test_generation_is_hf_generate(which, request):
    for options in (dict(max_new_tokens=10), dict(num_beams=3, num_return_sequences=2, max_new_tokens=8)):
        report = compare(request.getfixturevalue(which), batch_size=3, input_length=7, seed=2, **options)
        assert report.all_identical, [(r.hf_tokens, r.elx_tokens) for r in report.rows if not r.identical]


def test_a_wrong_kernel_is_refused(qwen2_exports, tmp_path, monkeypatch):
    """The verification is what accepts the rewrite: the kernels given ε x 10⁴ are refused and nothing is written."""
    from elx.exporter.export import apply_passes
    from elx.exporter.passes import fused_norm

    real = fused_norm.find_norm

    def off(power):
        found = real(power)
        return None if found is None else (found[0], found[1] * 1e4, *found[2:])

    monkeypatch.setattr(fused_norm, "find_norm", off)
    with pytest.raises(ElxError, match="pass fused-norm.*exceeds"):
        apply_passes(qwen2_exports["per-beam"], tmp_path / "out", "fused-norm", quiet=True)
    assert not (tmp_path / "out").exists()


def test_engine_builds_refuse_the_export(qwen2_norm):
    from elx.exporter.tensorrt.build import build_engine

    with pytest.raises(ElxError, match="TensorRT has no layer for --pass fused-norm"):
        build_engine(qwen2_norm, quiet=True)
