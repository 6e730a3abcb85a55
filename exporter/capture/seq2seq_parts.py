"""The parts of the encoder-decoder templates that the builders of several families write alike (issue 41): the
wrappers' sizes and masks (``capture/wrappers.py``), the beam-shared cross-attention (``capture/attention.py``), the
cross K/V graph (the head is ``llama_builder._head``; the value shapes a traced template records:
``value_shapes.py``).

Used by ``t5_builder.py``, ``bart_builder.py`` and ``whisper_builder.py``; each function writes the nodes the trace
writes for that part, checked with the families' templates (``tests/test_template_builders.py``).
"""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from elx.exporter.capture.llama_builder import Emitter, linear
from elx.exporter.capture.value_shapes import shaped

WRAPPERS = "elx.exporter.capture.wrappers"
FLOAT_MIN = np.finfo(np.float32).min


def emitter(model, values: bool, named: dict, aliases=(), paths=None) -> Emitter:
    """An ``Emitter`` over ``model`` whose constants of ``named``'s values ({name: (value, dtype)}) carry those names
    (as onnxscript shares them), whose weights are also found by the wrapper's names ``aliases`` ({wrapper name: the
    model's parameter name}), and whose modules by the wrapper's ``paths`` (``Emitter``)."""
    e = Emitter(model, values, paths)
    for name, (value, dtype) in named.items():
        array = np.array(value, dtype=dtype)
        e.inits.append(numpy_helper.from_array(array, name))
        e.consts[(array.dtype.str, array.shape, array.tobytes())] = name
    for wrapper_name, hf_name in dict(aliases).items():
        e.sources[wrapper_name] = e.sources[f"model.{hf_name}"]
    return e




def encoder_sizes(e):
    """The encoder wrapper's sizes, read as the trace reads them: (batch [1], its scalar, width [1], its scalar)."""
    b_shape = e("Shape", ["input_ids"], "sym_size_int", dict(end=1, start=0), hook=True)
    b = e("Squeeze", [b_shape], "sym_size_int", hook=True)
    n_shape = e("Shape", ["attention_mask"], "sym_size_int", dict(end=2, start=1), hook=True)
    n = e("Squeeze", [n_shape], "sym_size_int", hook=True)
    return b_shape, b, n_shape, n


def encoder_mask(e, b, keys):
    """HF's bidirectional padding mask (an index per batch row and key, vectorised, as the trace writes it), over
    ``keys`` = arange(width): [batch, 1, width, width] additive; inside the encoder's scope."""
    C = e.const
    as_bool = e("Cast", ["attention_mask"], "_to_copy", dict(to=TensorProto.BOOL))
    rows = e("Range", [C(0), b, C(1)], "arange")
    rows4 = e("Unsqueeze", [e("Unsqueeze", [rows, C([1, 2])], "unsqueeze"), C([3])], "unsqueeze")
    keys2 = e("Unsqueeze", [keys, C([0, 1])], "unsqueeze")
    keys4 = e("Unsqueeze", [keys2, C([3])], "unsqueeze")
    keys_q = e("Unsqueeze", [keys2, C([2])], "unsqueeze")
    allowed = e("And", [C(True, np.bool_), e("GreaterOrEqual", [keys4, C(0)], "ge")], "bitwise_and")
    shape = e("Shape", [e("Max", [rows4, keys_q], "index")], "index", dict(start=0))
    at = [e("Unsqueeze", [e("Expand", [v, shape], "index"), C([-1])], "index") for v in (rows4, keys_q)]
    picked = e("GatherND", [as_bool, e("Concat", at, "index", dict(axis=-1))], "index", dict(batch_dims=0))
    allowed = e("And", [allowed, picked], "bitwise_and")
    return e("Where", [allowed, C(0.0, np.float32), C(FLOAT_MIN, np.float32)], "where")


class StepSizes:
    """The decoder step wrapper's sizes (read from its inputs as the trace reads them: by default rows and past length
    from the last layer's past value, the batch from layer 0's cross value; ``reads`` {"past", "rows", "batch": input}
    where the trace reads others: Whisper's) and its cross-attention mask [batch, 1, 1, N] additive (none without
    ``cross_mask``: Whisper's step has no encoder mask), written in the wrapper's scope; ``self_mask(steps,
    positions)`` the causal mask inside the decoder's."""

    def __init__(self, e, layers: int, heads: int, d: int, reads: dict | None = None, cross_mask: bool = True):
        C = e.const
        self.e, self.heads, self.d = e, heads, d
        last = f"past_key_values.{layers - 1}.decoder.value"
        reads = {"past": last, "rows": last, "batch": "past_key_values.0.encoder.value", **(reads or {})}
        self.t_shape = e("Shape", ["input_ids"], "sym_size_int", dict(end=2, start=1), hook=True)
        self.t = e("Squeeze", [self.t_shape], "sym_size_int", hook=True)
        self.r_shape = e("Shape", [reads["rows"]], "sym_size_int", dict(end=1, start=0), hook=True)
        rows = e("Squeeze", [self.r_shape], "sym_size_int", hook=True)
        p_shape = e("Shape", [reads["past"]], "sym_size_int", dict(end=3, start=2), hook=True)
        self.past = e("Squeeze", [p_shape], "sym_size_int", hook=True)
        self.b_shape = e("Shape", [reads["batch"]], "sym_size_int", dict(end=1, start=0), hook=True)
        self.b = e("Squeeze", [self.b_shape], "sym_size_int", hook=True)
        self.beams = e("Div", [rows, self.b], "floordiv", hook=True)
        self.total = e("Add", [self.past, self.t], "add", hook=True)
        self.bhd = e("Mul", [C(heads * d), self.b], "mul")
        self.cross_mask = None
        if cross_mask:
            mask = e("Cast", [e("Unsqueeze", ["encoder_attention_mask", C([1, 2])], "unsqueeze")], "_to_copy",
                     dict(to=TensorProto.FLOAT))
            self.cross_mask = e("Mul", [e("Sub", [C(1.0, np.float32), mask], "sub"), C(FLOAT_MIN, np.float32)], "mul")
        self.shared = {}

    def self_mask(self, query_positions, positions):
        """The causal mask [rows, 1, t, past + t] of the step's queries at ``query_positions`` [t] over
        ``positions`` = arange(past + t)."""
        e, C = self.e, self.e.const
        query_at = e("Unsqueeze", [e("Unsqueeze", [query_positions, C([0, 1])], "unsqueeze"), C([3])], "unsqueeze")
        key_at = e("Unsqueeze", [e("Unsqueeze", [positions, C([0, 1])], "unsqueeze"), C([2])], "unsqueeze")
        causal = e("LessOrEqual", [key_at, query_at], "le")
        size = e("Concat", [self.r_shape, C([1]), self.t_shape,
                            e("Reshape", [self.total, C([-1])], "expand", dict(allowzero=0))], "expand", dict(axis=0))
        return e("Where", [e("Expand", [causal, size], "expand"), C(0.0, np.float32), C(FLOAT_MIN, np.float32)],
                 "where")

    def view(self):
        """[rows, t, -1, d]: the step's heads view (made once, in layer 0's self-attention scope)."""
        if "view" not in self.shared:
            self.shared["view"] = self.e("Concat", [self.r_shape, self.t_shape, self.e.const([-1]),
                                                    self.e.const([self.d])], "view", dict(axis=0))
        return self.shared["view"]

    def merged(self):
        """[rows, t, -1]: the heads merged back (made once)."""
        if "merged" not in self.shared:
            self.shared["merged"] = self.e("Concat", [self.r_shape, self.t_shape, self.e.const([-1])], "view",
                                           dict(axis=0))
        return self.shared["merged"]

    def heads_first(self, y, keys: bool = False):
        """[rows, t, h·d] -> [rows, h, t, d]; ``keys``: through the view [rows, -1, h, d] (Whisper's keys and
        values; its queries and every other family's go through ``view``)."""
        e, C = self.e, self.e.const
        view = self.view()
        if keys:
            if "keys_view" not in self.shared:
                self.shared["keys_view"] = e("Concat", [self.r_shape, C([-1]), C([self.heads]), C([self.d])], "view",
                                             dict(axis=0))
            view = self.shared["keys_view"]
        return e("Transpose", [e("Reshape", [y, view], "view", dict(allowzero=1))], "transpose",
                 dict(perm=[0, 2, 1, 3]))

    def self_attention(self, q, k, v, i: int, bias=None, mask=None, scaling=None):
        """Layer ``i``'s attention over [past ; this step] (its presents the graph's outputs): scores (times
        ``scaling``) plus ``bias`` (T5's positions) plus ``mask``, merged heads [rows, t, h·d]."""
        e = self.e
        key = e("Concat", [f"past_key_values.{i}.decoder.key", k], "cat", dict(axis=-2),
                out=f"present.{i}.decoder.key")
        value = e("Concat", [f"past_key_values.{i}.decoder.value", v], "cat", dict(axis=-2),
                  out=f"present.{i}.decoder.value")
        o = attend(e, q, e("Transpose", [key], "transpose", dict(perm=[0, 1, 3, 2])), value, scaling, bias, mask)
        return e("Reshape", [o, self.merged()], "view", dict(allowzero=1))

    def cross_attention(self, q, i: int, scaling=None, beams_from_shape: bool = True):
        """Layer ``i``'s attention of the rows' queries ``q`` [rows, t, h·d] over the batch's encoder keys and values
        (one per input, shared by its beams: ``capture/attention.py``), merged heads [rows, t, h·d].  The queries
        are viewed [batch, beams, h, t, d] with the beams counted (or -1 where ``beams_from_shape`` is False, as the
        trace writes Whisper's)."""
        e, C, shared, heads, d = self.e, self.e.const, self.shared, self.heads, self.d
        q = self.heads_first(q)
        fx = "_unsafe_view" if beams_from_shape else "view"
        if "beams_q" not in shared:
            bh = e("Mul", [self.b, C(heads)], "mul")
            per_beam = (e("Reshape", [self.beams, C([-1])], "_unsafe_view", dict(allowzero=0)) if beams_from_shape
                        else C([-1]))
            shared["beams_q"] = e("Concat", [self.b_shape, per_beam, C([heads]), self.t_shape, C([d])], fx,
                                  dict(axis=0))
            items = e("Mul", [e("Mul", [e("Mul", [bh, self.beams], "mul"), self.t], "mul"), C(d)], "mul")
            items = e("Reshape", [e("Div", [items, self.bhd], "floordiv"), C([-1])], "_unsafe_view", dict(allowzero=0))
            shared["items_q"] = e("Concat", [self.b_shape, C([heads]), items, C([d])], "_unsafe_view", dict(axis=0))
        q = e("Transpose", [e("Reshape", [q, shared["beams_q"]], fx, dict(allowzero=1))], "transpose",
              dict(perm=[0, 2, 1, 3, 4]))
        q = e("Reshape", [q, shared["items_q"]], "_unsafe_view", dict(allowzero=1))
        key_t = e("Transpose", [f"past_key_values.{i}.encoder.key"], "transpose", dict(perm=[0, 1, 3, 2]))
        s = e("MatMul", [q, key_t], "matmul")
        if scaling is not None:
            s = e("Mul", [s, scaling], "mul")
        if self.cross_mask is not None:
            s = e("Add", [s, self.cross_mask], "add")
        o = e("MatMul", [e("Softmax", [s], "softmax", dict(axis=-1)), f"past_key_values.{i}.encoder.value"], "matmul")
        if "into_beams_o" not in shared:
            shared["into_beams_o"] = e("Concat", [self.b_shape, C([heads]), C([-1]), self.t_shape, C([d])], "view",
                                       dict(axis=0))
        o = e("Transpose", [e("Reshape", [o, shared["into_beams_o"]], "view", dict(allowzero=1))], "permute",
              dict(perm=[0, 2, 3, 1, 4]))
        if "rows_o" not in shared:
            shared["rows_o"] = e("Concat", [self.r_shape, self.t_shape, C([heads]), C([d])], "_unsafe_view",
                                 dict(axis=0))
        o = e("Reshape", [o, shared["rows_o"]], "_unsafe_view", dict(allowzero=1))
        return e("Reshape", [o, self.merged()], "view", dict(allowzero=1))


def attend(e, q, key_t, value, scaling, bias, mask):
    """softmax(q @ ``key_t`` (times ``scaling``) + ``bias`` + ``mask``) @ ``value``, heads moved back after the
    positions: [B, t, h, d] (the elx attention's order of operations: ``capture/attention.py``)."""
    s = e("MatMul", [q, key_t], "matmul")
    if scaling is not None:
        s = e("Mul", [s, scaling], "mul")
    if bias is not None:
        s = e("Add", [s, bias], "add")
    s = e("Add", [s, mask], "add")
    o = e("MatMul", [e("Softmax", [s], "softmax", dict(axis=-1)), value], "matmul")
    return e("Transpose", [o], "transpose", dict(perm=[0, 2, 1, 3]))


def encoder_start(model, values: bool, named: dict, aliases, paths=None) -> tuple:
    """An ``emitter`` inside the encoder wrapper's ``encoder`` scope, after the wrapper's sizes and the token
    embedding: (e, batch [1], batch, width [1], width, embeddings)."""
    e = emitter(model, values, named, aliases, paths)
    e.enter("", f"{WRAPPERS}.EncoderGraph")
    b_shape, b, n_shape, n = encoder_sizes(e)
    e.enter("encoder")
    return (e, b_shape, b, n_shape, n, embedding(e, "encoder.embed_tokens.weight", "encoder.embed_tokens"))


def embedding(e, weight: str, path: str):
    """The token embedding at ``path``: a Gather of the initializer ``weight`` (the wrapper's name of it)."""
    e.weight(weight, weight)
    e.enter(path)
    x = e("Gather", [weight, "input_ids"], "embedding", dict(axis=0))
    e.leave()
    return x


def encoder_attention(e, h, shared, sizes, projections: dict, bias=None, mask=None, scaling=None):
    """The encoder's self-attention over its rows ``h`` (inside the attention's scope): ``projections`` {"q"/"k"/"v"/"o": (its
    module path, its transposed weight)}, the scores (times ``scaling``) plus ``bias`` and ``mask``; [B, N, h·d]."""
    b_shape, n_shape, d = sizes
    C = e.const

    def project(which, x):
        path, weight = projections[which]
        return linear(e, x, weight, path)
    q = project("q", h)
    if "view" not in shared:
        shared["view"] = e("Concat", [b_shape, n_shape, C([-1]), C([d])], "view", dict(axis=0))
    q = e("Transpose", [e("Reshape", [q, shared["view"]], "view", dict(allowzero=1))], "transpose",
          dict(perm=[0, 2, 1, 3]))
    k = e("Reshape", [project("k", h), shared["view"]], "view", dict(allowzero=1))
    v = e("Transpose", [e("Reshape", [project("v", h), shared["view"]], "view", dict(allowzero=1))], "transpose",
          dict(perm=[0, 2, 1, 3]))
    bias = bias() if callable(bias) else bias
    o = attend(e, q, e("Transpose", [k], "transpose", dict(perm=[0, 2, 3, 1])), v, scaling, bias, mask)
    if "merged" not in shared:
        shared["merged"] = e("Concat", [b_shape, n_shape, C([-1])], "view", dict(axis=0))
    o = e("Reshape", [o, shared["merged"]], "view", dict(allowzero=1))
    return project("o", o)


def build_cross_kv(template_model, values: bool, layers: int, heads: int, d: int, d_model: int, projections) -> tuple:
    """(``wrappers.CrossKVGraph``'s graph: each decoder layer's cross-attention keys and values; its bindings).
    ``projections(i)``: layer ``i``'s (key, value) projection modules' paths in the template model."""
    aliases = {}
    for i in range(layers):
        for w, path in zip(("k", "v"), projections(i)):
            aliases[f"layers.{i}.{w}_proj.weight"] = f"{path}.weight"
            if getattr(template_model.get_submodule(path), "bias", None) is not None:
                aliases[f"layers.{i}.{w}_proj.bias"] = f"{path}.bias"
    e = emitter(template_model, values, {}, aliases)
    C = e.const
    e.enter("", f"{WRAPPERS}.CrossKVGraph")
    b_shape = e("Shape", ["encoder_hidden_states"], "sym_size_int", dict(end=1, start=0), hook=True)
    n_shape = e("Shape", ["encoder_hidden_states"], "sym_size_int", dict(end=2, start=1), hook=True)
    view = None
    for i in range(layers):
        e.enter(f"layers.{i}", f"{WRAPPERS}._CrossKV")
        for w, kind in (("k", "key"), ("v", "value")):
            weight = e.weight(f"val_w{i}_{w}", f"layers.{i}.{w}_proj.weight", transposed=True)
            e.enter(f"layers.{i}.{w}_proj", "torch.nn.modules.linear.Linear")
            y = e("MatMul", ["encoder_hidden_states", weight], "linear")
            if f"layers.{i}.{w}_proj.bias" in aliases:
                y = e("Add", [y, e.weight(f"layers.{i}.{w}_proj.bias", f"layers.{i}.{w}_proj.bias")], "linear")
            e.leave()
            if view is None:
                view = e("Concat", [b_shape, n_shape, C([heads]), C([d])], "view", dict(axis=0))
            e("Transpose", [e("Reshape", [y, view], "view", dict(allowzero=1))], "transpose", dict(perm=[0, 2, 1, 3]),
              out=f"present.{i}.encoder.{kind}")
        e.leave()
    inputs = [helper.make_tensor_value_info("encoder_hidden_states", TensorProto.FLOAT,
                                            ["batch", "encoder_sequence", d_model])]
    outputs = [helper.make_tensor_value_info(f"present.{i}.encoder.{kind}", TensorProto.FLOAT,
                                             ["batch", heads, "encoder_sequence", d])
               for i in range(layers) for kind in ("key", "value")]
    return graph(e, inputs, outputs)


def encoder_io(d_model: int) -> tuple:
    inputs = [helper.make_tensor_value_info(name, TensorProto.INT64, ["batch", "encoder_sequence"])
              for name in ("input_ids", "attention_mask")]
    outputs = [helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT,
                                             ["batch", "encoder_sequence", d_model])]
    return inputs, outputs


def decoder_io(layers: int, heads: int, d: int, vocab: int) -> tuple:
    rows_kv = ["rows", heads, "past_sequence", d]
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["rows", "decoder_sequence"]),
              helper.make_tensor_value_info("encoder_attention_mask", TensorProto.INT64, ["batch", "encoder_sequence"])]
    inputs += [helper.make_tensor_value_info(f"past_key_values.{i}.decoder.{kind}", TensorProto.FLOAT, rows_kv)
               for i in range(layers) for kind in ("key", "value")]
    inputs += [helper.make_tensor_value_info(f"past_key_values.{i}.encoder.{kind}", TensorProto.FLOAT,
                                             ["batch", heads, "encoder_sequence", d])
               for i in range(layers) for kind in ("key", "value")]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["rows", vocab])]
    outputs += [helper.make_tensor_value_info(f"present.{i}.decoder.{kind}", TensorProto.FLOAT,
                                              ["rows", heads, "past_sequence + decoder_sequence", d])
                for i in range(layers) for kind in ("key", "value")]
    return inputs, outputs


def graph(e, inputs, outputs) -> tuple:
    """(the template's model with its values' shapes: ``shaped``; its bindings)."""
    from elx.exporter.capture.llama_builder import _model

    return shaped(_model(e, inputs, outputs))
