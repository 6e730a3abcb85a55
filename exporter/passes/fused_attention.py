"""``--pass fused-attention``: each layer's attention in the step graph as one ONNX Runtime kernel.

The traced step graph of a decoder-only model computes a layer's attention for the new token in ~40 small
nodes (SmolLM2-135M, ``--prompt-cache per-beam``): the cache appends (``present = Concat(past, k_new)``), the
grouping of query heads over key/value heads (Reshape/Transpose), q·Kᵀ, the scale, the mask, Softmax, p·V and
the heads merged back.  ONNX Runtime's ``com.microsoft.GroupQueryAttention`` computes the same thing in one
kernel, as onnxruntime-genai's graphs do:

    O = softmax(scale · q·[K_past; k]ᵀ + bias) · [V_past; v],   present_k = [K_past; k],  present_v = [V_past; v]

with ``num_heads`` query heads sharing ``kv_num_heads`` key/value heads (GQA; MHA when equal) and the mask as
``attention_bias``.  RoPE stays as traced (the kernel's own rotary is not asked for: q and k reach it rotated,
their tables the graph's own), so positions, left padding and the cache layout are the export's.

**RoPE in the kernel too** (``do_rotary``) where every layer's RoPE has HF's form (x·cos + rotate_half(x)·sin on
the whole head), its frequencies do not depend on the run's length (``STATIC_ROPE``), the head size is a multiple of
16 (the kernel's rule) and ``max_position_embeddings`` is known: the kernel then takes q and k straight from their
projections, with cos/sin tables [max_position_embeddings, d/2] computed by the graph's own nodes on every position
(so the same numbers the traced graph computes per step), and the runtime refuses a run that would need a position
past them (``runners/families.py``).  Otherwise RoPE stays as traced and the kernel takes q and k rotated.

**Pattern** (walked from each Softmax of the step graph, through shape-only nodes): ``Add(scores, mask)`` where
``scores`` is ``MatMul(q, Transpose(present_k))`` (optionally times a scalar constant, the scale), ``present_k
= Concat(past_k, k)`` on the sequence axis with ``past_k`` a graph input; after the Softmax, ``MatMul(p,
present_v)`` with ``present_v = Concat(past_v, v)``, then shape-only nodes to the tensor the output projection
reads.  q, k and v are taken where the graph has them per head ([rows, heads, 1, d]) and given to the kernel as
[rows, 1, heads·d].  The kernel's ``seqlens_k`` is (past length) for every row and its total length past + 1:
every cached position is a key, and the export's mask (``attention_bias``) removes the left padding, as the
traced graph's Add did.

**Where it applies**: the step graph of a decoder-only export with ``--prompt-cache per-beam`` (HF's layout: one
cache per row): the Llama family and OPT (checked: a tiny OPT fused, 8.9e-8 from the traced graph, beam 3 = HF);
GPT-2's graph merges the heads straight into the 2-D rows its Conv1D Gemm reads and is refused in one line.  The default shared prompt cache keeps the prompt's keys apart from the generated ones (two
key sets, one softmax across both, ``exporter/capture/shared_prompt.py``), which this kernel cannot take; a
layer the pattern does not match is refused in one line.  The prefill graph is left as traced (it runs once per
prompt).  The kernel runs on ONNX Runtime's CPU provider in fp32; TensorRT has no such layer (engine builds
refuse the export) and ONNX Runtime's CUDA kernel takes fp16/bf16 only.

**Exactness**: the kernel computes the same products, scale, bias and softmax in fp32; the rewritten graph is
verified against the traced one on the export's random cases like any pass, within the export's fp32
tolerance (recorded).  On this kernel's numbers: the real SmolLM2-135M-Instruct's step graph run twice, once with
ONNX Runtime's weights prepacked and once mapped (the same graph, two GEMM paths), differs by 1.0-1.6e-3 on the
verification's random-cache cases; the fused graph differs from the traced one by 2-6e-4 there.

**Packed q/k/v**: where q, k and v reach the kernel as three projections of one x (RoPE in the kernel, or none),
they become one product x·[W_q W_k W_v] (+ [b_q b_k b_v]) fed as the kernel's packed input; the weights are
concatenated by a graph node ONNX Runtime folds at load (the weights file is unchanged; an int8 conversion folds it
before quantizing, and the packed MatMul keeps the q projection's layer for int8's per-layer rule).

**The cache in place**: the kernel's lengths (``seqlens_k``, the total length) and every other read of a past input's
shape (the traced graph sizes its mask from it) are computed from the attention mask, so nothing but the kernel reads
the caches (``_lengths_from_mask``) and the manifest marks them ``in_place``.  The CPU runtime then binds each past
input and its present output to one buffer with room after the cache (``runners/model.py`` ``room_for``,
``runners/backends/ort.py`` ``run_in_place``): the kernel appends the new token inside it, instead of zeroing a new
present and copying the whole past into it every step (30 layers x 2 x the cache, ~17 MB a step at 190 positions on
SmolLM2-135M).  Bit for bit the plain run (``tests/test_fused_attention.py``).

**Measured** (real SmolLM2-135M-Instruct, this 2-core VM, ``docs/measurements/real_smollm2_2026-11-30.md``): the pass
as first written (kernel only): one step 43.3 -> 39.6 ms, greedy batch 1 0.88x GenAI.  With the cache in place,
packed q/k/v and ``--pass fused-norm``: the step graph 323 nodes after ONNX Runtime's fusions (GenAI's 309), greedy
batch 1 level with GenAI (0.95-1.08x in four alternating runs), beam 4 batch 4 1.58x GenAI; tokens = HF ``generate``
(greedy 1/1, beam 4 batch 4 4/4).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from elx.runners.errors import ElxError
from elx.runners.manifest import Manifest

from elx.exporter.passes import catalog
from elx.exporter.passes.rewrite import SHAPE_OPS, Builder, commit, constant_shape, \
    inherit_metadata, load_graph, pass_file, producer, refuse_twice, save_graph, scalar_value

SPEC = catalog.FUSED_ATTENTION
NAME, parse_argument = SPEC.name, SPEC.parse
DOMAIN = "com.microsoft"
OP = "GroupQueryAttention"


@dataclass
class Core:
    """One layer's attention core in the step graph, as the pattern found it."""

    q: gs.Variable  # [rows, heads, 1, d], rotated
    k: gs.Variable  # [rows, kv_heads, 1, d], the new token's key as cached
    v: gs.Variable
    past_k: gs.Variable  # graph inputs
    past_v: gs.Variable
    present_k: gs.Variable  # graph outputs
    present_v: gs.Variable
    mask: gs.Variable  # the additive mask, broadcast over heads
    scale: float
    output: gs.Variable  # [rows, 1, heads·d]: what the output projection reads
    nodes: list  # the nodes the kernel replaces
    rotary: tuple | None = None  # (q before RoPE, k before RoPE, cos, sin) where RoPE has the form the kernel computes


def _up(tensor):
    """The tensor above ``tensor`` through shape-only nodes, and those nodes."""
    path = []
    node = producer(tensor)
    while node is not None and node.op in SHAPE_OPS:
        path.append(node)
        tensor = node.inputs[0]
        node = producer(tensor)
    return tensor, path


def _down(tensor):
    """Follow single consumers through shape-only nodes: the last tensor reached, the nodes and the next node."""
    path = []
    while len(tensor.outputs) == 1 and tensor.outputs[0].op in SHAPE_OPS:
        node = tensor.outputs[0]
        path.append(node)
        tensor = node.outputs[0]
    return tensor, path


def _is_scores(tensor) -> bool:
    """``tensor`` is a product of queries and keys (through shape-only nodes and a scaling by a constant)."""
    tensor, _ = _up(tensor)
    node = producer(tensor)
    if node is not None and node.op == "Mul":
        scaled = [i for i in (0, 1) if scalar_value(node.inputs[i]) is not None]
        if not scaled:
            return False
        node = producer(_up(node.inputs[1 - scaled[0]])[0])
    return node is not None and node.op == "MatMul"


def _no_match(softmax: gs.Node, why: str) -> ElxError:
    return ElxError(f"pass {NAME}: the step graph's attention at {softmax.name or 'a Softmax'} does not have the "
                    f"form the fused kernel takes ({why}); nothing was written (drop the pass for this model)")


def _cache_concat(tensor, inputs: set, softmax: gs.Node, which: str):
    """``tensor`` = Concat(past, new) on axis 2 with ``past`` a graph input: (past, new, the Concat)."""
    node = producer(tensor)
    if node is None or node.op != "Concat" or len(node.inputs) != 2 or node.attrs.get("axis") not in (2, -2):
        raise _no_match(softmax, f"its {which} are not the past {which} and the new token's, concatenated")
    past, new = node.inputs
    if past.name not in inputs:
        raise _no_match(softmax, f"its past {which} are not a graph input (a shared prompt cache keeps two key sets)")
    return past, new, node


def _rope(rotated):
    """``rotated`` = x·cos + rotate_half(x)·sin (HF's rotate_half: [-x₂, x₁] on the last axis, both halves
    rotated): (x, cos, sin, the nodes), else None."""
    add = producer(rotated)
    if add is None or add.op != "Add" or len(add.inputs) != 2:
        return None
    muls = [producer(t) for t in add.inputs]
    if any(m is None or m.op != "Mul" for m in muls):
        return None
    for plain, turned in (muls, muls[::-1]):
        for i in (0, 1):
            x, cos = plain.inputs[i], plain.inputs[1 - i]
            for j in (0, 1):
                half, sin = turned.inputs[j], turned.inputs[1 - j]
                concat = producer(half)
                if concat is None or concat.op != "Concat" or len(concat.inputs) != 2 or \
                        concat.attrs.get("axis") not in (-1, 3):
                    continue
                neg, second = producer(concat.inputs[0]), producer(concat.inputs[1])
                if neg is None or neg.op != "Neg" or second is None or second.op != "Slice":
                    continue
                first = producer(neg.inputs[0])
                if first is None or first.op != "Slice" or first.inputs[0] is not x or second.inputs[0] is not x:
                    continue
                return x, cos, sin, [add, *muls, concat, neg, first, second]
    return None


def _packed(tensor):
    """The projection's own [rows, 1, heads·d] tensor where ``tensor`` is it viewed per head (Reshape to
    [rows, 1, heads, d], then Transpose 0,2,1,3), else None."""
    moved = producer(tensor)
    if moved is None or moved.op != "Transpose" or list(moved.attrs.get("perm", [])) != [0, 2, 1, 3]:
        return None
    viewed = producer(moved.inputs[0])
    if viewed is None or viewed.op != "Reshape":
        return None
    source = viewed.inputs[0]
    shape = getattr(source, "shape", None)
    return source if shape is not None and len(shape) == 3 else None


def find_core(softmax: gs.Node, inputs: set, outputs: set) -> Core:
    """The attention core around ``softmax`` (see the module doc); ``ElxError`` where the form differs."""
    added, above = _up(softmax.inputs[0])
    add = producer(added)
    if add is None or add.op != "Add":
        raise _no_match(softmax, "no mask is added to its scores")
    scores = next((i for i in (0, 1) if _is_scores(add.inputs[i])), None)
    if scores is None:
        raise _no_match(softmax, "its scores are not a product of queries and keys")
    mask = add.inputs[1 - scores]
    tensor, path = _up(add.inputs[scores])
    nodes = [softmax, *above, add, *path]
    node, scale = producer(tensor), 1.0
    if node.op == "Mul":
        i = next(i for i in (0, 1) if scalar_value(node.inputs[i]) is not None)
        scale = scalar_value(node.inputs[i])
        nodes.append(node)
        tensor, path = _up(node.inputs[1 - i])
        nodes += path
        node = producer(tensor)
    if node is None or node.op != "MatMul":
        raise _no_match(softmax, "its scores are not a product of queries and keys")
    nodes.append(node)
    q, path = _up(node.inputs[0])
    nodes += path
    transposed = producer(node.inputs[1])
    if transposed is None or transposed.op != "Transpose" or list(transposed.attrs.get("perm", [])) != [0, 1, 3, 2]:
        raise _no_match(softmax, "its keys are not the cache transposed")
    nodes.append(transposed)
    present_k = transposed.inputs[0]
    past_k, k, concat_k = _cache_concat(present_k, inputs, softmax, "keys")
    nodes.append(concat_k)
    probs, path = _down(softmax.outputs[0])
    nodes += path
    if len(probs.outputs) != 1 or probs.outputs[0].op != "MatMul" or probs.outputs[0].inputs[0] is not probs:
        raise _no_match(softmax, "its probabilities are not multiplied by the values")
    weighted = probs.outputs[0]
    nodes.append(weighted)
    present_v = weighted.inputs[1]
    past_v, v, concat_v = _cache_concat(present_v, inputs, softmax, "values")
    nodes.append(concat_v)
    output, path = _down(weighted.outputs[0])
    # the kernel's output is [rows, 1, heads·d]: the heads merged, before any flattening to [rows, heads·d] (GPT-2's
    # Conv1D runs as Gemm on 2-D rows): the shape nodes after that tensor stay, reading the kernel's output
    merged = [i for i, node in enumerate(path) if len(getattr(node.outputs[0], "shape", None) or ()) == 3]
    if not merged:
        raise _no_match(softmax, "its heads are not merged back to one [rows, 1, heads·d] tensor")
    output, path = path[merged[-1]].outputs[0], path[: merged[-1] + 1]
    nodes += path
    if present_k.name not in outputs or present_v.name not in outputs:
        raise _no_match(softmax, "its caches are not graph outputs")
    for tensor in (present_k, present_v):  # the keys and values are read by this attention and the graph alone
        readers = [n for n in tensor.outputs if n not in nodes]
        if readers:
            raise _no_match(softmax, f"{tensor.name} is also read by {readers[0].name}")
    core = Core(q, k, v, past_k, past_v, present_k, present_v, mask, scale, output, nodes)
    rope_q, rope_k = _rope(q), _rope(k)
    if rope_q and rope_k and rope_q[1] is rope_k[1] and rope_q[2] is rope_k[2]:
        core.rotary = (rope_q[0], rope_k[0], *rope_q[1:3])
    return core


def _per_token(builder: Builder, tensor, hint: str):
    """The kernel's packed layout [rows, 1, heads·d] of ``tensor``: [rows, heads, 1, d] as the graph holds q, k and
    v per head, or [rows, 1, heads, d], or already [rows, 1, heads·d].  With one new token the three hold the
    same numbers in the same order, so a Reshape gives it (no copy)."""
    shape = getattr(tensor, "shape", None)
    if shape is not None and len(shape) not in (3, 4):
        raise ElxError(f"pass {NAME}: {tensor.name} has rank {len(shape)}, not a per-head or packed projection; "
                       "nothing was written")
    return builder.op("Reshape", [tensor, builder.const(f"{hint}_shape", np.array([0, 1, -1], np.int64))], hint,
                      dtype=np.float32)


def _projection(tensor):
    """(x, W, b or None, the MatMul) where ``tensor`` = x·W (+ b) with constant W [in, out] (and b [out]), else None."""
    node, bias = producer(tensor), None
    if node is not None and node.op == "Add":
        biases = [i for i in (0, 1) if len(constant_shape(node.inputs[i]) or ()) == 1]
        if not biases:
            return None
        bias, node = node.inputs[biases[0]], producer(node.inputs[1 - biases[0]])
    if node is None or node.op != "MatMul" or len(constant_shape(node.inputs[1]) or ()) != 2:
        return None
    return node.inputs[0], node.inputs[1], bias, node


def _pack(builder: Builder, q, k, v):
    """x·[W_q W_k W_v] (+ [b_q b_k b_v]): the kernel's packed q/k/v input, where q, k and v are three projections of
    one x as it reads them (RoPE in the kernel, or none), else None.  The weights are concatenated by a graph node
    (ONNX Runtime folds it once at load: the weights file is unchanged); each output column is the same dot product
    over the same inputs as before (bit for bit on SmolLM2-135M's step graph)."""
    parts = [_projection(t) for t in (q, k, v)]
    if any(p is None for p in parts) or any(p[0] is not parts[0][0] for p in parts) or \
            len({p[2] is None for p in parts}) != 1:
        return None
    weight = builder.op("Concat", [p[1] for p in parts], "qkv_weight", dtype=np.float32, axis=1)
    packed = builder.op("MatMul", [parts[0][0], weight], "qkv", dtype=np.float32)
    inherit_metadata(builder.graph, packed.inputs[0].name, parts[0][3])  # its layer, for int8's per-layer rule
    if parts[0][2] is not None:
        bias = builder.op("Concat", [p[2] for p in parts], "qkv_bias", dtype=np.float32, axis=0)
        packed = builder.op("Add", [packed, bias], "qkv_biased", dtype=np.float32)
    return packed


STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # frequencies that do not depend on the run's length


def rotary_tables(graph: gs.Graph, cos, sin, positions: int, head_dim: int):
    """(cos, sin) tables [positions, head_dim / 2] for the kernel, computed by the graph's own nodes (the part that
    makes ``cos`` and ``sin`` from ``position_ids``) on positions 0..positions-1; None where that part reads other
    inputs or its tables are not two equal halves (HF's ``cat(freqs, freqs)``)."""
    import onnxruntime as ort

    part = graph.copy()
    tensors = part.tensors()
    if "position_ids" not in tensors:
        return None
    part.inputs = [tensors["position_ids"]]
    part.outputs = [tensors[cos.name], tensors[sin.name]]
    for tensor in part.outputs:
        tensor.dtype = tensor.dtype or np.float32
    part.cleanup(remove_unused_graph_inputs=False)
    needed = {t.name for node in part.nodes for t in node.inputs if isinstance(t, gs.Variable) and not t.inputs}
    if needed - {"position_ids"}:
        return None
    model = gs.export_onnx(part)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    ids = np.arange(positions, dtype=np.int64).reshape(positions, 1)
    tables = []
    for value in session.run(None, {"position_ids": ids}):
        value = np.asarray(value, dtype=np.float32).reshape(positions, -1)
        half = head_dim // 2
        if value.shape[1] != head_dim or not np.array_equal(value[:, :half], value[:, half:]):
            return None
        tables.append(np.ascontiguousarray(value[:, :half]))
    return tables


def _lengths_from_mask(graph: gs.Graph, builder: Builder, cores: list, rows, past64) -> bool:
    """Every other read of a past input's shape (the traced graph sizes its mask from it) replaced by the same shape
    computed from the attention mask ([rows, kv_heads, mask length - 1, d]), so that nothing but the kernel reads
    the caches.  Returns whether that holds (then the runtime may run the cache in place, ``IN_PLACE``)."""
    pasts = {t.name: t for core in cores for t in (core.past_k, core.past_v)}
    for tensor in pasts.values():
        shape = getattr(tensor, "shape", None)
        if shape is None or len(shape) != 4 or not all(isinstance(d, int) for d in (shape[1], shape[3])):
            return False
    for tensor in pasts.values():
        for node in list(tensor.outputs):
            if node.op == OP:
                continue
            if node.op != "Shape":
                return False
            shape = tensor.shape
            full = builder.op("Concat", [rows, builder.const("heads", np.array([shape[1]], np.int64)), past64,
                                         builder.const("head_size", np.array([shape[3]], np.int64))],
                              "cache_shape", dtype=np.int64, axis=0)
            start, end = int(node.attrs.get("start", 0)), node.attrs.get("end")
            out = node.outputs[0]
            node.inputs.clear()
            node.outputs.clear()
            builder.graph.nodes.append(gs.Node(
                "Slice", builder._name("cache_shape_part"),
                inputs=[full, builder.const("start", np.array([start], np.int64)),
                        builder.const("end", np.array([4 if end is None else int(end)], np.int64))], outputs=[out]))
    return True


def rewrite_graph(graph: gs.Graph, heads: int, kv_heads: int, rotary_positions: int | None = None,
                  mask_name: str = "attention_mask") -> tuple:
    """Every attention core of the step graph replaced by the kernel.  ``rotary_positions``: RoPE moves into the
    kernel too (its tables for that many positions) where every layer's has the form it computes.  ``mask_name``:
    the step's attention mask input [rows, past + 1].  Returns (one record per layer, the positions the rotary tables
    hold or None, whether the caches may run in place)."""
    inputs, outputs = {t.name for t in graph.inputs}, {t.name for t in graph.outputs}
    softmaxes = [node for node in graph.nodes if node.op == "Softmax"]
    if not softmaxes:
        raise ElxError(f"pass {NAME}: the step graph has no attention (no Softmax); nothing was written")
    cores = [find_core(node, inputs, outputs) for node in softmaxes]
    mask_input = next((t for t in graph.inputs if t.name == mask_name), None)
    if mask_input is None:
        raise ElxError(f"pass {NAME}: the step graph has no attention mask input {mask_name!r}; nothing was written")
    tables = None
    if rotary_positions and all(core.rotary is not None for core in cores) and \
            len({(id(c.rotary[2]), id(c.rotary[3])) for c in cores}) == 1:
        head_dim = cores[0].q.shape[-1] if getattr(cores[0].q, "shape", None) else None
        if isinstance(head_dim, int) and head_dim % 16 == 0:  # the kernel's rotary takes heads of 16k only
            tables = rotary_tables(graph, cores[0].rotary[2], cores[0].rotary[3], rotary_positions, head_dim)
    builder = Builder(graph, NAME)
    # the kernel's lengths, once, from the attention mask [rows, past + 1]: every cached position is a key
    # (seqlens_k = past length for every row).  The cache's own shape is read nowhere (``_lengths_from_mask``), so
    # the runtime may bind each past input and its present output to one longer buffer (``IN_PLACE``)
    shape = builder.op("Shape", [mask_input], "mask_shape", dtype=np.int64)
    rows = builder.op("Slice", [shape, builder.const("zero", np.array([0], np.int64)),
                                builder.const("one", np.array([1], np.int64))], "rows", dtype=np.int64)
    total64 = builder.op("Slice", [shape, builder.const("one", np.array([1], np.int64)),
                                   builder.const("two", np.array([2], np.int64))], "total_length_1d", dtype=np.int64)
    past64 = builder.op("Sub", [total64, builder.const("one", np.array([1], np.int64))], "past_length_1d",
                        dtype=np.int64)
    total32 = builder.op("Cast", [total64], "total_length_int32_1d", dtype=np.int32, to=onnx.TensorProto.INT32)
    total = builder.op("Squeeze", [total32, builder.const("axis", np.array([0], np.int64))], "total_length",
                       dtype=np.int32)
    past32 = builder.op("Cast", [past64], "past_length_int32", dtype=np.int32, to=onnx.TensorProto.INT32)
    seqlens = builder.op("Expand", [past32, rows], "seqlens_k", dtype=np.int32)
    empty = gs.Variable.empty()
    rotary = [empty, empty, empty]
    if tables is not None:
        positions = next(t for t in graph.inputs if t.name == "position_ids")
        rotary = [builder.const("cos_cache", tables[0]), builder.const("sin_cache", tables[1]), positions]
    records = []
    for core in cores:
        q, k = (core.rotary[0], core.rotary[1]) if tables is not None else (core.q, core.k)
        q, k, v = (_packed(x) or _per_token(builder, x, hint) for x, hint in ((q, "query"), (k, "key"), (core.v, "value")))
        packed = _pack(builder, q, k, v)
        if packed is not None:  # the kernel's packed input: one projection instead of three
            q, k, v = packed, empty, empty
        for node in core.nodes:
            node.outputs.clear()  # orphaned: cleanup drops them (RoPE's nodes too, once nothing reads them)
            node.inputs.clear()
        attrs = {"num_heads": heads, "kv_num_heads": kv_heads, "scale": core.scale}
        if tables is not None:
            attrs["do_rotary"] = 1
        graph.nodes.append(gs.Node(
            OP, builder._name("gqa"), domain=DOMAIN, attrs=attrs,
            inputs=[q, k, v, core.past_k, core.past_v, seqlens, total, *rotary, core.mask],
            outputs=[core.output, core.present_k, core.present_v]))
        records.append({"present": [core.present_k.name, core.present_v.name], "scale": core.scale,
                        "replaced_nodes": len(core.nodes), "packed_qkv": packed is not None})
    in_place = _lengths_from_mask(graph, builder, cores, rows, past64)
    if not any(d.domain == DOMAIN for d in (graph.import_domains or [])):
        graph.import_domains = list(graph.import_domains or []) + [onnx.helper.make_opsetid(DOMAIN, 1)]
    return records, (rotary_positions if tables is not None else None), in_place


def refuse_layout(manifest: Manifest) -> None:
    """Decoder-only exports with one cache per row only (see the module doc)."""
    if manifest.data.get("is_encoder_decoder", True):
        raise ElxError(f"pass {NAME} applies to decoder-only exports; {manifest.family} is encoder-decoder")
    form = (manifest.data.get("cache") or {}).get("prompt", {}).get("kind")
    if form != "per-beam":
        raise ElxError(f"pass {NAME} needs the step graph's keys in one cache per row (--prompt-cache per-beam); this "
                       f"export keeps the prompt's keys shared by the beams ({form or 'shared'}), which the fused "
                       "kernel cannot take: export with --prompt-cache per-beam --pass fused-attention")


def apply(folder: Path, manifest: Manifest, argument: str | None) -> dict:
    parse_argument(argument)
    refuse_twice(manifest, NAME)
    refuse_layout(manifest)
    dims = manifest.dims
    heads, kv_heads = int(dims["num_heads"]), int(dims.get("num_kv_heads") or dims["num_heads"])
    before = manifest.copy()
    step = manifest.graphs[manifest.step]
    graph = load_graph(manifest, manifest.step)
    nodes_before = len(graph.nodes)
    static = dims.get("rope_type") in STATIC_ROPE and dims.get("rotary_dim") == dims.get("d_kv")
    mask = next((name for name, spec in step["inputs"].items() if spec.get("from") == "step:attention_mask"), None)
    if mask is None:
        raise ElxError(f"pass {NAME}: the step graph reads no attention mask (step:attention_mask); nothing was written")
    layers, positions, in_place = rewrite_graph(graph, heads, kv_heads,
                                                dims.get("max_position_embeddings") if static else None, mask)
    if in_place:  # the runtime may feed each past with a longer buffer and read the present back in it
        fused = {name for record in layers for name in record["present"]}
        for entry in manifest.cache_entries:
            if entry["output"] in fused:
                entry["in_place"] = True
    file = pass_file(step["file"], NAME)
    step["external_data"] = save_graph(graph, folder, file)
    step["file"] = file
    report = commit(folder, before, manifest, f"pass {NAME}")
    return {"name": NAME, "op": f"{DOMAIN}.{OP}", "layers": len(layers), "num_heads": heads, "kv_num_heads": kv_heads,
            "packed_qkv": sum(record["packed_qkv"] for record in layers),
            "rotary_positions": positions, "in_place_cache": in_place, "step_nodes": {"before": nodes_before, "after": len(graph.nodes)}, **report}
