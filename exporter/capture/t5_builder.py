"""The encoder, cross K/V and decoder-step templates of T5 (``T5ForConditionalGeneration``) built from the weights,
without torch.export (issue 41).

**Why.**  An encoder-decoder's first export traces three 3-layer templates (``exporter/capture/stitched.py``);
t5-base's took 12-13 s of the first export's 25.8 s against 12.4 s for a re-export from cached templates
(``docs/measurements/export_speed_2026-11-30.md``).  Written from the weights they take milliseconds, as the
Llama-architecture ones do (``llama_builder.py``, whose ``Emitter`` this module uses).

**Same graph.**  The nodes are those ``trace`` writes for ``wrappers.EncoderGraph``, ``CrossKVGraph`` and
``DecoderGraph`` over the template model (HF's T5 modules with elx's attention, ``capture/attention.py``: the
cross-attention shared across beams), after torch's decompositions and onnxscript's optimizer: the same op types,
attributes, inputs (constants by value), module scopes and weights, checked canonically against the trace
(``tests/test_template_builders.py``).  Details of the trace repeated here: the relative position buckets
(bidirectional in the encoder, causal in the decoder, computed in layer 0 and shared), the encoder mask's index
arithmetic (HF's mask function, vectorised), the sizes torch reads from the inputs (rows and past length from the
last layer's past value, the batch from layer 0's cross value), and three scalar constants the trace names instead
of numbering (``new_ones``, ``zeros`` / ``zeros_1``, ``scalar_tensor_default``: onnxscript shares one initializer
per value, so every other constant of the same value carries that name too).

**When.**  T5's ReLU feed-forward and T5 v1.1's / Flan-T5's gated tanh-GELU, a head scaled by d_model^-0.5 or not
(``scale_decoder_outputs``: False for configs saved untied).  ``applies(model)`` says why not where the template
would differ: another feed-forward, an odd bucket count, an untied head; those templates are traced, as everything
is with ``ELX_TEMPLATE_BUILDER=0``.
"""
from __future__ import annotations

import math

import numpy as np
from onnx import TensorProto

from elx.exporter.capture import seq2seq_parts as parts
from elx.exporter.capture.llama_builder import _head, linear, rms_norm, why_not

CLASSES = ("T5ForConditionalGeneration",)
# (gated, activation) of the feed-forwards written here: T5's ReLU, T5 v1.1's and Flan-T5's gated tanh-GELU
FEED_FORWARDS = {(False, "relu"), (True, "gelu_new")}


def applies(model) -> str | None:
    """None where this module gives the traced templates of ``model``; else why not."""
    def checks(model):
        c = model.config
        return {
            f"feed-forward {c.feed_forward_proj}": (c.is_gated_act, c.dense_act_fn) not in FEED_FORWARDS,
            "odd relative_attention_num_buckets": c.relative_attention_num_buckets % 2 != 0,
            "untied head": not _tied(model),
            "encoder and decoder of different widths": model.encoder.config.d_kv != model.decoder.config.d_kv,
        }
    return why_not(model, CLASSES, checks)


def _tied(model) -> bool:
    return model.lm_head.weight is model.shared.weight


def _bucket_scalar(c) -> float:
    """``max_exact`` (= buckets - ``max_exact`` for an even count) of the encoder's (halved) or decoder's buckets,
    as a float: the value of the trace's ``scalar_tensor_default``."""
    return float(c.relative_attention_num_buckets // (4 if c.is_decoder is False else 2))


def _relative_bias(e, c, rel, bidirectional: bool, table: str, path: str):
    """T5's ``_relative_position_bucket`` of ``rel`` (memory - context positions) and the bias table's lookup,
    [1, heads, q, k], inside the attention at ``path``."""
    C = e.const
    buckets = c.relative_attention_num_buckets
    if bidirectional:
        buckets //= 2
        sign = e("Mul", [e("Cast", [e("Greater", [rel, C(0)], "gt")], "_to_copy", dict(to=TensorProto.INT64)),
                         C(buckets)], "mul")
        distance = e("Abs", [rel], "abs")
    else:
        zeros = e("Expand", [C(0), e("Shape", [rel], "zeros_like", dict(start=0))], "zeros_like")
        distance = e("Neg", [e("Min", [rel, zeros], "minimum")], "neg")
    exact = buckets // 2
    small = e("Less", [distance, C(exact)], "lt")
    scale = C(float(exact), np.float32)
    large = e("Div", [e("Cast", [distance], "_to_copy", dict(to=TensorProto.FLOAT)), scale], "div")
    large = e("Div", [e("Log", [large], "log"), C(math.log(c.relative_attention_max_distance / exact), np.float32)],
              "div")
    large = e("Cast", [e("Mul", [large, C(float(buckets - exact), np.float32)], "mul")], "_to_copy",
              dict(to=TensorProto.INT64))
    large = e("Add", [large, C(exact)], "add")
    top = e("Expand", [C(buckets - 1), e("Shape", [large], "full_like", dict(start=0))], "full_like")
    index = e("Where", [small, distance, e("Min", [large, top], "minimum")], "where")
    if bidirectional:
        index = e("Add", [sign, index], "add")
    e.enter(f"{path}.relative_attention_bias")
    bias = e("Gather", [table, index], "embedding", dict(axis=0))
    e.leave()
    return e("Unsqueeze", [e("Transpose", [bias], "permute", dict(perm=[2, 0, 1])), C([0])], "unsqueeze")


def _weights(e, lp: str, block):
    """Register block ``lp``'s norm weights; ``t(name)``: the initializer of the block's weight ``name`` stored
    transposed (as the exporter folds ``linear``'s transpose)."""
    for k in range(len(block.layer)):
        e.weight(f"{lp}.layer.{k}.layer_norm.weight", f"{_hf(lp)}.layer.{k}.layer_norm.weight")

    def t(name):
        return e.weight(f"val_w_{lp}_{name}", f"{_hf(lp)}.{name}.weight", transposed=True)
    return t


def _hf(path: str) -> str:
    """The wrapper's path (``encoder.block.0``, ``model.decoder.block.0``) as the ``Emitter``'s source name."""
    return path if path.startswith("model.") else f"model.{path}"


def _gelu_tanh(e, x):
    """``gelu_new``: 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), as the trace decomposes it."""
    C = e.const
    half = e("Mul", [x, C(0.5, np.float32)], "mul")
    cube = e("Mul", [e("Pow", [x, C(3.0, np.float32)], "pow"), C(0.044715, np.float32)], "mul")
    inner = e("Mul", [e("Add", [x, cube], "add"), C(math.sqrt(2.0 / math.pi), np.float32)], "mul")
    return e("Mul", [half, e("Add", [e("Tanh", [inner], "tanh"), C(1.0, np.float32)], "add")], "mul")


def _self_attention_start(e, x, lp: str, eps: float) -> tuple:
    """Into block ``lp``, its sub-layer 0 and its self-attention: (the sub-layer's norm of ``x``, the attention's
    path)."""
    e.enter(lp)
    sub = f"{lp}.layer.0"
    e.enter(sub)
    h = rms_norm(e, x, f"{sub}.layer_norm.weight", eps, f"{sub}.layer_norm")
    e.enter(f"{sub}.SelfAttention")
    return h, f"{sub}.SelfAttention"


def _feed_forward(e, x, lp: str, k: int, t, eps: float):
    """Sub-layer ``k`` of block ``lp``: its norm, ReLU feed-forward and residual add."""
    sub = f"{lp}.layer.{k}"
    e.enter(sub)
    h = rms_norm(e, x, f"{sub}.layer_norm.weight", eps, f"{sub}.layer_norm")
    dense = f"{sub}.DenseReluDense"
    e.enter(dense)
    gated = e.module(dense).__class__.__name__ == "T5DenseGatedActDense"
    y = linear(e, h, t(f"layer.{k}.DenseReluDense.wi{'_0' if gated else ''}"), f"{dense}.wi{'_0' if gated else ''}")
    e.enter(f"{dense}.act")
    y = _gelu_tanh(e, y) if gated else e("Relu", [y], "relu")
    e.leave()
    if gated:
        y = e("Mul", [y, linear(e, h, t(f"layer.{k}.DenseReluDense.wi_1"), f"{dense}.wi_1")], "mul")
    h = linear(e, y, t(f"layer.{k}.DenseReluDense.wo"), f"{dense}.wo")
    e.leave()
    x = e("Add", [x, h], "add")
    e.leave()
    return x


def build_encoder(template_model, values: bool = False) -> tuple:
    """(``wrappers.EncoderGraph``'s graph over ``template_model``, its bindings)."""
    model, c = template_model, template_model.encoder.config
    d, layers = c.d_kv, c.num_layers
    aliases = {f"encoder.{n}": f"encoder.{n}" for n, _ in model.encoder.named_parameters(remove_duplicate=False)}
    named = {"new_ones": (True, np.bool_), "zeros": (0.0, np.float32),
             "scalar_tensor_default": (_bucket_scalar(c), np.float32)}
    e, b_shape, b, n_shape, n, x = parts.encoder_start(model, values, named, aliases)
    C = e.const
    keys = e("Range", [C(0), n, C(1)], "arange")
    mask = parts.encoder_mask(e, b, keys)
    eps = float(c.layer_norm_epsilon)
    shared = {}
    for i in range(layers):
        lp = f"encoder.block.{i}"
        t = _weights(e, lp, model.encoder.block[i])
        h, sa = _self_attention_start(e, x, lp, eps)

        def position_bias(sa=sa):
            if "bias" not in shared:
                table = e.weight(f"{sa}.relative_attention_bias.weight", f"model.{sa}.relative_attention_bias.weight")
                rel = e("Sub", [e("Unsqueeze", [keys, C([0])], "unsqueeze"),
                                e("Unsqueeze", [keys, C([1])], "unsqueeze")], "sub")
                shared["bias"] = _relative_bias(e, c, rel, True, table, sa)
            return shared["bias"]
        projections = {w: (f"{sa}.{w}", t(f"layer.0.SelfAttention.{w}")) for w in "qkvo"}
        o = parts.encoder_attention(e, h, shared, (b_shape, n_shape, d), projections, position_bias, mask)
        e.leave()
        x = e("Add", [x, o], "add")
        e.leave()
        x = _feed_forward(e, x, lp, 1, t, eps)
        e.leave()
    e.weight("encoder.final_layer_norm.weight", "encoder.final_layer_norm.weight")
    rms_norm(e, x, "encoder.final_layer_norm.weight", eps, "encoder.final_layer_norm", out="last_hidden_state")
    return parts.graph(e, *parts.encoder_io(c.d_model))


def build_cross_kv(template_model, values: bool = False) -> tuple:
    """(``wrappers.CrossKVGraph``'s graph: each decoder layer's cross-attention keys and values, its bindings)."""
    c = template_model.decoder.config
    return parts.build_cross_kv(template_model, values, c.num_layers, c.num_heads, c.d_kv, c.d_model,
                                lambda i: [f"decoder.block.{i}.layer.1.EncDecAttention.{w}" for w in "kv"])


def build_decoder(template_model, values: bool = False) -> tuple:
    """(``wrappers.DecoderGraph``'s graph: a decoder step over the self-attention past and the beam-shared cross
    K/V, its bindings)."""
    model, c = template_model, template_model.decoder.config
    heads, d, layers = c.num_heads, c.d_kv, c.num_layers
    e = parts.emitter(model, values, {"zeros_1": (0.0, np.float32),
                                      "scalar_tensor_default": (_bucket_scalar(c), np.float32)})
    C = e.const
    e.enter("", f"{parts.WRAPPERS}.DecoderGraph")
    step = parts.StepSizes(e, layers, heads, d)
    e.enter("model")
    e.enter("model.decoder")
    x = parts.embedding(e, "model.lm_head.weight", "model.decoder.embed_tokens")
    steps = e("Range", [C(0), step.t, C(1)], "arange")
    positions = e("Range", [C(0), step.total, C(1)], "arange")
    mask = step.self_mask(e("Add", [steps, step.past], "add"), positions)
    eps = float(c.layer_norm_epsilon)
    bias = None
    for i in range(layers):
        lp = f"model.decoder.block.{i}"
        tw = _weights(e, lp, model.decoder.block[i])
        h, sa = _self_attention_start(e, x, lp, eps)
        q, k, v = (step.heads_first(linear(e, h, tw(f"layer.0.SelfAttention.{w}"), f"{sa}.{w}")) for w in "qkv")
        if bias is None:
            table = e.weight(f"{sa}.relative_attention_bias.weight", f"{sa}.relative_attention_bias.weight")
            context = e("Add", [e("Unsqueeze", [steps, C([1])], "unsqueeze"), step.past], "add")
            rel = e("Sub", [e("Unsqueeze", [positions, C([0])], "unsqueeze"), context], "sub")
            bias = _relative_bias(e, c, rel, False, table, sa)
        o = step.self_attention(q, k, v, i, bias=bias, mask=mask)
        o = linear(e, o, tw("layer.0.SelfAttention.o"), f"{sa}.o")
        e.leave()
        x = e("Add", [x, o], "add")
        e.leave()
        sub = f"{lp}.layer.1"
        e.enter(sub)
        h = rms_norm(e, x, f"{sub}.layer_norm.weight", eps, f"{sub}.layer_norm")
        ca = f"{sub}.EncDecAttention"
        e.enter(ca)
        o = step.cross_attention(linear(e, h, tw("layer.1.EncDecAttention.q"), f"{ca}.q"), i)
        o = linear(e, o, tw("layer.1.EncDecAttention.o"), f"{ca}.o")
        e.leave()
        x = e("Add", [x, o], "add")
        e.leave()
        x = _feed_forward(e, x, lp, 2, tw, eps)
        e.leave()
    e.weight("model.decoder.final_layer_norm.weight", "model.decoder.final_layer_norm.weight")
    x = rms_norm(e, x, "model.decoder.final_layer_norm.weight", eps, "model.decoder.final_layer_norm")
    e.leave()  # model.decoder
    if getattr(model.config, "scale_decoder_outputs", True):  # (False: a config saved untied, Flan-T5's)
        x = e("Mul", [x, C(np.float32(c.d_model ** -0.5), np.float32)], "mul")
    _head(e, x, model, True)
    return parts.graph(e, *parts.decoder_io(layers, heads, d, c.vocab_size))
