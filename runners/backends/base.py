"""The backend seam: a backend runs the graphs of one export folder and keeps tensors on its device.

A backend knows nothing of generation: no manifest semantics, no search, no logits processing.
It runs a graph (by its manifest name) on named inputs and returns named outputs, moves arrays
between the host and its device, and takes rows of a device tensor (beam reordering, dropping
finished items).  ``elx.runners.model.Model`` drives any backend through the run plan
(``runners/plan.py``); the searches (``runners/search/search.py``) drive the model.

Backends: ``ort`` (ONNX Runtime, host numpy arrays: ``runners/backends/ort.py``), ``ort-io``
(ONNX Runtime with IOBinding, device-resident tensors, CUDA or CPU EP:
``runners/backends/ort_io.py``), ``tensorrt`` (``runners/backends/tensorrt.py``).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection
from dataclasses import dataclass, field

import numpy as np

from elx.runners.inputs.prompt import Prompt

DTYPES = {"int64": np.int64, "int32": np.int32, "float32": np.float32, "float16": np.float16, "bool": np.bool_}


class Backend(ABC):
    name: str = "abstract"
    device: str = "cpu"
    device_id: int = 0
    # whether ``as_tensor`` hands the values ``run`` returns to PyTorch on their device, without a copy: the
    # searches then run their vocabulary-wide part there (``runners/search/device.py``)
    device_tensors: bool = False
    # whether ``run_in_place`` can bind a cache input and its output to one buffer (cache entries marked ``in_place``)
    in_place_cache: bool = False

    @abstractmethod
    def run(self, graph: str, feeds: dict, outputs: list[str], host_outputs: Collection[str] = ()) -> list:
        """Run manifest graph ``graph`` on ``feeds`` (device values or host numpy arrays); return ``outputs``
        in order, those named in ``host_outputs`` as host numpy arrays, the others as device values."""

    def run_in_place(self, graph: str, feeds: dict, outputs: list[str], in_place: dict) -> list:
        """``run`` with each output named in ``in_place`` (output → input name) written into the buffer fed as that
        input (the graph's kernel writes the new positions there): returns ``outputs`` in order, those the fed buffers
        themselves, the others as host arrays.  Only where ``in_place_cache``."""
        raise NotImplementedError(f"backend {self.name} does not run caches in place")

    def release_run(self) -> None:
        """Let go of whatever a generation left bound to the backend (called when each ``generate`` ends)."""

    @abstractmethod
    def to_device(self, array: np.ndarray):
        """A device value holding ``array``."""

    @abstractmethod
    def to_host(self, value) -> np.ndarray:
        """A host numpy array holding ``value``."""

    @abstractmethod
    def take(self, value, rows: np.ndarray):
        """Rows ``rows`` (int64) of ``value`` along axis 0, on the device."""

    def permute_rows(self, value, rows: np.ndarray):
        """``take(value, rows)`` where ``rows`` has as many rows as ``value`` (a beam reorder); ``value`` is
        consumed: a backend may reorder it in place and return it."""
        return self.take(value, rows)

    @abstractmethod
    def nbytes(self, value) -> int:
        """Bytes ``value`` occupies on its device."""

    # -- PyTorch tensors on this backend's device (the device search path) --------------------------------
    @property
    def torch_device(self) -> str:
        if self.device == "cpu" or ":" in self.device:  # TensorRT names its device "cuda:N"
            return self.device
        return f"{self.device}:{self.device_id}"

    def as_tensor(self, value):
        """A torch tensor sharing the memory of device value ``value`` (one of ``run``'s outputs); torch tensors
        and host arrays (a first step's scores kept on the host) pass as they are / are moved up."""
        import torch

        if isinstance(value, torch.Tensor):
            return value
        return self.tensor_from_host(value)

    def tensor_to_host(self, tensor) -> np.ndarray:
        """A host copy of torch tensor ``tensor`` (the search's candidates, tokens)."""
        return tensor.cpu().numpy()

    def tensor_from_host(self, array: np.ndarray):
        """A torch tensor on this backend's device holding host ``array`` (running scores, row indices, ids)."""
        import torch

        return torch.from_numpy(np.ascontiguousarray(array)).to(self.torch_device)

    def zeros(self, shape: list[int], dtype: str):
        return self.to_device(np.zeros(shape, dtype=DTYPES[dtype]))

    def adapt(self, plan):
        """The run plan for what this backend's build of the graphs does (default: what the manifest says).

        E.g. a TensorRT engine built with n-gram blocking left to the host has no blocked output."""
        return plan


@dataclass
class EncoderState:
    """Per-input state the step graph reads every step, at batch B (shared by the beams of an item).

    ``feeds`` maps step input names to device values: the "input-related state" bytes.
    ``kept`` holds stage outputs on the host that the plan keeps (e.g. the encoder output, for compare).
    ``prompt`` is a decoder-only model's prompt (mask, positions, the prefill's outputs: ``runners/inputs/prompt.py``).
    """

    feeds: dict
    batch: int
    kept: dict = field(default_factory=dict)
    prompt: Prompt | None = None


@dataclass
class DecoderCache:
    """The self-attention cache: step input name → device value [rows, ...], reordered with the beams.

    ``length`` counts the sequence positions the model has consumed (prompt and generated tokens)."""

    arrays: dict
    rows: int
    length: int = 0
