"""GPT-2's prefill and shared-prompt step templates built from the weights, without torch.export (issue 41).

The same mechanism as ``exporter/capture/llama_builder.py`` (its ``Emitter``, mask, graph inputs and head), for
``GPT2LMHeadModel``: learned positions added to the token embedding, LayerNorm, the fused ``c_attn`` projection
(``Conv1D``: a Gemm on the flattened rows, split into query, key and value), GELU's tanh form, and the same
shared-prompt attention elx traces (``capture/shared_prompt.py``).  The nodes are those ``trace`` writes for the
template (checked canonically against it in ``tests/test_gpt2_builder.py``), so stitching, the passes and the
verification see what they see after a trace.  Where the trace differs from Llama's, this module repeats it: the
step's beams count (rows // batch) is computed in the hook's scope and reshaped once, the split of ``c_attn``'s
output has no module scope, the attention output's flattening Reshape has no ``allowzero``.

Measured on GPT-2's dims (124M, this 2-core VM, `tools/measure_export_speed.py`): a first export traced its two
templates in 8.9 s and 17.3 s (a second process) of its 26.2 s.

``applies(model)`` refuses what the graph would not describe: another class, another activation, the attention
options that change its arithmetic (``scale_attn_by_inverse_layer_idx``, ``reorder_and_upcast_attn``, unscaled
attention), cross-attention; those templates are traced.
"""
from __future__ import annotations

import numpy as np
from onnx import TensorProto

from elx.exporter.capture.llama_builder import (INT64_MAX, Emitter, _head, prefill_graph, prefill_start, step_graph,
                                                why_not)

CLASSES = ("GPT2LMHeadModel",)
GELU_TANH = (0.5, 3.0, 0.044715, float(np.sqrt(2.0 / np.pi)), 1.0)


def applies(model) -> str | None:
    """None where ``build_prefill``/``build_step`` give the traced templates of ``model``; else why not."""
    def checks(model):
        c = model.config
        return {
            f"activation {c.activation_function}": c.activation_function != "gelu_new",
            "scale_attn_by_inverse_layer_idx": getattr(c, "scale_attn_by_inverse_layer_idx", False),
            "reorder_and_upcast_attn": getattr(c, "reorder_and_upcast_attn", False),
            "unscaled attention": not getattr(c, "scale_attn_weights", True),
            "cross-attention": getattr(c, "add_cross_attention", False),
        }
    return why_not(model, CLASSES, checks)


class _Dims:
    def __init__(self, model):
        c = model.config
        self.layers, self.heads, self.hidden = c.n_layer, c.n_head, c.n_embd
        self.d = self.hidden // self.heads
        self.inner = c.n_inner or 4 * self.hidden
        self.tied = model.lm_head.weight is model.transformer.wte.weight
        self.vocab = c.vocab_size


def _once(make):
    """``make()`` on the first call (in the scope the node belongs to), its result after."""
    made = []

    def get():
        if not made:
            made.append(make())
        return made[0]
    return get


def _conv1d(e, x, path, to_rows, out_shape, allowzero=True):
    """HF's ``Conv1D`` at ``path``: ``x`` flattened to rows (``to_rows``), ``x @ W + b`` as one Gemm, reshaped to
    ``out_shape()`` (a shape made where first used)."""
    e.enter(path)
    rows = e("Reshape", [x, to_rows], "view", dict(allowzero=1) if allowzero else None)
    weight = e.weight(f"{path}.weight", f"{path}.weight")
    bias = e.weight(f"{path}.bias", f"{path}.bias")
    y = e("Gemm", [rows, weight, bias], "addmm", dict(alpha=1.0, beta=1.0, transA=0, transB=0))
    y = e("Reshape", [y, out_shape()], "view", dict(allowzero=1))
    e.leave()
    return y


def _layer_norm(e, x, path):
    module = e.model.get_submodule(path.removeprefix("model."))
    e.enter(path)
    weight = e.weight(f"{path}.weight", f"{path}.weight")
    bias = e.weight(f"{path}.bias", f"{path}.bias")
    y = e("LayerNormalization", [x, weight, bias], "layer_norm",
          dict(axis=-1, epsilon=float(module.eps), stash_type=1))
    e.leave()
    return y


def _gelu_tanh(e, x, path):
    half, cube, coefficient, root, one = GELU_TANH
    C = e.const
    e.enter(path)
    a = e("Mul", [x, C(half, np.float32)], "mul")
    p = e("Pow", [x, C(cube, np.float32)], "pow")
    p = e("Mul", [p, C(coefficient, np.float32)], "mul")
    inner = e("Mul", [e("Add", [x, p], "add"), C(root, np.float32)], "mul")
    t = e("Add", [e("Tanh", [inner], "tanh"), C(one, np.float32)], "add")
    y = e("Mul", [a, t], "mul")
    e.leave()
    return y


def _embeddings(e, n: _Dims, ids_shape):
    """Into ``model`` / ``model.transformer``: token and position embeddings added (``ids_shape()``: the ids'
    reshape, made there)."""
    e.enter("model")
    e.enter("model.transformer")
    ids = e("Reshape", ["input_ids", ids_shape()], "view", dict(allowzero=1))
    name = "model.lm_head.weight" if n.tied else "model.transformer.wte.weight"
    e.weight(name, "model.transformer.wte.weight")
    e.enter("model.transformer.wte")
    tokens = e("Gather", [name, ids], "embedding", dict(axis=0))
    e.leave()
    e.weight("model.transformer.wpe.weight", "model.transformer.wpe.weight")
    e.enter("model.transformer.wpe")
    positions = e("Gather", ["model.transformer.wpe.weight", "position_ids"], "embedding", dict(axis=0))
    e.leave()
    return e("Add", [tokens, positions], "add")


def _block(e, x, i: int, attention, shapes):
    """Layer ``i``: LayerNorm, ``attention(q, k, v, i) -> heads merged``, the residual add, the MLP and its
    residual add.  ``shapes``: the Conv1Ds' flattening shapes and their output shapes (made where first used)."""
    lp = f"model.transformer.h.{i}"
    e.enter(lp)
    h = _layer_norm(e, x, f"{lp}.ln_1")
    e.enter(f"{lp}.attn")
    qkv = _conv1d(e, h, f"{lp}.attn.c_attn", shapes["rows"], shapes["qkv"])
    q, k, v = e("Split", [qkv], "split", dict(axis=2, num_outputs=3), outputs=3, bare=True)
    o = attention(q, k, v, i)
    o = _conv1d(e, o, f"{lp}.attn.c_proj", shapes["rows"], shapes["hidden"], allowzero=False)
    e.leave()
    x = e("Add", [o, x], "add")
    h = _layer_norm(e, x, f"{lp}.ln_2")
    e.enter(f"{lp}.mlp")
    y = _conv1d(e, h, f"{lp}.mlp.c_fc", shapes["rows"], shapes["inner"])
    y = _gelu_tanh(e, y, f"{lp}.mlp.act")
    y = _conv1d(e, y, f"{lp}.mlp.c_proj", shapes["inner_rows"], shapes["hidden"])
    e.leave()
    x = e("Add", [x, y], "add")
    e.leave()
    return x


def _finish(e, x, n: _Dims, model, out_shape):
    """The final LayerNorm, its reshape (``out_shape()``), out of the transformer, the head."""
    x = _layer_norm(e, x, "model.transformer.ln_f")
    x = e("Reshape", [x, out_shape()], "view", dict(allowzero=1))
    e.leave()  # model.transformer
    _head(e, x, model, n.tied)


def build_prefill(template_model, values: bool = False,
                  wrapper_class="elx.exporter.capture.decoder_only.PrefillGraph") -> tuple:
    """(``decoder_only.PrefillGraph``'s graph over GPT-2 ``template_model``, its bindings)."""
    model, n = template_model, _Dims(template_model)
    e, b_shape, p_shape, mask = prefill_start(model, values, wrapper_class)
    C = e.const
    x = _embeddings(e, n, lambda: e("Concat", [C([-1]), p_shape], "view", dict(axis=0)))
    widths = lambda width: _once(lambda: e("Concat", [b_shape, p_shape, C([width])], "view", dict(axis=0)))  # noqa: E731
    shapes = {"rows": C([-1, n.hidden]), "inner_rows": C([-1, n.inner]), "qkv": widths(3 * n.hidden),
              "hidden": widths(n.hidden), "inner": widths(n.inner)}
    view = _once(lambda: e("Concat", [b_shape, p_shape, C([-1]), C([n.d])], "view", dict(axis=0)))
    scale = C(np.float32(n.d ** -0.5), np.float32)

    def attention(q, k, v, i):
        k = e("Transpose", [e("Reshape", [k, view()], "view", dict(allowzero=1))], "transpose",
              dict(perm=[0, 2, 1, 3]), out=f"present.{i}.key")
        v = e("Transpose", [e("Reshape", [v, view()], "view", dict(allowzero=1))], "transpose",
              dict(perm=[0, 2, 1, 3]), out=f"present.{i}.value")
        q = e("Transpose", [e("Reshape", [q, view()], "view", dict(allowzero=1))], "transpose",
              dict(perm=[0, 2, 1, 3]))
        s = e("MatMul", [q, e("Transpose", [k], "transpose", dict(perm=[0, 1, 3, 2]))], "matmul")
        s = e("Add", [e("Mul", [s, scale], "mul"), mask], "add")
        o = e("MatMul", [e("Softmax", [s], "softmax", dict(axis=-1)), v], "matmul")
        return e("Transpose", [o], "transpose", dict(perm=[0, 2, 1, 3]))

    for i in range(n.layers):
        x = _block(e, x, i, attention, shapes)
    _finish(e, x, n, model, lambda: e("Concat", [C([-1]), p_shape, C([n.hidden])], "view", dict(axis=0)))
    return prefill_graph(e, n.layers, n.heads, n.d, n.vocab)


def build_step(template_model, values: bool = False,
               wrapper_class="elx.exporter.capture.decoder_only.SharedPromptStepGraph") -> tuple:
    """The shared-prompt step template (``decoder_only.SharedPromptStepGraph``) over GPT-2 ``template_model``."""
    model, n = template_model, _Dims(template_model)
    e = Emitter(model, values)
    C = e.const
    H, d, last = n.heads, n.d, n.layers - 1
    e.enter("", wrapper_class)
    b_shape = e("Shape", ["prompt_key_values.0.key"], "sym_size_int", dict(end=1, start=0), hook=True)
    b = e("Squeeze", [b_shape], "sym_size_int", hook=True)
    p_shape = e("Shape", [f"prompt_key_values.{last}.value"], "sym_size_int", dict(end=3, start=2), hook=True)
    gen = e("Squeeze", [e("Shape", ["past_key_values.0.value"], "sym_size_int", dict(end=3, start=2), hook=True)],
            "sym_size_int", hook=True)
    r_shape = e("Shape", [f"past_key_values.{min(1, last)}.key"], "sym_size_int", dict(end=1, start=0), hook=True)
    beams = e("Div", [e("Squeeze", [r_shape], "sym_size_int", hook=True), b], "floordiv", hook=True)
    keys_ok = e("Unsqueeze", [e("Cast", ["prompt_attention_mask"], "_to_copy", dict(to=TensorProto.BOOL)),
                              C([1, 2])], "unsqueeze")
    zeros = e("Expand", [C(0.0, np.float32), e("Concat", [b_shape, C([1]), C([1]), p_shape], "zeros", dict(axis=0))],
              "zeros")
    mask = e("Where", [e("Not", [keys_ok], "bitwise_not"), C(np.finfo(np.float32).min, np.float32), zeros],
             "masked_fill")
    g1 = e("Reshape", [e("Add", [gen, C(1)], "add"), C([-1])], "zeros", dict(allowzero=0))
    own = e("Expand", [C(0.0, np.float32), e("Concat", [r_shape, C([1]), C([1]), g1], "zeros", dict(axis=0))],
            "zeros")
    x = _embeddings(e, n, lambda: C([-1, 1]))
    constant = lambda value: lambda: C(value)  # noqa: E731
    shapes = {"rows": C([-1, n.hidden]), "inner_rows": C([-1, n.inner]), "qkv": constant([-1, 1, 3 * n.hidden]),
              "hidden": constant([-1, 1, n.hidden]), "inner": constant([-1, 1, n.inner])}
    scale = C(np.float32(d ** -0.5), np.float32)
    items = _once(lambda: e("Reshape", [beams, C([-1])], "view", dict(allowzero=0)))
    made = {}

    def shape(name, parts, fx="view"):  # made in layer 0's attention scope, shared by the others
        if name not in made:
            made[name] = e("Concat", [part() if callable(part) else part for part in parts], fx, dict(axis=0))
        return made[name]

    def attention(q, k, v, i):
        heads = C([-1, 1, H, d])
        k = e("Transpose", [e("Reshape", [k, heads], "view", dict(allowzero=1))], "transpose", dict(perm=[0, 2, 1, 3]))
        v = e("Transpose", [e("Reshape", [v, heads], "view", dict(allowzero=1))], "transpose", dict(perm=[0, 2, 1, 3]))
        q = e("Transpose", [e("Reshape", [q, heads], "view", dict(allowzero=1))], "transpose", dict(perm=[0, 2, 1, 3]))
        key = e("Concat", [f"past_key_values.{i}.key", k], "cat", dict(axis=-2), out=f"present.{i}.key")
        value = e("Concat", [f"past_key_values.{i}.value", v], "cat", dict(axis=-2), out=f"present.{i}.value")
        qb = e("Reshape", [q, shape("beams_q", [b_shape, items, C([H]), C([1]), C([d])])], "view", dict(allowzero=1))
        qb = e("Transpose", [qb], "transpose", dict(perm=[0, 2, 1, 3, 4]))
        qi = e("Reshape", [qb, shape("items_q", [b_shape, C([H]), items, C([d])])], "view", dict(allowzero=1))
        pk = e("Transpose", [f"prompt_key_values.{i}.key"], "transpose", dict(perm=[0, 1, 3, 2]))
        sp = e("Add", [e("Mul", [e("MatMul", [qi, pk], "matmul"), scale], "mul"), mask], "add")
        sp = e("Reshape", [sp, shape("beams_s", [b_shape, C([H]), C([-1]), C([1]), p_shape])], "view",
               dict(allowzero=1))
        sp = e("Transpose", [sp], "transpose", dict(perm=[0, 2, 1, 3, 4]))
        sp = e("Reshape", [sp, shape("rows_s", [r_shape, C([H]), C([1]), p_shape], "_unsafe_view")], "_unsafe_view",
               dict(allowzero=1))
        kt = e("Transpose", [key], "transpose", dict(perm=[0, 1, 3, 2]))
        sg = e("Add", [e("Mul", [e("MatMul", [q, kt], "matmul"), scale], "mul"), own], "add")
        probs = e("Softmax", [e("Concat", [sp, sg], "cat", dict(axis=-1))], "softmax", dict(axis=-1))
        pp = e("Slice", [probs, C([0]), p_shape, C([3]), C([1])], "slice")
        pg = e("Slice", [probs, p_shape, C([INT64_MAX]), C([3]), C([1])], "slice")
        pp = e("Reshape", [pp, shape("beams_p", [b_shape, items, C([H]), C([1]), p_shape])], "view",
               dict(allowzero=1))
        pp = e("Transpose", [pp], "transpose", dict(perm=[0, 2, 1, 3, 4]))
        pp = e("Reshape", [pp, shape("items_p", [b_shape, C([H]), items, p_shape])], "view", dict(allowzero=1))
        op = e("MatMul", [pp, f"prompt_key_values.{i}.value"], "matmul")
        op = e("Reshape", [op, shape("beams_o", [b_shape, C([H]), C([-1]), C([1]), C([d])])], "view",
               dict(allowzero=1))
        op = e("Transpose", [op], "transpose", dict(perm=[0, 2, 1, 3, 4]))
        op = e("Reshape", [op, C([-1, H, 1, d])], "_unsafe_view", dict(allowzero=1))
        o = e("Add", [op, e("MatMul", [pg, value], "matmul")], "add")
        return e("Transpose", [o], "transpose", dict(perm=[0, 2, 1, 3]))

    for i in range(n.layers):
        x = _block(e, x, i, attention, shapes)
    _finish(e, x, n, model, lambda: C([-1, 1, n.hidden]))
    return step_graph(e, n.layers, n.heads, n.d, n.vocab)

