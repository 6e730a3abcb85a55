"""The prefill and shared-prompt step templates of the Llama-architecture families (Llama, Mistral, Qwen2, Qwen3,
Gemma, Phi-3) built from the weights, without torch.export (issue 41).

**Why.**  A first export's critical path is tracing its two 3-layer templates (``exporter/capture/stitched.py``):
on the real SmolLM2-135M, 11.7 s (prefill) and 19.9 s (step) on two cores at once, most of it torch.export's
symbolic-shape work per FX node, whatever the model's size.  onnxruntime-genai's builder writes its graphs from
the weights in seconds; this module does the same for the templates of ``LlamaForCausalLM`` and the classes that
share its graph (``CLASSES``: Mistral's is Llama's; Qwen2 adds q/k/v biases, Qwen3 an RMSNorm per query and key
head, Gemma its embeddings scaled by sqrt(d), RMSNorms scaling by ``1 + w`` (folded, bound as ``w`` shifted:
``exporter/capture/weights.py``) and GELU's tanh form, Phi-3 its fused ``qkv_proj`` and ``gate_up_proj`` (one
product each, sliced and split as HF does) and a rotation over part of each head where ``partial_rotary_factor`` <
1): milliseconds, since it writes no weight values (stitching binds the model's own tensors).

**Same graph.**  The nodes are those ``trace`` writes for ``decoder_only.PrefillGraph`` and
``SharedPromptStepGraph`` over the template model (HF's Llama modules with elx's attention: ``capture/attention.py``,
``shared_prompt.py``, ``grouped_attention.py``, after torch's decompositions and onnxscript's optimizer): the same
op types, attributes, inputs (constants by value), module scopes and weights, checked canonically against the
trace (``tests/test_llama_builder.py``: GQA, MHA and MQA, tied and untied heads, Llama 3 rotary scaling, biases,
Mistral, Qwen2, Qwen3; on this machine also the real SmolLM2-135M and the TinyLlama-1.1B and SmolLM2-1.7B dims).
Each scope's class is read from the template model's own module there (as the trace names it).  So the stitcher, the passes and
int8's per-layer rule (which read ``namespace`` and ``pkg.torch.onnx.name_scopes``) see what they see after a
trace, and the export verifies the stitched graphs against PyTorch as always.  Details the trace decides and
this module repeats: the symbolic sizes torch reads from the inputs (batch from ``prompt_key_values.0.key``, the
prompt width from the last layer's prompt value, rows from layer 1's past key), the shape arithmetic of the
grouped-query reshapes (computed once, in layer 0's scope; a product by one key/value head left out, as torch
does), the static one-token step shapes, and onnxscript's
folding rule for the head's transpose (a tied head larger than 8192 values is shared with the embedding's Gather
and kept as a Transpose node; every other weight is stored transposed).  The prefill records the shapes of its values
as a trace does (``value_shapes.shaped``: ``unpad`` finds the rows [batch, sequence, features] by them; without
them ``--pass unpad`` refused every stitched Llama until the 20th session); the step graph carries none, which
nothing downstream reads.

**When.**  ``applies(model)`` says why not where the template would differ: another class (GPT-NeoX's:
``neox_builder.py``), another activation (``ACTIVATIONS``: SiLU and GELU's tanh form) or rotary type, a rotary
attention factor, ``pretraining_tp``; those templates are traced (``stitched.py``), as everything is
with ``ELX_TEMPLATE_BUILDER=0``.  A transformers, torch or onnxscript upgrade that changes the traced graph shows in
the canonical test before it reaches a user.
"""
from __future__ import annotations

import os

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

INT64_MAX = 9223372036854775807
FOLD_INPUT_LIMIT = 8192  # onnxscript optimizer DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT
HOOK = "_empty_nn_module_stack_from_metadata_hook"


class Emitter:
    """Nodes with the trace's module scopes, constants (one initializer per value), and the template's weights: each
    recorded as its binding (``exporter/capture/weights.py``: which model tensor it holds, as it is or transposed),
    its values written only with ``values`` (the canonical test; stitching binds the model's own tensors)."""

    def __init__(self, model, values: bool, paths: dict | None = None):
        self.nodes, self.inits, self.consts, self.count = [], [], {}, 0
        # {the wrapper's path prefix: the template model's}: where a wrapper holds a submodule under another name
        # (BART's encoder graph: "encoder" is the model's "model.encoder"); "model." is the model itself
        self.paths = {**(paths or {}), "model.": ""}
        self.scope = []  # [(path, class)]
        self.values, self.bindings, self.model = values, {}, model
        # the wrapper's names ("model." + the HF model's); a tied head is the embedding's (as ``bind`` names it)
        first, self.sources = {}, {}
        for n, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
            self.sources[f"model.{n}"] = (first.setdefault(id(t), n), t)

    def const(self, value, dtype=np.int64, shape=None):
        array = np.array(value, dtype=dtype)
        if shape is not None:
            array = array.reshape(shape)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self.consts:
            name = f"val_c{len(self.consts)}"
            self.inits.append(numpy_helper.from_array(array, name))
            self.consts[key] = name
        return self.consts[key]

    def weight(self, name: str, source: str, transposed: bool = False, shift: float = 0.0) -> str:
        """Initializer ``name`` holding the model tensor ``source`` (the wrapper's name), transposed or not, or plus
        the constant ``shift`` (Gemma's ``1 + w``, as onnxscript's optimizer folds it)."""
        from elx.exporter.capture.weights import IDENTITY, SHIFT, TRANSPOSE, Binding

        source, tensor = self.sources[source]
        binding = Binding(source, SHIFT, shift) if shift else Binding(source, TRANSPOSE if transposed else IDENTITY)
        if tensor.numel() < 2:  # as ``bind`` has it: a single value is a constant of the graph, not a bound weight
            self.inits.append(numpy_helper.from_array(binding.apply(tensor.detach().numpy()), name))
            return name
        self.bindings[name] = binding
        shape = tuple(reversed(tensor.shape)) if transposed else tuple(tensor.shape)
        if self.values:
            self.inits.append(numpy_helper.from_array(np.ascontiguousarray(binding.apply(tensor.detach().numpy())),
                                                      name))
        else:
            self.inits.append(TensorProto(name=name, data_type=TensorProto.FLOAT, dims=shape))  # as the cache's bound
        return name

    def __call__(self, op, inputs, fx, attrs=None, out=None, hook=False, outputs=1, bare=False):
        """A node (its output's name, or the names of its ``outputs``, if more than one); ``bare``: no module
        scope (a node onnxscript's optimizer wrote, e.g. GPT-2's Split of its fused projection)."""
        self.count += 1
        out = out or f"{fx}_{self.count}"
        names = [out] if outputs == 1 else [f"{out}_{k}" for k in range(outputs)]
        node = helper.make_node(op, list(inputs), names, name=f"node_{fx}_{self.count}", **(attrs or {}))
        if bare:
            self.nodes.append(node)
            return names
        if hook:
            scopes, classes = [HOOK], [HOOK]
            namespace = f"{HOOK}: {HOOK}/{fx}: aten"
        else:
            scopes = [p for p, _ in self.scope]
            classes = [c for _, c in self.scope]
            namespace = "/".join(f"{p}: {c}" for p, c in self.scope) + f"/{fx}: aten"
        scopes = scopes + [fx]
        node.metadata_props.extend([
            onnx.StringStringEntryProto(key="namespace", value=namespace),
            onnx.StringStringEntryProto(key="pkg.torch.onnx.name_scopes", value=repr(scopes)),
            onnx.StringStringEntryProto(key="pkg.torch.onnx.class_hierarchy", value=repr(classes + ["aten"])),
        ])
        self.nodes.append(node)
        return out if outputs == 1 else names

    def enter(self, path, cls=None):
        """Into module ``path`` (the wrapper's name: "model" is the template model); its class, unless given, the
        template model's own module's there (as the trace names it: module and qualified name)."""
        if cls is None:
            module = self.module(path)
            cls = f"{type(module).__module__}.{type(module).__qualname__}"
        self.scope.append((path, cls))

    def module(self, path: str):
        """The template model's module at the wrapper's ``path``."""
        if path == "model":
            return self.model
        for prefix, inner in self.paths.items():
            if path.startswith(prefix):
                return self.model.get_submodule(inner + path[len(prefix):])
        return self.model.get_submodule(path)

    def leave(self):
        self.scope.pop()


SHIFTED_NORMS = ("GemmaRMSNorm",)  # RMSNorms that scale by ``1 + w``, after the normalized values


def norm_weight(e, path: str) -> str:
    """The initializer the RMSNorm at ``path`` scales by: its ``weight``, named as the model names it, or, for a norm
    that scales by ``1 + w`` (``SHIFTED_NORMS``), ``1 + weight`` folded (onnxscript's optimizer does, naming it after
    its node: the builder's name starts with ``val_``, the exporter's own, as the canonical comparison reads names)."""
    source = f"{path}.weight"
    if type(e.module(path)).__name__ in SHIFTED_NORMS:
        return e.weight(f"val_shifted_{path}.weight", source, shift=1.0)
    return e.weight(source, source)


def rms_norm(e, x, weight_name, eps, path, out=None):
    """The RMSNorm at ``path`` (its own epsilon where it keeps one, else ``eps``) scaling by the initializer
    ``weight_name`` (``norm_weight``); its output named ``out`` where given (a graph output)."""
    eps = float(getattr(e.module(path), "variance_epsilon", eps))
    shifted = type(e.module(path)).__name__ in SHIFTED_NORMS
    e.enter(path)
    p = e("Pow", [x, e.const(2.0, np.float32)], "pow")
    m = e("ReduceMean", [p, e.const([-1])], "mean", dict(noop_with_empty_axes=0, keepdims=1))
    a = e("Add", [m, e.const(eps, np.float32)], "add")
    s = e("Sqrt", [a], "rsqrt")
    r = e("Reciprocal", [s], "rsqrt")
    y = e("Mul", [x, r], "mul")
    y = e("Mul", [y, weight_name] if shifted else [weight_name, y], "mul", out=out)  # HF's operand order
    e.leave()
    return y


def head_norm(e, y, lp, which, eps):
    """Qwen3's RMSNorm of each query or key head (``which``: "q" or "k") over ``y`` [.., heads, d], where the layer's
    attention has one; else ``y``."""
    path = f"{lp}.self_attn.{which}_norm"
    if not hasattr(e.module(f"{lp}.self_attn"), f"{which}_norm"):
        return y
    return rms_norm(e, y, norm_weight(e, path), eps, path)


def projections(e, h, t, lp: str, heads: int, kv: int, d: int) -> tuple:
    """Layer ``lp``'s query, key and value projections of ``h`` (before the heads' reshape): three products, or one
    of Phi-3's fused ``qkv_proj`` sliced along the features as HF slices it."""
    if not hasattr(e.module(f"{lp}.self_attn"), "qkv_proj"):
        return tuple(linear(e, h, t(f"self_attn.{w}_proj"), f"{lp}.self_attn.{w}_proj") for w in "qkv")
    fused, C = linear(e, h, t("self_attn.qkv_proj"), f"{lp}.self_attn.qkv_proj"), e.const
    ends = (heads * d, (heads + kv) * d)
    return (e("Slice", [fused, C([0]), C([ends[0]]), C([2]), C([1])], "slice"),
            e("Slice", [fused, C([ends[0]]), C([ends[1]]), C([2]), C([1])], "slice"),
            e("Slice", [fused, C([ends[1]]), C([INT64_MAX]), C([2]), C([1])], "slice"))


def linear(e, x, weight_t, path, fx="linear"):
    """``x @ weight_t`` (+ the module's bias, where it has one: Qwen2's q/k/v), inside the module's scope."""
    e.enter(path)
    y = e("MatMul", [x, weight_t], fx)
    if getattr(e.module(path), "bias", None) is not None:
        y = e("Add", [y, e.weight(f"{path}.bias", f"{path}.bias")], fx)
    e.leave()
    return y


def prefill_start(model, values: bool, wrapper_class: str) -> tuple:
    """(an ``Emitter`` inside the prefill wrapper's scope, and ``prompt_mask``'s batch, width and mask)."""
    e = Emitter(model, values)
    e.enter("", wrapper_class)
    return (e, *prompt_mask(e))


def step_start(model, values: bool, wrapper_class: str, layers: int, heads: int, kv: int, d: int) -> tuple:
    """(an ``Emitter`` inside the shared-prompt step wrapper's scope, and its ``StepSizes``: every decoder-only
    family whose step wrapper computes them alike: Llama's architecture, GPT-NeoX, OPT)."""
    e = Emitter(model, values)
    e.enter("", wrapper_class)
    return e, StepSizes(e, layers, heads, kv, d)


def prompt_mask(e):
    """The prefill wrapper's sizes and additive causal mask over ``attention_mask``: (batch [1], width [1], mask
    [batch, 1, width, width]) as the trace writes them (every decoder-only family alike)."""
    b_shape = e("Shape", ["attention_mask"], "sym_size_int", dict(end=1, start=0), hook=True)
    p_shape = e("Shape", ["attention_mask"], "sym_size_int", dict(end=2, start=1), hook=True)
    pp = e("Concat", [p_shape, p_shape], "ones", dict(axis=0))
    ones = e("Expand", [e.const(True, np.bool_), pp], "ones")
    tril = e("Trilu", [ones, e.const(0)], "tril", dict(upper=0))
    causal = e("Unsqueeze", [tril, e.const([0, 1])], "unsqueeze")
    as_bool = e("Cast", ["attention_mask"], "_to_copy", dict(to=TensorProto.BOOL))
    keys_ok = e("Unsqueeze", [as_bool, e.const([1, 2])], "unsqueeze")
    allowed = e("And", [causal, keys_ok], "bitwise_and")
    zshape = e("Concat", [b_shape, e.const([1]), p_shape, p_shape], "zeros", dict(axis=0))
    zeros = e("Expand", [e.const(0.0, np.float32), zshape], "zeros")
    banned = e("Not", [allowed], "bitwise_not")
    return b_shape, p_shape, e("Where", [banned, e.const(np.finfo(np.float32).min, np.float32), zeros], "masked_fill")


def build_prefill(template_model, values: bool = False,
                  wrapper_class="elx.exporter.capture.decoder_only.PrefillGraph") -> tuple:
    """(``decoder_only.PrefillGraph``'s graph over ``template_model``, its bindings)."""
    model, c = template_model, template_model.config
    heads, kv, d, layers, tied = _dims(model)
    e, b_shape, p_shape, mask = prefill_start(model, values, wrapper_class)
    grouped = kv != heads
    # Phi-3's queries (sliced from the fused product) are grouped by a view over [batch, kv, -1, d]; the others' by
    # an unsafe view whose rows torch computes from the sizes (b h p d // b kv d)
    sliced = hasattr(e.module("model.model.layers.0.self_attn"), "qkv_proj")
    if grouped:
        b = None if sliced else e("Squeeze", [b_shape], "sym_size_int", hook=True)
        p = e("Squeeze", [p_shape], "sym_size_int", hook=True)
        p2 = e("Pow", [p, e.const(2)], "pow", hook=True)
        p_sq_over_p = e("Div", [p2, p], "floordiv", hook=True)
    x, rope = _embedding_and_rotary(e, model, tied)
    eps = float(c.rms_norm_eps)
    shared = {}
    for i in range(layers):
        lp, h, t = _layer_start(e, x, i, eps)
        q, k, v = projections(e, h, t, lp, heads, kv, d)
        if "view" not in shared:
            shared["view"] = e("Concat", [b_shape, p_shape, e.const([-1]), e.const([d])], "view", dict(axis=0))
        q = e("Transpose", [head_norm(e, e("Reshape", [q, shared["view"]], "view", dict(allowzero=1)), lp, "q", eps)],
              "transpose", dict(perm=[0, 2, 1, 3]))
        k = e("Transpose", [head_norm(e, e("Reshape", [k, shared["view"]], "view", dict(allowzero=1)), lp, "k", eps)],
              "transpose", dict(perm=[0, 2, 1, 3]))
        v = e("Transpose", [e("Reshape", [v, shared["view"]], "view", dict(allowzero=1))], "transpose",
              dict(perm=[0, 2, 1, 3]), out=f"present.{i}.value")
        q = rope(q)
        k = rope(k, out=f"present.{i}.key")
        scaling = e.const(np.float32(d ** -0.5), np.float32)
        if grouped and sliced:
            if "grouped_q" not in shared:
                shared["grouped_q"] = e("Concat", [b_shape, e.const([kv]), e.const([-1]), e.const([d])], "view",
                                        dict(axis=0))
            qg = e("Reshape", [q, shared["grouped_q"]], "view", dict(allowzero=1))
        if grouped and not sliced:
            if "grouped_q" not in shared:
                m1 = e("Mul", [b, e.const(heads)], "mul")
                m1 = e("Mul", [m1, p], "mul")
                m1 = e("Mul", [m1, e.const(d)], "mul")
                m2 = e("Mul", [b, e.const(kv)], "mul") if kv > 1 else b  # torch drops a product by 1
                m2 = e("Mul", [m2, e.const(d)], "mul")
                rows = e("Div", [m1, m2], "floordiv")
                rows = e("Reshape", [rows, e.const([-1])], "_unsafe_view", dict(allowzero=0))
                shared["grouped_q"] = e("Concat", [b_shape, e.const([kv]), rows, e.const([d])], "_unsafe_view",
                                        dict(axis=0))
            qg = e("Reshape", [q, shared["grouped_q"]], "_unsafe_view", dict(allowzero=1))
        if grouped:
            s = e("MatMul", [qg, e("Transpose", [k], "transpose", dict(perm=[0, 1, 3, 2]))], "matmul")
            if "scores" not in shared:
                shared["scores"] = e("Concat", [b_shape, e.const([heads]), p_shape, e.const([-1])], "view",
                                     dict(axis=0))
            s = e("Reshape", [s, shared["scores"]], "view", dict(allowzero=1))
        else:
            s = e("MatMul", [q, e("Transpose", [k], "transpose", dict(perm=[0, 1, 3, 2]))], "matmul")
        s = e("Add", [e("Mul", [s, scaling], "mul"), mask], "add")
        probs = e("Softmax", [s], "softmax", dict(axis=-1))
        if grouped:
            if "grouped_p" not in shared:
                last = e("Reshape", [p_sq_over_p, e.const([-1])], "view", dict(allowzero=0))
                shared["grouped_p"] = e("Concat", [b_shape, e.const([kv]), e.const([-1]), last], "view", dict(axis=0))
            pg = e("Reshape", [probs, shared["grouped_p"]], "view", dict(allowzero=1))
            o = e("MatMul", [pg, v], "matmul")
            o = e("Reshape", [o, shared["scores"]], "view", dict(allowzero=1))
        else:
            o = e("MatMul", [probs, v], "matmul")
        o = e("Transpose", [o], "transpose", dict(perm=[0, 2, 1, 3]))
        if "merged" not in shared:
            shared["merged"] = e("Concat", [b_shape, p_shape, e.const([-1])], "view", dict(axis=0))
        o = e("Reshape", [o, shared["merged"]], "view", dict(allowzero=1))
        o = linear(e, o, t("self_attn.o_proj"), f"{lp}.self_attn.o_proj")
        e.leave()
        x = _residual_and_mlp(e, x, o, lp, t, eps)
        e.leave()
    x = rms_norm(e, x, norm_weight(e, "model.model.norm"), eps, "model.model.norm")
    e.leave()  # model.model
    _head(e, x, model, tied)
    return prefill_graph(e, layers, kv, d, c.vocab_size)



class StepSizes:
    """The shared-prompt step wrapper's sizes and masks (read from the inputs as the trace reads them), and its
    attention over [prompt ; past ; the token] (``capture/shared_prompt.py``), for every decoder-only family whose
    wrapper computes them alike (Llama's architecture, OPT)."""

    def __init__(self, e, layers: int, heads: int, kv: int, d: int):
        C = e.const
        self.e, self.heads, self.kv, self.d, self.shared = e, heads, kv, d, {}
        self.b_shape = e("Shape", ["prompt_key_values.0.key"], "sym_size_int", dict(end=1, start=0), hook=True)
        self.b = e("Squeeze", [self.b_shape], "sym_size_int", hook=True)
        self.p_shape = e("Shape", [f"prompt_key_values.{layers - 1}.value"], "sym_size_int", dict(end=3, start=2),
                         hook=True)
        gen = e("Squeeze", [e("Shape", ["past_key_values.0.value"], "sym_size_int", dict(end=3, start=2), hook=True)],
                "sym_size_int", hook=True)
        self.r_shape = e("Shape", [f"past_key_values.{min(1, layers - 1)}.key"], "sym_size_int", dict(end=1, start=0),
                         hook=True)
        rows = e("Squeeze", [self.r_shape], "sym_size_int", hook=True)
        as_bool = e("Cast", ["prompt_attention_mask"], "_to_copy", dict(to=TensorProto.BOOL))
        self.beams = e("Div", [rows, self.b], "floordiv")
        keys_ok = e("Unsqueeze", [as_bool, C([1, 2])], "unsqueeze")
        zshape = e("Concat", [self.b_shape, C([1]), C([1]), self.p_shape], "zeros", dict(axis=0))
        zeros = e("Expand", [C(0.0, np.float32), zshape], "zeros")
        banned = e("Not", [keys_ok], "bitwise_not")
        self.mask = e("Where", [banned, C(np.finfo(np.float32).min, np.float32), zeros], "masked_fill")
        self.g1_shape = e("Reshape", [e("Add", [gen, C(1)], "add"), C([-1])], "zeros", dict(allowzero=0))
        own_shape = e("Concat", [self.r_shape, C([1]), C([1]), self.g1_shape], "zeros", dict(axis=0))
        self.own = e("Expand", [C(0.0, np.float32), own_shape], "zeros")

    def attention(self, q, k, v, i: int, scaling=None):
        """Layer ``i``'s attention of the token's ``q`` [rows, heads, 1, d] over the prompt's cache and the rows'
        [past ; ``k``, ``v``]; the scores times ``scaling`` where given (OPT scales the query before); the heads
        merged [rows, 1, heads * d]."""
        e, shared, C = self.e, self.shared, self.e.const
        b_shape, b, beams, p_shape, r_shape = self.b_shape, self.b, self.beams, self.p_shape, self.r_shape
        mask, own, g1_shape = self.mask, self.own, self.g1_shape
        heads, kv, d = self.heads, self.kv, self.d
        g, grouped = heads // kv, kv != heads

        def scaled(scores):
            return scores if scaling is None else e("Mul", [scores, scaling], "mul")

        key = e("Concat", [f"past_key_values.{i}.key", k], "cat", dict(axis=-2), out=f"present.{i}.key")
        value = e("Concat", [f"past_key_values.{i}.value", v], "cat", dict(axis=-2), out=f"present.{i}.value")
        if "beams_q" not in shared:
            shared["beams_q"] = e("Concat", [b_shape, C([-1]), C([heads]), C([1]), C([d])], "view", dict(axis=0))
        qb = e("Transpose", [e("Reshape", [q, shared["beams_q"]], "view", dict(allowzero=1))], "transpose",
               dict(perm=[0, 2, 1, 3, 4]))
        if "k_items" not in shared:
            if grouped:  # heads * beams * d elements per item and key head (the grouped reshape's -1)
                m = e("Mul", [b, C(heads)], "mul")
                m = e("Mul", [m, beams], "mul")
                shared["hkd"] = e("Mul", [m, C(d)], "mul")
            shared["k_items"] = e("Reshape", [beams, C([-1])], "view", dict(allowzero=0))
            shared["items_q"] = e("Concat", [b_shape, C([heads]), shared["k_items"], C([d])], "view", dict(axis=0))
        qi = e("Reshape", [qb, shared["items_q"]], "view", dict(allowzero=1))
        pk = e("Transpose", [f"prompt_key_values.{i}.key"], "transpose", dict(perm=[0, 1, 3, 2]))
        if grouped:
            if "grouped_q" not in shared:
                m2 = e("Mul", [b, C(kv)], "mul") if kv > 1 else b  # torch drops a product by 1
                m2 = e("Mul", [m2, C(d)], "mul")
                gq = e("Div", [shared["hkd"], m2], "floordiv")
                shared["gk"] = e("Reshape", [gq, C([-1])], "_unsafe_view", dict(allowzero=0))
                shared["grouped_q"] = e("Concat", [b_shape, C([kv]), shared["gk"], C([d])], "_unsafe_view",
                                        dict(axis=0))
            qi = e("Reshape", [qi, shared["grouped_q"]], "_unsafe_view", dict(allowzero=1))
            sp = e("MatMul", [qi, pk], "matmul")
            if "scores_items" not in shared:
                shared["scores_items"] = e("Concat", [b_shape, C([heads]), shared["k_items"], C([-1])], "view",
                                           dict(axis=0))
            sp = e("Reshape", [sp, shared["scores_items"]], "view", dict(allowzero=1))
        else:
            sp = e("MatMul", [qi, pk], "matmul")
        sp = e("Add", [scaled(sp), mask], "add")
        if "into_beams_s" not in shared:
            shared["into_beams_s"] = e("Concat", [b_shape, C([heads]), C([-1]), C([1]), p_shape], "view", dict(axis=0))
        sp = e("Transpose", [e("Reshape", [sp, shared["into_beams_s"]], "view", dict(allowzero=1))], "transpose",
               dict(perm=[0, 2, 1, 3, 4]))
        if "rows_s" not in shared:
            shared["rows_s"] = e("Concat", [r_shape, C([heads]), C([1]), p_shape], "_unsafe_view", dict(axis=0))
        sp = e("Reshape", [sp, shared["rows_s"]], "_unsafe_view", dict(allowzero=1))
        kt = e("Transpose", [key], "transpose", dict(perm=[0, 1, 3, 2]))
        if grouped:
            qg = e("Reshape", [q, C([-1, kv, g, d])], "view", dict(allowzero=1))
            sg = e("MatMul", [qg, kt], "matmul")
            if "rows_g" not in shared:
                shared["rows_g"] = e("Concat", [r_shape, C([heads]), C([1]), C([-1])], "view", dict(axis=0))
            sg = e("Reshape", [sg, shared["rows_g"]], "view", dict(allowzero=1))
        else:
            sg = e("MatMul", [q, kt], "matmul")
        sg = e("Add", [scaled(sg), own], "add")
        probs = e("Softmax", [e("Concat", [sp, sg], "cat", dict(axis=-1))], "softmax", dict(axis=-1))
        pp = e("Slice", [probs, C([0]), p_shape, C([3]), C([1])], "slice")
        pg = e("Slice", [probs, p_shape, C([INT64_MAX]), C([3]), C([1])], "slice")
        if "beams_p" not in shared:
            shared["beams_p"] = e("Concat", [b_shape, shared["k_items"], C([heads]), C([1]), p_shape], "view",
                                  dict(axis=0))
            shared["items_p"] = e("Concat", [b_shape, C([heads]), shared["k_items"], p_shape], "view", dict(axis=0))
        pp = e("Transpose", [e("Reshape", [pp, shared["beams_p"]], "view", dict(allowzero=1))], "transpose",
               dict(perm=[0, 2, 1, 3, 4]))
        pp = e("Reshape", [pp, shared["items_p"]], "view", dict(allowzero=1))
        if grouped:
            if "grouped_p" not in shared:
                shared["grouped_p"] = e("Concat", [b_shape, C([kv]), shared["gk"], p_shape], "_unsafe_view",
                                        dict(axis=0))
            pp = e("Reshape", [pp, shared["grouped_p"]], "_unsafe_view", dict(allowzero=1))
            op = e("MatMul", [pp, f"prompt_key_values.{i}.value"], "matmul")
            op = e("Reshape", [op, shared["scores_items"]], "view", dict(allowzero=1))
        else:
            op = e("MatMul", [pp, f"prompt_key_values.{i}.value"], "matmul")
        if "into_beams_o" not in shared:
            shared["into_beams_o"] = e("Concat", [b_shape, C([heads]), C([-1]), C([1]), C([d])], "view", dict(axis=0))
        op = e("Transpose", [e("Reshape", [op, shared["into_beams_o"]], "view", dict(allowzero=1))], "transpose",
               dict(perm=[0, 2, 1, 3, 4]))
        op = e("Reshape", [op, C([-1, heads, 1, d])], "_unsafe_view", dict(allowzero=1))
        if grouped:
            if "grouped_pg" not in shared:
                shared["grouped_pg"] = e("Concat", [r_shape, C([kv]), C([g]), g1_shape], "view", dict(axis=0))
            og = e("MatMul", [e("Reshape", [pg, shared["grouped_pg"]], "view", dict(allowzero=1)), value], "matmul")
            og = e("Reshape", [og, C([-1, heads, 1, d])], "view", dict(allowzero=1))
        else:
            og = e("MatMul", [pg, value], "matmul")
        o = e("Transpose", [e("Add", [op, og], "add")], "transpose", dict(perm=[0, 2, 1, 3]))
        o = e("Reshape", [o, C([-1, 1, heads * d])], "view", dict(allowzero=1))
        return o


def build_step(template_model, values: bool = False,
               wrapper_class="elx.exporter.capture.decoder_only.SharedPromptStepGraph") -> tuple:
    """The shared-prompt step template (``decoder_only.SharedPromptStepGraph``)."""
    model, c = template_model, template_model.config
    heads, kv, d, layers, tied = _dims(model)
    e, step = step_start(model, values, wrapper_class, layers, heads, kv, d)
    x, rope = _embedding_and_rotary(e, model, tied)
    eps = float(c.rms_norm_eps)
    scaling = e.const(np.float32(d ** -0.5), np.float32)
    C = e.const
    for i in range(layers):
        lp, h, t = _layer_start(e, x, i, eps)
        q, k, v = projections(e, h, t, lp, heads, kv, d)
        q = e("Transpose", [head_norm(e, e("Reshape", [q, C([-1, 1, heads, d])], "view", dict(allowzero=1)), lp, "q",
                                      eps)], "transpose", dict(perm=[0, 2, 1, 3]))
        k = e("Transpose", [head_norm(e, e("Reshape", [k, C([-1, 1, kv, d])], "view", dict(allowzero=1)), lp, "k",
                                      eps)], "transpose", dict(perm=[0, 2, 1, 3]))
        v = e("Transpose", [e("Reshape", [v, C([-1, 1, kv, d])], "view", dict(allowzero=1))], "transpose",
              dict(perm=[0, 2, 1, 3]))
        q = rope(q)
        k = rope(k)
        o = step.attention(q, k, v, i, scaling)
        o = linear(e, o, t("self_attn.o_proj"), f"{lp}.self_attn.o_proj")
        e.leave()
        x = _residual_and_mlp(e, x, o, lp, t, eps)
        e.leave()
    x = rms_norm(e, x, norm_weight(e, "model.model.norm"), eps, "model.model.norm")
    e.leave()
    _head(e, x, model, tied)
    return step_graph(e, layers, kv, d, c.vocab_size)


def prefill_graph(e, layers: int, kv: int, d: int, vocab: int) -> tuple:
    """(the prefill template's model: ``e``'s nodes and initializers with its inputs and outputs and the shapes of
    its values, as a trace records them: ``unpad`` reads which values are rows [batch, sequence, features]; its
    bindings)."""
    from elx.exporter.capture.value_shapes import shaped

    kv_shape = ["batch", kv, "prompt_sequence", d]
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "prompt_sequence"])
              for n in ("input_ids", "attention_mask", "position_ids")]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", vocab])]
    for i in range(layers):
        outputs += [helper.make_tensor_value_info(f"present.{i}.{w}", TensorProto.FLOAT, kv_shape)
                    for w in ("key", "value")]
    return shaped(_model(e, inputs, outputs))


def step_graph(e, layers: int, kv: int, d: int, vocab: int) -> tuple:
    """(the shared-prompt step template's model, its bindings)."""
    def kvs(lead, seq):
        return [lead, kv, seq, d]

    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["rows", 1]),
              helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["rows", 1]),
              helper.make_tensor_value_info("prompt_attention_mask", TensorProto.INT64, ["batch", "prompt_sequence"])]
    for prefix, lead, seq in (("prompt_key_values", "batch", "prompt_sequence"), ("past_key_values", "rows", "past_sequence")):
        for i in range(layers):
            inputs += [helper.make_tensor_value_info(f"{prefix}.{i}.{w}", TensorProto.FLOAT, kvs(lead, seq))
                       for w in ("key", "value")]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["rows", vocab])]
    for i in range(layers):
        outputs += [helper.make_tensor_value_info(f"present.{i}.{w}", TensorProto.FLOAT, kvs("rows", "past_sequence + 1"))
                    for w in ("key", "value")]
    return _model(e, inputs, outputs)


def _model(e, inputs, outputs) -> tuple:
    graph = helper.make_graph(e.nodes, "main_graph", inputs, outputs, e.inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10,
                             producer_name="elx"), e.bindings


def _dims(model) -> tuple:
    """(query heads, key/value heads, head size, layers, whether the head is tied to the embedding)."""
    c = model.config
    heads, kv = c.num_attention_heads, c.num_key_value_heads
    return (heads, kv, getattr(c, "head_dim", None) or c.hidden_size // heads, c.num_hidden_layers,
            model.lm_head.weight is model.model.embed_tokens.weight)


class Rotary:
    """``rope(y, out=None)``: the rotary embedding of ``y`` [.., heads, seq, d] (rotate-half), its cos and sin
    unsqueezed over the heads at the first call (layer 0's attention scope, as the trace makes them).  Where the
    rotation covers ``rotary`` < ``d`` features (Phi-3's ``partial_rotary_factor``) the rest pass unrotated:
    ``Concat(rope(y[..., :rotary]), y[..., rotary:])``; over all of them the optimizer drops that slicing."""

    def __init__(self, e, cos, sin, rotary: int, d: int):
        self.e, self.cos, self.sin, self.rotary, self.d, self.unsqueezed = e, cos, sin, rotary, d, None

    def __call__(self, y, out=None):
        e, C, half = self.e, self.e.const, self.rotary // 2
        if self.unsqueezed is None:
            self.unsqueezed = tuple(e("Unsqueeze", [t, C([1])], "unsqueeze") for t in (self.cos, self.sin))
        cos, sin = self.unsqueezed
        partial = self.rotary < self.d
        if partial:
            rest = e("Slice", [y, C([self.rotary]), C([INT64_MAX]), C([3]), C([1])], "slice")
            y = e("Slice", [y, C([0]), C([self.rotary]), C([3]), C([1])], "slice")
        a = e("Mul", [y, cos], "mul")
        s1 = e("Slice", [y, C([0]), C([half]), C([3]), C([1])], "slice")
        s2 = e("Slice", [y, C([half]), C([INT64_MAX]), C([3]), C([1])], "slice")
        rot = e("Concat", [e("Neg", [s2], "neg"), s1], "cat", dict(axis=-1))
        y = e("Add", [a, e("Mul", [rot, sin], "mul")], "add", out=None if partial else out)
        return e("Concat", [y, rest], "cat", dict(axis=-1), out=out) if partial else y


def _embedding_and_rotary(e, model, tied):
    """Inside ``model`` / ``model.model``: the token embedding and the rotary embedding (``Rotary``; both templates
    alike)."""
    e.enter("model")
    e.enter("model.model")
    embed_name = "model.lm_head.weight" if tied else "model.model.embed_tokens.weight"
    e.weight(embed_name, "model.model.embed_tokens.weight")
    e.enter("model.model.embed_tokens")
    x = e("Gather", [embed_name, "input_ids"], "embedding", dict(axis=0))
    scale = getattr(e.module("model.model.embed_tokens"), "embed_scale", None)
    if scale is not None:  # Gemma's sqrt(d): a constant of the graph (a buffer the config sets), by the buffer's name
        name = "model.model.embed_tokens.embed_scale"
        e.inits.append(numpy_helper.from_array(scale.detach().numpy().astype(np.float32), name))
        x = e("Mul", [x, name], "mul")
    e.leave()
    return x, rotary(e, "model.model.rotary_emb", _dims(model)[2])


def rotary(e, path: str, d: int) -> Rotary:
    """The rotary embedding module at ``path`` (its cos and sin tables at ``position_ids``), as ``Rotary`` over heads
    of ``d`` features (the rotated ones: twice its frequencies)."""
    e.enter(path)
    inv = e.weight(f"{path}.inv_freq", f"{path}.inv_freq")
    pos = e("Unsqueeze", ["position_ids", e.const([2])], "unsqueeze")
    pos = e("Cast", [pos], "_to_copy", dict(to=TensorProto.FLOAT))
    freqs = e("Mul", [pos, inv], "mul")
    emb = e("Concat", [freqs, freqs], "cat", dict(axis=-1))
    cos, sin = e("Cos", [emb], "cos"), e("Sin", [emb], "sin")
    e.leave()
    return Rotary(e, cos, sin, 2 * e.module(path).inv_freq.numel(), d)


def _layer_start(e, x, i: int, eps: float):
    """Enter layer ``i`` and its attention: its path, its input norm's output, and ``t(name)``, the initializer of
    the weight ``name`` of the layer stored transposed (as the exporter folds ``linear``'s transpose)."""
    lp = f"model.model.layers.{i}"
    e.enter(lp)
    h = rms_norm(e, x, norm_weight(e, f"{lp}.input_layernorm"), eps, f"{lp}.input_layernorm")
    e.enter(f"{lp}.self_attn")
    return lp, h, lambda name: e.weight(f"val_w{i}_{name}", f"{lp}.{name}.weight", transposed=True)


def _residual_and_mlp(e, x, attention, lp, t, eps):
    """Layer ``lp``'s residual add, post-attention norm, gated MLP (``activation(gate) * up``; Phi-3's gate and up from
    one product) and second residual add."""
    x = e("Add", [x, attention], "add")
    post = f"{lp}.post_attention_layernorm"
    h = rms_norm(e, x, norm_weight(e, post), eps, post)
    e.enter(f"{lp}.mlp")
    if hasattr(e.module(f"{lp}.mlp"), "gate_up_proj"):  # Phi-3: one product, chunked; up * act(gate)
        fused = linear(e, h, t("mlp.gate_up_proj"), f"{lp}.mlp.gate_up_proj")
        gate, up = e("Split", [fused], "split", dict(axis=2, num_outputs=2), outputs=2, bare=True)
        hidden = e("Mul", [up, activation(e, gate, f"{lp}.mlp.activation_fn")], "mul")
    else:
        gate = activation(e, linear(e, h, t("mlp.gate_proj"), f"{lp}.mlp.gate_proj"), f"{lp}.mlp.act_fn")
        hidden = e("Mul", [gate, linear(e, h, t("mlp.up_proj"), f"{lp}.mlp.up_proj")], "mul")
    y = linear(e, hidden, t("mlp.down_proj"), f"{lp}.mlp.down_proj")
    e.leave()
    return e("Add", [x, y], "add")


ACTIVATIONS = ("SiLUActivation", "GELUTanh")  # HF's activation modules the Llama-family templates are built with


def activation(e, x, path: str):
    """The activation module at ``path`` over ``x`` as torch decomposes it: SiLU as ``x * sigmoid(x)``; exact GELU
    (GPT-NeoX's) as ``x * 0.5 * (1 + erf(x / sqrt(2)))``; GELU's tanh form (Gemma's ``gelu_pytorch_tanh``) as ``x *
    0.5 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))``; the constants in float32."""
    kind = type(e.module(path)).__name__
    fx = "silu" if kind == "SiLUActivation" else "gelu"
    f32 = np.float32
    e.enter(path)
    if kind == "SiLUActivation":
        y = e("Mul", [x, e("Sigmoid", [x], fx)], fx)
    elif kind == "GELUActivation":
        erf = e("Erf", [e("Div", [x, e.const(np.sqrt(2.0), f32)], fx)], fx)
        y = e("Mul", [x, e("Mul", [e.const(0.5, f32), e("Add", [erf, e.const(1.0, f32)], fx)], fx)], fx)
    else:
        inner = e("Add", [x, e("Mul", [e.const(0.044715, f32), e("Pow", [x, e.const(3.0, f32)], fx)], fx)], fx)
        t = e("Tanh", [e("Mul", [e.const(np.sqrt(2 / np.pi), f32), inner], fx)], fx)
        y = e("Mul", [x, e("Mul", [e.const(0.5, f32), e("Add", [t, e.const(1.0, f32)], fx)], fx)], fx)
    e.leave()
    return y


def _head(e, x, model, tied, final_bias: str | None = None, path: str = "model.lm_head"):
    """The language-model head (the module at the wrapper's ``path``: Whisper's is ``model.proj_out``) over the last
    position of ``x`` (elx's last-position rewrite), inside ``model``'s scope: the embedding's transpose where the
    head is ``tied`` and larger than onnxscript folds, else a weight stored transposed; then the ``final_bias``
    (BART's ``final_logits_bias``: the wrapper's name) where given."""
    last = helper.make_node("Gather", [x, "node_select_last_index"], ["node_select_last_position"],
                            name="node_select_before_head", axis=1)
    e.inits.append(numpy_helper.from_array(np.array(-1, np.int64), "node_select_last_index"))
    e.nodes.append(last)
    if tied and e.module(path).weight.numel() > FOLD_INPUT_LIMIT:  # onnxscript keeps a shared large input
        e.enter(path)
        head = e("Transpose", [f"{path}.weight"], "linear", dict(perm=[1, 0]))
        e.leave()
    else:
        head = e.weight("val_head", f"{path}.weight", transposed=True)
    e.enter(path)
    logits = e("MatMul", ["node_select_last_position", head], "linear", out=None if final_bias else "logits")
    e.leave()
    if final_bias:
        e("Add", [logits, e.weight(final_bias, final_bias)], "add", out="logits")


# the classes whose templates are the same nodes over the same module tree (canonically checked against the trace:
# ``tests/test_llama_builder.py``): Mistral is Llama's graph; Qwen2 adds q/k/v biases, Qwen3 an RMSNorm per query
# and key head (``linear``, ``head_norm``)
CLASSES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "GemmaForCausalLM",
           "Phi3ForCausalLM")


def enabled() -> bool:
    """``ELX_TEMPLATE_BUILDER`` is not 0 (default 1); another value is refused in one line."""
    text = os.environ.get("ELX_TEMPLATE_BUILDER", "1").strip() or "1"
    if text not in ("0", "1"):
        from elx.runners.errors import ElxError

        raise ElxError(f"ELX_TEMPLATE_BUILDER is {text!r}; use 1 (build the templates of Llama, Mistral, Qwen, "
                       "GPT-2, OPT, T5, BART, Marian, mBART, Pegasus, M2M100 and Whisper from the weights, the "
                       "default) or 0 (trace them)")
    return text == "1"


def applies(model) -> str | None:
    """None where the builders give the traced templates of ``model``; else why not."""
    def checks(model):
        c = model.config
        heads, kv = c.num_attention_heads, getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        rope = getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {}
        return {
            f"activation {c.hidden_act}": type(_activation_module(model.model.layers[0].mlp)).__name__
            not in ACTIVATIONS,
            f"rotary type {rope.get('rope_type')}": rope.get("rope_type", "default") not in ("default", "llama3"),
            "rotary attention factor": float(getattr(model.model.rotary_emb, "attention_scaling", 1.0)) != 1.0,
            "pretraining_tp": getattr(c, "pretraining_tp", 1) not in (None, 1),
            "query heads not a multiple of the key/value heads": heads % kv != 0,
        }
    return why_not(model, CLASSES, checks)


def _activation_module(mlp):
    return getattr(mlp, "act_fn", None) or mlp.activation_fn  # Phi-3's is ``activation_fn``


def why_not(model, classes, checks) -> str | None:
    """A builder's ``applies``: None where ``model`` is of one of ``classes`` and no entry of ``checks(model)``
    (what it does not describe: is it there) holds; else one line saying why."""
    if type(model).__name__ not in classes:
        return f"no graph builder for {type(model).__name__}"
    why = [what for what, bad in checks(model).items() if bad]
    return f"no graph builder for its {', '.join(why)}" if why else None

