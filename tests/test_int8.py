"""int8 exports (``--precision int8``): the rule's graphs, the recorded agreement with HF fp32, ``elx compare`` held
to the record, and the refusals.

The int8 folders are the session's fp32 exports (``exported``), converted by the same ``finish`` that ``elx export
--precision int8`` runs after its passes (no second export).
"""
from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from elx.exporter.bench.bench import rows_equal, split_precision
from elx.exporter.bench.peers import parse_peers
from elx.exporter.verification.compare import CompareReport, RowReport, compare, format_report
from elx.exporter.precision.int8_check import ALPHA, LOGITS_MARGIN, binomial_cdf, judge, logits_bound
from elx.exporter.progress import Progress
from elx.runners.errors import ElxError
from elx.runners.generate import Generator
from elx.runners.manifest import Manifest
from elx.runners.manifest_schema import check
from elx.exporter.capture.shared_weights import graph_files

_INT8 = {}


@pytest.fixture(scope="module")
def int8_export(exported, model_folders, tmp_path_factory):
    """``int8_export(family, passes)`` → the fp32 export converted to int8 (as ``elx export --precision int8``)."""
    from transformers import AutoModelForSeq2SeqLM

    from elx.exporter.export import finish_folder
    from elx.exporter.precision.int8_export import finish

    def get(family: str, passes: str | None = None):
        key = (family, passes)
        if key not in _INT8:
            folder = tmp_path_factory.mktemp("int8") / f"{family}-{passes or 'base'}"
            shutil.copytree(exported(family, passes), folder)
            manifest = Manifest.load(folder)
            model = AutoModelForSeq2SeqLM.from_pretrained(model_folders[family]).eval()
            progress = Progress("test", progress="none")
            finish(model, folder, manifest, progress)
            finish_folder(folder, manifest, progress)
            _INT8[key] = folder
        return _INT8[key]

    return get


def _weight_matmuls(path) -> tuple[int, int]:
    """(MatMuls reading a float initializer, quantized MatMuls) in the graph file at ``path``."""
    model = onnx.load(str(path))
    floats = {t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT}
    made = {o: n for n in model.graph.node for o in n.output}
    plain = sum(1 for n in model.graph.node if n.op_type == "MatMul" and (
        n.input[1] in floats or (n.input[1] in made and made[n.input[1]].op_type == "Transpose"
                                 and made[n.input[1]].input[0] in floats)))
    quantized = sum(1 for n in model.graph.node if n.op_type in ("MatMulInteger", "DynamicQuantizeMatMul"))
    return plain, quantized


@pytest.mark.parametrize("passes", [None, "el", "unpad"])  # unpad: its packed products are quantized too
def test_int8_quantizes_every_weight_matmul_and_keeps_io(exported, int8_export, passes):
    fp32, int8 = Manifest.load(exported("t5", passes)), Manifest.load(int8_export("t5", passes))
    assert int8.data["precision"] == "int8" and int8.data["int8"]["lm_head"] == "int8"
    assert int8.data["int8"]["kernel"] == "dynamic"  # encoder-decoder: per-tensor activations (int8.py, "Kernels")
    for name in [*fp32.stages, fp32.step]:
        before, _ = _weight_matmuls(fp32.graph_path(name))
        plain, quantized = _weight_matmuls(int8.graph_path(name))
        counts = int8.data["int8"]["graphs"][name]
        kept = sum(v for k, v in counts.items() if k.startswith("fp32") and "activation" not in k)
        assert kept == (2 * fp32.dims["num_decoder_layers"] if passes == "el" and name == fp32.step else 0)
        assert plain == kept and quantized == before - kept > 0
        assert sum(v for k, v in counts.items() if k.startswith("int8")) == quantized
        # graph IO (caches, per-input state, logits) is the fp32 export's
        assert int8.graphs[name]["inputs"] == fp32.graphs[name]["inputs"]
        assert int8.graphs[name]["outputs"] == fp32.graphs[name]["outputs"]
    # int8 weights: the weight MatMuls' bytes shrink (the fp32 embedding table stays for its Gather)
    assert int8.data["weights"]["bytes"] < fp32.data["weights"]["bytes"]
    int8_weights = [t for name in [*int8.stages, int8.step] for t in onnx.load(str(int8.graph_path(name))).graph.initializer
                    if t.data_type == onnx.TensorProto.INT8]
    assert int8_weights and all(np.abs(numpy_helper.to_array(t)).max() <= 64 for t in int8_weights)  # reduce_range: 7 bits
    # one weights file for every graph, no fp32 graph file left behind (exporter/capture/shared_weights.py)
    assert sorted(p.name for p in int8.folder.iterdir()) == sorted([*graph_files(int8), "weights.data", "manifest.json"])
    assert all(f.endswith(".int8.onnx") for f in graph_files(int8))
    out = Generator.from_folder(int8.folder).generate(input_ids=[[5, 6, 7, 8], [9, 10]], num_beams=2, max_new_tokens=4)
    assert out.sequences.shape[0] == 2


def test_int8_record_is_reproduced_by_compare_on_its_draw(int8_export):
    folder = int8_export("t5")
    manifest = Manifest.load(folder)
    check(manifest.data, "manifest")
    found = manifest.data["verification"]["int8"]
    draw = found["draw"]
    for name, beams in (("greedy", 1), ("beam4", 4)):
        recorded = found["searches"][name]
        assert recorded["rows"] == draw["batch_size"] and 0 <= recorded["rows_identical"] <= recorded["rows"]
        assert len(recorded["top1_agreement_per_step"]) == draw["max_new_tokens"]
        assert 0 < recorded["max_abs_logits_diff"] <= logits_bound(manifest) / LOGITS_MARGIN
        report = compare(folder, batch_size=draw["batch_size"], input_length=draw["input_length"], seed=draw["seed"],
                         num_beams=beams, max_new_tokens=draw["max_new_tokens"])
        assert report.agreement.same_draw and report.agreement.search == name
        assert report.agreement.measured["rows_identical"] == recorded["rows_identical"]
        assert report.agreement.measured["top1_agree"] == recorded["top1_agree"]
        assert report.atol == logits_bound(manifest) and report.passed, report.problems
        text = format_report(report, [])
        assert "int8 agreement on the recorded draw" in text and text.endswith("PASS")


def test_int8_records_the_error_of_the_kernels_the_runtime_runs(exported, model_folders, tmp_path):
    """The recorded random-inputs error of a decoder-only int8 export is measured on the sessions the runtime loads
    (prepacked): ONNX Runtime's MatMulNBits computes with int8 activations there (accuracy level 4) and with fp32
    ones unpacked, as the verification's mapped sessions run (the real SmolLM2-135M: 1.68 against 0.97)."""
    from transformers import AutoModelForCausalLM

    from elx.exporter.precision.decoder_only import torch_side
    from elx.exporter.precision.int8 import convert_folder, kernel_for
    from elx.exporter.precision.int8_check import random_inputs_error
    from elx.exporter.precision.int8_export import record
    from elx.exporter.verification.verify import RuntimeSide, default_shapes, measure
    from elx.runners.backends.ort import OrtBackend
    from elx.runners.generate import Model

    fp32 = Manifest.load(exported("llama"))
    assert kernel_for(fp32) == "nbits"
    int8 = convert_folder(fp32, tmp_path / "int8")
    int8.save(tmp_path / "int8")
    model = AutoModelForCausalLM.from_pretrained(model_folders["llama"]).eval()
    runtime = RuntimeSide(int8, prefill=True)
    runtime.model = Model(int8, OrtBackend(int8)).for_run(0)  # the backend the runtime's generator loads
    runs = measure(torch_side(model, int8), runtime, int8, default_shapes(int8))["max_abs_logits_diff"]
    unpacked = random_inputs_error(model, int8)["max_abs_logits_diff"]
    assert random_inputs_error(model, int8, packed=True)["max_abs_logits_diff"] == runs != unpacked
    assert record(model, int8, dict(batch_size=2, input_length=8, max_new_tokens=3, seed=0))[
        "random_inputs"]["max_abs_logits_diff"] == runs


def test_int8_compare_fails_a_damaged_export(int8_export, tmp_path):
    """An LM head whose int8 weights are garbled: the logits leave the recorded bound and the tokens the record."""
    folder = tmp_path / "damaged"
    shutil.copytree(int8_export("t5"), folder)
    manifest = Manifest.load(folder)
    path = manifest.graph_path(manifest.step)
    model = onnx.load(str(path))
    for tensor in model.graph.initializer:
        if tensor.data_type == onnx.TensorProto.INT8:  # every int8 weight of the step graph, sign flipped
            value = numpy_helper.to_array(tensor)
            tensor.CopyFrom(numpy_helper.from_array((-value).astype(np.int8), tensor.name))
    onnx.save(model, str(path))
    draw = manifest.data["verification"]["int8"]["draw"]
    report = compare(folder, batch_size=draw["batch_size"], input_length=draw["input_length"], seed=draw["seed"],
                     num_beams=4, max_new_tokens=draw["max_new_tokens"])
    assert not report.passed
    assert not report.logits_within_tolerance and report.agreement.problems


def _report(identical: int, rows: int, top1: list) -> CompareReport:
    return CompareReport([RowReport(0, i < identical, None if i < identical else 0, [0.1], step_top1=list(top1))
                          for i in range(rows)], 0.0, None, None, {})


def test_int8_agreement_on_another_draw_is_a_binomial_test():
    recorded = {"num_beams": 4, "rows": 8, "rows_identical": 7, "identical_share": 0.875, "top1_pairs": 80,
                "top1_agree": 80, "top1_agreement": 0.95, "max_abs_logits_diff": 0.1}
    manifest = Manifest({"verification": {"int8": {"draw": {"seed": 0, "batch_size": 8, "input_length": 32,
                                                            "max_new_tokens": 16},
                                                   "searches": {"beam4": recorded}}}}, None)
    other = {"seed": 1, "batch_size": 20, "input_length": 32, "max_new_tokens": 10, "num_beams": 4}
    good = judge(manifest, _report(15, 20, [True] * 19 + [False]), other)  # 75% of rows: chance at 87.5%
    assert not good.problems and not good.same_draw and binomial_cdf(15, 20, 0.875) >= ALPHA
    # 800 top-1 pairs at 92.5% are not a 95% export's chance (rows: 75% again)
    assert len(judge(manifest, _report(15, 20, [True] * 37 + [False] * 3), other).problems) == 1
    bad = judge(manifest, _report(10, 20, [True] * 5 + [False] * 5), other)  # 50%, 50%: worse than recorded
    assert len(bad.problems) == 2 and binomial_cdf(10, 20, 0.875) < ALPHA
    same = {**other, "seed": 0, "batch_size": 8, "max_new_tokens": 16}
    assert judge(manifest, _report(6, 8, [True] * 10), same).problems  # one row fewer on the recorded draw fails


def test_int8_refusals():
    from elx.exporter.precision.fp16_export import check_precision

    with pytest.raises(ElxError, match="choose fp32, fp16 or int8"):
        check_precision("int4")


def test_int8_refuses_passes_and_engines_on_an_int8_folder(int8_export, tmp_path):
    from elx.exporter.export import apply_passes

    with pytest.raises(ElxError, match=r"is an int8 export; apply passes from the fp32 export"):
        apply_passes(int8_export("t5"), tmp_path / "out", "el")
    data = json.loads((int8_export("t5") / "manifest.json").read_text())
    assert data["verification"]["int8"]["searches"]["beam4"]["num_beams"] == 4


def test_int8_bench_pass_sets_and_rows_equal():
    assert split_precision("baseline@int8") == ("", "int8") and split_precision("el,slim@int8") == ("el,slim", "int8")
    assert split_precision("el") == ("el", "fp32") and split_precision("baseline") == ("", "fp32")
    assert parse_peers("ct2-int8,ct2") == ["ct2-int8", "ct2"]
    reference = np.array([[0, 5, 6, 1], [0, 7, 8, 1], [0, 9, 1, 0]])
    peer = np.array([[0, 5, 6, 1, 0], [0, 7, 9, 1, 0], [0, 9, 1, 0, 0]])  # padded one column wider
    assert rows_equal(reference, peer, pad=0) == (2, 3)
    assert rows_equal(reference, peer[:2], pad=0) == (1, 3)  # a missing row is not equal


def test_the_lm_head_is_the_matmul_reaching_the_logits_through_adds_and_scales_only():
    """``lm_heads``: walked back from the logits through at most four Add/Mul/Identity nodes; a MatMul feeding
    another MatMul, or one too many steps away, is not the head."""
    from onnx import TensorProto, helper

    from elx.exporter.precision.int8 import choose, lm_heads

    w = [numpy_helper.from_array(np.ones((4, 4), np.float32), f"w{i}") for i in range(3)]
    nodes = [helper.make_node("MatMul", ["x", "w0"], ["h0"], name="inner"),
             helper.make_node("MatMul", ["h0", "w1"], ["h1"], name="head"),
             helper.make_node("Add", ["h1", "x"], ["a"]), helper.make_node("Mul", ["a", "x"], ["logits"]),
             helper.make_node("MatMul", ["x", "w2"], ["far"], name="far")]
    nodes += [helper.make_node("Identity", [f"far{'' if i == 0 else i}" if i else "far"], [f"far{i + 1}"])
              for i in range(5)]
    nodes.append(helper.make_node("Add", ["far5", "x"], ["far_logits"]))
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [4, 4]) for n in ("x", "logits", "far_logits")]
    model = helper.make_model(helper.make_graph(nodes, "g", io[:1], io[1:], initializer=w))
    assert lm_heads(model, "logits") == {"h1"}
    assert lm_heads(model, "far_logits") == set()  # six steps away
    assert lm_heads(model, None) == set()
    chosen, counts = choose(model, logits="logits", keep_lm_head=True)
    assert "head" not in chosen and "inner" in chosen and counts["fp32: LM head"] == 1


@pytest.mark.parametrize("family", ["llama", "gpt2"])  # gpt2: Conv1D Gemms rewritten first, a transposed weight
def test_nbits_one_weight_at_a_time_writes_what_the_quantizer_writes(exported, tmp_path, family):
    """``int8_nbits`` (the graph read without its weights, each converted and written alone) writes what ONNX
    Runtime's ``MatMulNBitsQuantizer`` writes from the whole loaded graph: the same nodes, byte for byte, and the
    same tensors; every large tensor in the graph's own data file."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    from elx.exporter.precision.int8 import NBITS_ACCURACY, NBITS_BLOCK, _scores_output, choose, prepare
    from elx.exporter.precision.int8_nbits import save, to_nbits

    manifest = Manifest.load(exported(family))
    for name in [*manifest.stages, manifest.step]:
        path = manifest.graph_path(name)
        whole = prepare(onnx.load(str(path)))
        chosen, _ = choose(whole, logits=_scores_output(manifest, name))
        others = [n.name for n in whole.graph.node if n.op_type == "MatMul" and n.name not in set(chosen)]
        quantizer = MatMulNBitsQuantizer(whole, bits=8, block_size=NBITS_BLOCK, is_symmetric=True,
                                         accuracy_level=NBITS_ACCURACY, nodes_to_exclude=others,
                                         op_types_to_quantize=("MatMul",))
        quantizer.process()
        theirs = quantizer.model.model
        lazy = onnx.load(str(path), load_external_data=False)
        assert any(t.data_location == onnx.TensorProto.EXTERNAL for t in lazy.graph.initializer)  # read from the file
        to_nbits(prepare(lazy, path.parent), chosen, path.parent, NBITS_BLOCK, NBITS_ACCURACY)
        assert save(lazy, path.parent, tmp_path / f"{name}.onnx") == [f"{name}.onnx.data"]
        ours = onnx.load(str(tmp_path / f"{name}.onnx"))
        assert [n.SerializeToString() for n in ours.graph.node] == [n.SerializeToString() for n in theirs.graph.node]
        assert sum(n.op_type == "MatMulNBits" for n in ours.graph.node) == len(chosen) > 0

        def tensors(model):
            return {t.name: (tuple(t.dims), t.data_type, numpy_helper.to_array(t).tobytes())
                    for t in model.graph.initializer}
        assert tensors(ours) == tensors(theirs)
        assert {(o.domain, o.version) for o in ours.opset_import} == {(o.domain, o.version) for o in theirs.opset_import}


def test_nbits_packs_any_weight_shape_as_the_quantizer_does():
    """Weights drawn at random, K a whole number of blocks or not (zero-padded): the packed bytes and scales are
    ``DefaultWeightOnlyQuantizer``'s."""
    from hypothesis import given, settings
    from hypothesis import strategies as st
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, DefaultWeightOnlyQuantizer

    from elx.exporter.precision.int8_nbits import quantize

    @settings(max_examples=25, deadline=None)
    @given(st.integers(1, 100), st.integers(1, 40), st.sampled_from([16, 32, 64]), st.integers(0, 2**32 - 1),
           st.floats(1e-3, 1e3))
    def check(rows, cols, block, seed, scale):
        weight = (np.random.default_rng(seed).standard_normal((rows, cols)) * scale).astype(np.float32)
        config = DefaultWeightOnlyQuantConfig(block_size=block, is_symmetric=True, bits=8)
        want_packed, want_scales, _ = DefaultWeightOnlyQuantizer(config).qbits_block_quant(weight)
        packed, scales = quantize(weight, block)
        assert packed.tobytes() == want_packed.tobytes() and packed.shape == want_packed.shape
        assert scales.tobytes() == want_scales.tobytes() and scales.shape == want_scales.shape

    check()
