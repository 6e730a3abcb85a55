"""int8's ``nbits`` kernel, one weight at a time: a graph's chosen MatMuls as ``MatMulNBits`` (8-bit symmetric weights
per block along K), converted without the graph's weights in memory.

ONNX Runtime's ``MatMulNBitsQuantizer`` takes a loaded model: the graph's fp32 weights in memory, its int8 weights
beside them, and a save that serializes both into one message.  Measured on the real SmolLM2-135M-Instruct
(``docs/measurements/export_speed_2026-11-29.md``, fifth session): ``convert_folder`` took the process from 963 to
2154 MiB, the int8 export's peak (2533 MiB against the issue's bound of 2 x 538 MB + 1 GB).

Here the graph is read without its weights (``onnx.load(..., load_external_data=False)``).  Each chosen weight is read
from the export's data file alone, quantized by the quantizer's own kernel (``quantize_matmul_8bits`` of
``onnxruntime.capi._pybind_state``, which ``DefaultWeightOnlyQuantizer.qbits_block_quant`` calls for 8 bits: K padded
with zeros to whole blocks, one scale per block of each output column) and replaced by what the quantizer writes for
it: a ``MatMulNBits`` node named ``<MatMul>_Q8`` in the MatMul's place (attributes K, N, bits, block_size,
accuracy_level) reading ``<weight>_Q8`` (uint8 [N, K blocks, block]) and ``<weight>_scales`` (float [N, K blocks]);
the fp32 weight goes when nothing else reads it, and the ``com.microsoft`` opset is imported.  The result equals the
quantizer's node for node and byte for byte (``tests/test_int8.py::
test_nbits_one_weight_at_a_time_writes_what_the_quantizer_writes``).  ``save`` then writes every tensor of the graph
to its own data file, again one tensor at a time (the export folds it into ``weights.data`` at the end:
``exporter/capture/shared_weights.py``).
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from onnx.external_data_helper import uses_external_data

from elx.exporter.capture.shared_weights import values

BITS = 8


def quantize(weight: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``weight`` [K, N] (fp32) as ``MatMulNBits`` stores it: packed uint8 [N, K blocks, block] and the fp32
    scales [N, K blocks] (symmetric, so no zero points), computed by ONNX Runtime's quantizer kernel."""
    from onnxruntime.capi._pybind_state import quantize_matmul_8bits

    rows, cols = weight.shape
    blocks = -(-rows // block_size)
    if rows % block_size == 0 and weight.dtype == np.float32 and weight.flags.c_contiguous:
        padded = weight  # read only by the kernel: no copy (an LM head is 113 MB on SmolLM2-135M)
    else:
        padded = np.zeros((blocks * block_size, cols), dtype=np.float32)
        padded[:rows] = weight
    packed = np.zeros((cols, blocks, block_size), dtype=np.uint8)
    scales = np.zeros((cols, blocks), dtype=np.float32)
    zero_points = np.zeros((cols, blocks), dtype=np.uint8)  # written by the kernel, unused when symmetric
    quantize_matmul_8bits(packed, padded, scales, zero_points, block_size, cols, rows, True)
    return packed, scales


def to_nbits(model: onnx.ModelProto, chosen, folder: Path | None, block_size: int,
             accuracy_level: int) -> onnx.ModelProto:
    """``model`` (in place) with each MatMul named in ``chosen`` on 8-bit weights (see the module doc); weights
    stored outside the graph are read from ``folder``, one at a time."""
    graph = model.graph
    weights = {t.name: t for t in graph.initializer}
    chosen, nodes, added = set(chosen), [], []
    for node in graph.node:
        weight = weights.get(node.input[1]) if node.op_type == "MatMul" and node.name in chosen else None
        if weight is None or weight.data_type != TensorProto.FLOAT or len(weight.dims) != 2:
            if node.name in chosen:
                raise ValueError(f"MatMulNBits cannot take {node.name}: its weight is not a 2-D fp32 initializer; "
                                 "report this model")
            nodes.append(node)
            continue
        rows, cols = weight.dims
        packed, scales = quantize(values(weight, folder), block_size)
        quantized = numpy_helper.from_array(packed, f"{weight.name}_Q{BITS}")
        scale = numpy_helper.from_array(scales, f"{weight.name}_scales")
        added += [quantized, scale]
        nodes.append(helper.make_node("MatMulNBits", [node.input[0], quantized.name, scale.name], [node.output[0]],
                                      name=f"{node.name}_Q{BITS}" if node.name else "", domain="com.microsoft",
                                      K=rows, N=cols, bits=BITS, block_size=block_size,
                                      accuracy_level=accuracy_level))
        del packed, scales
    del graph.node[:]
    graph.node.extend(nodes)
    graph.initializer.extend(added)
    used = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
    for index in reversed(range(len(graph.initializer))):
        if graph.initializer[index].name not in used:
            del graph.initializer[index]
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return model


def save(model: onnx.ModelProto, source: Path | None, path: Path) -> list[str]:
    """Write ``model`` to ``path``, every initializer of ``MIN_BYTES`` or more in ``<path name>.data`` beside it, read
    (from its own bytes or, when external, from ``source``) and written one tensor at a time; returns the data files
    written (as ``capture.onnx_export.save_model`` does)."""
    from elx.exporter.capture.shared_weights import MIN_BYTES, ByteStore, _Reader, store_tensor

    path = Path(path)
    data_file = path.name + ".data"
    reader = _Reader(Path(source)) if source is not None else None
    stored = False
    try:
        with open(path.parent / data_file, "w+b") as handle:
            store = ByteStore(handle)
            for tensor in model.graph.initializer:
                external = uses_external_data(tensor)
                if external and reader is None:
                    raise ValueError(f"{tensor.name} is stored outside the graph, and no folder was given to read it")
                if not external and not tensor.HasField("raw_data"):
                    if tensor.ByteSize() < MIN_BYTES or tensor.data_type == TensorProto.STRING:
                        continue
                    tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor), tensor.name))
                stored = store_tensor(tensor, reader, store, data_file) or stored
    finally:
        if reader is not None:
            reader.close()
    if not stored:
        os.unlink(path.parent / data_file)
    onnx.save_model(model, str(path))
    return [data_file] if stored else []
