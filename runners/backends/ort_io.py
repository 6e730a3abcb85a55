"""ONNX Runtime backend with IOBinding: tensors stay in device buffers (``OrtValue``s) between runs.

For the CUDA execution provider (``onnxruntime-gpu``): per-input state and the self-attention
cache live on the GPU and are bound to the graphs' inputs and outputs directly; taking rows
(beam reordering, dropping finished items) runs as a one-node ``Gather`` graph on the same
device.  Only what a caller asks for on the host (the step's scores) is copied down.

With ``device="cpu"`` the very same code path runs on the CPU execution provider, which is how
the tests exercise it on machines without a GPU.

The device search path (``runners/search/device.py``) reads the step's logits where ORT wrote them:
``as_tensor`` hands an output ``OrtValue`` to PyTorch through DLPack (no copy, CPU EP and CUDA alike; the
tensor keeps the ``OrtValue`` alive, as DLPack requires).  DLPack rather than binding the output to a
preallocated torch buffer: the output's shape (rows, a vocabulary the export may pad) need not be known
before the run.  ORT's run returns with its outputs written; the search's host copy of the candidates waits for the
torch kernels that read the logits, before the tensor (and with it the ``OrtValue``) is dropped and ORT
may reuse the memory.
"""
from __future__ import annotations

import functools
from collections.abc import Collection

import numpy as np

from elx.runners.backends.base import Backend
from elx.runners.errors import ElxError
from elx.runners.manifest import Manifest
from elx.runners.backends.ort import allocation_failures, load_sessions, session_options

_ONNX_TYPES = {"tensor(float)": "FLOAT", "tensor(float16)": "FLOAT16", "tensor(int64)": "INT64",
               "tensor(int32)": "INT32", "tensor(bool)": "BOOL"}
_ITEMSIZE = {"tensor(float)": 4, "tensor(float16)": 2, "tensor(int64)": 8, "tensor(int32)": 4, "tensor(bool)": 1}


def _gather_model(onnx_type: str) -> bytes:
    from onnx import TensorProto, helper

    elem = getattr(TensorProto, onnx_type)
    node = helper.make_node("Gather", ["x", "idx"], ["y"], axis=0)
    graph = helper.make_graph([node], "gather", [helper.make_tensor_value_info("x", elem, None),
                                                 helper.make_tensor_value_info("idx", TensorProto.INT64, ["n"])],
                              [helper.make_tensor_value_info("y", elem, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9).SerializeToString()


def cuda_options(device_id: int = 0) -> dict:
    """The CUDA provider's options.  ``use_tf32`` off: ONNX Runtime's CUDA provider multiplies float32 matrices
    in TF32 (10-bit mantissas) by default on Ampere and later, where PyTorch, HF's reference, does not
    (``torch.backends.cuda.matmul.allow_tf32`` is False by default).  On an H200 the fp32 t5-base bench with
    TF32 on gave HF's tokens on 30/32 and 127/128 rows (``docs/measurements/gpu_ort_cuda_2026-11-28.md``)."""
    return {"device_id": device_id, "use_tf32": 0}


def check_on_cuda(sessions: dict) -> None:
    """ONNX Runtime falls back to the CPU, with a log line only, when its CUDA provider cannot load (a CUDA,
    cuBLAS or cuDNN library of the wrong major, or none on the library path): a "cuda" run would then time the
    CPU.  One line instead, naming what to install."""
    for name, session in sessions.items():
        if "CUDAExecutionProvider" not in session.get_providers():
            raise ElxError(f"ONNX Runtime could not put the {name} graph on the GPU (its CUDA provider did not load: "
                           "CUDA 13 runtime, cuBLAS and cuDNN 9 libraries are needed on the library path, e.g. "
                           "'import torch' first with a cu130 PyTorch, or onnxruntime.preload_dlls())")


class OrtIoBackend(Backend):
    name = "ort-io"
    device_tensors = True

    def __init__(self, manifest: Manifest, device: str = "cuda", device_id: int = 0, threads: int | None = None):
        import onnxruntime as ort

        if device == "cuda" and "CUDAExecutionProvider" not in ort.get_available_providers():
            raise ElxError("ONNX Runtime has no CUDA execution provider here; install onnxruntime-gpu "
                           "(pip install 'elx[gpu]') on a machine with a GPU")
        if device not in ("cuda", "cpu"):
            raise ElxError(f"unknown device {device!r} for ONNX Runtime; use cpu or cuda")
        self.providers = ([("CUDAExecutionProvider", cuda_options(device_id)), "CPUExecutionProvider"]
                          if device == "cuda" else ["CPUExecutionProvider"])
        self.sessions = load_sessions(manifest, self.providers, threads)
        if device == "cuda":
            check_on_cuda(self.sessions)
        self.device, self.device_id, self.threads = device, device_id, threads
        self._ortvalue = ort.OrtValue

    @functools.lru_cache(maxsize=None)
    def _gather(self, data_type: str):
        import onnxruntime as ort

        return ort.InferenceSession(_gather_model(_ONNX_TYPES[data_type]), session_options(self.threads),
                                    providers=self.providers)

    def _bind_run(self, session, feeds: dict, outputs: list, host_outputs: Collection[str] = ()) -> list:
        binding = session.io_binding()
        for name, value in feeds.items():
            if isinstance(value, np.ndarray):
                binding.bind_cpu_input(name, np.ascontiguousarray(value))
            else:
                binding.bind_ortvalue_input(name, value)
        for name in outputs:
            on_host = name in host_outputs
            binding.bind_output(name, "cpu" if on_host else self.device, 0 if on_host else self.device_id)
        session.run_with_iobinding(binding)
        values = binding.get_outputs()
        return [v.numpy() if name in host_outputs else v for name, v in zip(outputs, values)]

    def run(self, graph: str, feeds: dict, outputs: list[str], host_outputs: Collection[str] = ()) -> list:
        with allocation_failures(graph):
            return self._bind_run(self.sessions[graph], feeds, outputs, host_outputs)

    def to_device(self, array: np.ndarray):
        return self._ortvalue.ortvalue_from_numpy(np.ascontiguousarray(array), self.device, self.device_id)

    def to_host(self, value) -> np.ndarray:
        return value if isinstance(value, np.ndarray) else value.numpy()

    def as_tensor(self, value):
        if not isinstance(value, self._ortvalue):
            return super().as_tensor(value)
        import torch

        tensor = torch.from_dlpack(value)
        tensor.elx_owner = value  # DLPack: the OrtValue must outlive the tensor that shares its memory
        return tensor

    def take(self, value, rows: np.ndarray):
        session = self._gather(value.data_type())
        return self._bind_run(session, {"x": value, "idx": np.ascontiguousarray(rows, dtype=np.int64)}, ["y"])[0]

    def nbytes(self, value) -> int:
        if isinstance(value, np.ndarray):
            return int(value.nbytes)
        return int(np.prod(value.shape())) * _ITEMSIZE[value.data_type()]
