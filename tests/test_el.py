"""The ``el`` pass: structure of the rewritten graphs, verification, refusals, state accounting."""
from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest

from elx.runners.errors import ElxError
from elx.exporter.export import export_model
from elx.exporter.verification.compare import compare
from elx.runners.generate import Generator
from elx.runners.inputs.random_inputs import random_inputs
from elx.runners.manifest import Manifest
from tests.conftest import make_model_folder


@pytest.mark.parametrize("family", ["t5", "bart", "whisper"])
def test_el_graph_has_no_cross_cache(exported, family):
    folder = exported(family, "el")
    manifest = Manifest.load(folder)
    record = manifest.passes[0]
    assert record["name"] == "el" and record["max_abs_logits_diff"] <= 1e-4
    assert len(record["shapes"]) >= 4 and {s["beams"] for s in record["shapes"]} >= {1, 2, 3, 4}
    assert manifest.stages == ["encoder"] and "cross_kv" not in manifest.graphs
    assert not (folder / "cross_kv.onnx").exists() and not (folder / "decoder.onnx").exists()
    inputs = manifest.graphs["decoder"]["inputs"]
    assert not any(".encoder." in name for name in inputs)
    d_model = manifest.dims["d_model"]
    assert inputs["encoder_hidden_states"] == {"dtype": "float32", "shape": ["batch", "encoder_sequence", d_model],
                                               "from": "encoder:last_hidden_state"}
    graph = onnx.load(str(folder / "decoder.el.onnx"))
    assert not any(".encoder." in i.name for i in graph.graph.input)
    assert not any(".encoder." in o.name for o in graph.graph.output)
    # one Softmax per self- and cross-attention layer, and the cross ones read H directly
    layers = manifest.dims["num_decoder_layers"]
    assert sum(n.op_type == "Softmax" for n in graph.graph.node) == 2 * layers
    h_readers = [n for n in graph.graph.node if "encoder_hidden_states" in n.input]
    assert {n.op_type for n in h_readers} <= {"Transpose", "MatMul", "Shape"}
    assert sum(n.op_type == "MatMul" for n in h_readers) == layers  # P·H, once per layer


def test_el_where_heads_times_dkv_differs_from_d_model(tmp_path):
    folder = make_model_folder(tmp_path, "t5", d_kv=12)  # 4 heads · 12 = 48 ≠ d_model 32
    out = export_model(str(folder), tmp_path / "odd-el", passes="el", quiet=True)
    report = compare(out, batch_size=3, input_length=10, num_beams=4, no_repeat_ngram_size=3, max_new_tokens=10)
    assert report.all_identical
    assert max(max(r.step_logits_diff) for r in report.rows) <= 1e-4


def test_el_whisper_style_generation(exported):
    """Whisper-style attention (K projection without bias, V with bias, scaled): identical greedy/beam tokens."""
    for options in (dict(max_new_tokens=10), dict(num_beams=4, max_new_tokens=10, no_repeat_ngram_size=2)):
        report = compare(exported("whisper", "el"), batch_size=2, input_length=0, **options)
        assert report.all_identical, [(r.hf_tokens, r.elx_tokens) for r in report.rows]


def _apply_el(folder):
    from elx.exporter.passes import el

    manifest = Manifest.load(folder)
    return el.apply(folder, manifest, None)


def test_el_twice_is_refused(tmp_path, exported):
    folder = tmp_path / "twice"
    shutil.copytree(exported("t5", "el"), folder)
    with pytest.raises(ElxError, match="already applied"):
        _apply_el(folder)


def test_el_without_cross_attention_is_refused(tmp_path, exported):
    folder = tmp_path / "nocross"
    shutil.copytree(exported("t5", "el"), folder)
    data = json.loads((folder / "manifest.json").read_text())
    data["passes"] = []  # the graph has no cross-attention inputs left, whatever the record says
    (folder / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ElxError, match="needs a decoder with cross-attention"):
        _apply_el(folder)


def test_el_refuses_extra_argument(tmp_path, exported):
    from elx.exporter.passes import el

    folder = tmp_path / "arg"
    shutil.copytree(exported("t5"), folder)
    with pytest.raises(ElxError, match="takes no argument"):
        el.apply(folder, Manifest.load(folder), "fast")


@pytest.mark.parametrize("family", ["t5", "bart"])
def test_input_related_state_accounting(exported, family):
    """Live tensors: el keeps one [B, N, D] encoder output instead of 2·L beam-shared K/V per layer."""
    batch, length, beams = 3, 13, 4
    sizes = {}
    for passes in (None, "el"):
        gen = Generator.from_folder(exported(family, passes))
        inputs = random_inputs(gen.manifest, batch, length, np.random.default_rng(0))
        result = gen.generate(inputs, num_beams=beams, max_new_tokens=5, min_new_tokens=5, track_memory=True)
        sizes[passes] = result.memory
    dims = Manifest.load(exported(family)).dims
    layers, d_model = dims["num_decoder_layers"], dims["d_model"]
    heads, d_kv = dims["num_heads"], dims["d_kv"]
    mask = batch * length * 8
    assert sizes["el"][0]["state_bytes"] == batch * length * d_model * 4 + mask
    assert sizes[None][0]["state_bytes"] == 2 * layers * batch * heads * length * d_kv * 4 + mask
    # the self-attention cache is untouched by el
    assert [m["cache_bytes"] for m in sizes["el"]] == [m["cache_bytes"] for m in sizes[None]]
