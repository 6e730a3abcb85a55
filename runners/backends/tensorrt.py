"""TensorRT backend: runs the engines ``elx build-engine`` wrote for an export folder, on one CUDA GPU.

It implements the backend seam of ``runners/backends/base.py`` (``run`` a manifest graph on feeds, move values
to and from the device, ``take`` rows on the device) and knows nothing of generation: the searches keep
the per-input state and the self-attention cache as device values between steps, so only the step
tokens go up and the last-position logits (``host_outputs``) come down.

* **Engines**: one per graph of ``manifest.stages + [manifest.step]``, described by the manifest's
  ``engines`` section (``runners/backends/tensorrt_engines.py``), which is checked against the folder, the
  installed TensorRT version (engines run only on the version that built them) and each deserialized
  engine's IO names and dtypes.
* **Device values** are torch CUDA tensors (torch imports only here; the rest of elx runs without it).
  Everything runs on torch's current stream of the device, so TensorRT's work, torch's copies and the
  ``index_select`` of ``take`` are ordered without explicit synchronisation; a host output is a
  ``.cpu()`` copy, which waits for that stream.
* **Profiles**: each call picks the first optimization profile whose [min, max] holds every input
  shape; a shape outside every profile is a one-line ``ElxError`` naming the input, the axis and the
  built range (and which build option raises it).
* **n-gram blocking**: ``ngram_blocking`` is ``"engine"`` when the step engine blocks n-grams itself
  (its plugin is registered here before deserializing: the Python plugin of ``runners/backends/tensorrt_ngram.py``
  for TensorRT for RTX, the C++ library for NVIDIA TensorRT), ``"host"`` when the build left it to
  the host (the step engine returns plain logits only; ``adapt`` tells the run plan, so the search
  applies its own n-gram processor), ``None`` for exports without the ngram pass.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from elx.runners.errors import ElxError

from elx.runners.backends import tensorrt_engines
from elx.runners.backends.base import Backend
from elx.runners.plan import RunPlan
from elx.runners.backends.tensorrt_runtime import RUNTIMES, load, version

_NUMPY = {"float32": np.float32, "float16": np.float16, "int64": np.int64, "int32": np.int32, "bool": np.bool_,
          "int8": np.int8, "uint8": np.uint8}


def _torch():
    try:
        import torch
    except ImportError:
        raise ElxError("the TensorRT backend keeps tensors on the GPU with PyTorch; pip install torch (a CUDA build)")
    if not torch.cuda.is_available():
        raise ElxError("the TensorRT backend needs a CUDA GPU and PyTorch with CUDA; none is available here")
    return torch


class TensorRTBackend(Backend):
    name = "tensorrt"

    def __init__(self, manifest, *, device: str = "cuda", device_id: int = 0, threads: int | None = None):
        if device != "cuda":
            raise ElxError(f"the TensorRT backend runs on a CUDA GPU, not {device!r}; use device='cuda' or the "
                           "ONNX Runtime backend")
        self.manifest = manifest
        self.engines = tensorrt_engines.section(manifest)
        info = RUNTIMES[self.engines["runtime"]]
        self.trt = trt = load(info)
        self.label = f"{info.label} {version(trt)}"
        if version(trt) != self.engines["runtime_version"]:
            raise ElxError(f"the engines in {manifest.folder} were built with {info.label} "
                           f"{self.engines['runtime_version']} and {self.label} is installed; run elx build-engine "
                           "again (engines run only on the TensorRT version that built them)")
        self.torch = torch = _torch()
        self.device, self.device_id = f"cuda:{device_id}", device_id
        folder = Path(manifest.folder)
        self.ngram_blocking = (self.engines.get("ngram") or {}).get("blocking")
        self._log: list[str] = []
        self._runtime = trt.Runtime(self._logger())
        if self.ngram_blocking == "engine":
            self._register_plugin(folder / self.engines["ngram"]["library"])
        self._engines, self._contexts, self._profile = {}, {}, {}
        with torch.cuda.device(device_id):  # TensorRT works on the thread's current CUDA device
            for graph in [*manifest.stages, manifest.step]:
                self._load(folder, graph)
        self._empty = torch.empty(256, dtype=torch.uint8, device=self.device)  # address for zero-size tensors

    def adapt(self, plan: RunPlan) -> RunPlan:
        """An engine built with n-gram blocking left to the host has no blocked output and no history input."""
        if self.ngram_blocking == "host":
            return dataclasses.replace(plan, blocked=None, ngram_size=0, history_input=None)
        return plan

    # -- setup -------------------------------------------------------------------------------
    def _logger(self):
        trt, log = self.trt, self._log

        class Collect(trt.ILogger):
            def __init__(self):
                trt.ILogger.__init__(self)

            def log(self, severity, msg):
                if severity in (trt.ILogger.INTERNAL_ERROR, trt.ILogger.ERROR):
                    log.append(" ".join(str(msg).split()))

        return Collect()

    def _load(self, folder: Path, graph: str) -> None:
        spec = self.engines["graphs"][graph]
        engine = self._runtime.deserialize_cuda_engine((folder / spec["file"]).read_bytes())
        if engine is None:
            major, minor = self.torch.cuda.get_device_capability(self.device_id)
            raise ElxError(f"{self.label} cannot load {folder / spec['file']} on this GPU (compute capability "
                           f"{major}.{minor}; built for {', '.join(self.engines['compute_capabilities'])}): "
                           f"{self._last_error()}")
        self._check_io(graph, engine, spec)
        self._engines[graph] = engine
        self._contexts[graph] = engine.create_execution_context()
        self._profile[graph] = 0

    def _last_error(self) -> str:
        return self._log[-1] if self._log else "no message from TensorRT"

    def _register_plugin(self, library: Path) -> None:
        if self.trt.__name__ == "tensorrt_rtx":
            from elx.runners.backends import tensorrt_ngram

            tensorrt_ngram.load_kernel(library)
            tensorrt_ngram.register(self.trt, self._runtime.get_plugin_registry())
        else:
            if not library.is_file():
                raise ElxError(f"{library} is missing; run elx build-engine again")
            self._runtime.get_plugin_registry().load_library(str(library))

    def _check_io(self, graph: str, engine, spec: dict) -> None:
        trt = self.trt
        names = {engine.get_tensor_name(i) for i in range(engine.num_io_tensors)}
        expected = {**{n: ("input", t["dtype"]) for n, t in spec["inputs"].items()},
                    **{n: ("output", t["dtype"]) for n, t in spec["outputs"].items()}}
        if names != set(expected):
            raise ElxError(f"the {graph} engine's tensors {sorted(names ^ set(expected))} differ from the manifest; "
                           "run elx build-engine again")
        for name, (mode, dtype) in expected.items():
            is_input = engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT
            actual = np.dtype(trt.nptype(engine.get_tensor_dtype(name))).name
            if is_input != (mode == "input") or actual != dtype:
                raise ElxError(f"the {graph} engine's {name!r} is a {actual} {'input' if is_input else 'output'}, "
                               f"the manifest says a {dtype} {mode}; run elx build-engine again")

    # -- device values -----------------------------------------------------------------------
    def to_device(self, array):
        if isinstance(array, self.torch.Tensor):
            return array.to(self.device)
        return self.torch.from_numpy(np.ascontiguousarray(array)).to(self.device)

    def to_host(self, value) -> np.ndarray:
        if isinstance(value, np.ndarray):
            return value
        return value.detach().cpu().numpy()

    def take(self, value, rows):
        if isinstance(value, np.ndarray):
            return np.take(value, rows, axis=0)
        index = self.torch.as_tensor(np.asarray(rows, dtype=np.int64), device=value.device)
        return value.index_select(0, index)

    def nbytes(self, value) -> int:
        if isinstance(value, np.ndarray):
            return int(value.nbytes)
        return int(value.numel() * value.element_size())

    def _input(self, graph: str, name: str, value, dtype: str):
        torch = self.torch
        if isinstance(value, np.ndarray) or not isinstance(value, torch.Tensor):
            return torch.from_numpy(np.ascontiguousarray(value, dtype=_NUMPY[dtype])).to(self.device)
        if value.device != torch.device(self.device):
            raise ElxError(f"{graph} input {name!r} is on {value.device}, the engines run on {self.device}")
        wanted = getattr(torch, {"float32": "float32", "float16": "float16", "int64": "int64", "int32": "int32",
                                 "bool": "bool", "int8": "int8", "uint8": "uint8"}[dtype])
        return value.to(wanted).contiguous()

    def _address(self, tensor) -> int:
        return tensor.data_ptr() if tensor.numel() else self._empty.data_ptr()

    # -- running -----------------------------------------------------------------------------
    def run(self, graph: str, feeds: dict, outputs: list[str], host_outputs=()) -> list:
        torch = self.torch
        spec = self.engines["graphs"].get(graph)
        if spec is None or graph not in self._contexts:
            raise ElxError(f"this export has no engine for graph {graph!r}; graphs: {', '.join(self._contexts)}")
        unknown = [o for o in outputs if o not in spec["outputs"]]
        if unknown:
            raise ElxError(f"the {graph} engine has no output {', '.join(map(repr, unknown))}")
        missing = [n for n in spec["inputs"] if n not in feeds]
        if missing:
            raise ElxError(f"{graph} needs input(s) {', '.join(map(repr, missing))}")
        values = {name: self._input(graph, name, feeds[name], t["dtype"]) for name, t in spec["inputs"].items()}
        profile = tensorrt_engines.check_shapes(graph, spec, {n: tuple(v.shape) for n, v in values.items()})
        context = self._contexts[graph]
        stream = torch.cuda.current_stream(self.device).cuda_stream
        if self._profile[graph] != profile:
            context.set_optimization_profile_async(profile, stream)
            self._profile[graph] = profile
        for name, value in values.items():
            if not context.set_input_shape(name, tuple(value.shape)):
                raise ElxError(f"{self.label} refused shape {list(value.shape)} for {graph} input {name!r}: "
                               f"{self._last_error()}")
            context.set_tensor_address(name, self._address(value))
        results = {}
        for name, out in spec["outputs"].items():
            shape = tuple(context.get_tensor_shape(name))
            buffer = torch.empty(shape, dtype=getattr(torch, out["dtype"]), device=self.device)
            context.set_tensor_address(name, self._address(buffer))
            results[name] = buffer
        with torch.cuda.device(self.device_id):
            if not context.execute_async_v3(stream):
                raise ElxError(f"{self.label} failed running the {graph} engine: {self._last_error()}")
        return [results[o].cpu().numpy() if o in host_outputs else results[o] for o in outputs]
