"""The encoder, cross K/V and decoder-step templates of Whisper (``WhisperForConditionalGeneration``) built from the
weights, without torch.export (issue 41).

**Why.**  whisper-base's first export took 54.5 s against CTranslate2's 6.4 s (``docs/measurements/
export_speed_2026-11-30.md``): its encoder's template traced 4.1 s, its decoder's 12.8 s in a second process beside
the PyTorch references, both cores shared (the references' 30 s audio cases took 10.7 + 13.0 s there).  Built from
the weights the templates take milliseconds and the references have the cores.

**Same graph.**  The nodes ``trace`` writes for ``wrappers.EncoderGraph``, ``CrossKVGraph`` and ``DecoderGraph`` over
the template model, after torch's decompositions and onnxscript's optimizer, checked canonically against the trace
(``tests/test_template_builders.py``): the encoder's two convolutions with exact GELU over the log-mel features
[batch, mels, 2 x positions] (fixed: Whisper reads 30 s windows), the positions' table added, its attention over
the fixed 1500 positions with no mask, queries scaled before the scores (as Whisper scales them) and no key bias;
pre-LayerNorm layers and the stacks' final LayerNorms (``bart_builder``'s); the decoder step's learned positions at
past + arange(t) gathered per row, its self-attention over [past ; step] with the causal mask, the beam-shared
cross-attention with no mask (a Whisper encoder has no padding), the head tied to the token embedding
(``proj_out``).  The wrapper's sizes are read from other inputs than BART's (``whisper_sizes``), as the trace reads
them.

**When.**  ``applies(model)`` says why not where the template would differ: another activation, an untied head,
key biases; those templates are traced, as everything is with ``ELX_TEMPLATE_BUILDER=0``.
"""
from __future__ import annotations

import numpy as np

from elx.exporter.capture import seq2seq_parts as parts
from elx.exporter.capture.bart_builder import _layer_norm, _layer_start, _mlp, _sublayer, decoder_end, \
    decoder_layer, decoder_start
from elx.exporter.capture.bart_builder import build_cross_kv  # noqa: F401 - BART's: the same cross K/V graph
from elx.exporter.capture.llama_builder import _head, linear, why_not

CLASSES = ("WhisperForConditionalGeneration",)


def applies(model) -> str | None:
    """None where this module gives the traced templates of ``model``; else why not."""
    def checks(model):
        c = model.config
        decoder = model.model.decoder
        keys = [m.k_proj for stack in (model.model.encoder, decoder) for layer in stack.layers
                for m in (layer.self_attn, getattr(layer, "encoder_attn", None)) if m is not None]
        return {
            f"activation {c.activation_function}": c.activation_function != "gelu",
            "untied head": model.proj_out.weight is not decoder.embed_tokens.weight,
            "key biases": any(k.bias is not None for k in keys),
        }
    return why_not(model, CLASSES, checks)


def _gelu(e, x, fx="gelu"):
    """Exact GELU (``Erf``), in the current scope."""
    C = e.const
    half = e("Mul", [C(0.5, np.float32), e("Add", [e("Erf", [e("Div", [x, C(np.float32(np.sqrt(2.0)), np.float32)], fx)],
                                                          fx), C(1.0, np.float32)], fx)], fx)
    return e("Mul", [x, half], fx)


def build_encoder(template_model, values: bool = False) -> tuple:
    """(``wrappers.EncoderGraph``'s graph over ``template_model``, its bindings)."""
    from onnx import TensorProto, helper

    model, c = template_model, template_model.config
    heads, layers, width = c.encoder_attention_heads, c.encoder_layers, c.max_source_positions
    d = c.d_model // heads
    encoder = model.get_encoder()
    aliases = {f"encoder.{n}": f"model.encoder.{n}" for n, _ in [*encoder.named_parameters(remove_duplicate=False),
                                                                  *encoder.named_buffers(remove_duplicate=False)]}
    e = parts.emitter(model, values, {"arange": (np.arange(width), np.int64)}, aliases, {"encoder": "model.encoder"})
    C = e.const
    e.enter("", f"{parts.WRAPPERS}.EncoderGraph")
    e.enter("encoder")
    x = "input_features"
    for conv in ("conv1", "conv2"):
        module = e.module(f"encoder.{conv}")
        weight, bias = (e.weight(f"encoder.{conv}.{w}", f"encoder.{conv}.{w}") for w in ("weight", "bias"))
        e.enter(f"encoder.{conv}")
        x = e("Conv", [x, weight, bias], "conv1d", dict(group=1, pads=[module.padding[0]] * 2, auto_pad="NOTSET",
                                                         strides=list(module.stride), dilations=list(module.dilation),
                                                         kernel_shape=list(module.kernel_size)))
        e.leave()
        x = _gelu(e, x)
    x = e("Transpose", [x], "permute", dict(perm=[0, 2, 1]))
    table = e.weight("encoder.embed_positions.weight", "encoder.embed_positions.weight")
    e.enter("encoder.embed_positions")
    positions = e("Gather", [table, "arange"], "embedding", dict(axis=0))
    e.leave()
    x = e("Add", [x, positions], "add")
    scaling = C(np.float32(d ** -0.5), np.float32)
    views = {}
    for i in range(layers):
        lp = f"encoder.layers.{i}"
        t, sa = _layer_start(e, lp), f"{lp}.self_attn"

        def attention(h, sa=sa, t=t):
            e.enter(sa)
            if not views:
                views["heads"], views["merged"] = C([-1, width, heads, d]), C([-1, width, c.d_model])
            q = e("Mul", [linear(e, h, t("self_attn.q_proj"), f"{sa}.q_proj"), scaling], "mul")
            q = e("Transpose", [e("Reshape", [q, views["heads"]], "view", dict(allowzero=1))], "transpose",
                  dict(perm=[0, 2, 1, 3]))
            k = e("Reshape", [linear(e, h, t("self_attn.k_proj"), f"{sa}.k_proj"), views["heads"]], "view",
                  dict(allowzero=1))
            v = e("Transpose", [e("Reshape", [linear(e, h, t("self_attn.v_proj"), f"{sa}.v_proj"), views["heads"]],
                                  "view", dict(allowzero=1))], "transpose", dict(perm=[0, 2, 1, 3]))
            s = e("MatMul", [q, e("Transpose", [k], "transpose", dict(perm=[0, 2, 3, 1]))], "matmul")
            o = e("MatMul", [e("Softmax", [s], "softmax", dict(axis=-1)), v], "matmul")
            o = e("Reshape", [e("Transpose", [o], "transpose", dict(perm=[0, 2, 1, 3])), views["merged"]], "view",
                  dict(allowzero=1))
            o = linear(e, o, t("self_attn.out_proj"), f"{sa}.out_proj")
            e.leave()
            return o
        x = _sublayer(e, x, f"{lp}.self_attn_layer_norm", attention, True)
        x = _sublayer(e, x, f"{lp}.final_layer_norm", lambda h, lp=lp, t=t: _mlp(e, h, lp, t), True)
        e.leave()
    _layer_norm(e, x, "encoder.layer_norm", out="last_hidden_state")
    inputs = [helper.make_tensor_value_info("input_features", TensorProto.FLOAT, ["batch", c.num_mel_bins, 2 * width])]
    outputs = [helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, ["batch", width, c.d_model])]
    return parts.graph(e, inputs, outputs)


def build_decoder(template_model, values: bool = False) -> tuple:
    """(``wrappers.DecoderGraph``'s graph: a decoder step over the self-attention past and the beam-shared cross
    K/V, its bindings)."""
    model, c = template_model, template_model.config
    e, step, (heads, layers, d) = decoder_start(model, values, reads=whisper_sizes(c.decoder_layers), cross_mask=False)
    C = e.const
    x = parts.embedding(e, "model.proj_out.weight", "model.model.decoder.embed_tokens")
    query_positions = e("Add", [e("Range", [C(0), step.t, C(1)], "arange"), step.past], "add")
    # position ids [rows, t]: the step's positions repeated per row, then the table's rows there
    per_row = e("Expand", [e("Unsqueeze", [query_positions, C([0])], "unsqueeze"), C([1, 1])], "repeat")
    per_row = e("Tile", [per_row, e("Concat", [step.r_shape, C([1])], "repeat", dict(axis=0))], "repeat")
    table = e.weight("val_decoder_positions", "model.model.decoder.embed_positions.weight")
    e.enter("model.model.decoder.embed_positions")
    positions = e("GatherND", [table, e("Unsqueeze", [per_row, C([-1])], "index")], "index", dict(batch_dims=0))
    e.leave()
    x = e("Add", [x, positions], "add")
    mask = step.self_mask(query_positions, e("Range", [C(0), step.total, C(1)], "arange"))
    scaling = C(np.float32(d ** -0.5), np.float32)
    for i in range(layers):
        lp = f"model.model.decoder.layers.{i}"
        t = _layer_start(e, lp)

        def attention(h, i=i, lp=lp, t=t):
            sa = f"{lp}.self_attn"
            e.enter(sa)
            q = e("Mul", [linear(e, h, t("self_attn.q_proj"), f"{sa}.q_proj"), scaling], "mul")
            q = step.heads_first(q)
            k, v = (step.heads_first(linear(e, h, t(f"self_attn.{w}_proj"), f"{sa}.{w}_proj"), keys=True)
                    for w in "kv")
            o = linear(e, step.self_attention(q, k, v, i, mask=mask), t("self_attn.out_proj"), f"{sa}.out_proj")
            e.leave()
            return o

        def cross(h, i=i, lp=lp, t=t):
            ca = f"{lp}.encoder_attn"
            e.enter(ca)
            q = e("Mul", [linear(e, h, t("encoder_attn.q_proj"), f"{ca}.q_proj"), scaling], "mul")
            o = linear(e, step.cross_attention(q, i, beams_from_shape=False), t("encoder_attn.out_proj"),
                       f"{ca}.out_proj")
            e.leave()
            return o
        x = decoder_layer(e, x, lp, t, attention, cross, True)
    x = decoder_end(e, x, True)
    _head(e, x, model, True, path="model.proj_out")
    inputs, outputs = parts.decoder_io(layers, heads, d, c.vocab_size)
    return parts.graph(e, [i for i in inputs if i.name != "encoder_attention_mask"], outputs)


def whisper_sizes(layers: int) -> dict:
    """Which inputs the trace reads Whisper's step sizes from (``seq2seq_parts.StepSizes``): the past length from
    layer 0's past key, the rows from layer 1's past key, the batch from its cross key."""
    middle = 1 if layers > 1 else 0  # (a template has 3 layers)
    return {"past": "past_key_values.0.decoder.key", "rows": f"past_key_values.{middle}.decoder.key",
            "batch": f"past_key_values.{middle}.encoder.key"}
