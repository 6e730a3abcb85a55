"""fp16 and int8 exports of decoder-only models (GPT-2 and Llama with GQA and Llama 3's rotary scaling).

The precision folders are the session's fp32 exports (``exported``), converted and checked by the same code
``elx export --precision fp16|int8`` runs after its passes (``Fp16Export``, ``precision_int8_export.finish``): no
second trace.  One end-to-end ``elx export --precision fp16`` of GPT-2 runs through the command line.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from elx.exporter.verification.compare import compare, export_tolerance, format_report
from elx.exporter.precision.fp16 import gemms_to_matmuls
from elx.exporter.precision.fp16_check import UNIT_ROUNDOFF, fp16_depth
from elx.exporter.progress import Progress
from elx.runners.errors import ElxError
from elx.runners.generate import Generator
from elx.runners.inputs.random_inputs import random_inputs
from elx.runners.manifest import Manifest

pytestmark = pytest.mark.usefixtures("one_torch_thread")
FAMILIES = ("gpt2", "llama")
ONNX_DTYPES = {TensorProto.FLOAT: "float32", TensorProto.FLOAT16: "float16", TensorProto.INT64: "int64"}
_FOLDERS = {}


def _weight_matmuls_per_layer(family: str) -> int:
    return {"gpt2": 4, "llama": 7}[family]  # GPT-2: c_attn, c_proj, c_fc, mlp c_proj; Llama: q k v o gate up down


def _torch_model(model_folders, family):
    from elx.exporter.source.load import resolve_model

    return resolve_model(str(model_folders[family])).model


@pytest.fixture(scope="module")
def converted(exported, model_folders, tmp_path_factory):
    """``converted(family, precision)`` → the fp32 export converted as ``elx export --precision`` converts it."""
    from elx.exporter.export import finish_folder
    from elx.exporter.precision.fp16_export import fp16_checks
    from elx.exporter.precision.int8_export import finish

    def get(family: str, precision: str):
        key = (family, precision)
        if key not in _FOLDERS:
            folder = tmp_path_factory.mktemp(precision) / family
            shutil.copytree(exported(family), folder)
            manifest = Manifest.load(folder)
            model = _torch_model(model_folders, family)
            progress = Progress("test", progress="none")
            if precision == "fp16":
                with fp16_checks("fp16", model, manifest, progress) as fp16:
                    fp16.finish(folder, manifest)
            else:
                finish(model, folder, manifest, progress)
            finish_folder(folder, manifest, progress)
            _FOLDERS[key] = folder
        return _FOLDERS[key]

    return get


def _generate(folder, options: dict):
    generator = Generator.from_folder(folder)
    inputs = random_inputs(generator.manifest, 2, 7, np.random.default_rng(3))
    return generator.generate(inputs, track_memory=True, **options)


@pytest.mark.parametrize("family", FAMILIES)
def test_decoder_only_fp16_export(exported, converted, family):
    """Every weight MatMul in fp16 (GPT-2's Conv1D Gemms included), the prompt K/V and the cache fp16, both
    first-step and step scores fp32; checked against PyTorch within D·u in both modes; half the cache bytes."""
    manifest = Manifest.load(converted(family, "fp16"))
    data = manifest.data
    assert data["precision"] == "fp16" and data["stages"] == ["prefill"]
    layers = manifest.dims["num_decoder_layers"]
    for name in ("prefill", "decoder"):
        spec = manifest.graphs[name]
        model = onnx.load(str(manifest.graph_path(name)), load_external_data=False)
        for values, declared in ((model.graph.input, spec["inputs"]), (model.graph.output, spec["outputs"])):
            assert {v.name: ONNX_DTYPES[v.type.tensor_type.elem_type] for v in values} == \
                {n: s["dtype"] for n, s in declared.items()}
        assert spec["outputs"]["logits"]["dtype"] == "float32"  # first_step_scores and the step's logits
        assert all(s["dtype"] == "float16" for n, s in spec["outputs"].items() if n.startswith("present."))
        # before Gemms were rewritten, GPT-2 had one fp16 MatMul (the LM head) and D = 1
        assert data["fp16"]["graphs"][name]["fp16: weight MatMul"] == _weight_matmuls_per_layer(family) * layers + 1
        assert not any(n.op_type == "Gemm" for n in model.graph.node)
    step = manifest.graphs["decoder"]["inputs"]
    assert all(step[n]["dtype"] == "float16" for n in step if n.startswith(("prompt_key_values.", "past_key_values.")))
    assert all(e["dtype"] == "float16" for e in manifest.cache_entries)
    for mode in ("runtime", "fp16_arithmetic"):
        check = data["verification"]["fp16"][mode]
        assert 0 < check["relative_diff"] <= check["relative_tolerance"] == check["fp16_depth"] * UNIT_ROUNDOFF
        assert [s["past"] for s in check["shapes"]] == [0, 4, 1, 7, 3]  # each side filled its own cache
    assert data["verification"]["fp16"]["fp16_arithmetic"]["fp16_depth"] == fp16_depth(manifest) >= 2 * layers
    options = dict(num_beams=3, max_new_tokens=5, min_new_tokens=5)
    out16, out32 = _generate(manifest.folder, options), _generate(exported(family), options)
    mask = 2 * 7 * 8  # the shared prompt's attention mask stays int64
    assert len(out16.memory) == len(out32.memory) == 5
    for m16, m32 in zip(out16.memory, out32.memory):
        assert m16["cache_bytes"] * 2 == m32["cache_bytes"] and (m16["state_bytes"] - mask) * 2 == m32["state_bytes"] - mask


@pytest.mark.parametrize("family", FAMILIES)
def test_decoder_only_fp16_compare_uses_the_fp16_rule(converted, family):
    folder = converted(family, "fp16")
    report = compare(folder, batch_size=3, input_length=6, num_beams=2, max_new_tokens=5)
    assert report.atol == export_tolerance(Manifest.load(folder)) > 1e-4 and report.passed, report.problems
    assert 0 < report.max_logits_diff <= report.atol


def test_prefix_torch_side_matches_the_fp32_export(exported, model_folders):
    """The fp16 checks' PyTorch side (prompt, prefix and token in one forward) against the fp32 export filling
    its own cache: the fp32 tolerance, so a wrong mask or position in the side would show."""
    from elx.exporter.precision.decoder_only import DecoderOnlyPrefixTorchSide
    from elx.exporter.verification.verify import DECODER_ONLY_SHAPES, RuntimeSide, measure

    manifest = Manifest.load(exported("llama"))
    side = DecoderOnlyPrefixTorchSide(_torch_model(model_folders, "llama"), manifest)
    report = measure(side, RuntimeSide(manifest, prefill=True), manifest, DECODER_ONLY_SHAPES)
    assert report["max_abs_logits_diff"] <= report["tolerance"]
    assert max(s["past"] for s in report["shapes"]) == 7


def test_decoder_only_fp16_refuses_a_broken_conversion(exported, model_folders, tmp_path, monkeypatch):
    """LM head weights off by 2% after conversion: refused by the D·u check, the folder left as it was."""
    from elx.exporter.precision import fp16_export as precision_export
    from elx.exporter.precision.fp16_export import fp16_checks

    convert = precision_export.to_fp16

    def broken(model, family, dims, boundary):
        model, counts = convert(model, family, dims, boundary)
        for tensor in model.graph.initializer:
            if tensor.data_type == TensorProto.FLOAT16 and tensor.dims[-1] == dims["vocab_size"]:
                value = numpy_helper.to_array(tensor) * np.float16(1.02)
                tensor.CopyFrom(numpy_helper.from_array(value.astype(np.float16), tensor.name))
        return model, counts

    monkeypatch.setattr(precision_export, "to_fp16", broken)
    manifest = Manifest.load(exported("gpt2"))
    with pytest.raises(ElxError, match=r"fp16 baseline vs PyTorch .*relative .* > D·u"):
        with fp16_checks("fp16", _torch_model(model_folders, "gpt2"), manifest, Progress("t", progress="none")):
            pass


def _gemm_model(trans_b: int, alpha: float = 1.0, bias: bool = True) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((5, 3) if trans_b else (3, 5)).astype(np.float32)
    inputs = ["x", "w"] + (["b"] if bias else [])
    inits = [numpy_helper.from_array(weight, "w")]
    if bias:
        inits.append(numpy_helper.from_array(rng.standard_normal(5).astype(np.float32), "b"))
    node = helper.make_node("Gemm", inputs, ["y"], transB=trans_b, alpha=alpha)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 5])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize(("trans_b", "alpha", "bias", "rewritten"),
                         [(0, 1.0, True, 1), (1, 1.0, True, 1), (0, 1.0, False, 1), (0, 0.5, True, 0)])
def test_gemms_to_matmuls_computes_the_same(trans_b, alpha, bias, rewritten):
    import onnxruntime as ort

    x = np.random.default_rng(1).standard_normal((4, 3)).astype(np.float32)
    model = _gemm_model(trans_b, alpha, bias)
    before = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    assert gemms_to_matmuls(model) == rewritten
    ops = [n.op_type for n in model.graph.node]
    assert ops == (["MatMul", "Add"] if bias else ["MatMul"]) if rewritten else ["Gemm"]
    after = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    np.testing.assert_allclose(after, before, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(os.environ.get("ELX_LONG_TESTS") != "1", reason="a whole export (~40 s here); the conversion "
                    "and checks it runs are tested above on the session's exports; set ELX_LONG_TESTS=1")
def test_cli_exports_gpt2_in_fp16(model_folders, tmp_path):
    """``elx export --precision fp16`` of a decoder-only model (refused in one line before this change)."""
    out = tmp_path / "gpt2-fp16"
    proc = subprocess.run([sys.executable, "-m", "elx", "export", "--model", str(model_folders["gpt2"]), "--output",
                           str(out), "--precision", "fp16", "--quiet"], capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr
    data = Manifest.load(out).data
    assert data["precision"] == "fp16" and "fp16" in data["verification"]


# -- int8 ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_decoder_only_int8_export_records_agreement(exported, converted, family):
    """Every weight MatMul of both graphs on int8 weights (GPT-2's Gemms included) unless the per-layer
    measurement kept its layer fp32; graph IO as fp32's; the record has decoder-only top-1 agreement per step,
    and every layer's error measured alone."""
    fp32, manifest = Manifest.load(exported(family)), Manifest.load(converted(family, "int8"))
    data = manifest.data
    assert data["precision"] == "int8"
    layers = data["int8"]["layers"]
    expected = [f"{'h' if family == 'gpt2' else 'layers'}.{i}" for i in range(manifest.dims["num_decoder_layers"])]
    assert sorted(layers["max_abs_logits_diff"]) == sorted([*expected, "lm_head"])
    assert all(e > 0 for e in layers["max_abs_logits_diff"].values())
    kept = layers["kept_fp32"]
    assert kept == [k for k, e in layers["max_abs_logits_diff"].items()
                    if e > layers["factor"] * layers["median_max_abs_logits_diff"]]
    assert data["int8"]["lm_head"] == ("fp32" if "lm_head" in kept else "int8")
    per_layer = _weight_matmuls_per_layer(family)
    for name in ("prefill", "decoder"):
        counts = data["int8"]["graphs"][name]
        quantized = counts.get("int8: weight MatMul", 0) + counts.get("int8: LM head", 0)
        kept_here = counts.get("fp32: layer out of line (measured)", 0) + counts.get("fp32: LM head", 0)
        assert quantized + kept_here == per_layer * len(expected) + 1
        assert kept_here == per_layer * len([k for k in kept if k != "lm_head"]) + ("lm_head" in kept)
        assert manifest.graphs[name]["inputs"] == fp32.graphs[name]["inputs"]
        assert manifest.graphs[name]["outputs"] == fp32.graphs[name]["outputs"]
        # decoder-only: MatMulNBits, 8-bit blocks of 32 (exporter/precision/int8.py, "Kernels"), one per quantized
        # MatMul, and no dynamic quantization left
        ops = [n.op_type for n in onnx.load(str(manifest.graph_path(name))).graph.node]
        assert ops.count("MatMulNBits") == quantized and "DynamicQuantizeLinear" not in ops
    assert data["int8"]["kernel"] == "nbits" and not data["int8"]["reduce_range"]
    found = data["verification"]["int8"]
    for name in ("greedy", "beam4"):
        search = found["searches"][name]
        assert search["top1_pairs"] == search["rows"] * found["draw"]["max_new_tokens"] > 0
        assert len(search["top1_agreement_per_step"]) == found["draw"]["max_new_tokens"]
        assert 0 < search["max_abs_logits_diff"] < 1
    assert [s["past"] for s in found["random_inputs"]["shapes"]] == [0, 4, 1, 7, 3]


def test_decoder_only_int8_compare_reproduces_its_record(converted):
    folder = converted("llama", "int8")
    manifest = Manifest.load(folder)
    found = manifest.data["verification"]["int8"]
    draw = found["draw"]
    report = compare(folder, batch_size=draw["batch_size"], input_length=draw["input_length"], seed=draw["seed"],
                     num_beams=4, max_new_tokens=draw["max_new_tokens"])
    recorded = found["searches"]["beam4"]
    assert report.agreement.same_draw and report.passed, report.problems
    assert report.agreement.measured["rows_identical"] == recorded["rows_identical"]
    assert report.agreement.measured["top1_agree"] == recorded["top1_agree"]
    assert format_report(report, []).endswith("PASS")


def test_decoder_only_int8_compare_fails_a_damaged_export(converted, tmp_path):
    """Every int8 weight of the step graph sign-flipped: the logits leave the recorded bound and the top-1
    agreement falls below the record."""
    folder = tmp_path / "damaged"
    shutil.copytree(converted("gpt2", "int8"), folder)
    manifest = Manifest.load(folder)
    path = manifest.graph_path(manifest.step)
    model = onnx.load(str(path))
    flipped = 0
    for tensor in model.graph.initializer:
        if tensor.data_type == TensorProto.INT8:  # dynamic quantization's weights
            tensor.CopyFrom(numpy_helper.from_array((-numpy_helper.to_array(tensor)).astype(np.int8), tensor.name))
            flipped += 1
        elif tensor.data_type == TensorProto.UINT8 and tensor.name.endswith("_Q8"):  # MatMulNBits: q - 128
            q = numpy_helper.to_array(tensor).astype(np.int16)
            tensor.CopyFrom(numpy_helper.from_array(np.where(q == 0, 0, 256 - q).astype(np.uint8), tensor.name))
            flipped += 1
    assert flipped > 0
    onnx.save(model, str(path))
    draw = manifest.data["verification"]["int8"]["draw"]
    report = compare(folder, batch_size=draw["batch_size"], input_length=draw["input_length"], seed=draw["seed"],
                     num_beams=1, max_new_tokens=draw["max_new_tokens"])
    assert not report.passed and not report.logits_within_tolerance and report.agreement.problems


def test_per_layer_rule_keeps_an_out_of_line_layer(exported, model_folders, monkeypatch):
    """A layer whose measured error is out of line (here: made so by scaling its measured error) stays fp32,
    and the record says so; the others are quantized."""
    from elx.exporter.precision import int8_check as precision_int8_check
    from elx.exporter.precision.int8_layers import measure_layers

    measure = precision_int8_check.random_inputs_error

    def louder(torch_model, manifest, reference=None, **kernels):
        found = measure(torch_model, manifest, reference, **kernels)
        if Path(manifest.folder).name == "layers.1":  # the conversion with only layers.1 on int8 weights
            found["max_abs_logits_diff"] *= 100
        return found

    monkeypatch.setattr(precision_int8_check, "random_inputs_error", louder)
    manifest = Manifest.load(exported("llama"))
    found = measure_layers(_torch_model(model_folders, "llama"), manifest)
    assert found["kept_fp32"] == ["layers.1"]
    assert set(found["max_abs_logits_diff"]) == {"layers.0", "layers.1", "lm_head"}


# -- elx bench --precision -----------------------------------------------------------------------------------

def test_bench_runs_precision_exports_and_says_what_hf_runs(converted):
    """fp16 and int8 exports side by side with HF (fp32 on the CPU, said in one line), tokens counted per row."""
    from elx.exporter.bench.bench import BenchSettings, hf_precision_note, run_bench
    from elx.exporter.bench.results import report_markdown as markdown_table

    settings = BenchSettings(batch_size=2, input_length=6, num_beams=2, new_tokens=3, repeats=1, precision="fp16")
    report = run_bench([converted("gpt2", "fp16"), converted("gpt2", "int8")], settings, progress="none")
    systems = {s["system"]: s for s in report["systems"]}
    assert set(systems) == {"HF generate (PyTorch)", "elx baseline@fp16 (prompt beam-shared)",
                            "elx baseline@int8 (prompt beam-shared)"}
    assert report["hf_precision"] == "fp32" and report["hf_precision_note"] == hf_precision_note(settings)
    assert "HF generate runs in fp32 on the cpu" in markdown_table(report).splitlines()[2]
    assert all(s["rows_equal_hf"][1] == 2 and len(s["all_seconds"]) == 1 for s in systems.values())


def test_bench_precision_names_the_exports(monkeypatch, tmp_path):
    """``--precision`` applies to the pass sets that name none; ``baseline@int8`` keeps its own."""
    from elx.exporter.bench import bench
    from elx.exporter.bench.bench import BenchSettings, export_precision

    calls = []
    monkeypatch.setattr("elx.exporter.export.export_model",
                        lambda model, folder, **kw: calls.append((folder.name, kw["precision"])) or folder)
    bench.ensure_exports("gpt2", True, ["", "el", "@int8"], tmp_path, precision="fp16")
    assert calls == [("baseline-fp16", "fp16"), ("el-fp16", "fp16"), ("baseline-int8", "int8")]
    assert export_precision(BenchSettings(precision="fp16", backend="tensorrt", device="cuda")) == "fp32"
    assert export_precision(BenchSettings(precision="fp16")) == "fp16"


def test_bench_precision_option_and_refusals(tmp_path, capsys):
    from elx.cli import build_parser, main

    assert build_parser().parse_args(["bench", "--precision", "fp16"]).precision == "fp16"  # tools/gpu_check.py
    work = tmp_path / "bench"
    assert main(["bench", "--quick", "--backend", "tensorrt", "--device", "cuda", "--precision", "int8",
                 "--work", str(work)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("elx: error: --precision int8 runs on ONNX Runtime") and "\n" not in err
    assert not work.exists()


def test_int8_composes_with_slim_rope(qwen2_exports, model_folders, tmp_path):
    """int8 after ``slim`` (Qwen2, MHA with RoPE): the record's random-inputs check fills each side's own cache
    (the fp32 check's random past has V entries a K-only cache lacks: a KeyError before), the slim key
    projections and W_KV products stay fp32."""
    from elx.exporter.export import apply_passes, finish_folder
    from elx.exporter.precision.int8_export import finish

    folder = apply_passes(qwen2_exports["shared"], tmp_path / "slim", "slim")
    manifest = Manifest.load(folder)
    progress = Progress("test", progress="none")
    found = finish(_torch_model(model_folders, "qwen2"), folder, manifest, progress)
    finish_folder(folder, manifest, progress)
    counts = manifest.data["int8"]["graphs"]["decoder"]
    slimmed = len(next(p for p in manifest.passes if p["name"] == "slim")["layers"])
    assert counts.get("fp32: slim key projection") == slimmed > 0, counts
    # slim with RoPE stores W_KV per head (3-D): kept fp32 by that rule
    assert counts.get("fp32: slim W_KV product", 0) + counts.get("fp32: per-head (3-D) weight", 0) >= slimmed
    assert 0 < found["random_inputs"]["max_abs_logits_diff"] < 1
    assert Generator.from_folder(folder).generate(input_ids=[[5, 6, 7], [8, 9]], num_beams=2,
                                                  max_new_tokens=3).sequences.shape[0] == 2
