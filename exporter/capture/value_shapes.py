"""The shapes of a built graph's values, as a trace records them (issue 41).

A traced template records torch's shape of every value, and passes read some: ``unpad`` finds the rows
[batch, sequence, features] by them, and their widths.  The builders (``exporter/capture/builders.py``) write nodes
only; ``shaped`` gives their graphs the shapes ONNX's own inference finds, helped where it stops (ranges, and
reshapes to computed shapes).  Used by the encoder-decoder builders (``seq2seq_parts.graph``) and the decoder-only
prefill (``llama_builder.prefill_graph``).
"""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, numpy_helper


def shaped(built: tuple) -> tuple:
    """(the template with the shapes of its values, its bindings).  A traced template records torch's shapes of
    every value, and the passes read some (``unpad``: which values are rows [batch, sequence, features], and their
    widths).  ONNX's shape inference finds them but for ranges and reshapes to computed shapes; ``_reshaped_dims``
    names those, and the inference runs again from there.  A dimension still unknown (``unk__N``) is left unnamed."""
    import onnx

    bare, bindings = built
    named = {}  # value: its shape with the dimensions ``_reshaped_dims`` named, given to the next inference
    for _ in range(6):  # a named dimension lets the next reshape be solved: three rounds suffice for T5's
        model = onnx.ModelProto()
        model.CopyFrom(bare)
        model.graph.value_info.extend(named.values())
        model = onnx.shape_inference.infer_shapes(model, data_prop=True)
        more = _reshaped_dims(model)
        if not more:
            break
        named.update(more)
    for value in model.graph.value_info:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param.startswith("unk__"):
                dim.Clear()
    return model, bindings


def _dims(value) -> list | None:
    """A value's dimensions (int, symbol, or None where unknown), or None without a shape."""
    tensor = value.type.tensor_type
    if not tensor.HasField("shape"):
        return None
    def dim(d):
        if d.HasField("dim_value"):
            return d.dim_value
        return d.dim_param if d.dim_param and not d.dim_param.startswith("unk__") else None
    return [dim(d) for d in tensor.shape.dim]


def _reshaped_dims(model) -> dict:
    """Name the unknown dimensions of each ``Reshape`` to a ``Concat`` of constants and ``Shape`` slices (the
    trace's views), solving its -1 from the input's dimensions where the symbols cancel, of each ``Tile`` by such a
    ``Concat``, and the length of each ``Range(0, x.shape[k], 1)``; {value: its shape} for those named."""
    graph = model.graph
    values = {v.name: v for v in [*graph.input, *graph.value_info, *graph.output]}
    consts = {t.name: numpy_helper.to_array(t) for t in graph.initializer if t.data_type == TensorProto.INT64}
    producer = {out: node for node in graph.node for out in node.output}
    named = {}

    def shape_slice(name):
        """The dimensions a ``Shape`` node (``name`` its output) reads, or None."""
        made = producer.get(name)
        if made is None or made.op_type != "Shape" or made.input[0] not in values:
            return None
        attrs = {a.name: a.i for a in made.attribute}
        of = _dims(values[made.input[0]]) or []
        return of[attrs.get("start", 0):attrs.get("end", len(of))]

    for node in graph.node:
        if node.op_type == "Range" and node.output[0] in values and _dims(values[node.output[0]]) == [None]:
            limit = producer.get(node.input[1])  # arange(0, x.shape[k]): of length x.shape[k]
            size = shape_slice(limit.input[0]) if limit is not None and limit.op_type == "Squeeze" else None
            start, step = (consts.get(n) for n in (node.input[0], node.input[2]))
            if size and len(size) == 1 and size[0] is not None and start is not None and step is not None \
                    and int(start) == 0 and int(step) == 1:
                dim = values[node.output[0]].type.tensor_type.shape.dim[0]
                dim.Clear()
                if isinstance(size[0], str):
                    dim.dim_param = size[0]
                else:
                    dim.dim_value = size[0]
                named[node.output[0]] = values[node.output[0]]
            continue
        if node.op_type not in ("Reshape", "Tile"):
            continue
        out = values.get(node.output[0])
        shape = _dims(out) if out is not None else None
        source = _dims(values[node.input[0]]) if node.input[0] in values else None
        concat = producer.get(node.input[1])
        if shape is None or None not in shape or source is None or concat is None or concat.op_type != "Concat":
            continue
        parts = []
        for name in concat.input:
            if name in consts:
                parts += [int(v) for v in consts[name].ravel()]
            elif shape_slice(name) is not None:
                parts += shape_slice(name)
            else:
                parts = None
                break
        if parts is None or len(parts) != len(shape) or None in parts:
            continue
        if node.op_type == "Tile":  # each dimension times its repeat, where one of the two is 1 (Whisper's positions)
            if len(source) != len(parts):
                continue
            parts = [p if s == 1 else s if p == 1 else None for s, p in zip(source, parts)]
        elif parts.count(-1) == 1:
            parts[parts.index(-1)] = _quotient(source, [p for p in parts if p != -1])
        for dim, part in zip(out.type.tensor_type.shape.dim, parts):
            unnamed = not dim.HasField("dim_value") and (not dim.dim_param or dim.dim_param.startswith("unk__"))
            if part is not None and unnamed:
                dim.Clear()
                if isinstance(part, str):
                    dim.dim_param = part
                else:
                    dim.dim_value = part
                named[node.output[0]] = out
    return named


def _quotient(numerator: list, denominator: list):
    """prod(numerator) / prod(denominator) over ints and symbols, where the symbols cancel and the ints divide;
    else None."""
    if None in numerator:
        return None
    symbols = [d for d in numerator if isinstance(d, str)]
    top = int(np.prod([d for d in numerator if not isinstance(d, str)], dtype=np.int64))
    bottom = 1
    for d in denominator:
        if isinstance(d, str):
            if d not in symbols:
                return None
            symbols.remove(d)
        else:
            bottom *= d
    return top // bottom if not symbols and bottom and top % bottom == 0 else None
