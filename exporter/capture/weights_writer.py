"""``weights.data`` written by a thread of its own while the export goes on.

A stitched export's graphs point at their weights by offset (``exporter/capture/weights.py``: ``WeightsFile``):
the offsets are known as soon as the tensors' sizes are, and nothing reads the file until the verification's
ONNX Runtime sessions load.  So the bytes are written by this thread, in the order the offsets were given,
while the export stitches the next graph and runs PyTorch's reference logits; ``finish`` waits for the last one
before the sessions load.

Why (measured on TinyLlama-1.1B dims, 4.4 GB of float32 weights, this 2-core VM): writing the weights where the
stitcher binds them took 9.3 s of the export's 13 s prefill stage, and a plain loop of transposes and writes of
the same tensors 9.1 s of writes on the first run against 3.7 s when no other file was being flushed: past the
kernel's dirty-page threshold (``vm.dirty_background_ratio``, ~2.3 GB here) every writer is held to the disk's
own speed (~450 MB/s), so the second half of the file costs seconds of waiting whatever the export does.  A
thread waits instead of the export.

Memory: nothing is copied to be queued.  A job holds a NumPy view of the model's tensor (its float32 storage
stays alive while the view does, even if the model's parameter is pointed elsewhere meanwhile: the fp64
reference converts the model in place, ``exporter/verification/fp32_noise.py``), and a transposed tensor is
transposed into one reused 16 MiB buffer a block of rows at a time (the old way made a transposed copy of each
tensor, 4.4 GB of fresh pages: 1.1 M page faults).  The file's gaps (alignment padding) are holes, read as zeros.

Errors (disk full, ...) are raised by ``finish``; ``abort`` stops the thread where it is (a failed export's folder
is removed by its caller).
"""
from __future__ import annotations

import os
import queue
import threading

import numpy as np

CHUNK_BYTES = 16 << 20  # the transposing buffer


class BackgroundWriter:
    """Writes jobs ``(offset, array, transform, shift)`` to the file ``fd`` in a thread, in submission order."""

    def __init__(self, fd: int):
        self.fd = fd
        self.jobs: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.stopped = False
        self.submitted = self.done = 0  # jobs (each counter moved by one thread only)
        self._buffer = None
        self.thread = threading.Thread(target=self._run, name="elx-weights-writer", daemon=True)
        self.thread.start()

    def submit(self, offset: int, array: np.ndarray, transform: str = "identity", shift: float = 0.0,
               written=None) -> None:
        """Queue ``transform(array)`` for ``offset``; ``written()``, if given, is called (in the thread) once it is."""
        if self.error is not None:
            raise self.error
        self.submitted += 1
        self.jobs.put((offset, array, transform, shift, written))

    def busy(self) -> bool:
        """Some submitted job is not written yet."""
        return self.done < self.submitted and self.thread.is_alive()

    def finish(self) -> None:
        """Wait for every submitted job; raise the first error any of them met."""
        self._stop()
        if self.error is not None:
            raise self.error

    def abort(self) -> None:
        """Stop after the job being written (the rest are dropped)."""
        self.stopped = True
        self._stop()

    def _stop(self) -> None:
        if self.thread.is_alive():
            self.jobs.put(None)
            self.thread.join()

    def _run(self) -> None:
        try:  # one PyTorch thread here (the setting is per thread): a transpose is memory-bound, one thread is as fast
            import torch  # as two (0.028 s for a 5632 x 2048 float32 matrix either way), and the cores are the

            torch.set_num_threads(1)  # reference's (``export.ReferenceThreads``)
        except ImportError:
            pass
        while True:
            job = self.jobs.get()
            if job is None:
                return
            offset, array, transform, shift, written = job
            job = None  # the array is not held past its write
            try:
                if not self.stopped and self.error is None:
                    self._write(offset, array, transform, shift)
                    if written is not None:
                        written()
            except BaseException as err:  # noqa: BLE001 - kept for ``finish`` (the export's thread) to raise
                self.error = err
            finally:
                array = written = None
                self.done += 1

    def _write(self, offset: int, array: np.ndarray, transform: str, shift: float) -> None:
        if transform == "transpose" and array.ndim == 2 and array.dtype.kind in "fiu" and array.flags.c_contiguous:
            self._write_transposed(offset, array)
            return
        if transform == "transpose":
            array = np.ascontiguousarray(array.T)
        elif transform == "shift":
            array = array + array.dtype.type(shift)
        self._pwrite(memoryview(np.ascontiguousarray(array)).cast("B"), offset)

    def _write_transposed(self, offset: int, array: np.ndarray) -> None:
        """``array.T``'s bytes at ``offset``: a block of its rows (columns of ``array``) at a time, transposed by
        PyTorch (a blocked copy: 2.3x NumPy's strided one here) into the reused buffer."""
        import torch

        rows, columns = array.shape
        row_bytes = rows * array.itemsize  # one row of the transpose
        if self._buffer is None:
            self._buffer = torch.empty(CHUNK_BYTES, dtype=torch.uint8)
        per = max(1, CHUNK_BYTES // row_bytes)
        if per * row_bytes > self._buffer.numel():
            self._buffer = torch.empty(per * row_bytes, dtype=torch.uint8)
        source = torch.from_numpy(array)
        for first in range(0, columns, per):
            if self.stopped:
                return
            count = min(per, columns - first)
            block = self._buffer[: count * row_bytes].view(source.dtype).view(count, rows)
            block.copy_(source[:, first: first + count].t())
            self._pwrite(memoryview(block.numpy()).cast("B"), offset + first * row_bytes)

    def _pwrite(self, data: memoryview, offset: int) -> None:
        while len(data):
            written = os.pwrite(self.fd, data, offset)
            data, offset = data[written:], offset + written
