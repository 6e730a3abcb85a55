"""The graphs' external weights as initializers over one read-only mapping of each data file.

An export folder's graphs read their large tensors from one ``weights.data`` (``exporter/capture/
shared_weights.py``).  ONNX Runtime, given the graph's path, maps or reads each graph's initializers on its
own: two sessions (prefill and step) hold two copies, or two mappings that the resident-set count adds
twice.  Here each data file is mapped once (copy-on-write, never written) and every session is handed
NumPy views into that mapping (``SessionOptions.add_initializer``, no copy on CPU), so the sessions of
one folder read the same pages.  Used with prepacking off (``runners/backends/ort.py``: prepacked MatMul
weights are a per-session copy whatever the source), which is what the export's verification runs.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np


class MappedWeights:
    """Mappings of the data files the graphs name, and the values handed to sessions (kept alive here:
    ONNX Runtime reads them for as long as a session lives)."""

    def __init__(self):
        self._maps = {}
        self._values = []

    def add_to(self, options, graph: Path) -> int:
        """Add every external initializer of ``graph`` to ``options``; returns how many were added.  A tensor
        whose type NumPy has no dtype for (bfloat16) is left to ONNX Runtime."""
        import onnx
        import onnxruntime as ort

        model = onnx.load(str(graph), load_external_data=False)
        added = 0
        for tensor in model.graph.initializer:
            if tensor.data_location != onnx.TensorProto.EXTERNAL:
                continue
            info = {entry.key: entry.value for entry in tensor.external_data}
            try:
                dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type))
            except (KeyError, TypeError, ValueError):
                continue
            if dtype.kind not in "fiub":
                continue
            count = int(np.prod(tensor.dims, dtype=np.int64))
            mapped = self._map(graph.parent / info["location"])
            array = np.frombuffer(mapped, dtype=dtype, count=count, offset=int(info.get("offset", 0)))
            value = ort.OrtValue.ortvalue_from_numpy(array.reshape(tuple(tensor.dims)))
            self._values.append(value)
            options.add_initializer(tensor.name, value)
            added += 1
        return added

    def _map(self, path: Path) -> np.memmap:
        key = str(path.resolve())
        if key not in self._maps:
            self._maps[key] = np.memmap(key, dtype=np.uint8, mode="c")
        return self._maps[key]
