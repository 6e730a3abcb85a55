"""Templates built from the weights (``exporter/capture/builders.py``: Llama, Mistral, Qwen2, Qwen3, Gemma, Phi-3,
GPT-NeoX, GPT-2, OPT, T5, BART, Marian, mBART, Pegasus, M2M100/NLLB, Whisper; issue 41) are the traced templates node
for node, and an export built on them verifies against PyTorch.

The comparison is canonical: op types, attributes, inputs by structure (constants by value, weights by their bytes),
module scopes (what the stitcher and int8's per-layer rule read); value names and node order may differ.  A
transformers, torch or onnxscript upgrade that changes the traced graph fails here first (every case with
ELX_LONG_TESTS=1: ``tools/check_transformers_range.sh`` runs them; CI: Llama, Gemma, Phi-3, GPT-NeoX, Flan-T5,
Marian, M2M100, Whisper).  No timing is asserted.
(``tests/test_capture.py`` traces Llama's templates, ``ELX_TEMPLATE_BUILDER=0``, for the trace's own tests.)
"""
from __future__ import annotations

import hashlib
import json
import re
from collections import Counter

import onnx
import pytest
from onnx import numpy_helper

from tests.conftest import BUILDERS, LONG, make_model_folder


def canonical(model: onnx.ModelProto, names: dict | None = None) -> tuple[Counter, list]:
    """(the graph's nodes by canonical identity, its outputs'); ``names``, where given, receives each value's."""
    graph = model.graph
    names = {} if names is None else names
    names[""] = "none"
    for value in graph.input:
        names[value.name] = "input:" + value.name
    for tensor in graph.initializer:
        array = numpy_helper.to_array(tensor)
        # the exporter's own names say nothing: ``val_*``, and a folded constant named after its node (Gemma's
        # ``1 + w``: ``add_119``)
        named = "" if tensor.name.startswith("val_") or re.fullmatch(r"[a-z]+(_[a-z]+)*_[0-9]+", tensor.name) \
            else tensor.name
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
    # one key/value head, sliding window wider than the cases
    pytest.param("mistral", {}, id="mistral-mqa", marks=LONG_ONLY),
    pytest.param("qwen2", {}, id="qwen2-biases-tied", marks=LONG_ONLY),  # non-zero q/k/v biases, MHA, tied head
    # q/k RMSNorm per head, head_dim 16 != hidden / heads
    pytest.param("qwen3", {}, id="qwen3-head-norms", marks=LONG_ONLY),
    # Gemma: embeddings scaled by sqrt(d), RMSNorms by 1 + w (folded), GELU's tanh form, MQA, head_dim 16 != d / h,
    # a tied head of more than 8192 values (as every real Gemma's)
    pytest.param("gemma", dict(vocab_size=300), id="gemma-shifted-norms-gelu-large-tied-head"),
    # Phi-3: fused q/k/v and gate/up products sliced and split, half the head rotated (partial_rotary_factor 0.5),
    # grouped-query (as Phi-3-medium; its queries grouped by a view, not Llama's computed rows)
    pytest.param("phi3", dict(num_key_value_heads=2), id="phi3-fused-partial-rotary-gqa"),
    # Phi-3-mini's: all of the head rotated (the slicing folded away), MHA
    pytest.param("phi3", dict(partial_rotary_factor=1.0), id="phi3-full-rotary-mha", marks=LONG_ONLY),
    # GPT-NeoX (Pythia): LayerNorms, biased fused q/k/v viewed per head and split, a quarter of each head rotated,
    # parallel residual, exact GELU, untied head
    pytest.param("gpt_neox", {}, id="gpt-neox-parallel-residual"),
    # a tied head of more than 8192 values (kept a Transpose by the optimizer, as GPT-2's 50257 x 768), n_inner set
    # (CI time: GPT-2's and OPT's built exports run in CI, verified against PyTorch with their Gemm heads; their
    # canonical comparisons with the trace run with ELX_LONG_TESTS=1, as before a transformers upgrade)
    pytest.param("gpt2", dict(vocab_size=300, n_inner=80), id="gpt2-large-tied-head", marks=LONG_ONLY),
    pytest.param("gpt2", {}, id="gpt2-small-head", marks=LONG_ONLY),  # a head of 4096 values: stored transposed
    pytest.param("opt", dict(vocab_size=300, ffn_dim=48), id="opt-large-tied-head", marks=LONG_ONLY),
    pytest.param("opt", {}, id="opt-small-head", marks=LONG_ONLY),
    # the encoder, cross K/V and decoder step; a tied head of 9600 values (a Transpose, as t5-small's)
    pytest.param("t5", dict(vocab_size=300), id="t5-large-tied-head", marks=LONG_ONLY),
    # T5 v1.1 / Flan-T5: gated tanh-GELU feed-forward, a config saved untied (no d_model^-0.5 before the head)
    pytest.param("t5", dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False, vocab_size=300),
                 id="flan-t5-gated-unscaled"),
    pytest.param("t5-wide", {}, id="t5-wide-small-head", marks=LONG_ONLY),  # heads x d_kv = 48 != d_model = 32
    pytest.param("t5", dict(relative_attention_num_buckets=32, relative_attention_max_distance=64, num_heads=2,
                            d_kv=16), id="t5-32-buckets", marks=LONG_ONLY),
    # + final_logits_bias, LayerNormalization, learned positions offset by 2
    pytest.param("bart", dict(vocab_size=300), id="bart-large-tied-head", marks=LONG_ONLY),
    pytest.param("bart-biased", {}, id="bart-biased-small-head", marks=LONG_ONLY),
    # opus-mt's: sinusoidal positions, embeddings scaled by sqrt(d_model), SiLU ("swish"); BART's graph otherwise
    pytest.param("marian", dict(activation_function="swish", scale_embedding=True), id="marian-swish-scaled"),
    # pre-LayerNorm with the stacks' final LayerNorms
    pytest.param("mbart", dict(vocab_size=300, scale_embedding=True), id="mbart-pre-norm-scaled", marks=LONG_ONLY),
    # Marian's sinusoidal, scaled embeddings with mBART's pre-LayerNorm and final norms; ReLU
    pytest.param("pegasus", dict(activation_function="relu", scale_embedding=True, vocab_size=300),
                 id="pegasus-relu-scaled", marks=LONG_ONLY),
    # M2M100 / NLLB: positions counted past the padding id from the tokens, embeddings scaled in their module
    pytest.param("m2m100", dict(activation_function="relu", scale_embedding=True, vocab_size=300),
                 id="m2m100-padded-positions"),
    pytest.param("bart", dict(scale_embedding=True), id="bart-scaled-embeddings", marks=LONG_ONLY),
    # convolutions over log-mel features, fixed 1500 positions, queries scaled first, the step's sizes read elsewhere
    pytest.param("whisper", dict(vocab_size=300), id="whisper-tied-head"),
]


def layers(family: str, count: int) -> dict:
    """The config overrides giving ``family``'s model ``count`` layers per stack."""
    if family.startswith("t5"):
        return dict(num_layers=count, num_decoder_layers=count)
    if family.startswith(("bart", "marian", "mbart", "pegasus", "m2m100", "whisper")):
        return dict(encoder_layers=count, decoder_layers=count)
    return {{"gpt2": "n_layer"}.get(family, "num_hidden_layers"): count}


def trained_like(model):
    """``model`` with its small tensors outside the layer stacks (norms, embedding norms) drawn at random, as in a
    trained model: a fresh model's are ones and zeros, and the exporter merges equal small initializers (onnxscript's
    ``DeduplicateInitializersPass``, up to 1024 values), so its trace would read one LayerNorm's weight for
    another's.  The same function either way; the builders write one initializer per weight."""
    import torch

    from elx.exporter.capture.template import STACK

    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if not STACK.match(name) and tensor.numel() <= 1024:
                tensor.copy_(torch.randn(tensor.shape, generator=generator))
    return model


def graph_specs(model, family) -> dict:
    """{graph: its spec maker} for the wrappers a builder writes, as the export makes them."""
    from elx.exporter.capture import decoder_only, onnx_export

    if family.is_encoder_decoder:
        return {"encoder": lambda m: onnx_export._encoder_spec(m, family),
                "cross_kv": lambda m: onnx_export._cross_kv_spec(m, family),
                "decoder": lambda m: onnx_export.decoder_spec(m, family)[0]}
    return {"prefill": lambda m: decoder_only._prefill_spec(m, family),
            "step": lambda m: decoder_only._step_spec(m, family, "shared")[0]}


@pytest.mark.parametrize("family,overrides", CONFIGS)
def test_built_templates_are_the_traced_templates(family, overrides, monkeypatch):
    import torch

    from elx.exporter.capture import builders
    from elx.exporter.capture.onnx_export import trace
    from elx.exporter.capture.template import make_template
    from elx.exporter.capture.weights import bind
    from elx.exporter.families.catalog import family_for_architecture

    from tests.differential import LOCAL_BUILDERS

    torch.manual_seed(0)
    model = trained_like({**BUILDERS, **LOCAL_BUILDERS}[family](**layers(family, 5), **overrides).eval())
    family = family_for_architecture(type(model).__name__)
    template = make_template(model)
    builder = builders.for_model(template.model)
    assert builder is not None and builder.applies(template.model) is None
    for name, make_spec in graph_specs(model, family).items():
        torch.manual_seed(0)
        spec = make_spec(template.model)
        built, bindings = builders.build(builder, spec.module, template.model, values=True)
        onnx.checker.check_model(built)
        sources = {n: t.detach().numpy() for n, t in [*template.model.named_parameters(remove_duplicate=False),
                                                       *template.model.named_buffers(remove_duplicate=False)]}
        found = bind(built.graph.initializer, sources)  # what stitching would have found by value
        assert set(found) == set(bindings), name
        for key, binding in bindings.items():  # or a tensor of the same values (T5's two all-ones final norms)
            assert binding == found[key] or (binding.transform == found[key].transform and binding.shift == found[key].shift
                                             and (sources[binding.source] == sources[found[key].source]).all()), key
        bare, bare_bindings = builders.build(builder, spec.module, template.model)  # the export's: no weight values
        assert bare_bindings == bindings and not any(t.raw_data for t in bare.graph.initializer if t.name in bindings)
        traced = trace(spec)
        (built_nodes, built_outputs), (traced_nodes, traced_outputs) = canonical(built), canonical(traced)
        assert sum(built_nodes.values()) == sum(traced_nodes.values()), name
        assert built_nodes == traced_nodes, (name, sum((built_nodes - traced_nodes).values()))
        assert built_outputs == traced_outputs, name
        assert [i.name for i in built.graph.input] == [i.name for i in traced.graph.input], name
        if family.is_encoder_decoder:  # the passes read these shapes (unpad: the rows [batch, sequence, features])
            rows = _row_shapes(built)
            assert rows == _row_shapes(traced), name
            assert rows or (family.name, name) == ("whisper", "encoder")  # (its rows are 1500 fixed positions)


def _row_shapes(model) -> dict:
    """{canonical value: its shape} of the rank-3 values whose first two dimensions are a graph input's."""
    ids = {}
    canonical(model, ids)
    graph = model.graph
    lead = {tuple(d.dim_param for d in v.type.tensor_type.shape.dim[:2]) for v in graph.input}
    shapes = {}
    for value in [*graph.value_info, *graph.output]:
        dims = [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]
        if len(dims) == 3 and tuple(dims[:2]) in lead and value.name in ids:
            shapes[ids[value.name]] = dims
    return shapes


def test_models_the_builder_does_not_describe_are_named_with_the_reason():
    from elx.exporter.capture import llama_builder

    for family in ("llama", "mistral", "qwen2", "qwen3", "gemma", "phi3"):
        assert llama_builder.applies(BUILDERS[family]().eval()) is None, family
    assert "GPTNeoXForCausalLM" in llama_builder.applies(BUILDERS["gpt_neox"]().eval())  # another graph
    longrope = dict(rope_type="longrope", short_factor=[1.0] * 2, long_factor=[2.0] * 2,
                    original_max_position_embeddings=64)
    assert "rotary type longrope" in llama_builder.applies(BUILDERS["phi3"](rope_scaling=longrope).eval())
    assert "activation gelu_new" in llama_builder.applies(BUILDERS["gemma"](hidden_act="gelu_new").eval())
    assert "activation gelu" in llama_builder.applies(BUILDERS["llama"](hidden_act="gelu").eval())
    scaled = BUILDERS["llama"](rope_scaling=dict(rope_type="linear", factor=2.0)).eval()
    assert "rotary type linear" in llama_builder.applies(scaled)
    assert "pretraining_tp" in llama_builder.applies(BUILDERS["qwen2"](pretraining_tp=2).eval())
    from elx.exporter.capture import builders

    assert builders.build(llama_builder, object(), BUILDERS["llama"]().eval()) is None  # a wrapper not built


def test_gpt_neox_models_the_builder_does_not_describe_are_named_with_the_reason():
    from elx.exporter.capture import builders, neox_builder

    assert builders.for_model(BUILDERS["gpt_neox"]().eval()) is neox_builder
    assert neox_builder.applies(BUILDERS["gpt_neox"]().eval()) is None
    for overrides, why in ((dict(use_parallel_residual=False), "sequential residual"),
                           (dict(hidden_act="relu"), "activation relu"),
                           (dict(attention_bias=False), "no attention biases"),
                           (dict(tie_word_embeddings=True), "tied to the embedding"),
                           (dict(rope_scaling=dict(rope_type="linear", factor=2.0)), "rotary type linear")):
        assert why in neox_builder.applies(BUILDERS["gpt_neox"](**overrides).eval()), why


def test_gpt2_models_the_builder_does_not_describe_are_named_with_the_reason():
    from elx.exporter.capture import builders, gpt2_builder

    assert builders.for_model(BUILDERS["gpt2"]().eval()) is gpt2_builder
    assert builders.for_model(BUILDERS["fsmt"]().eval()) is None  # no builder: traced
    for overrides, why in ((dict(activation_function="relu"), "activation relu"),
                           (dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
                           (dict(reorder_and_upcast_attn=True), "reorder_and_upcast_attn"),
                           (dict(scale_attn_weights=False), "unscaled attention")):
        assert why in gpt2_builder.applies(BUILDERS["gpt2"](**overrides).eval()), why


def test_t5_models_the_builder_does_not_describe_are_named_with_the_reason():
    from elx.exporter.capture import builders, t5_builder

    assert builders.for_model(BUILDERS["t5"]().eval()) is t5_builder and t5_builder.applies(BUILDERS["t5"]()) is None
    for overrides, why in ((dict(feed_forward_proj="gated-relu"), "feed-forward gated-relu"),
                           (dict(feed_forward_proj="gelu"), "feed-forward gelu"),
                           (dict(relative_attention_num_buckets=7), "odd relative_attention_num_buckets")):
        assert why in t5_builder.applies(BUILDERS["t5"](**overrides).eval()), why
    assert builders.build(t5_builder, object(), BUILDERS["t5"]().eval()) is None  # a wrapper it does not build


def test_bart_models_the_builder_does_not_describe_are_named_with_the_reason():
    from elx.exporter.capture import bart_builder, builders

    assert builders.for_model(BUILDERS["bart"]().eval()) is bart_builder and bart_builder.applies(BUILDERS["bart"]()) is None
    assert "activation relu" not in (bart_builder.applies(BUILDERS["bart"](activation_function="relu").eval()) or "")
    for overrides, why in ((dict(activation_function="gelu_new"), "activation gelu_new"),
                           (dict(tie_word_embeddings=False), "untied head")):
        assert why in (bart_builder.applies(BUILDERS["bart"](**overrides).eval()) or ""), why
    for family in ("mbart", "pegasus", "m2m100"):  # pre-LayerNorm; sinusoidal; padded positions
        model = BUILDERS[family]().eval()
        assert builders.for_model(model) is bart_builder and bart_builder.applies(model) is None, family
    assert "activation gelu_new" in bart_builder.applies(BUILDERS["m2m100"](activation_function="gelu_new").eval())
    from tests.differential import LOCAL_BUILDERS

    marian = LOCAL_BUILDERS["marian"]
    assert builders.for_model(marian().eval()) is bart_builder and bart_builder.applies(marian(scale_embedding=True)) is None
    assert "activation tanh" in bart_builder.applies(marian(activation_function="tanh").eval())


def test_whisper_models_the_builder_does_not_describe_are_named_with_the_reason():
    from elx.exporter.capture import builders, whisper_builder

    assert builders.for_model(BUILDERS["whisper"]().eval()) is whisper_builder
    assert whisper_builder.applies(BUILDERS["whisper"]().eval()) is None
    for overrides, why in ((dict(activation_function="relu"), "activation relu"),
                           (dict(tie_word_embeddings=False), "untied head")):
        assert why in (whisper_builder.applies(BUILDERS["whisper"](**overrides).eval()) or ""), why
    import torch

    keyed = BUILDERS["whisper"]().eval()  # HF's Whisper has no key bias; a model given one is not described
    projection = keyed.model.decoder.layers[0].encoder_attn.k_proj
    projection.bias = torch.nn.Parameter(torch.zeros(projection.out_features))
    assert "key biases" in whisper_builder.applies(keyed)


def test_opt_models_the_builder_does_not_describe_are_named_with_the_reason():
    from elx.exporter.capture import builders, opt_builder

    assert builders.for_model(BUILDERS["opt"]().eval()) is opt_builder
    for overrides, why in ((dict(do_layer_norm_before=False), "post-LayerNorm"),  # OPT-350M
                           (dict(word_embed_proj_dim=16), "project_in/project_out"),
                           (dict(activation_function="gelu"), "activation gelu"), (dict(enable_bias=False), "no biases")):
        assert why in opt_builder.applies(BUILDERS["opt"](**overrides).eval()), why


@pytest.mark.parametrize("family,overrides", [("llama", {}), ("qwen3", {}), ("mistral", {}),
                                             ("gemma", dict(vocab_size=300)), ("phi3", dict(num_key_value_heads=2)),
                                             ("gpt_neox", {}),
                                             # tied heads of more than 8192 values: the optimizer keeps a Transpose
                                             ("qwen2", dict(vocab_size=300)), ("gpt2", dict(vocab_size=300)),
                                             ("opt", dict(vocab_size=300)), ("t5", dict(vocab_size=300)),
                                             ("bart", dict(vocab_size=300)), ("mbart", {}), ("m2m100", {}),
                                             pytest.param("pegasus", {}, marks=LONG_ONLY),
                                             pytest.param("whisper", {}, marks=LONG_ONLY)])
def test_an_export_on_built_templates_verifies_and_says_so(family, overrides, tmp_path, monkeypatch):  # ~1-6 s each
    """By default the templates of the families ``builders.py`` covers are built: none traced (the cache empty), the
    graphs stitched from built templates and held to the export's verification against PyTorch like any other; a
    T5's take the passes that read its shapes (unpad) and verify again."""
    import io
    from contextlib import redirect_stderr

    from elx.exporter.export import export_model

    monkeypatch.delenv("ELX_TEMPLATE_BUILDER", raising=False)
    monkeypatch.setenv("ELX_CAPTURE", "stitch")
    monkeypatch.setenv("ELX_CACHE_DIR", str(tmp_path / "cache"))
    folder = make_model_folder(tmp_path, family, **layers(family, 5), **overrides)
    stream = io.StringIO()
    with redirect_stderr(stream):
        out = export_model(str(folder), tmp_path / "out", progress="plain")
    log = stream.getvalue()
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    seq2seq = family in ("t5", "bart", "mbart", "m2m100", "pegasus", "whisper")
    for graph in ("encoder", "cross_kv", "decoder") if seq2seq else ("prefill", "decoder"):
        capture = manifest["graphs"][graph]["capture"]
        assert capture["method"] == "stitched" and capture["template_built"] is True, capture
    assert "built its 3-layer template from the weights" in log and "traced a 3-layer template" not in log, log
    assert "built whole" not in log, log  # 5 layers: stitched (a model of 3 or fewer is built whole)
    assert "second process" not in log, log  # nothing forked for a built template
    assert manifest["verification"]["export"]["within"] is True
    assert out is not None
    if family in ("t5", "llama"):  # (BART's el and unpad: the canonical test's shapes, and tests/test_unpad.py)
        from elx.exporter.export import apply_passes

        # a built prefill without its values' shapes was refused by unpad ("found no products ... on [batch,
        # sequence, d] activations") until the 20th session: every stitched Llama, Mistral, Qwen, GPT-2, OPT
        passes, graph = ("el,unpad", "encoder") if family == "t5" else ("unpad", "prefill")
        passed = json.loads((apply_passes(out, tmp_path / "unpad", passes, quiet=True) / "manifest.json").read_text())
        assert passed["graphs"][graph]["file"] == f"{graph}.unpad.onnx"
        assert passed["verification"]["export"]["within"] is True
    if "vocab_size" in overrides:  # the tied head over the last position: a Gemm on the embedding, no Transpose for ORT
        # to fold
        graph = onnx.load(str(tmp_path / "out" / ("decoder.onnx" if seq2seq else "prefill.onnx")),
                          load_external_data=False).graph
        logits = next(n for n in graph.node if "logits" in n.output)
        if logits.op_type == "Add":  # BART's final_logits_bias after the head
            logits = next(n for n in graph.node if logits.input[0] in n.output)
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
