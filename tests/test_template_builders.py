"""Templates built from the weights (``exporter/capture/builders.py``: Llama, Mistral, Qwen2, Qwen3, GPT-2, OPT; issue 41)
are the traced templates node for node, and an export built on them verifies against PyTorch.

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


LONG_ONLY = pytest.mark.skipif(not LONG, reason="CI runs one case of each kind; set ELX_LONG_TESTS=1")
CONFIGS = [
    pytest.param("llama", {}, id="llama-gqa-llama3-untied"),  # GQA, Llama 3 rotary scaling, untied head
    pytest.param("llama", dict(num_key_value_heads=4, tie_word_embeddings=True, rope_scaling=None), id="llama-mha-tied",
                 marks=LONG_ONLY),
    pytest.param("llama", dict(attention_bias=True, mlp_bias=True), id="llama-biases", marks=LONG_ONLY),
    pytest.param("mistral", {}, id="mistral-mqa"),  # one key/value head, sliding window wider than the cases
    pytest.param("qwen2", {}, id="qwen2-biases-tied", marks=LONG_ONLY),  # non-zero q/k/v biases, MHA, tied head
    pytest.param("qwen3", {}, id="qwen3-head-norms"),  # q/k RMSNorm per head, head_dim 16 != hidden / heads
    # a tied head of more than 8192 values (kept a Transpose by the optimizer, as GPT-2's 50257 x 768), n_inner set
    pytest.param("gpt2", dict(vocab_size=300, n_inner=80), id="gpt2-large-tied-head"),
    pytest.param("gpt2", {}, id="gpt2-small-head", marks=LONG_ONLY),  # a head of 4096 values: stored transposed
    pytest.param("opt", dict(vocab_size=300, ffn_dim=48), id="opt-large-tied-head"),
    pytest.param("opt", {}, id="opt-small-head", marks=LONG_ONLY),
]
LAYERS = {"gpt2": "n_layer"}  # the config's name for the layer count (else num_hidden_layers)


@pytest.mark.parametrize("family,overrides", CONFIGS)
def test_built_templates_are_the_traced_templates(family, overrides, monkeypatch):
    import torch

    from elx.exporter.capture import builders, decoder_only
    from elx.exporter.capture.onnx_export import trace
    from elx.exporter.capture.template import make_template
    from elx.exporter.capture.weights import bind
    from elx.exporter.families.catalog import family_for_architecture

    torch.manual_seed(0)
    model = BUILDERS[family](**{LAYERS.get(family, "num_hidden_layers"): 5}, **overrides).eval()
    family = family_for_architecture(type(model).__name__)
    template = make_template(model)
    builder = builders.for_model(template.model)
    assert builder is not None and builder.applies(template.model) is None
    specs = {"prefill": lambda m: decoder_only._prefill_spec(m, family),
             "step": lambda m: decoder_only._step_spec(m, family, "shared")[0]}
    for name, make_spec in specs.items():
        torch.manual_seed(0)
        spec = make_spec(template.model)
        built, bindings = builders.build(builder, spec.module, template.model, values=True)
        onnx.checker.check_model(built)
        sources = {n: t.detach().numpy() for n, t in [*template.model.named_parameters(remove_duplicate=False),
                                                       *template.model.named_buffers(remove_duplicate=False)]}
        assert bindings == bind(built.graph.initializer, sources), name  # what stitching would have found
        bare, bare_bindings = builders.build(builder, spec.module, template.model)  # the export's: no weight values
        assert bare_bindings == bindings and not any(t.raw_data for t in bare.graph.initializer if t.name in bindings)
        traced = trace(spec)
        (built_nodes, built_outputs), (traced_nodes, traced_outputs) = canonical(built), canonical(traced)
        assert sum(built_nodes.values()) == sum(traced_nodes.values()), name
        assert built_nodes == traced_nodes, (name, sum((built_nodes - traced_nodes).values()))
        assert built_outputs == traced_outputs, name
        assert [i.name for i in built.graph.input] == [i.name for i in traced.graph.input], name


def test_models_the_builder_does_not_describe_are_named_with_the_reason():
    from elx.exporter.capture import llama_builder

    for family in ("llama", "mistral", "qwen2", "qwen3"):
        assert llama_builder.applies(BUILDERS[family]().eval()) is None, family
    assert "Phi3ForCausalLM" in llama_builder.applies(BUILDERS["phi3"]().eval())  # fused q/k/v: another graph
    assert "GemmaForCausalLM" in llama_builder.applies(BUILDERS["gemma"]().eval())
    assert "activation gelu" in llama_builder.applies(BUILDERS["llama"](hidden_act="gelu").eval())
    scaled = BUILDERS["llama"](rope_scaling=dict(rope_type="linear", factor=2.0)).eval()
    assert "rotary type linear" in llama_builder.applies(scaled)
    assert "pretraining_tp" in llama_builder.applies(BUILDERS["qwen2"](pretraining_tp=2).eval())
    from elx.exporter.capture import builders

    assert builders.build(llama_builder, object(), BUILDERS["llama"]().eval()) is None  # a wrapper not built


def test_gpt2_models_the_builder_does_not_describe_are_named_with_the_reason():
    from elx.exporter.capture import builders, gpt2_builder

    assert builders.for_model(BUILDERS["gpt2"]().eval()) is gpt2_builder
    assert builders.for_model(BUILDERS["gemma"]().eval()) is None  # no builder: traced
    for overrides, why in ((dict(activation_function="relu"), "activation relu"),
                           (dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
                           (dict(reorder_and_upcast_attn=True), "reorder_and_upcast_attn"),
                           (dict(scale_attn_weights=False), "unscaled attention")):
        assert why in gpt2_builder.applies(BUILDERS["gpt2"](**overrides).eval()), why


def test_opt_models_the_builder_does_not_describe_are_named_with_the_reason():
    from elx.exporter.capture import builders, opt_builder

    assert builders.for_model(BUILDERS["opt"]().eval()) is opt_builder
    for overrides, why in ((dict(do_layer_norm_before=False), "post-LayerNorm"),  # OPT-350M
                           (dict(word_embed_proj_dim=16), "project_in/project_out"),
                           (dict(activation_function="gelu"), "activation gelu"), (dict(enable_bias=False), "no biases")):
        assert why in opt_builder.applies(BUILDERS["opt"](**overrides).eval()), why


@pytest.mark.parametrize("family,overrides", [("llama", {}), ("qwen3", {}), ("mistral", {}),
                                             # tied heads of more than 8192 values: the optimizer keeps a Transpose
                                             ("qwen2", dict(vocab_size=300)), ("gpt2", dict(vocab_size=300)),
                                             ("opt", dict(vocab_size=300))])
def test_an_export_on_built_templates_verifies_and_says_so(family, overrides, tmp_path, monkeypatch):  # ~1-6 s each
    """By default the templates of a Llama (Mistral, Qwen2, Qwen3) are built: none traced (the cache empty), the
    graphs stitched from built templates and held to the export's verification against PyTorch like any other."""
    import io
    from contextlib import redirect_stderr

    from elx.exporter.export import export_model

    monkeypatch.delenv("ELX_TEMPLATE_BUILDER", raising=False)
    monkeypatch.setenv("ELX_CAPTURE", "stitch")
    monkeypatch.setenv("ELX_CACHE_DIR", str(tmp_path / "cache"))
    folder = make_model_folder(tmp_path, family, **{LAYERS.get(family, "num_hidden_layers"): 5}, **overrides)
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
    if overrides:  # the tied head over the last position: a Gemm on the embedding, no Transpose for ORT to fold
        graph = onnx.load(str(tmp_path / "out" / "prefill.onnx"), load_external_data=False).graph
        logits = next(n for n in graph.node if "logits" in n.output)
        assert logits.op_type == "Gemm" and onnx.helper.get_attribute_value(logits.attribute[0]) == 1, logits
        assert not any(n.op_type == "Transpose" and n.input[0] == logits.input[1] for n in graph.node)


@pytest.mark.parametrize("value", ["2", "yes", "off"])
def test_a_malformed_builder_switch_is_refused_in_one_line(value, monkeypatch):
    from elx.exporter.capture import llama_builder
    from elx.runners.errors import ElxError

    monkeypatch.setenv("ELX_TEMPLATE_BUILDER", value)
    with pytest.raises(ElxError, match="ELX_TEMPLATE_BUILDER is .*use 1 .* or 0"):
        llama_builder.enabled()
    monkeypatch.setenv("ELX_TEMPLATE_BUILDER", "0")
    assert llama_builder.enabled() is False
