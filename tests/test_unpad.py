"""``--pass unpad`` (exporter/passes/unpad.py): the position-wise products of a padded batch run on its real
tokens only; the rewritten graphs compute the same real rows bit for bit, and generation stays HF's."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from elx.runners.manifest import Manifest


def _products_on_packed_rows(folder, graph_name: str) -> tuple[int, int]:
    """(constant-weight MatMuls of a graph reading packed rows, all of them): a product reads packed rows when
    its input comes from the pass's Gather or from another node of its region (named ``unpad/...`` or not)."""
    model = onnx.load(str(Manifest.load(folder).graph_path(graph_name)), load_external_data=False)
    weights = {i.name for i in model.graph.initializer}
    producers = {o: n for n in model.graph.node for o in n.output}
    packed, total = 0, 0
    for node in model.graph.node:
        if node.op_type != "MatMul" or node.input[1] not in weights:
            continue
        total += 1
        seen, todo = set(), [node.input[0]]
        while todo:  # walk up to the Gather of packed rows or to anything else
            tensor = todo.pop()
            source = producers.get(tensor)
            if source is None or tensor in seen:
                continue
            seen.add(tensor)
            if source.op_type == "Gather" and source.name.startswith("unpad/packed"):
                packed += 1
                break
            if source.op_type in ("Unsqueeze", "Relu", "Mul", "Add", "Sub", "Tanh", "Pow", "Div", "Erf", "Sigmoid",
                                  "MatMul", "Cast", "Sqrt", "Reciprocal", "ReduceMean", "LayerNormalization"):
                todo.extend(source.input)
    return packed, total


@pytest.mark.parametrize("family", ["t5", "llama", "bart"])
def test_unpad_is_bit_identical_and_hf_identical(exported, family):
    """The pass rewrites the graphs fed the mask (T5/BART: encoder and cross K/V; Llama: the prefill) so that every
    constant-weight product there reads packed rows; its verification finds the logits and the encoder output at
    real positions unchanged to the bit, and generation on padded batches is HF's."""
    from elx.exporter.verification.compare import compare

    folder = exported(family, "unpad")
    manifest = Manifest.load(folder)
    record = next(p for p in manifest.data["passes"] if p["name"] == "unpad")
    expected = ["prefill"] if family == "llama" else ["encoder", "cross_kv"]
    assert sorted(record["graphs"]) == sorted(expected)
    assert record["max_abs_logits_diff"] == 0.0
    assert record.get("max_abs_encoder_diff", 0.0) == 0.0
    for graph in expected:
        packed, total = _products_on_packed_rows(folder, graph)
        assert record["graphs"][graph]["products"] == packed
        # the prefill's LM head reads the last position only ([B, d]: no padding to remove)
        assert packed == total - (family == "llama"), (graph, packed, total)
    if family == "t5":  # 2 encoder layers: the residual stream stays packed through the norms and the FFN
        layers = 2
        assert record["graphs"]["encoder"]["packs"] == 1 + layers  # the embeddings, attention's output per layer
        assert record["graphs"]["encoder"]["unpacks"] == 3 * layers + 1  # q, k, v per layer; the encoder output
        assert record["graphs"]["cross_kv"]["unpacks"] == 2 * layers  # each decoder layer's cross K and V
        assert record["graphs"]["cross_kv"]["packs"] == 1  # the products reading one input share its packed copy
    report = compare(folder, batch_size=3, input_length=9, num_beams=2, max_new_tokens=5)
    assert report.all_identical


def test_regions_hold_position_wise_nodes_only():
    """What mixes positions never joins a region: a reduction over the positions axis, a softmax, an add of a
    tensor that is not [B, N, ·] (a [1, N, d] table); what acts per position does (a residual add of two row
    tensors, a reduction over the last axis, a layer norm, a product with a constant weight)."""
    import onnx_graphsurgeon as gs

    from elx.exporter.passes.unpad import find_regions

    rng = np.random.default_rng(0)
    x = gs.Variable("x", np.float32, ["B", "N", 4])
    table = gs.Variable("table", np.float32, [1, "N", 4])
    w = gs.Constant("w", rng.standard_normal((4, 4)).astype(np.float32))
    axis_last, axis_positions = gs.Constant("last", np.array([-1])), gs.Constant("positions", np.array([1]))
    t = {name: gs.Variable(name, np.float32) for name in ("h", "mean", "centred", "y", "ln", "z", "over_n", "sm",
                                                          "shifted", "out")}
    gamma = gs.Constant("gamma", np.ones(4, np.float32))
    nodes = [
        gs.Node("MatMul", "product", inputs=[x, w], outputs=[t["h"]]),
        gs.Node("ReduceMean", "mean_last", inputs=[t["h"], axis_last], outputs=[t["mean"]], attrs={"keepdims": 1}),
        gs.Node("Sub", "centre", inputs=[t["h"], t["mean"]], outputs=[t["centred"]]),
        gs.Node("Add", "residual", inputs=[t["centred"], x], outputs=[t["y"]]),
        gs.Node("LayerNormalization", "norm", inputs=[t["y"], gamma], outputs=[t["ln"]], attrs={"axis": -1}),
        gs.Node("Add", "table_add", inputs=[t["ln"], table], outputs=[t["z"]]),  # [1, N, d]: per position of N
        gs.Node("ReduceMean", "mean_positions", inputs=[t["ln"], axis_positions], outputs=[t["over_n"]],
                attrs={"keepdims": 1}),
        gs.Node("Softmax", "softmax", inputs=[t["ln"]], outputs=[t["sm"]], attrs={"axis": -1}),
        gs.Node("Add", "after", inputs=[t["over_n"], t["sm"]], outputs=[t["shifted"]]),
        gs.Node("MatMul", "lonely", inputs=[t["z"], w], outputs=[t["out"]]),
    ]
    graph = gs.Graph(nodes=nodes, inputs=[x, table], outputs=[t["shifted"], t["out"]])
    regions = find_regions(graph, ("B", "N"))
    joined = sorted(n.name for r in regions for n in r.nodes)
    assert joined == ["centre", "mean_last", "norm", "product", "residual"], joined
    # the product reading the table's sum has no [B, N, ·] input: it is left as it is
    assert "lonely" not in joined and len(regions) == 1


def test_padded_rows_are_never_computed(exported):
    """What the rewritten encoder computes at real positions does not depend on the padding it is batched with:
    the same row padded to 8 or to 14 positions gives the same bits at its real positions."""
    import onnxruntime as ort

    folder = exported("t5", "unpad")
    session = ort.InferenceSession(str(Manifest.load(folder).graph_path("encoder")))
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 128, (2, 14))
    mask = np.ones((2, 14), np.int64)
    mask[0, 6:] = 0
    short = session.run(None, {"input_ids": ids[:, :8].copy(), "attention_mask": mask[:, :8].copy()})[0]
    long = session.run(None, {"input_ids": ids, "attention_mask": mask})[0]
    np.testing.assert_array_equal(short[0, :6], long[0, :6])
    # the cross keys and values the decoder reads at padded positions are zeros (the packed rows' zero row),
    # never values left in memory: attention multiplies them by exact zeros, and 0·NaN would be NaN
    cross = ort.InferenceSession(str(Manifest.load(folder).graph_path("cross_kv")))
    feeds = {i.name: long if i.name == "encoder_hidden_states" else mask for i in cross.get_inputs()}
    for name, value in zip([o.name for o in cross.get_outputs()], cross.run(None, feeds)):
        assert np.all(value[0, :, 6:] == 0) and np.any(value[0, :, :6] != 0), name
        assert np.any(value[1] != 0), name


def test_unpad_composes_with_int8(model_folders, tmp_path):
    """``unpad`` then ``--precision int8``: the quantizer finds the packed products (weights in int8) and the
    export records its agreement as any int8 export does."""
    from elx.exporter.export import export_model

    folder = export_model(str(model_folders["t5"]), tmp_path / "t5-unpad-int8", passes="unpad", precision="int8",
                          quiet=True)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["precision"] == "int8" and [p["name"] for p in manifest["passes"]] == ["unpad"]
    encoder = onnx.load(str(folder / manifest["graphs"]["encoder"]["file"]), load_external_data=False)
    ops = {n.op_type for n in encoder.graph.node}
    assert {"MatMulInteger", "NonZero", "CumSum", "Gather"} <= ops and "ScatterND" not in ops
    assert manifest["verification"]["int8"]["searches"]["beam4"]["rows"] > 0


def test_tensorrt_for_rtx_refuses_an_unpad_export_in_one_line(exported):
    """TensorRT for RTX has no NonZero layer: the build is refused before any engine is built, nothing written."""
    pytest.importorskip("tensorrt_rtx")
    from elx.exporter.tensorrt.build import build_engine
    from elx.runners.errors import ElxError

    folder = exported("t5", "unpad")
    before = sorted(p.name for p in folder.iterdir())
    with pytest.raises(ElxError, match="no NonZero layer.*without --pass unpad"):
        build_engine(folder, compute_capabilities="8.6", max_batch_size=2, max_beams=2, max_input_length=16,
                     max_new_tokens=8, quiet=True)
    assert sorted(p.name for p in folder.iterdir()) == before


UNPAD_FAMILIES = ["t5-wide", "bart-biased", "mbart", "m2m100", "pegasus", "fsmt", "opt", "mistral", "qwen2", "qwen3",
                  "phi3", "gemma"]  # GPT-2 is refused: test_gpt2_is_refused_in_one_line_before_any_export


@pytest.mark.skipif(__import__("os").environ.get("ELX_LONG_TESTS") != "1",
                    reason="CI runs test_unpad_is_bit_identical_and_hf_identical (t5, llama) of this kind; "
                           "set ELX_LONG_TESTS=1")
@pytest.mark.parametrize("family", UNPAD_FAMILIES)
def test_unpad_on_every_padded_family(exported, family):
    """Every family with padded inputs: the pass applies, its products all read packed rows, the real rows stay
    bit-identical (0.0 recorded) and generation on padded batches is HF's."""
    from elx.exporter.verification.compare import compare

    folder = exported(family, "unpad")
    record = next(p for p in Manifest.load(folder).data["passes"] if p["name"] == "unpad")
    assert record["max_abs_logits_diff"] == 0.0 and record.get("max_abs_encoder_diff", 0.0) == 0.0, record
    for graph in record["graphs"]:
        packed, total = _products_on_packed_rows(folder, graph)
        assert record["graphs"][graph]["products"] == packed > 0, (graph, record["graphs"][graph], packed, total)
    assert compare(folder, batch_size=3, input_length=9, num_beams=2, max_new_tokens=5).all_identical


def test_gpt2_is_refused_in_one_line_before_any_export(model_folders, tmp_path):
    """GPT-2's projections are Gemm on flattened rows (Conv1D), which the pass does not pack: refused by name and
    reason before the model is exported (it once exported, then failed with "report this model"), nothing written."""
    from elx.exporter.export import export_model
    from elx.runners.errors import ElxError

    with pytest.raises(ElxError, match="unpad does not apply to gpt2.*Gemm on flattened"):
        export_model(str(model_folders["gpt2"]), tmp_path / "out", passes="unpad", quiet=True)
    assert not (tmp_path / "out").exists()


def test_unpad_reads_the_weights_shapes_not_their_values(exported, tmp_path, monkeypatch):
    """Finding the position-wise regions needs each weight's shape only: reading the values (what the pass did)
    held a second copy of the model and wrote every weight again with the new prefill (TinyLlama-1.1B: a 16.9 GB
    peak, 8.4 GB now)."""
    import elx.exporter.passes.rewrite as rewrite
    from elx.exporter.export import apply_passes

    read, load = [], rewrite._StoredValues.load
    monkeypatch.setattr(rewrite._StoredValues, "load", lambda self: read.append(self.tensor.name) or load(self))
    out = apply_passes(exported("llama"), tmp_path / "unpad", "unpad")
    manifest = Manifest.load(out)
    assert manifest.data["passes"][-1]["name"] == "unpad"
    assert read == []
    # the rewritten prefill points at the export's weights.data, not at a copy of its own
    assert manifest.graphs["prefill"]["external_data"] == ["weights.data"]
