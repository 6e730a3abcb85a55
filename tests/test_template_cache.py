"""The traced-template cache (``exporter/capture/template_cache.py``, issue 41): a second export of the same model
takes its templates from the cache and writes the same folder byte for byte; the key follows what the trace
depends on (the model's own non-layer tensors, not its layers' weights); a broken entry, a cache that cannot be
written, a full cache and ``ELX_TEMPLATE_CACHE=0`` cost nothing but the trace."""
from __future__ import annotations

import hashlib
import io
import os
from contextlib import redirect_stderr
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from elx.exporter.capture import template_cache
from elx.runners.manifest import Manifest
from tests.conftest import BUILDERS, make_model_folder


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ELX_TEMPLATE_CACHE", "1")
    monkeypatch.setenv("ELX_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "templates"


def _files(folder: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())
            if p.suffix in (".onnx", ".data")}


def test_a_second_export_takes_its_templates_from_the_cache_and_writes_the_same_graphs(cache, tmp_path, monkeypatch):
    import elx.exporter.export as export_module
    from elx.exporter.export import export_model

    monkeypatch.setenv("ELX_CAPTURE", "stitch")
    monkeypatch.setenv("ELX_TEMPLATE_BUILDER", "0")  # traced templates (a built one is not kept: quicker to build)
    # both references on one thread: PyTorch's batched forwards round by the thread count, which follows the load
    monkeypatch.setattr(export_module, "idle_cores", lambda: 1.0)
    folder = make_model_folder(tmp_path, "llama", num_hidden_layers=5)
    outs, logs = [], []
    for run in ("first", "second"):
        stream = io.StringIO()
        with redirect_stderr(stream):
            outs.append(export_model(str(folder), tmp_path / run, progress="plain"))
        logs.append(stream.getvalue())
        if run == "first":
            entries = [e for e in cache.iterdir() if not e.name.startswith(".")]
            assert len(entries) == 2  # prefill's and step's
            assert all((e / template_cache.BINDINGS).is_file() for e in entries)  # the second export binds nothing
    first, second = (Manifest.load(out) for out in outs)
    for graph in ("prefill", "decoder"):
        assert first.data["graphs"][graph]["capture"]["template_from_cache"] is False
        assert second.data["graphs"][graph]["capture"]["template_from_cache"] is True
        assert f"{graph}.onnx: its 3-layer template from the cache" in logs[1]
    assert "from the cache" not in logs[0]
    assert _files(outs[0]) == _files(outs[1])  # the graphs and weights.data, byte for byte
    assert second.data["verification"]["export"] == first.data["verification"]["export"]



def test_a_shallow_models_graph_traced_whole_comes_from_the_cache_the_second_time(cache, tmp_path, monkeypatch):
    """A model traced whole (3 layers or fewer per stack): its graph kept whole, keyed by all its tensors; the second
    capture traces nothing and writes the same graph byte for byte (what the whole export then writes the same:
    measured on T5, GPT-2 and Whisper, every graph and weights.data)."""
    from elx.exporter.capture.onnx_export import export_encoder
    from elx.exporter.capture.stitched import Capture
    from elx.exporter.families.catalog import family_for_architecture

    monkeypatch.setenv("ELX_CAPTURE_PARALLEL", "0")
    monkeypatch.setenv("ELX_TEMPLATE_BUILDER", "0")  # traced (with the builders on, T5's graphs are built whole)
    torch.manual_seed(0)
    model = BUILDERS["t5"]().eval()
    family = family_for_architecture(type(model).__name__)
    records, logs = [], []
    for run in ("first", "second"):
        (tmp_path / run).mkdir()
        lines = []
        capture = Capture(model, family, tmp_path / run, report=lines.append)
        try:
            export_encoder(model, family, tmp_path / run / "encoder.onnx", capture)
        finally:
            capture.close()
        records.append(capture.records["encoder.onnx"])
        logs.append("\n".join(lines))
    assert len([e for e in cache.iterdir() if not e.name.startswith(".")]) == 1
    assert records[0]["method"] == records[1]["method"] == "traced"
    assert records[0]["from_cache"] is False and records[1]["from_cache"] is True
    assert "encoder.onnx: traced whole by an earlier export, from the cache" in logs[1]
    assert "from the cache" not in logs[0]
    assert _files(tmp_path / "first") == _files(tmp_path / "second") != {}

def test_a_whole_graphs_key_follows_every_tensor_and_a_large_model_is_not_kept(cache, monkeypatch):
    from elx.exporter.capture.onnx_export import _encoder_spec
    from elx.exporter.families.catalog import family_for_architecture

    torch.manual_seed(0)
    model = BUILDERS["t5"]().eval()
    spec = _encoder_spec(model, family_for_architecture(type(model).__name__))
    key = template_cache.whole_graph_key("encoder.onnx", spec, model)
    assert key and key != template_cache.whole_graph_key("decoder.onnx", spec, model)
    with torch.no_grad():
        model.encoder.block[0].layer[1].DenseReluDense.wi.weight[0, 0] += 1e-3  # a layer's weight: in the graph
    assert template_cache.whole_graph_key("encoder.onnx", spec, model) != key
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    monkeypatch.setenv("ELX_TEMPLATE_CACHE_GB", str(9 * size / 1e9))  # a tenth of it is less than the model
    assert template_cache.model_digest(model) is None and template_cache.whole_graph_key("encoder.onnx", spec,
                                                                                         model) is None

def _template(seed: int = 0):
    from elx.exporter.capture.decoder_only import _prefill_spec
    from elx.exporter.capture.template import make_template
    from elx.exporter.families.catalog import family_for_architecture

    torch.manual_seed(seed)
    model = BUILDERS["llama"](num_hidden_layers=5).eval()
    template = make_template(model)
    return model, template, _prefill_spec(template.model, family_for_architecture(type(model).__name__))


def test_the_key_follows_the_models_own_tensors_not_its_layers_weights(cache):
    model, template, spec = _template()
    key = template_cache.template_key("prefill.onnx", spec, template)
    assert key == template_cache.template_key("prefill.onnx", spec, _template()[1])  # the same model: the same key
    assert key != template_cache.template_key("decoder.onnx", spec, template)
    with torch.no_grad():
        model.model.layers[4].mlp.up_proj.weight.add_(1.0)  # a layer's weight: bound later, not in the template
    assert template_cache.template_key("prefill.onnx", spec, _rebuilt(model)) == key
    with torch.no_grad():
        model.model.embed_tokens.weight[7, 3] += 1e-3  # an embedding: the template holds it
    assert template_cache.template_key("prefill.onnx", spec, _rebuilt(model)) != key


def _rebuilt(model):
    from elx.exporter.capture.template import make_template

    return make_template(model)


def _graph(size: int = 4) -> onnx.ModelProto:
    weight = numpy_helper.from_array(np.arange(size, dtype=np.float32), "w")  # raw bytes: kept in the data file
    node = helper.make_node("Add", ["x", "w"], ["y"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [size])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [size])], [weight])
    return helper.make_model(graph)


def test_an_entry_is_whole_or_absent_and_a_broken_one_is_removed(cache):
    model = _graph(2048)
    assert template_cache.load("k1") is None
    assert template_cache.store("k1", model) is None
    assert template_cache.load("k1").SerializeToString() == model.SerializeToString()
    assert template_cache.store("k1", _graph(16)) is None  # a second export storing the same key: the first stays
    assert template_cache.load("k1").SerializeToString() == model.SerializeToString()
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]  # no partial folder left
    (cache / "k1" / (template_cache.ENTRY + ".data")).write_bytes(b"x")  # truncated tensors
    assert template_cache.load("k1") is None and not (cache / "k1").exists()


def _two_weights(size: int = 2048) -> onnx.ModelProto:
    """A graph of two weights of ``size`` floats each (both kept in the data file)."""
    weights = [numpy_helper.from_array(np.arange(size, dtype=np.float32) + i, f"w{i}") for i in range(2)]
    nodes = [helper.make_node("Add", ["x", "w0"], ["h"]), helper.make_node("Add", ["h", "w1"], ["y"])]
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [size]) for n in ("x", "y")]
    return helper.make_model(helper.make_graph(nodes, "g", io[:1], io[1:], weights))


def test_kept_bindings_spare_reading_the_bound_weights_and_a_damaged_entry_is_removed(cache):
    """``load_bound``: the unbound initializers read, the bound ones left without values (stitching points them at
    the user's model); bindings that name a missing initializer, or a data file shorter than the tensors it holds,
    remove the entry (the export traces again)."""
    from elx.exporter.capture.weights import Binding

    model = _two_weights()
    assert template_cache.load_bound("k") is None
    assert template_cache.store("k", model) is None
    assert template_cache.load_bound("k") is None  # no bindings kept yet: the whole template is read (``load``)
    bindings = {"w0": Binding("model.layers.1.mlp.up_proj.weight", "transpose", 0.0)}
    template_cache.store_bindings("k", bindings)
    loaded, found = template_cache.load_bound("k")
    assert found == bindings
    w0, w1 = loaded.graph.initializer
    assert not w0.raw_data and not w0.external_data and w0.data_location == TensorProto.DEFAULT
    np.testing.assert_array_equal(numpy_helper.to_array(w1), numpy_helper.to_array(model.graph.initializer[1]))
    assert not w1.external_data and w1.data_location == TensorProto.DEFAULT
    template_cache.store_bindings("k", {"w0": Binding("other", "identity", 0.0)})  # a second store keeps the first
    assert template_cache.load_bound("k")[1] == bindings

    data = cache / "k" / (template_cache.ENTRY + ".data")
    data.write_bytes(data.read_bytes()[:-4])  # the last tensor cut short (a bound one would be too)
    assert template_cache.load_bound("k") is None and not (cache / "k").exists()
    assert template_cache.store("k", model) is None
    (cache / "k" / template_cache.BINDINGS).write_text('{"w9": ["x", "identity", 0.0]}')
    assert template_cache.load_bound("k") is None and not (cache / "k").exists()


def test_a_cache_that_cannot_be_written_says_why_and_keeps_nothing(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("ELX_CACHE_DIR", str(blocker))
    why = template_cache.store("k", _graph())
    assert why and "Error" in why
    assert template_cache.load("k") is None


def test_the_least_recently_used_entries_go_when_the_cache_is_full(cache, monkeypatch):
    monkeypatch.setenv("ELX_TEMPLATE_CACHE_GB", str(3.5 * 40_000 / 1e9))  # room for three 40 kB entries, not four
    for i in range(3):
        assert template_cache.store(f"k{i}", _graph(10_000)) is None
        os.utime(cache / f"k{i}", (1000 + i, 1000 + i))
    template_cache.load("k0")  # used: now the most recent
    assert template_cache.store("k3", _graph(10_000)) is None
    assert sorted(p.name for p in cache.iterdir()) == ["k0", "k2", "k3"]


def test_the_cache_is_off_when_asked(monkeypatch):
    for value in ("0", "off", "false"):
        monkeypatch.setenv("ELX_TEMPLATE_CACHE", value)
        assert not template_cache.enabled()
    monkeypatch.setenv("ELX_TEMPLATE_CACHE", "1")
    assert template_cache.enabled()


@pytest.mark.parametrize("value", ["four", "-1", "nan"])
def test_a_malformed_cache_size_is_refused_in_one_line(value, monkeypatch):
    from elx.runners.errors import ElxError

    monkeypatch.setenv("ELX_TEMPLATE_CACHE", "1")
    monkeypatch.setenv("ELX_TEMPLATE_CACHE_GB", value)
    with pytest.raises(ElxError, match="ELX_TEMPLATE_CACHE_GB is .*a number >= 0"):
        template_cache.enabled()
