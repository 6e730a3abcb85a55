"""Llama's templates built from the weights (``exporter/capture/llama_builder.py``, issue 41) are the traced templates
node for node, and an export built on them verifies against PyTorch.

The comparison is canonical: op types, attributes, inputs by structure (constants by value, weights by their bytes),
module scopes (what the stitcher and int8's per-layer rule read); value names and node order may differ.  A
transformers, torch or onnxscript upgrade that changes the traced graph fails here first.  No timing is asserted.
(``tests/test_capture.py`` traces Llama's templates, ``ELX_TEMPLATE_BUILDER=0``, for the trace's own tests.)
"""
from __future__ import annotations

import hashlib
import json
from collections import Counter

import onnx
import pytest
from onnx import numpy_helper

from tests.conftest import BUILDERS, LONG, make_model_folder


def canonical(model: onnx.ModelProto) -> tuple[Counter, list]:
    graph, names = model.graph, {"": "none"}
    for value in graph.input:
        names[value.name] = "input:" + value.name
    for tensor in graph.initializer:
        array = numpy_helper.to_array(tensor)
        named = "" if tensor.name.startswith("val_") else tensor.name  # the exporter's own names say nothing
        digest = hashlib.sha1(array.dtype.str.encode() + repr(array.shape).encode() + array.tobytes()).hexdigest()
        names[tensor.name] = f"initializer:{named}:{digest}"
    nodes = Counter()
    for node in graph.node:
        meta = {p.key: p.value for p in node.metadata_props}
        scopes = json.loads(meta.get("pkg.torch.onnx.name_scopes", "[]").replace("'", '"'))[:-1]
        attributes = sorted((a.name, str(onnx.helper.get_attribute_value(a))) for a in node.attribute)
        key = repr((node.op_type, node.domain, [names[x] for x in node.input], attributes, scopes))
        digest = hashlib.sha1(key.encode()).hexdigest()
        nodes[digest] += 1
        for i, out in enumerate(node.output):
            names[out] = f"{digest}:{i}"
    return nodes, [names[o.name] for o in graph.output]


CONFIGS = [
    pytest.param({}, id="gqa-llama3-untied"),  # the tests' Llama: GQA, Llama 3 rotary scaling, untied head
    pytest.param(dict(num_key_value_heads=4, tie_word_embeddings=True, rope_scaling=None), id="mha-tied",
                 marks=pytest.mark.skipif(not LONG, reason="CI runs the GQA case; set ELX_LONG_TESTS=1")),
]


@pytest.mark.parametrize("overrides", CONFIGS)
def test_built_templates_are_the_traced_templates(overrides, monkeypatch):
    import torch

    from elx.exporter.capture import decoder_only, llama_builder
    from elx.exporter.capture.onnx_export import trace
    from elx.exporter.capture.template import make_template
    from elx.exporter.capture.weights import bind
    from elx.exporter.families.catalog import family_for_architecture

    model = BUILDERS["llama"](num_hidden_layers=5, **overrides).eval()
    family = family_for_architecture("LlamaForCausalLM")
    template = make_template(model)
    assert llama_builder.applies(template.model) is None
    specs = {"prefill": lambda m: decoder_only._prefill_spec(m, family),
             "step": lambda m: decoder_only._step_spec(m, family, "shared")[0]}
    for name, make_spec in specs.items():
        torch.manual_seed(0)
        spec = make_spec(template.model)
        built, bindings = llama_builder.build(spec.module, template.model, values=True)
        onnx.checker.check_model(built)
        sources = {n: t.detach().numpy() for n, t in [*template.model.named_parameters(remove_duplicate=False),
                                                       *template.model.named_buffers(remove_duplicate=False)]}
        assert bindings == bind(built.graph.initializer, sources), name  # what stitching would have found
        bare, bare_bindings = llama_builder.build(spec.module, template.model)  # the export's: no weight values
        assert bare_bindings == bindings and not any(t.raw_data for t in bare.graph.initializer if t.name in bindings)
        traced = trace(spec)
        (built_nodes, built_outputs), (traced_nodes, traced_outputs) = canonical(built), canonical(traced)
        assert sum(built_nodes.values()) == sum(traced_nodes.values()), name
        assert built_nodes == traced_nodes, (name, sum((built_nodes - traced_nodes).values()))
        assert built_outputs == traced_outputs, name
        assert [i.name for i in built.graph.input] == [i.name for i in traced.graph.input], name


def test_models_the_builder_does_not_describe_are_named_with_the_reason():
    from elx.exporter.capture import llama_builder

    assert "MistralForCausalLM" in llama_builder.applies(BUILDERS["mistral"]().eval())
    biased = BUILDERS["llama"](attention_bias=True).eval()
    assert "biases" in llama_builder.applies(biased)
    mqa = BUILDERS["llama"](num_key_value_heads=1).eval()
    assert "multi-query" in llama_builder.applies(mqa)
    assert llama_builder.build(object(), BUILDERS["llama"]().eval()) is None  # a wrapper it does not build


def test_an_export_on_built_templates_verifies_and_says_so(tmp_path, monkeypatch):
    """By default a Llama's templates are built: none traced (the cache empty), the graphs stitched from built
    templates and held to the export's verification against PyTorch like any other."""
    import io
    from contextlib import redirect_stderr

    from elx.exporter.export import export_model

    monkeypatch.delenv("ELX_TEMPLATE_BUILDER", raising=False)
    monkeypatch.setenv("ELX_CAPTURE", "stitch")
    monkeypatch.setenv("ELX_CACHE_DIR", str(tmp_path / "cache"))
    folder = make_model_folder(tmp_path, "llama", num_hidden_layers=5)
    stream = io.StringIO()
    with redirect_stderr(stream):
        out = export_model(str(folder), tmp_path / "out", progress="plain")
    log = stream.getvalue()
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    for graph in ("prefill", "decoder"):
        capture = manifest["graphs"][graph]["capture"]
        assert capture["method"] == "stitched" and capture["template_built"] is True, capture
    assert "built its 3-layer template from the weights" in log and "traced a 3-layer template" not in log, log
    assert "second process" not in log, log  # nothing forked for a built template
    assert manifest["verification"]["export"]["within"] is True
    assert out is not None


@pytest.mark.parametrize("value", ["2", "yes", "off"])
def test_a_malformed_builder_switch_is_refused_in_one_line(value, monkeypatch):
    from elx.exporter.capture import llama_builder
    from elx.runners.errors import ElxError

    monkeypatch.setenv("ELX_TEMPLATE_BUILDER", value)
    with pytest.raises(ElxError, match="ELX_TEMPLATE_BUILDER is .*use 1 .* or 0"):
        llama_builder.enabled()
    monkeypatch.setenv("ELX_TEMPLATE_BUILDER", "0")
    assert llama_builder.enabled() is False
