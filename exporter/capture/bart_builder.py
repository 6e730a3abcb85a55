"""The encoder, cross K/V and decoder-step templates of BART (``BartForConditionalGeneration``), Marian
(``MarianMTModel``, the opus-mt translation models) and mBART (``MBartForConditionalGeneration``) built from the
weights, without torch.export (issue 41).

**Why.**  bart-large's first export spent ~14 s of its 30.2 s tracing three 3-layer templates; a re-export from
cached templates took 15.8 s (``docs/measurements/export_speed_2026-11-30.md``).  Built from the weights they take
milliseconds, as T5's do (``t5_builder.py``; the parts both write alike are ``seq2seq_parts.py``).

**Same graph.**  The nodes ``trace`` writes for ``wrappers.EncoderGraph``, ``CrossKVGraph`` and ``DecoderGraph`` over
the template model (HF's BART modules with elx's attention: scores scaled by d^-0.5, the cross-attention shared
across beams), after torch's decompositions and onnxscript's optimizer, checked canonically against the trace
(``tests/test_template_builders.py``): learned positions offset by 2, post-LayerNorm layers
(``LayerNormalization``), exact GELU (``Erf``), biases on every projection, the tied head plus
``final_logits_bias``; Marian's graph is BART's but for its positions (a sinusoidal table read at arange), its
embeddings scaled by sqrt(d_model) in the stacks' forward, no embedding LayerNorm and SiLU ("swish"); mBART's
normalises before each sub-layer and after each stack.

**When.**  ``applies(model)`` says why not where the template would differ: BART's and mBART's scaled embeddings, another
activation, an untied head or separate decoder embeddings; those templates are traced (and Pegasus', M2M100's:
other classes), as everything is with ``ELX_TEMPLATE_BUILDER=0``.
"""
from __future__ import annotations

import numpy as np

from elx.exporter.capture import seq2seq_parts as parts
from elx.exporter.capture.llama_builder import _head, linear, why_not

CLASSES = ("BartForConditionalGeneration", "MarianMTModel", "MBartForConditionalGeneration")
PRE_NORM = ("MBartForConditionalGeneration",)
ACTIVATIONS = ("gelu", "swish", "silu")  # exact GELU (Erf), SiLU (Marian's opus-mt models: "swish")


def applies(model) -> str | None:
    """None where this module gives the traced templates of ``model``; else why not."""
    def checks(model):
        c = model.config
        marian = type(model).__name__ == "MarianMTModel"
        decoder = model.model.decoder
        return {
            f"activation {c.activation_function}": c.activation_function not in ACTIVATIONS,
            # BART scales inside its embedding module (another scope); Marian in the encoder's and decoder's forward
            "scaled embeddings": not marian and bool(getattr(c, "scale_embedding", False)),
            "untied head": not (model.lm_head.weight is model.get_input_embeddings().weight
                                is decoder.embed_tokens.weight),
            "position offset other than 2": not marian and getattr(model.model.encoder.embed_positions, "offset",
                                                                   None) != 2,
        }
    return why_not(model, CLASSES, checks)


def _embeddings(e, x, stack: str, module, query_positions, b_shape=None):
    """The stack's token embeddings ``x`` (scaled where the stack scales them: Marian) plus its positions, then its
    embedding LayerNorm where it has one (BART): BART's learned positions offset by 2 (the encoder's expanded over
    the batch), Marian's sinusoidal table read as it is.  ``query_positions``: the decoder step's positions (None in
    the encoder: arange(width), made here from ``b_shape`` = (batch [1], width)).  (the embeddings, the positions'
    arange or ``query_positions``)."""
    C = e.const
    bart = hasattr(module.embed_positions, "offset")
    scale = float(getattr(module, "embed_scale", 1.0) or 1.0)
    if scale != 1.0 and not bart:
        x = e("Mul", [x, C(np.float32(scale), np.float32)], "mul")
    e.enter(f"{stack}.embed_positions")
    if query_positions is None:
        query_positions = e("Range", [C(0), b_shape[1], C(1)], "arange")
        at = query_positions
        if bart:
            at = e("Expand", [at, e("Concat", [b_shape[0], C([1])], "expand", dict(axis=0))], "expand")
    else:
        at = e("Unsqueeze", [query_positions, C([0])], "unsqueeze") if bart else query_positions
    if bart:
        at = e("Add", [at, C(2)], "add")
    table = e.weight(f"{stack}.embed_positions.weight", f"{stack}.embed_positions.weight")
    positions = e("Gather", [table, at], "embedding", dict(axis=0))
    e.leave()
    x = e("Add", [x, positions], "add")
    if getattr(module, "layernorm_embedding", None) is not None:
        x = _layer_norm(e, x, f"{stack}.layernorm_embedding")
    return x, query_positions


def _layer_norm(e, x, path: str, out=None):
    """The ``nn.LayerNorm`` at ``path`` (its weight and bias: the wrapper's names) as ONNX's LayerNormalization."""
    module = e.module(path)
    weight, bias = (e.weight(f"{path}.{w}", f"{path}.{w}") for w in ("weight", "bias"))
    e.enter(path)
    y = e("LayerNormalization", [x, weight, bias], "layer_norm",
          dict(stash_type=1, epsilon=float(module.eps), axis=-1), out=out)
    e.leave()
    return y


def _mlp(e, h, lp: str, t):
    """Layer ``lp``'s fc1, activation (exact GELU or SiLU) and fc2 over ``h``."""
    h = linear(e, h, t("fc1"), f"{lp}.fc1")
    e.enter(f"{lp}.activation_fn")
    if e.model.config.activation_function == "gelu":
        scaled = e("Div", [h, e.const(np.float32(np.sqrt(2.0)), np.float32)], "gelu")
        half = e("Mul", [e.const(0.5, np.float32), e("Add", [e("Erf", [scaled], "gelu"), e.const(1.0, np.float32)],
                                                         "gelu")], "gelu")
        h = e("Mul", [h, half], "gelu")
    else:  # SiLU
        h = e("Mul", [h, e("Sigmoid", [h], "silu")], "silu")
    e.leave()
    return linear(e, h, t("fc2"), f"{lp}.fc2")


def _sublayer(e, x, norm: str, body, pre: bool, out=None):
    """A residual sub-layer of the current layer: ``body`` over ``x`` normed first (pre-LayerNorm: mBART) or the sum
    normed after (post-LayerNorm: BART, Marian); ``norm`` the LayerNorm's path."""
    if pre:
        return e("Add", [x, body(_layer_norm(e, x, norm))], "add", out=out)
    return _layer_norm(e, e("Add", [x, body(x)], "add"), norm, out=out)


def _pre_norm(model) -> bool:
    """mBART normalises before each sub-layer and after the stacks (``layer_norm``); BART and Marian after each."""
    return type(model).__name__ in PRE_NORM


def _layer_start(e, lp: str):
    """Into layer ``lp``: ``t(name)``, the initializer of the layer's weight ``name`` stored transposed (as the
    exporter folds ``linear``'s transpose)."""
    e.enter(lp)
    return lambda name: e.weight(f"val_w_{lp}_{name}", f"{lp}.{name}.weight", transposed=True)


def build_encoder(template_model, values: bool = False) -> tuple:
    """(``wrappers.EncoderGraph``'s graph over ``template_model``, its bindings)."""
    model, c = template_model, template_model.config
    heads, layers = c.encoder_attention_heads, c.encoder_layers
    d = c.d_model // heads
    encoder = model.get_encoder()
    aliases = {f"encoder.{n}": f"model.encoder.{n}" for n, _ in encoder.named_parameters(remove_duplicate=False)}
    named = {"new_ones": (True, np.bool_), "zeros": (0.0, np.float32)}
    e, b_shape, b, n_shape, n, x = parts.encoder_start(model, values, named, aliases, {"encoder": "model.encoder"})
    C = e.const
    x, keys = _embeddings(e, x, "encoder", encoder, None, (b_shape, n))
    mask = parts.encoder_mask(e, b, keys)
    scaling = C(np.float32(d ** -0.5), np.float32)
    shared, pre = {}, _pre_norm(model)
    for i in range(layers):
        lp = f"encoder.layers.{i}"
        t, sa = _layer_start(e, lp), f"{lp}.self_attn"

        def attention(h, sa=sa, t=t):
            e.enter(sa)
            projections = {w: (f"{sa}.{w}_proj" if w != "o" else f"{sa}.out_proj",
                               t(f"self_attn.{w}_proj" if w != "o" else "self_attn.out_proj")) for w in "qkvo"}
            o = parts.encoder_attention(e, h, shared, (b_shape, n_shape, d), projections, None, mask, scaling)
            e.leave()
            return o
        x = _sublayer(e, x, f"{lp}.self_attn_layer_norm", attention, pre)
        last = "last_hidden_state" if i == layers - 1 and not pre else None
        x = _sublayer(e, x, f"{lp}.final_layer_norm", lambda h, lp=lp, t=t: _mlp(e, h, lp, t), pre, out=last)
        e.leave()
    if pre:
        _layer_norm(e, x, "encoder.layer_norm", out="last_hidden_state")
    return parts.graph(e, *parts.encoder_io(c.d_model))


def build_cross_kv(template_model, values: bool = False) -> tuple:
    """(``wrappers.CrossKVGraph``'s graph: each decoder layer's cross-attention keys and values, its bindings)."""
    c = template_model.config
    heads = c.decoder_attention_heads
    return parts.build_cross_kv(template_model, values, c.decoder_layers, heads, c.d_model // heads, c.d_model,
                                lambda i: [f"model.decoder.layers.{i}.encoder_attn.{w}_proj" for w in "kv"])


def build_decoder(template_model, values: bool = False) -> tuple:
    """(``wrappers.DecoderGraph``'s graph: a decoder step over the self-attention past and the beam-shared cross
    K/V, its bindings)."""
    model, c = template_model, template_model.config
    heads, layers = c.decoder_attention_heads, c.decoder_layers
    d = c.d_model // heads
    e = parts.emitter(model, values, {"zeros_1": (0.0, np.float32)})
    C = e.const
    e.enter("", f"{parts.WRAPPERS}.DecoderGraph")
    step = parts.StepSizes(e, layers, heads, d)
    e.enter("model")
    e.enter("model.model")
    e.enter("model.model.decoder")
    x = parts.embedding(e, "model.lm_head.weight", "model.model.decoder.embed_tokens")
    steps = e("Range", [C(0), step.t, C(1)], "arange")
    query_positions = e("Add", [steps, step.past], "add")
    mask = step.self_mask(query_positions, e("Range", [C(0), step.total, C(1)], "arange"))
    x, _ = _embeddings(e, x, "model.model.decoder", model.model.decoder, query_positions)
    scaling = C(np.float32(d ** -0.5), np.float32)
    pre = _pre_norm(model)
    for i in range(layers):
        lp = f"model.model.decoder.layers.{i}"
        t = _layer_start(e, lp)

        def attention(h, i=i, lp=lp, t=t):
            sa = f"{lp}.self_attn"
            e.enter(sa)
            q, k, v = (step.heads_first(linear(e, h, t(f"self_attn.{w}_proj"), f"{sa}.{w}_proj")) for w in "qkv")
            o = linear(e, step.self_attention(q, k, v, i, mask=mask, scaling=scaling), t("self_attn.out_proj"),
                       f"{sa}.out_proj")
            e.leave()
            return o

        def cross(h, i=i, lp=lp, t=t):
            ca = f"{lp}.encoder_attn"
            e.enter(ca)
            o = step.cross_attention(linear(e, h, t("encoder_attn.q_proj"), f"{ca}.q_proj"), i, scaling)
            o = linear(e, o, t("encoder_attn.out_proj"), f"{ca}.out_proj")
            e.leave()
            return o
        x = _sublayer(e, x, f"{lp}.self_attn_layer_norm", attention, pre)
        x = _sublayer(e, x, f"{lp}.encoder_attn_layer_norm", cross, pre)
        x = _sublayer(e, x, f"{lp}.final_layer_norm", lambda h, lp=lp, t=t: _mlp(e, h, lp, t), pre)
        e.leave()
    if pre:
        x = _layer_norm(e, x, "model.model.decoder.layer_norm")
    e.leave()  # model.model.decoder
    e.leave()  # model.model
    _head(e, x, model, True, final_bias="model.final_logits_bias")
    return parts.graph(e, *parts.decoder_io(layers, heads, d, c.vocab_size))
