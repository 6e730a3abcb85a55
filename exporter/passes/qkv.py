"""Head-split projections as exported graphs build them: one x·W (+ b) per K, V (BART, T5, Whisper, OPT),
or one slice of a fused QKV projection (GPT-2's Conv1D ``c_attn``).

A fused projection computes [Q | K | V] = x·W + b with W = [W_Q | W_K | W_V] ∈ R^{D×(sizes summed)}
in one product and splits the result along its last axis; the slice j of the Split is therefore
x·W[:, c_j : c_j + n_j] + b[c_j : c_j + n_j] with c_j the sizes of the slices before it.  The
exported chain (dynamo, GPT-2):

    x [R, t, D] ─Reshape[-1, D]─ Gemm(W, b) ─Reshape[.., sum]─ Split(axis −1) ─(slice j)─ Reshape ─ Transpose(0,2,1,3)

GPT-NeoX fuses per head instead (``per_head_fused_projection``): the head split comes first, then the Split.
``head_projection`` returns, for each form, the ``Projection`` (x, W, b, head-split chain) of
the tensor a cache concatenates, x being the [R, t, D] input (the layer norm's output).
"""
from __future__ import annotations

import numpy as np

from elx.exporter.passes.rewrite import constant_value, producer
from elx.exporter.passes.slim import head_split, linear, projection as separate_projection
from elx.exporter.passes.slim_math import Projection, Unfit


def head_projection(tensor) -> Projection:
    """``tensor`` = head-split(x·W (+ b)), from a projection of its own or a slice of a fused one (a Split's
    output, or a Slice of the last axis: Phi-3's ``qkv_proj``), or a part of a per-head fused one (GPT-NeoX)."""
    why = []
    for form in (separate_projection, fused_projection, sliced_projection, per_head_fused_projection):
        try:
            return form(tensor)
        except Unfit as unfit:
            why.append(str(unfit))
    raise Unfit(f"{why[0]} (nor a slice of a fused projection: {'; '.join(why[1:])})")


def sliced_projection(tensor) -> Projection:
    """``tensor`` = head-split(Slice(x·W (+ b), last axis, [c, e))) → the projection's columns c..e."""
    tensor, chain = head_split(tensor)
    node = producer(tensor)
    if node is None or node.op != "Slice" or len(node.inputs) < 4:
        raise Unfit(f"{tensor.name} is not a Slice of a fused projection")
    start, end, axes = (constant_value(node.inputs[i]) for i in (1, 2, 3))
    steps = constant_value(node.inputs[4]) if len(node.inputs) > 4 else np.array([1])
    if any(v is None or np.size(v) != 1 for v in (start, end, axes, steps)) or int(np.reshape(steps, -1)[0]) != 1:
        raise Unfit(f"{tensor.name} is not a constant step-1 Slice of one axis")
    product, _ = _restored_rows(node.inputs[0])
    weight, bias, x = _linear(product)
    if int(np.reshape(axes, -1)[0]) not in (-1, 2):
        raise Unfit(f"{tensor.name} slices axis {int(np.reshape(axes, -1)[0])}, not the projection's last")
    width = weight.shape[1]
    cols = slice(*slice(int(np.reshape(start, -1)[0]), int(np.reshape(end, -1)[0])).indices(width)[:2])
    return Projection(x, weight[:, cols], None if bias is None else bias[cols], chain)


def per_head_fused_projection(tensor) -> Projection:
    """GPT-NeoX's ``query_key_value``: the product x·W + b is viewed as [R, t, h, parts·d_k], transposed to
    [R, h, t, parts·d_k] and split along its last axis, so part j of head i is columns i·parts·d_k + j·d_k ... of W.
    Returned as the head-major projection [D, h·d_k] those columns make (what a Reshape [R, t, h, d_k] + Transpose
    of a separate x·W_j gives), with no chain (the head split precedes the Split; slim_rope reads x, W and b only;
    el-self, which reads the chain, refuses rotary models)."""
    split = producer(tensor)
    if split is None or split.op != "Split" or split.attrs.get("axis", 0) not in (-1, 3):
        raise Unfit(f"{tensor.name} is not a part of a Split along the last axis of [R, h, t, parts·d_k]")
    transpose = producer(split.inputs[0])
    if transpose is None or transpose.op != "Transpose" or list(transpose.attrs.get("perm", [])) != [0, 2, 1, 3]:
        raise Unfit(f"{split.inputs[0].name} is not a head transpose (0, 2, 1, 3) of the fused product")
    product, group = _restored_rows(transpose.inputs[0])  # the Reshape [R, t, h, parts·d_k] keeps the last axis
    if group is None:
        raise Unfit(f"{transpose.inputs[0].name} is not a Reshape of the fused product into heads")
    weight, bias, x = _linear(product)
    width = weight.shape[1]
    if width % group:
        raise Unfit(f"the fused product's {width} columns are not whole heads of {group}")
    sizes = _split_sizes(split, group)
    part = next(i for i, out in enumerate(split.outputs) if out is tensor)
    start = int(sum(sizes[:part]))
    cols = (np.arange(width // group)[:, None] * group + start + np.arange(sizes[part])[None, :]).reshape(-1)
    return Projection(x, np.asarray(weight)[:, cols], None if bias is None else bias[cols], [])


def fused_projection(tensor) -> Projection:
    tensor, chain = head_split(tensor)
    node = producer(tensor)
    if node is None or node.op != "Split":
        raise Unfit(f"{tensor.name} is not a slice of a Split")
    if node.attrs.get("axis", 0) not in (-1, 2):
        raise Unfit(f"the fused projection is split along axis {node.attrs.get('axis', 0)}, not its last (2)")
    part = next(i for i, out in enumerate(node.outputs) if out is tensor)
    fused = node.inputs[0]
    product, width = _restored_rows(fused)
    weight, bias, x = _linear(product)
    if width is not None and width != weight.shape[1]:
        raise Unfit(f"{fused.name} has {width} columns, its projection {weight.shape[1]}")
    sizes = _split_sizes(node, weight.shape[1])
    start = int(sum(sizes[:part]))
    cols = slice(start, start + int(sizes[part]))
    return Projection(x, weight[:, cols], None if bias is None else bias[cols], chain)


def _restored_rows(fused) -> tuple:
    """(the product, n): the 2-D product [R·t, n] under the Reshape that gives it back its [R, t, n]
    shape, keeping its last axis (n None: no Reshape)."""
    node = producer(fused)
    if node is None or node.op != "Reshape":
        return fused, None
    target = constant_value(node.inputs[1])
    if target is None:  # dynamic [R, t, n]: a Concat whose last piece is the constant n
        concat = producer(node.inputs[1])
        last = constant_value(concat.inputs[-1]) if concat is not None and concat.op == "Concat" else None
        target = None if last is None else np.asarray(last).reshape(-1)
    if target is None or target[-1] <= 0:
        raise Unfit(f"{fused.name} is reshaped from the fused product without keeping its last axis")
    return node.inputs[0], int(target[-1])


def _linear(y) -> tuple[np.ndarray, np.ndarray | None, object]:
    """``y`` = x2·W + b (Gemm, or MatMul then Add) with constant W, b → (W [D, n], b [n] float64 or None, x).

    x is x2 itself, or the [R, t, D] tensor x2 flattens with a Reshape to [-1, D]."""
    node, bias = producer(y), None
    if node is not None and node.op == "Gemm":
        attrs = node.attrs
        if attrs.get("transA", 0) or attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0:
            raise Unfit(f"{y.name} is a Gemm with transA/alpha/beta, not a plain x·W + b")
        weight = constant_value(node.inputs[1])
        if weight is None or weight.ndim != 2:
            raise Unfit(f"{y.name} is a Gemm without a constant 2-D weight")
        weight = weight.T if attrs.get("transB", 0) else weight
        if len(node.inputs) > 2:
            bias = constant_value(node.inputs[2])
            if bias is None or bias.size != weight.shape[1]:
                raise Unfit(f"{y.name} is a Gemm whose bias is not a constant of {weight.shape[1]} entries")
            bias = np.asarray(bias, np.float64).reshape(-1)
        x = node.inputs[0]
    else:
        x, weight, bias = linear(y)
    flatten = producer(x)
    if flatten is not None and flatten.op == "Reshape":
        target = constant_value(flatten.inputs[1])
        if target is not None and list(target) == [-1, weight.shape[0]]:
            x = flatten.inputs[0]
    return np.asarray(weight), bias, x


def _split_sizes(split, width: int) -> list[int]:
    """The sizes of the Split's outputs along its axis (explicit, or equal parts of ``width``)."""
    if len(split.inputs) > 1 and split.inputs[1] is not None and getattr(split.inputs[1], "name", ""):
        sizes = constant_value(split.inputs[1])
        if sizes is None:
            raise Unfit("the fused projection's Split has non-constant sizes")
        sizes = [int(s) for s in np.asarray(sizes).reshape(-1)]
    elif split.attrs.get("split") is not None:
        sizes = [int(s) for s in split.attrs["split"]]
    else:
        parts = len(split.outputs)
        if width % parts:
            raise Unfit(f"a Split into {parts} equal parts of a width {width}")
        sizes = [width // parts] * parts
    if sum(sizes) != width:
        raise Unfit(f"the Split's sizes {sizes} do not add up to the projection's {width} outputs")
    return sizes
