"""Which model tensor each initializer of a traced template holds, and the folder's ``weights.data`` written
from the model's own tensors, one tensor at a time.

**Binding.**  The template's layers carry synthetic weights, every value drawn at random
(``exporter/capture/template.py``), so each initializer the exporter derived from a layer weight is that
weight's bytes as they are, transposed (the dynamo exporter and onnxscript's optimizer fold ``Transpose(W)`` of a
``Linear`` into a new constant), or plus a constant (Gemma's ``1 + w``): ``bind`` finds it by its first values and
confirms it element for element.  An initializer no weight explains is a constant of the graph (shapes, scalars, RoPE
frequencies) or a folded expression of a weight the binding does not know; the stitcher refuses to copy a
layer that reads one of the latter (``exporter/capture/stitch.py``).

**Writing.**  ``WeightsFile`` gives each bound tensor its place in ``weights.data`` at once and points the graph's
initializer there (ONNX external data): the graph proto never holds the weights, and a tensor the prefill and the
step graph both read is stored once.  The bytes themselves are written straight from the PyTorch parameter by a
thread (``exporter/capture/weights_writer.py``: a transposed one a block at a time) while the export goes on, and
are all on disk when ``close`` returns.  The layout is ``exporter/capture/shared_weights.py``'s (page-aligned
tensors, equal bytes stored once).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from elx.exporter.capture.shared_weights import MIN_BYTES, WEIGHTS_FILE, alignment, bytes_key, point_external

FINGERPRINT = 8  # values compared first; a match is then confirmed on every element
IDENTITY, TRANSPOSE, SHIFT = "identity", "transpose", "shift"


@dataclass(frozen=True)
class Binding:
    """An initializer holds ``transform(tensor named source)`` (``source``: the parameter's or buffer's name in the HF
    model), with the initializer's own dims: the tensor as it is, transposed, or plus the constant ``shift`` (Gemma's
    RMSNorm scales by ``1 + w``, which the optimizer folds)."""

    source: str
    transform: str
    shift: float = 0.0

    def renamed(self, source: str) -> "Binding":
        return Binding(source, self.transform, self.shift)

    def apply(self, array: np.ndarray) -> np.ndarray:
        if self.transform == TRANSPOSE:
            return transposed(array)
        if self.transform == SHIFT:
            return array + array.dtype.type(self.shift)
        return array


def transposed(array: np.ndarray) -> np.ndarray:
    """A 2-D array's transpose, contiguous: PyTorch's blocked transpose (NumPy's strided copy took 2.3x as long:
    0.093 s against 0.042 s for a 5632 x 2048 float32 matrix on this 2-core machine; 13 s of TinyLlama-1.1B's
    export), the same bytes."""
    import torch

    if array.ndim != 2 or array.dtype.kind not in "fiub" or not array.flags.c_contiguous:
        return np.ascontiguousarray(array.T)
    return torch.from_numpy(array).t().contiguous().numpy()


_VIEWABLE = {TensorProto.FLOAT: np.float32, TensorProto.DOUBLE: np.float64, TensorProto.FLOAT16: np.float16,
             TensorProto.INT64: np.int64, TensorProto.INT32: np.int32, TensorProto.INT8: np.int8,
             TensorProto.UINT8: np.uint8}


def values_of(tensor: TensorProto) -> np.ndarray:
    """An in-memory initializer's values: a read-only view of its ``raw_data`` where it has one (no copy: the
    template's 1 GB of TinyLlama-1.1B weights were copied by ``numpy_helper.to_array`` per lookup), else
    ``numpy_helper.to_array``."""
    dtype = _VIEWABLE.get(tensor.data_type)
    if dtype is None or not tensor.HasField("raw_data") or tensor.data_location == TensorProto.EXTERNAL:
        return numpy_helper.to_array(tensor)
    return np.frombuffer(tensor.raw_data, dtype=np.dtype(dtype).newbyteorder("<")).reshape(tuple(tensor.dims))


def _bits(array: np.ndarray) -> np.ndarray:
    """The array's elements as unsigned integers of the same width (bitwise comparison: a weight's bytes)."""
    return array.view(f"u{array.dtype.itemsize}") if array.dtype.itemsize in (1, 2, 4, 8) else array


def as_array(tensor) -> np.ndarray:
    """A PyTorch tensor as a NumPy array, without a copy where it is contiguous."""
    return tensor.detach().contiguous().numpy()


def _head(array: np.ndarray) -> bytes:
    return np.ascontiguousarray(array.reshape(-1)[:FINGERPRINT]).tobytes()


def _transposed_head(array: np.ndarray) -> bytes:
    rows = array.shape[0]
    columns = -(-FINGERPRINT // rows)
    return np.ascontiguousarray(array[:, :columns].T).reshape(-1)[:FINGERPRINT].tobytes()


def _equal(initializer: np.ndarray, source: np.ndarray, transform: str) -> bool:
    """The initializer holds ``source``'s bytes (as they are, or transposed): compared bit for bit."""
    if initializer.dtype != source.dtype:
        return False
    if transform == IDENTITY:
        return initializer.size == source.size and np.array_equal(_bits(initializer.reshape(-1)),
                                                                  _bits(source.reshape(-1)))
    if initializer.ndim != 2 or initializer.shape != source.shape[::-1]:
        return False
    step = max(1, (1 << 22) // max(1, source.shape[0]))  # about 16 MB of the transpose at a time
    return all(np.array_equal(_bits(initializer[j: j + step]), _bits(source[:, j: j + step].T))
               for j in range(0, source.shape[1], step))


def bind(initializers, sources: dict) -> dict:
    """``{initializer name: Binding}`` for the initializers whose values are a source tensor's, as they are or
    transposed; ``sources``: {name: NumPy array} (the template's parameters and buffers)."""
    index = {}
    for name, array in sources.items():
        if array.dtype.kind != "f" or array.size < 2:
            continue
        index.setdefault((array.dtype.str, array.size, _head(array)), []).append((name, IDENTITY))
        if array.ndim == 2 and min(array.shape) > 1:
            index.setdefault((array.dtype.str, array.size, _transposed_head(array)), []).append((name, TRANSPOSE))
    by_size = {}
    for name, array in sources.items():
        if array.dtype.kind == "f" and array.size >= 2:
            by_size.setdefault((array.dtype.str, array.size), []).append(name)
    found = {}
    for tensor in initializers:
        if tensor.data_type not in (TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16):
            continue
        values = values_of(tensor)
        if values.size < 2:
            continue
        for name, transform in index.get((values.dtype.str, values.size, _head(values)), ()):
            if _equal(values, sources[name], transform):
                found[tensor.name] = Binding(name, transform)
                break
        else:
            shifted = _shifted(values, sources, by_size.get((values.dtype.str, values.size), ()))
            if shifted is not None:
                found[tensor.name] = shifted
    return found


def _shifted(values: np.ndarray, sources: dict, candidates) -> Binding | None:
    """A source that ``values`` is plus one constant, exactly as float arithmetic gives it (the constant is found
    from the first differences, rounded to the fewest decimals that reproduce every element)."""
    flat = values.reshape(-1)
    for name in candidates:
        source = sources[name].reshape(-1)
        differences = flat[:FINGERPRINT].astype(np.float64) - source[:FINGERPRINT].astype(np.float64)
        middle = float(np.median(differences))
        if middle == 0 or np.max(np.abs(differences - middle)) > 1e-5 * max(1.0, abs(middle)):
            continue
        for shift in dict.fromkeys([round(middle, digits) for digits in range(8)] + [middle]):
            binding = Binding(name, SHIFT, shift)
            if shift != 0 and np.array_equal(binding.apply(source), flat):
                return binding
    return None


class WeightsFile:
    """``weights.data`` in an export folder being written: tensors placed as graphs are stitched, their bytes
    written by a thread (``exporter/capture/weights_writer.py``) while the export goes on; ``close`` waits for
    them (and raises a failed write), ``abort`` drops them.

    Each distinct tensor is stored once: the bytes of a model tensor already placed under any name (the same
    parameter in the prefill and the step graph, or equal values: a model's RMSNorm scales of ones) with the same
    transform are pointed at, not written again.  Equal sources are confirmed element for element, in memory."""

    def __init__(self, folder: Path):
        from elx.exporter.capture.weights_writer import BackgroundWriter

        self.path = Path(folder) / WEIGHTS_FILE
        self.handle = open(self.path, "w+b")
        self.writer = BackgroundWriter(self.handle.fileno())
        self.end = 0  # bytes the file will have when every placed tensor is written
        self.placed = {}  # (source, transform, shift) -> (offset, length)
        self.same = {}  # (fingerprint, dtype, shape, transform, shift) -> [(array, offset)]

    def close(self) -> None:
        """Every placed tensor written (the first failed write raised), the file closed."""
        if self.handle.closed:
            return
        try:
            self.writer.finish()
            os.ftruncate(self.handle.fileno(), self.end)
        except BaseException:
            self.abort()
            raise
        self.handle.close()
        self.same.clear()  # the model's tensors, no longer needed here (the export frees them next)

    def writing(self) -> bool:
        """Some placed tensor is not on disk yet."""
        return self.writer.busy()

    def abort(self) -> None:
        """The writes left undone, the file closed (the caller removes the folder)."""
        self.writer.abort()
        if not self.handle.closed:
            self.handle.close()
        self.same.clear()

    def _place(self, array: np.ndarray, transform: str = IDENTITY, shift: float = 0.0) -> int:
        """The offset ``transform(array)`` will be at: where an equal source's is, or a new aligned range."""
        key = (bytes_key(memoryview(array).cast("B")), array.dtype.str, array.shape, transform, shift)
        for entry in self.same.get(key, ()):
            if self._equal(entry, array, transform, shift):
                return entry[1]
        step = alignment(array.nbytes)
        offset = -(-self.end // step) * step
        self.end = offset + array.nbytes
        entry = [array, offset]  # the source, until the thread has written it (then the file is compared)
        self.same.setdefault(key, []).append(entry)
        self.writer.submit(offset, array, transform, shift, written=lambda: entry.__setitem__(0, None))
        return offset

    def _equal(self, entry: list, array: np.ndarray, transform: str, shift: float) -> bool:
        """``array`` is the source of ``entry`` (a placed tensor): compared with that source while it is queued, with
        the written bytes after (not holding the model's tensor meanwhile: the fp64 reference, running beside the
        writer, converts some of them in place, and a kept float32 storage is memory)."""
        source, offset = entry
        if source is not None:
            return np.array_equal(_bits(source), _bits(array))
        stored = np.frombuffer(os.pread(self.handle.fileno(), array.nbytes, offset), dtype=array.dtype)
        if stored.size != array.size:
            return False
        if transform == TRANSPOSE:
            return np.array_equal(_bits(stored.reshape(array.shape[::-1]).T), _bits(array))
        expected = Binding("", transform, shift).apply(array)
        return np.array_equal(_bits(stored), _bits(np.ascontiguousarray(expected).reshape(-1)))

    def bound(self, tensor: TensorProto, binding: Binding, source) -> None:
        """Point ``tensor`` at ``binding``'s transform of ``source`` (a PyTorch tensor), written once per folder."""
        key = (binding.source, binding.transform, binding.shift)
        expected = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize * int(np.prod(tensor.dims))
        if expected < MIN_BYTES:  # small tensors stay in the graph, as store_weights_once leaves them
            data = np.ascontiguousarray(binding.apply(as_array(source))).tobytes()
            if len(data) != expected:
                raise ValueError(f"{tensor.name}: {binding.source} has {len(data)} bytes, the initializer {expected}")
            for field in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
                tensor.ClearField(field)
            del tensor.external_data[:]
            tensor.data_location = TensorProto.DEFAULT
            tensor.raw_data = data
            return
        if key not in self.placed:
            array = as_array(source)
            if binding.transform == TRANSPOSE and array.ndim != 2:
                raise ValueError(f"{tensor.name}: {binding.source} is not a matrix to transpose")
            self.placed[key] = (self._place(array, binding.transform, binding.shift), array.nbytes)
        offset, length = self.placed[key]
        if length != expected:
            raise ValueError(f"{tensor.name}: {binding.source} has {length} bytes, the initializer {expected}")
        point_external(tensor, offset, length)

    def own(self, tensor: TensorProto) -> None:
        """Move a large initializer's own bytes to the file (small ones stay in the graph)."""
        if tensor.data_type == TensorProto.STRING or not tensor.HasField("raw_data") or len(tensor.raw_data) < MIN_BYTES:
            return
        data = np.frombuffer(tensor.raw_data, dtype=np.uint8)
        point_external(tensor, self._place(data), data.nbytes)
