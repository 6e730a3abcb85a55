"""TensorRT engines built on this machine: TensorRT for RTX builds ahead of time, no GPU needed.

Real builds (tiny T5 and BART exports, baseline and ``el``, fp32 and fp16, n-gram plugin and host
blocking) for one compute capability (8.6) and small profiles.  TensorRT for RTX cannot deserialize an
engine without a GPU (``IRuntime::deserializeCudaEngine: cudaError 35``), so the IO tensors and
profile shapes checked against the manifest are those the build process read back from the parsed
network and the optimization profile; the backend checks the deserialized engines against the same
record on a GPU (tests/test_tensorrt_backend.py).  Tests that need TensorRT for RTX skip without it;
the profile and rewrite checks run everywhere.
"""
from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from elx.exporter.tensorrt import build as tensorrt_build
from elx.exporter.tensorrt import ngram as tensorrt_ngram
from elx.exporter.precision.fp16 import to_fp16
from elx.exporter.tensorrt.profiles import Limits, axis_ranges, input_profiles
from elx.runners.errors import ElxError
from elx.runners.manifest import Manifest
from elx.runners.backends.tensorrt_engines import check_shapes, section

HAVE_RTX = importlib.util.find_spec("tensorrt_rtx") is not None
needs_rtx = pytest.mark.skipif(not HAVE_RTX, reason="tensorrt_rtx is not installed (pip install 'elx[tensorrt]')")
CC = "8.6"
LIMITS = dict(max_batch_size=2, max_beams=3, max_input_length=16, max_new_tokens=6)


def _copy(folder: Path, tmp_path: Path, name: str) -> Path:
    target = tmp_path / name
    shutil.copytree(folder, target)
    return target


def _build(folder: Path, **options) -> Path:
    return tensorrt_build.build_engine(folder, compute_capabilities=[CC], quiet=True, **{**LIMITS, **options})


def _expected_profile(shape: list, axes: dict) -> list:
    return [[axes[d][i] if isinstance(d, str) else d for d in shape] for i in range(3)]


def _check_engines(folder: Path, precision: str = "fp32") -> dict:
    """Every graph the runner runs has an engine whose IO and profiles match the manifest."""
    manifest = Manifest.load(folder)
    engines = section(manifest)  # also checks build id, files and sources against the folder
    assert engines["runtime"] == "tensorrt_rtx" and engines["runtime_version"].startswith("1.7")
    assert engines["precision"] == precision and engines["tf32"] is False
    assert engines["compute_capabilities"] == [CC] and engines["limits"] == LIMITS
    axes = engines["axes"]
    assert axes["batch"] == [1, 2, 2] and axes["rows"] == [1, 6, 6] and axes["encoder_sequence"] == [1, 8, 16]
    assert axes["past_sequence"][0] == 0 and axes["past_sequence"][2] == 6 + 3
    assert sorted(engines["graphs"]) == sorted([*manifest.stages, manifest.step])
    for name in [*manifest.stages, manifest.step]:
        graph, built = manifest.graphs[name], engines["graphs"][name]
        plan = folder / built["file"]
        assert plan.is_file() and plan.stat().st_size == built["bytes"] > 0
        assert built["source"] in (graph["file"], graph.get("tensorrt_file"))
        wanted_inputs = {n: s for n, s in graph["inputs"].items() if n in built["inputs"]}
        ngram = (engines.get("ngram") or {}) if name == manifest.step else {}
        removed, removed_out = ngram.get("removed_inputs", []), ngram.get("removed_outputs", [])
        assert sorted(built["inputs"]) == sorted(n for n in graph["inputs"] if n not in removed)
        for n, spec in wanted_inputs.items():
            got = built["inputs"][n]
            assert got["dtype"] == spec["dtype"], (name, n)
            assert got["profiles"] == [_expected_profile(spec["shape"], axes)], (name, n)
            assert [d if isinstance(d, int) else -1 for d in spec["shape"]] == got["shape"], (name, n)
        outputs = {n: o for n, o in graph["outputs"].items() if n not in removed_out}
        assert list(built["outputs"]) == list(outputs)
        assert {n: o["dtype"] for n, o in built["outputs"].items()} == {n: o["dtype"] for n, o in outputs.items()}
    assert not [p.name for p in folder.iterdir() if p.name.startswith(".")], "temporary files left behind"
    assert json.loads((folder / "engines" / "build.json").read_text())["build_id"] == engines["build_id"]
    return engines


# -- no TensorRT needed ------------------------------------------------------------------------
def test_profiles_cover_the_axes_the_runner_feeds(exported):
    manifest = Manifest.load(exported("t5"))
    axes = axis_ranges(manifest, Limits(**LIMITS))
    assert axes["decoder_sequence"] == [1, 1, 4] and axes["history_length"] == [1, 5, 10]
    decoder = input_profiles(manifest, manifest.step, axes)
    past = decoder["past_key_values.0.decoder.key"]
    assert past["axes"] == ["rows", 4, "past_sequence", 8]
    assert past["profiles"] == [[[1, 4, 0, 8], [6, 4, 5, 8], [6, 4, 9, 8]]]
    assert decoder["input_ids"]["profiles"] == [[[1, 1], [6, 1], [6, 4]]]
    with pytest.raises(ElxError, match="max-beams must be a positive integer"):
        Limits(max_beams=0).checked()


def test_shape_outside_the_profiles_names_the_axis_and_range():
    spec = {"inputs": {"past": {"dtype": "float32", "axes": ["rows", 4, "past_sequence", 8],
                                "profiles": [[[1, 4, 0, 8], [6, 4, 5, 8], [6, 4, 9, 8]]]}}}
    assert check_shapes("decoder", spec, {"past": (6, 4, 9, 8)}) == 0
    with pytest.raises(ElxError) as err:
        check_shapes("decoder", spec, {"past": (6, 4, 10, 8)})
    message = str(err.value)
    assert "\n" not in message
    assert "'past_sequence' is 10, outside the engine's built range 0..9" in message and "--max-new-tokens" in message
    with pytest.raises(ElxError, match="axis 'rows' is 7, outside the engine's built range 1..6; .*--max-beams"):
        check_shapes("decoder", spec, {"past": (7, 4, 3, 8)})
    with pytest.raises(ElxError, match="rank 3, the engine takes rank 4"):
        check_shapes("decoder", spec, {"past": (6, 4, 3)})


def test_fp16_rule_keeps_t5_feed_forward_output_in_fp32(exported):
    manifest = Manifest.load(exported("t5"))
    model = onnx.load(str(manifest.graph_path(manifest.step)))
    converted, counts = to_fp16(model, "t5", manifest.dims)
    layers = manifest.dims["num_decoder_layers"]
    assert counts["fp32: T5 feed-forward output (wo)"] == layers
    half = {t.name for t in converted.graph.initializer if t.data_type == onnx.TensorProto.FLOAT16}
    matmuls = [n for n in converted.graph.node if n.op_type == "MatMul"]
    kept = [n for n in matmuls if any(t.name == n.input[1] and t.data_type == onnx.TensorProto.FLOAT
                                      for t in converted.graph.initializer)]
    # the kept weight MatMuls reduce over d_ff (64 in the tiny config), the others over 32 or 8
    assert len(kept) == layers and all(
        next(t for t in converted.graph.initializer if t.name == n.input[1]).dims[0] == 64 for n in kept)
    assert counts["fp16: weight MatMul"] == sum(1 for n in matmuls if n.input[1] in half)
    io = {i.name: i.type.tensor_type.elem_type for i in [*converted.graph.input, *converted.graph.output]}
    assert onnx.TensorProto.FLOAT16 not in io.values()  # the engine's IO stay as the manifest says


def test_no_tensorrt_is_a_one_line_error(monkeypatch):
    from elx.runners.backends import tensorrt_runtime

    monkeypatch.setattr(tensorrt_runtime, "_try_import", lambda name: None)
    with pytest.raises(ElxError, match=r"pip install tensorrt-rtx-cu13==1\.7\.1\.116"):
        tensorrt_runtime.resolve("auto")
    with pytest.raises(ElxError, match="TensorRT for RTX is not installed .*tensorrt-rtx-cu13"):
        tensorrt_runtime.resolve("tensorrt-rtx")
    with pytest.raises(ElxError, match="unknown TensorRT runtime 'onnx'"):
        tensorrt_runtime.resolve("onnx")


# -- real builds with TensorRT for RTX -----------------------------------------------------------
@needs_rtx
@pytest.mark.parametrize("family,passes", [("t5", None), ("t5", "el"), ("bart", None)])
def test_every_graph_builds_and_matches_the_manifest(exported, tmp_path, family, passes):
    folder = _copy(exported(family, passes), tmp_path, "export")
    assert _build(folder) == folder / "engines"
    engines = _check_engines(folder)
    assert "ngram" not in engines and "fp16" not in engines
    assert ("cross_kv" in engines["graphs"]) == (passes is None)


@needs_rtx
def test_cli_builds_bart_el_and_rebuilds_in_place(exported, tmp_path):
    folder = _copy(exported("bart", "el"), tmp_path, "bart-el")
    args = [sys.executable, "-m", "elx.cli", "build-engine", str(folder), "--max-batch-size", "2", "--max-beams", "3",
            "--max-input-length", "16", "--max-new-tokens", "6", "--compute-capability", CC, "--quiet"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"wrote {folder / 'engines'}"
    first = _check_engines(folder)
    _build(folder)  # again, through the Python API: the new engines replace the old ones
    second = _check_engines(folder)
    assert second["build_id"] != first["build_id"]
    # a manifest and an engines folder of different builds are refused, as are changed graphs
    (folder / "engines" / "build.json").write_text(json.dumps({"build_id": first["build_id"]}))
    with pytest.raises(ElxError, match="does not match manifest.json"):
        section(Manifest.load(folder))
    (folder / "engines" / "build.json").write_text(json.dumps({"build_id": second["build_id"]}))
    with open(folder / "decoder.el.onnx", "ab") as f:
        f.write(b"\0")
    with pytest.raises(ElxError, match="built from another decoder.el.onnx"):
        section(Manifest.load(folder))


@needs_rtx
def test_fp16_engines_keep_fp32_where_decided(exported, tmp_path):
    folder = _copy(exported("t5"), tmp_path, "t5-fp16")
    _build(folder, precision="fp16")
    engines = _check_engines(folder, precision="fp16")
    report = engines["fp16"]
    layers = Manifest.load(folder).dims["num_decoder_layers"]
    assert report["graphs"]["decoder"]["fp32: T5 feed-forward output (wo)"] == layers
    assert report["graphs"]["cross_kv"] == {"fp16: weight MatMul": 2 * layers}
    check = report["verification"]
    assert 0 < check["max_abs_logits_diff"] and check["relative_diff"] <= check["relative_tolerance"]


@needs_rtx
def test_unsupported_op_names_the_node_and_leaves_the_folder_alone(exported, tmp_path):
    folder = _copy(exported("t5", "el"), tmp_path, "t5-bad")
    path = folder / "decoder.el.onnx"
    model = onnx.load(str(path))
    relu = next(n for n in model.graph.node if n.op_type == "Relu")
    relu.op_type, relu.domain = "ElxNoSuchOp", "elx.test"
    model.opset_import.append(onnx.helper.make_opsetid("elx.test", 1))
    onnx.save(model, str(path))
    before = sorted(p.name for p in folder.iterdir())
    manifest_before = (folder / "manifest.json").read_text()
    with pytest.raises(ElxError) as err:
        _build(folder)
    message = str(err.value)
    assert "\n" not in message
    assert f"node {relu.name!r} (op ElxNoSuchOp) is not supported" in message and "decoder.el.onnx" in message
    assert sorted(p.name for p in folder.iterdir()) == before
    assert (folder / "manifest.json").read_text() == manifest_before


@needs_rtx
@pytest.mark.skipif(shutil.which("nvcc") is None and not Path("/usr/local/cuda/bin/nvcc").exists(),
                    reason="nvcc is needed to compile the n-gram kernel shipped with the engines")
def test_ngram_blocking_in_the_engine_then_on_the_host(exported, tmp_path, monkeypatch):
    folder = _copy(exported("bart", "ngram=2"), tmp_path, "bart-ngram")  # the export test_ngram_pass uses
    _build(folder, ngram="engine")
    engines = _check_engines(folder)
    record = engines["ngram"]
    assert record["size"] == 2 and record["blocking"] == "engine" and "IPluginV3" in record["plugin"]
    assert (folder / record["library"]).is_file()
    assert engines["graphs"]["decoder"]["source"] == "decoder.ngram.tensorrt.onnx"
    assert "decoder_input_ids_history" in engines["graphs"]["decoder"]["inputs"]

    # the kernel cannot be built: auto keeps the blocking on the host and says so; "engine" refuses
    def no_nvcc(*args, **kwargs):
        raise ElxError("cannot build the n-gram kernel library: nvcc not found")

    monkeypatch.setattr(tensorrt_ngram, "compiled_library", no_nvcc)
    with pytest.raises(ElxError, match="n-gram blocking cannot go into the engine: .*nvcc not found"):
        _build(folder, ngram="engine")
    assert section(Manifest.load(folder))["build_id"] == engines["build_id"]  # untouched by the failure
    _build(folder)
    host = _check_engines(folder)
    record = host["ngram"]
    assert record["blocking"] == "host" and "nvcc not found" in record["reason"]
    assert record["removed_inputs"] == ["decoder_input_ids_history"]
    assert record["verification"]["max_abs_logits_diff"] <= record["verification"]["tolerance"]
    assert "decoder_input_ids_history" not in host["graphs"]["decoder"]["inputs"]
    assert not (folder / "engines" / "libelx_ngram_kernel.so").exists()
    outputs = list(host["graphs"]["decoder"]["outputs"])  # plain logits only: the host blocks, as HF does
    assert outputs[0] == "logits" and "log_probs" not in outputs


def test_stripped_decoder_plus_host_blocking_equals_the_export(exported, tmp_path):
    """The host-blocking graph (no TensorRT needed to check it): the export's plain logits, nothing blocked."""
    manifest = Manifest.load(exported("bart", "ngram=2"))
    step = manifest.graphs[manifest.step]
    stripped = tensorrt_ngram.strip_blocking(manifest.folder / step["file"], tmp_path / "host.onnx")
    model = onnx.load(str(stripped))
    assert not [n for n in model.graph.node if n.op_type == "NGramRepeatBlock"]
    assert not [n for n in model.graph.node if n.op_type == "LogSoftmax"]
    assert "decoder_input_ids_history" not in [i.name for i in model.graph.input]
    assert [o.name for o in model.graph.output][0] == "logits" and "log_probs" not in [o.name for o in model.graph.output]
    check = tensorrt_ngram.verify_stripped(manifest, stripped, 2)
    assert check["max_abs_logits_diff"] <= 1e-5
    assert np.isfinite(check["max_abs_logits_diff"])
