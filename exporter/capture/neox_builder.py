"""GPT-NeoX's prefill and shared-prompt step templates built from the weights, without torch.export (issue 41).

The mechanism of ``exporter/capture/llama_builder.py`` for ``GPTNeoXForCausalLM`` (Pythia, GPT-NeoX-20B): LayerNorms
with biases; one ``query_key_value`` product (with its bias) viewed per head as ``[q | k | v]`` and split after the
heads' transpose; the rotation over the first ``rotary_pct`` of each head (``llama_builder.Rotary``); the dense out
projection; the parallel residual (``x + attention(ln1(x)) + mlp(ln2(x))``, both norms reading the layer's input);
an exact-GELU feed-forward with biases; the untied ``lm_head``.  The step's shared-prompt attention is
``llama_builder.StepSizes``' (the same wrapper).  The nodes are those ``trace`` writes for the template, checked
canonically against it (``tests/test_template_builders.py``).

``applies(model)`` refuses the variants whose graph differs: the sequential residual
(``use_parallel_residual=False``), another activation, no attention biases, a head tied to the embedding, a rotary
type other than the default; those are traced.
"""
from __future__ import annotations

import numpy as np

from elx.exporter.capture.gpt2_builder import _layer_norm, _once
from elx.exporter.capture.llama_builder import (_head, activation, linear, prefill_graph, prefill_start, rotary,
                                                step_graph, step_start, why_not)

CLASSES = ("GPTNeoXForCausalLM",)


def applies(model) -> str | None:
    """None where ``build_prefill``/``build_step`` give the traced templates of ``model``; else why not."""
    def checks(model):
        c = model.config
        rope = getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {}
        return {
            "sequential residual (use_parallel_residual=False)": not c.use_parallel_residual,
            f"activation {c.hidden_act}": type(model.gpt_neox.layers[0].mlp.act).__name__ != "GELUActivation",
            "no attention biases": not getattr(c, "attention_bias", True),
            "a head tied to the embedding": model.lm_head.weight is model.gpt_neox.embed_in.weight,
            f"rotary type {rope.get('rope_type')}": rope.get("rope_type", "default") != "default",
            "rotary attention factor": float(getattr(model.gpt_neox.rotary_emb, "attention_scaling", 1.0)) != 1.0,
        }
    return why_not(model, CLASSES, checks)


class _Dims:
    def __init__(self, model):
        c = model.config
        self.layers, self.heads, self.vocab = c.num_hidden_layers, c.num_attention_heads, c.vocab_size
        self.d = c.hidden_size // self.heads


def _start(e, n: _Dims):
    """Into ``model`` / ``model.gpt_neox``: the token embedding and the rotary tables."""
    e.enter("model")
    e.enter("model.gpt_neox")
    name = "model.gpt_neox.embed_in.weight"
    e.weight(name, name)
    e.enter("model.gpt_neox.embed_in")
    x = e("Gather", [name, "input_ids"], "embedding", dict(axis=0))
    e.leave()
    return x, rotary(e, "model.gpt_neox.rotary_emb", n.d)


def _layer(e, x, i: int, heads_view, attention):
    """Layer ``i``: ``attention(q, k, v, i)`` (heads merged) over the first LayerNorm's q/k/v, the dense projection,
    the feed-forward over the second LayerNorm of the same input, both added to it."""
    lp = f"model.gpt_neox.layers.{i}"
    e.enter(lp)

    def t(name):
        return e.weight(f"val_w{i}_{name}", f"{lp}.{name}.weight", transposed=True)

    h = _layer_norm(e, x, f"{lp}.input_layernorm")
    e.enter(f"{lp}.attention")
    qkv = linear(e, h, t("attention.query_key_value"), f"{lp}.attention.query_key_value")
    qkv = e("Transpose", [e("Reshape", [qkv, heads_view()], "view", dict(allowzero=1))], "transpose",
            dict(perm=[0, 2, 1, 3]))
    q, k, v = e("Split", [qkv], "split", dict(axis=3, num_outputs=3), outputs=3, bare=True)
    o = linear(e, attention(q, k, v, i), t("attention.dense"), f"{lp}.attention.dense")
    e.leave()
    h = _layer_norm(e, x, f"{lp}.post_attention_layernorm")
    e.enter(f"{lp}.mlp")
    h = linear(e, h, t("mlp.dense_h_to_4h"), f"{lp}.mlp.dense_h_to_4h")
    h = linear(e, activation(e, h, f"{lp}.mlp.act"), t("mlp.dense_4h_to_h"), f"{lp}.mlp.dense_4h_to_h")
    e.leave()
    x = e("Add", [e("Add", [h, o], "add"), x], "add")
    e.leave()
    return x


def _finish(e, x, model):
    x = _layer_norm(e, x, "model.gpt_neox.final_layer_norm")
    e.leave()  # model.gpt_neox
    _head(e, x, model, False)


def _rename_value(e, i: int, v: str) -> str:
    """The prefill's split writes the value head as the graph output ``present.i.value`` (the trace names it so)."""
    split = next(n for n in reversed(e.nodes) if v in n.output)
    split.output[list(split.output).index(v)] = f"present.{i}.value"
    return f"present.{i}.value"


def build_prefill(template_model, values: bool = False,
                  wrapper_class="elx.exporter.capture.decoder_only.PrefillGraph") -> tuple:
    """(``decoder_only.PrefillGraph``'s graph over GPT-NeoX ``template_model``, its bindings)."""
    model, n = template_model, _Dims(template_model)
    e, b_shape, p_shape, mask = prefill_start(model, values, wrapper_class)
    C = e.const
    x, rope = _start(e, n)
    heads_view = _once(lambda: e("Concat", [b_shape, p_shape, C([-1]), C([3 * n.d])], "view", dict(axis=0)))
    merged = _once(lambda: e("Concat", [b_shape, p_shape, C([-1])], "view", dict(axis=0)))
    scaling = C(np.float32(n.d ** -0.5), np.float32)

    def attention(q, k, v, i):
        v = _rename_value(e, i, v)
        q, k = rope(q), rope(k, out=f"present.{i}.key")
        s = e("MatMul", [q, e("Transpose", [k], "transpose", dict(perm=[0, 1, 3, 2]))], "matmul")
        s = e("Add", [e("Mul", [s, scaling], "mul"), mask], "add")
        o = e("MatMul", [e("Softmax", [s], "softmax", dict(axis=-1)), v], "matmul")
        o = e("Transpose", [o], "transpose", dict(perm=[0, 2, 1, 3]))
        return e("Reshape", [o, merged()], "view", dict(allowzero=1))

    for i in range(n.layers):
        x = _layer(e, x, i, heads_view, attention)
    _finish(e, x, model)
    return prefill_graph(e, n.layers, n.heads, n.d, n.vocab)


def build_step(template_model, values: bool = False,
               wrapper_class="elx.exporter.capture.decoder_only.SharedPromptStepGraph") -> tuple:
    """The shared-prompt step template (``decoder_only.SharedPromptStepGraph``) over GPT-NeoX ``template_model``."""
    model, n = template_model, _Dims(template_model)
    e, step = step_start(model, values, wrapper_class, n.layers, n.heads, n.heads, n.d)
    C = e.const
    x, rope = _start(e, n)
    scaling = C(np.float32(n.d ** -0.5), np.float32)

    def attention(q, k, v, i):
        return step.attention(rope(q), rope(k), v, i, scaling)

    for i in range(n.layers):
        x = _layer(e, x, i, lambda: C([-1, 1, n.heads, 3 * n.d]), attention)
    _finish(e, x, model)
    return step_graph(e, n.layers, n.heads, n.d, n.vocab)
