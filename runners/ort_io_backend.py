"""ONNX Runtime backend with IOBinding: state and caches stay in device buffers between steps.

For the CUDA execution provider (``onnxruntime-gpu``): the per-input state (encoder outputs,
cross K/V or H) and the self-attention cache live on the GPU as ``OrtValue``s and are bound to
the decoder's inputs and outputs directly; beam reordering and dropping finished items run as a
one-node ``Gather`` graph on the same device.  Only the step tokens go up and the last-position
logits come down each step (the search itself runs on the host).

With ``device="cpu"`` the very same code path runs on the CPU execution provider, which is how
the tests exercise it on machines without a GPU.
"""
from __future__ import annotations

import numpy as np

from runners.errors import ElxError

from .backend import Backend, DecoderCache, EncoderState
from .manifest import Manifest
from .ort_backend import OrtBackend, session_options

def _gather_model():
    from onnx import TensorProto, helper

    node = helper.make_node("Gather", ["x", "idx"], ["y"], axis=0)
    graph = helper.make_graph([node], "gather", [helper.make_tensor_value_info("x", TensorProto.FLOAT, None),
                                                 helper.make_tensor_value_info("idx", TensorProto.INT64, ["n"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9).SerializeToString()


class OrtIoBackend(OrtBackend):
    def __init__(self, manifest: Manifest, device: str = "cuda", device_id: int = 0, threads: int | None = None):
        import onnxruntime as ort

        if device == "cuda" and "CUDAExecutionProvider" not in ort.get_available_providers():
            raise ElxError("ONNX Runtime has no CUDA execution provider here; install onnxruntime-gpu "
                           "(pip install 'elx[gpu]') on a machine with a GPU")
        providers = ([("CUDAExecutionProvider", {"device_id": device_id}), "CPUExecutionProvider"]
                     if device == "cuda" else ["CPUExecutionProvider"])
        super().__init__(manifest, threads=threads, providers=providers)
        self.device, self.device_id = device, device_id
        self._gather = ort.InferenceSession(_gather_model(), session_options(threads), providers=providers)
        self._ortvalue = ort.OrtValue

    # -- helpers ---------------------------------------------------------------------------
    def _to_device(self, array: np.ndarray):
        return self._ortvalue.ortvalue_from_numpy(np.ascontiguousarray(array), self.device, self.device_id)

    def _run(self, session, feeds: dict, outputs: list, host_outputs=()) -> list:
        binding = session.io_binding()
        for name, value in feeds.items():
            if isinstance(value, np.ndarray):
                binding.bind_cpu_input(name, np.ascontiguousarray(value))
            else:
                binding.bind_ortvalue_input(name, value)
        for name in outputs:
            binding.bind_output(name, "cpu" if name in host_outputs else self.device, 0 if name in host_outputs
                                else self.device_id)
        session.run_with_iobinding(binding)
        return binding.get_outputs()

    def _take(self, value, rows: np.ndarray):
        return self._run(self._gather, {"x": value, "idx": rows.astype(np.int64)}, ["y"])[0]

    # -- Backend ---------------------------------------------------------------------------
    def _run_graph(self, name: str, feeds: dict, outputs: list) -> list:
        return self._run(self.sessions[name], feeds, outputs)

    def _hold(self, value):
        return self._to_device(value) if isinstance(value, np.ndarray) else value

    @staticmethod
    def _to_host(value):
        return value if isinstance(value, np.ndarray) else value.numpy()

    def empty_cache(self, rows: int) -> DecoderCache:
        host = super().empty_cache(rows)
        return DecoderCache({k: self._to_device(a) for k, a in host.arrays.items()}, rows)

    def step(self, input_ids, state: EncoderState, cache: DecoderCache, history=None):
        feeds = dict(state.feeds)
        feeds.update(cache.arrays)
        feeds[self._token_input] = np.ascontiguousarray(input_ids, dtype=np.int64)
        if self._history_input is not None:
            if history is None:
                raise ElxError("this decoder blocks n-grams in the graph and needs the token history")
            feeds[self._history_input] = np.ascontiguousarray(history, dtype=np.int64)
        outputs = self._run(self.sessions[self.manifest.step], feeds, self._step_outputs, host_outputs=(self._logits,))
        logits = outputs[0].numpy()
        return logits, DecoderCache(dict(zip(self._cache_map, outputs[1:])), cache.rows)

    def reorder(self, cache: DecoderCache, rows: np.ndarray) -> DecoderCache:
        if rows.shape[0] == cache.rows and np.array_equal(rows, np.arange(cache.rows)):
            return cache
        return DecoderCache({k: self._take(v, rows) for k, v in cache.arrays.items()}, int(rows.shape[0]))

    def select(self, state: EncoderState, items: np.ndarray) -> EncoderState:
        feeds = {}
        for name, value in state.feeds.items():
            if value.data_type() == "tensor(float)":
                feeds[name] = self._take(value, items)
            else:  # masks: small, gather on the host
                feeds[name] = self._to_device(np.take(value.numpy(), items, axis=0))
        return EncoderState(feeds, int(items.shape[0]), state.extras)
