"""``--pass fused-attention``: the step graph's attention as ONNX Runtime's GroupQueryAttention kernel.

Applied to conftest's per-beam exports (no new trace): Qwen2 (MHA, q/k/v biases) in CI, and a GQA Llama
(4 query heads over 2 key/value heads) exported per-beam here.  Held to: one kernel per layer, the
verification recorded within the fp32 tolerance, generation token-identical to HF ``generate`` (greedy and
beam search on a left-padded batch), a deliberately wrong kernel refused, and every combination it cannot
take refused in one line (the command line's refusals, before any heavy import: ``tests/test_fast_refusals.py``).
"""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elx.exporter.verification.compare import compare
from elx.runners.errors import ElxError
from elx.runners.manifest import Manifest
from tests.conftest import make_model_folder

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def fused(qwen2_exports, tmp_path_factory):
    from elx.exporter.export import apply_passes

    out = tmp_path_factory.mktemp("fused") / "qwen2"
    return apply_passes(qwen2_exports["per-beam"], out, "fused-attention", quiet=True)


@pytest.fixture(scope="module")
def llama16(tmp_path_factory):
    """A GQA Llama (4 query heads, 2 key/value heads of 16: RoPE goes into the kernel too; conftest's heads of 8 keep
    it traced, as Qwen2's above), exported per-beam."""
    from elx.exporter.export import export_model

    root = tmp_path_factory.mktemp("llama16")
    folder = make_model_folder(root / "models", "llama", head_dim=16)
    return export_model(str(folder), root / "per-beam", quiet=True, prompt_cache="per-beam")


@pytest.fixture(scope="module")
def llama_fused(llama16, tmp_path_factory):
    from elx.exporter.export import apply_passes

    return apply_passes(llama16, tmp_path_factory.mktemp("fused") / "llama", "fused-attention", quiet=True)


def _ops(folder):
    manifest = Manifest.load(folder)
    model = onnx.load(str(manifest.graph_path(manifest.step)), load_external_data=False)
    return manifest, [n.op_type for n in model.graph.node]


@pytest.mark.parametrize("which", ["fused", "llama_fused"])
def test_one_kernel_per_layer_and_the_verification_recorded(which, request):
    manifest, ops = _ops(request.getfixturevalue(which))
    layers = manifest.dims["num_decoder_layers"]
    assert ops.count("GroupQueryAttention") == layers
    assert "Softmax" not in ops  # every attention core went into the kernel
    rotary = which == "llama_fused"  # heads of 16 and Llama 3's (static) scaling; Qwen2's heads of 8: RoPE as traced
    assert ("Neg" in ops) is not rotary
    record = next(p for p in manifest.data["passes"] if p["name"] == "fused-attention")
    assert record["layers"] == layers and record["op"] == "com.microsoft.GroupQueryAttention"
    assert (record["num_heads"], record["kv_num_heads"]) == (manifest.dims["num_heads"], manifest.dims["num_kv_heads"])
    assert record["step_nodes"]["after"] < record["step_nodes"]["before"]
    assert record["rotary_positions"] == (128 if rotary else None) and manifest.dims["max_position_embeddings"] == 128
    assert 0 < record["max_abs_logits_diff"] <= record["tolerance"]
    prefill = onnx.load(str(manifest.graph_path("prefill")), load_external_data=False)
    assert "GroupQueryAttention" not in {n.op_type for n in prefill.graph.node}  # the prompt's graph as traced


@pytest.mark.parametrize("which", ["fused", "llama_fused"])
@pytest.mark.parametrize("options", [dict(max_new_tokens=12),
                                     dict(num_beams=3, num_return_sequences=2, max_new_tokens=10)])
def test_generation_is_hf_generate(which, options, request):
    """A left-padded batch (rows of different lengths): the kernel's bias must mask the padding as the graph did."""
    report = compare(request.getfixturevalue(which), batch_size=3, input_length=9, seed=4, **options)
    assert report.all_identical, [(r.hf_tokens, r.elx_tokens) for r in report.rows if not r.identical]
    assert report.max_logits_diff <= report.atol


@pytest.mark.parametrize("wrong", ["scale", "rotary"])
def test_a_wrong_kernel_is_refused(wrong, qwen2_exports, tmp_path, monkeypatch, request):
    """The verification is what accepts the rewrite: the kernel given a wrong scale (x 1.01), or RoPE tables one
    position off, is refused and nothing is written."""
    from elx.exporter.export import apply_passes
    from elx.exporter.passes import fused_attention

    if wrong == "scale":
        real = fused_attention.find_core

        def off(*args):
            core = real(*args)
            core.scale *= 1.01
            return core

        monkeypatch.setattr(fused_attention, "find_core", off)
    else:  # Qwen2's heads of 8 keep RoPE as traced: this case needs heads of 16
        qwen2_exports = {"per-beam": request.getfixturevalue("llama16")}
        tables = fused_attention.rotary_tables
        monkeypatch.setattr(fused_attention, "rotary_tables",
                            lambda *args: [np.roll(t, 1, axis=0) for t in tables(*args)])
    with pytest.raises(ElxError, match="pass fused-attention.*exceeds"):
        apply_passes(qwen2_exports["per-beam"], tmp_path / "out", "fused-attention", quiet=True)
    assert not (tmp_path / "out").exists()


@settings(max_examples=4, deadline=None, derandomize=True, database=None)
@given(beams=st.integers(1, 5), batch=st.integers(1, 4), width=st.integers(2, 12), new=st.integers(1, 14),
       seed=st.integers(0, 2 ** 16))
def test_drawn_settings_are_hf_generate(llama_fused, beams, batch, width, new, seed):
    options = {"max_new_tokens": new, "num_beams": beams}
    if beams > 1:
        options["num_return_sequences"] = 1 + seed % beams
    report = compare(llama_fused, batch_size=batch, input_length=width, seed=seed, **options)
    assert report.all_identical, [(r.hf_tokens, r.elx_tokens) for r in report.rows if not r.identical]


def test_a_run_past_the_rotary_tables_is_refused(llama_fused):
    """The kernel's RoPE tables hold max_position_embeddings (128) positions: a longer run is refused in one line
    before it starts (ONNX Runtime would stop at the first position past them)."""
    from elx.runners.generate import Generator

    generator = Generator.from_folder(llama_fused)
    ids = np.array([[5, 6, 7, 8]], dtype=np.int64)
    assert generator.generate(input_ids=ids, max_new_tokens=120).sequences.shape[1] <= 124
    with pytest.raises(ElxError, match="RoPE tables for 128"):
        generator.generate(input_ids=ids, max_new_tokens=130)


def test_a_shared_prompt_cache_is_refused(qwen2_exports, tmp_path):
    from elx.exporter.export import apply_passes

    with pytest.raises(ElxError, match="--prompt-cache per-beam"):
        apply_passes(qwen2_exports["shared"], tmp_path / "out", "fused-attention", quiet=True)
    assert not (tmp_path / "out").exists()


def test_gpu_backends_refuse_the_export(fused):
    from elx.runners.generate import make_backend

    manifest = Manifest.load(fused)
    for backend, device in (("ort", "cuda"), ("ort-io", "cuda"), ("tensorrt", "cuda")):
        with pytest.raises(ElxError, match="run it on the CPU"):
            make_backend(manifest, backend=backend, device=device)


def test_engine_builds_refuse_the_export(fused):
    from elx.exporter.tensorrt.build import build_engine

    with pytest.raises(ElxError, match="TensorRT has no layer"):
        build_engine(fused, quiet=True)
    assert json.loads((fused / "manifest.json").read_text())["passes"][-1]["name"] == "fused-attention"
