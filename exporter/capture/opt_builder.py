"""OPT's prefill and shared-prompt step templates built from the weights, without torch.export (issue 41).

The mechanism of ``exporter/capture/llama_builder.py`` for ``OPTForCausalLM`` (pre-LayerNorm OPT: 125M, 1.3B and
up): learned positions offset by 2, q/k/v/out projections with biases (the query scaled before the scores), the
feed-forward on the flattened rows (two Gemms around a ReLU, weights as stored), and the step's shared-prompt
attention of ``llama_builder.StepSizes`` (the same wrapper).  The nodes are those ``trace`` writes for the template
(checked canonically against it in ``tests/test_template_builders.py``).

Measured on OPT-125M's dims (this 2-core VM, ``tools/measure_export_speed.py``): a first export traced its two
templates in 6.8 s and 15.0 s (a second process) of its 25.0 s.

``applies(model)`` refuses the variants whose graph differs: OPT-350M's post-LayerNorm layers and its
``project_in``/``project_out``, another activation, no biases, LayerNorms without weights; those are traced.
"""
from __future__ import annotations

import numpy as np

from elx.exporter.capture.gpt2_builder import _layer_norm, _once
from elx.exporter.capture.llama_builder import (_head, linear, prefill_graph, prefill_start, step_graph, step_start,
                                                why_not)

CLASSES = ("OPTForCausalLM",)


def applies(model) -> str | None:
    """None where ``build_prefill``/``build_step`` give the traced templates of ``model``; else why not."""
    def checks(model):
        c, decoder = model.config, model.model.decoder
        return {
            "post-LayerNorm layers (do_layer_norm_before=False)": not c.do_layer_norm_before,
            "project_in/project_out": decoder.project_in is not None or decoder.project_out is not None,
            f"activation {c.activation_function}": c.activation_function != "relu",
            "no biases": not getattr(c, "enable_bias", True),
            "LayerNorms without weights": not getattr(c, "layer_norm_elementwise_affine", True),
            "no final LayerNorm": decoder.final_layer_norm is None,
        }
    return why_not(model, CLASSES, checks)


class _Dims:
    def __init__(self, model):
        c = model.config
        self.layers, self.heads, self.hidden = c.num_hidden_layers, c.num_attention_heads, c.hidden_size
        self.d = self.hidden // self.heads
        self.tied = model.lm_head.weight is model.model.decoder.embed_tokens.weight
        self.vocab = c.vocab_size
        self.offset = int(getattr(model.model.decoder.embed_positions, "offset", 2))


def _embeddings(e, n: _Dims, ids_shape):
    """Into ``model`` / ``model.model.decoder`` (the trace records no scope of ``OPTModel``, which only calls its
    decoder): token and (offset) position embeddings added."""
    for path in ("model", "model.model.decoder"):
        e.enter(path)
    ids = e("Reshape", ["input_ids", ids_shape()], "view", dict(allowzero=1))
    name = "model.lm_head.weight" if n.tied else "model.model.decoder.embed_tokens.weight"
    e.weight(name, "model.model.decoder.embed_tokens.weight")
    e.enter("model.model.decoder.embed_tokens")
    tokens = e("Gather", [name, ids], "embedding", dict(axis=0))
    e.leave()
    table = e.weight("model.model.decoder.embed_positions.weight", "model.model.decoder.embed_positions.weight")
    e.enter("model.model.decoder.embed_positions")
    shifted = e("Add", ["position_ids", e.const(n.offset)], "add")
    positions = e("Gather", [table, shifted], "embedding", dict(axis=0))
    e.leave()
    return e("Add", [tokens, positions], "add")


def _layer(e, x, i: int, n: _Dims, heads_view, attention, rows_shape, out_shape):
    """Layer ``i``: LayerNorm, projections (the query scaled), ``attention(q, k, v, i)`` (heads merged), out
    projection, residual, the feed-forward on rows (``rows_shape``) and its residual, reshaped (``out_shape()``)."""
    lp = f"model.model.decoder.layers.{i}"
    e.enter(lp)
    h = _layer_norm(e, x, f"{lp}.self_attn_layer_norm")
    e.enter(f"{lp}.self_attn")

    def project(name):
        return linear(e, h, e.weight(f"val_w{i}_{name}", f"{lp}.self_attn.{name}.weight", transposed=True),
                      f"{lp}.self_attn.{name}")

    def heads(y):
        return e("Transpose", [e("Reshape", [y, heads_view()], "view", dict(allowzero=1))], "transpose",
                 dict(perm=[0, 2, 1, 3]))

    q = heads(e("Mul", [project("q_proj"), e.const(np.float32(n.d ** -0.5), np.float32)], "mul"))
    o = attention(q, project("k_proj"), project("v_proj"), i, heads)
    o = linear(e, o, e.weight(f"val_w{i}_out_proj", f"{lp}.self_attn.out_proj.weight", transposed=True),
               f"{lp}.self_attn.out_proj")
    e.leave()
    x = e("Add", [x, o], "add")
    rows = e("Reshape", [x, rows_shape], "view", dict(allowzero=1))
    h = _layer_norm(e, rows, f"{lp}.final_layer_norm")
    for name in ("fc1", "fc2"):
        if name == "fc2":
            e.enter(f"{lp}.activation_fn")
            h = e("Relu", [h], "relu")
            e.leave()
        e.enter(f"{lp}.{name}")
        weight = e.weight(f"{lp}.{name}.weight", f"{lp}.{name}.weight")
        bias = e.weight(f"{lp}.{name}.bias", f"{lp}.{name}.bias")
        h = e("Gemm", [h, weight, bias], "linear", dict(alpha=1.0, beta=1.0, transA=0, transB=1))
        e.leave()
    x = e("Reshape", [e("Add", [rows, h], "add"), out_shape()], "view", dict(allowzero=1))
    e.leave()
    return x


def _finish(e, x, n: _Dims, model):
    x = _layer_norm(e, x, "model.model.decoder.final_layer_norm")
    e.leave()  # model.model.decoder
    _head(e, x, model, n.tied)


def build_prefill(template_model, values: bool = False,
                  wrapper_class="elx.exporter.capture.decoder_only.PrefillGraph") -> tuple:
    """(``decoder_only.PrefillGraph``'s graph over OPT ``template_model``, its bindings)."""
    model, n = template_model, _Dims(template_model)
    e, b_shape, p_shape, mask = prefill_start(model, values, wrapper_class)
    C = e.const
    x = _embeddings(e, n, lambda: e("Concat", [C([-1]), p_shape], "view", dict(axis=0)))
    heads_view = _once(lambda: e("Concat", [b_shape, C([-1]), C([n.heads]), C([n.d])], "view", dict(axis=0)))
    merged = _once(lambda: e("Concat", [b_shape, p_shape, C([-1])], "view", dict(axis=0)))
    out_shape = _once(lambda: e("Concat", [b_shape, p_shape, C([n.hidden])], "view", dict(axis=0)))

    def attention(q, k, v, i, heads):
        k = e("Transpose", [e("Reshape", [k, heads_view()], "view", dict(allowzero=1))], "transpose",
              dict(perm=[0, 2, 1, 3]), out=f"present.{i}.key")
        v = e("Transpose", [e("Reshape", [v, heads_view()], "view", dict(allowzero=1))], "transpose",
              dict(perm=[0, 2, 1, 3]), out=f"present.{i}.value")
        s = e("MatMul", [q, e("Transpose", [k], "transpose", dict(perm=[0, 1, 3, 2]))], "matmul")
        o = e("MatMul", [e("Softmax", [e("Add", [s, mask], "add")], "softmax", dict(axis=-1)), v], "matmul")
        o = e("Transpose", [o], "transpose", dict(perm=[0, 2, 1, 3]))
        return e("Reshape", [o, merged()], "view", dict(allowzero=1))

    for i in range(n.layers):
        x = _layer(e, x, i, n, heads_view, attention, C([-1, n.hidden]), out_shape)
    _finish(e, x, n, model)
    return prefill_graph(e, n.layers, n.heads, n.d, n.vocab)


def build_step(template_model, values: bool = False,
               wrapper_class="elx.exporter.capture.decoder_only.SharedPromptStepGraph") -> tuple:
    """The shared-prompt step template (``decoder_only.SharedPromptStepGraph``) over OPT ``template_model``."""
    model, n = template_model, _Dims(template_model)
    e, step = step_start(model, values, wrapper_class, n.layers, n.heads, n.heads, n.d)
    C = e.const
    x = _embeddings(e, n, lambda: C([-1, 1]))
    heads_view = lambda: C([-1, 1, n.heads, n.d])  # noqa: E731

    def attention(q, k, v, i, heads):
        return step.attention(q, heads(k), heads(v), i)  # the query scaled already

    for i in range(n.layers):
        x = _layer(e, x, i, n, heads_view, attention, C([-1, n.hidden]), lambda: C([-1, 1, n.hidden]))
    _finish(e, x, n, model)
    return step_graph(e, n.layers, n.heads, n.d, n.vocab)

