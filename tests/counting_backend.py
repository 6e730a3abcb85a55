"""A backend that counts the bytes crossing between the host and the device, per decoder step (issue 26).

``CountingBackend`` wraps a device backend (``ort-io``, on the CUDA or the CPU execution provider, or
``tensorrt``: backends whose device values are not host arrays) and records each crossing through the
backend seam (``runners/backends/base.py``):

* host → device: a host numpy array fed to ``run`` (the runner's token ids, token history, step positions
  and masks), ``to_device`` (encoder inputs, the empty cache through ``zeros``), and the int64 row
  indices given to ``take`` / ``permute_rows`` (beam reorders, finished items leaving the batch);
* device → host: each output ``run`` is asked to return on the host (the step's scores), and ``to_host``
  of a device value.

Crossings are grouped per decoder step: a step starts with each run of the step graph and holds what
follows it until the next one (its beam reorder, items leaving); ``phases[0]`` is everything before the
first step (the encoder, the empty cache).  With ``device="cpu"`` nothing is copied on the CPU EP,
yet the same calls cross the same seam that copies on CUDA: the count is what a GPU run moves.
The host backend (``ort``) keeps everything in host arrays and cannot be counted this way.
"""
from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import numpy as np

from elx.runners.backends.base import Backend

H2D, D2H = "host->device", "device->host"


@dataclass(frozen=True)
class Crossing:
    direction: str  # H2D or D2H
    what: str  # "feed:<input>", "output:<output>", "to_device", "to_host", "rows"
    nbytes: int


@dataclass
class Phase:
    """The crossings of one decoder step (or, for ``phases[0]``, of everything before the first)."""

    crossings: list = field(default_factory=list)

    def bytes(self, direction: str) -> int:
        return sum(c.nbytes for c in self.crossings if c.direction == direction)

    def of(self, direction: str) -> list[Crossing]:
        return [c for c in self.crossings if c.direction == direction]


class CountingBackend(Backend):
    def __init__(self, inner: Backend, step_graph: str):
        if inner.name == "ort":
            raise ValueError("the host backend 'ort' keeps every value in host arrays: count a device backend "
                             "(ort-io, tensorrt)")
        self.inner, self.step_graph = inner, step_graph
        self.name, self.device = inner.name, inner.device
        self.phases = [Phase()]

    @property
    def steps(self) -> list[Phase]:
        """One ``Phase`` per decoder step, in order."""
        return self.phases[1:]

    def _count(self, direction: str, what: str, nbytes: int) -> None:
        self.phases[-1].crossings.append(Crossing(direction, what, int(nbytes)))

    def run(self, graph: str, feeds: dict, outputs: list[str], host_outputs: Collection[str] = ()) -> list:
        if graph == self.step_graph:
            self.phases.append(Phase())
        for name, value in feeds.items():
            if isinstance(value, np.ndarray):
                self._count(H2D, f"feed:{name}", value.nbytes)
        values = self.inner.run(graph, feeds, outputs, host_outputs)
        for name, value in zip(outputs, values):
            if name in host_outputs:
                self._count(D2H, f"output:{name}", np.asarray(value).nbytes)
        return values

    def to_device(self, array: np.ndarray):
        self._count(H2D, "to_device", np.asarray(array).nbytes)
        return self.inner.to_device(array)

    def to_host(self, value) -> np.ndarray:
        host = self.inner.to_host(value)
        if not isinstance(value, np.ndarray):
            self._count(D2H, "to_host", host.nbytes)
        return host

    def take(self, value, rows: np.ndarray):
        self._count(H2D, "rows", np.asarray(rows, dtype=np.int64).nbytes)
        return self.inner.take(value, rows)

    def permute_rows(self, value, rows: np.ndarray):
        self._count(H2D, "rows", np.asarray(rows, dtype=np.int64).nbytes)
        return self.inner.permute_rows(value, rows)

    def nbytes(self, value) -> int:
        return self.inner.nbytes(value)

    def adapt(self, plan):
        return self.inner.adapt(plan)


def count_crossings(generator) -> CountingBackend:
    """Put a ``CountingBackend`` between ``generator`` (``elx.runners.generate.Generator``) and its backend."""
    model = generator.model
    counting = CountingBackend(model.backend, model.plan.step.name)
    model.backend = counting
    return counting
