"""``weights.data`` written by a thread (``exporter/capture/weights_writer.py``) through ``WeightsFile``: the bytes
at each offset are the tensor's transform, equal sources are stored once whether the first is still queued or
already written, and a failed write is raised by ``close`` (no model: plain arrays)."""
from __future__ import annotations

import errno
import os
import threading

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto

from elx.exporter.capture.shared_weights import bytes_key
from elx.exporter.capture.weights import IDENTITY, SHIFT, TRANSPOSE, Binding, WeightsFile


def _initializer(name: str, array: np.ndarray) -> TensorProto:
    return onnx.numpy_helper.from_array(array, name)


def _unsampled_element(array: np.ndarray) -> int:
    """A float32 element of ``array`` whose bytes ``bytes_key`` does not sample."""
    length, stride = array.nbytes, (array.nbytes - (1 << 14)) // 64
    sampled = [(0, 1 << 20), (length - (1 << 20), length)] + [(i * stride, i * stride + (1 << 14)) for i in range(64)]
    return next(b // 4 for b in range(1 << 20, length, 4) if not any(lo <= b < hi for lo, hi in sampled))


def _stored(folder, tensor: TensorProto) -> np.ndarray:
    info = {e.key: e.value for e in tensor.external_data}
    data = (folder / info["location"]).read_bytes()[int(info["offset"]): int(info["offset"]) + int(info["length"])]
    return np.frombuffer(data, dtype=np.float32).reshape(tuple(tensor.dims))


@pytest.mark.parametrize("wait_between", [False, True], ids=["still-queued", "already-written"])
def test_each_tensor_is_its_transform_and_equal_sources_are_stored_once(tmp_path, wait_between):
    rng = np.random.default_rng(0)
    square = rng.standard_normal((1100, 1000)).astype(np.float32)  # 4.4 MB: keyed by samples, written in blocks
    norm = np.ones(512, dtype=np.float32)
    weights = WeightsFile(tmp_path)
    first = [_initializer("w1", square.T.copy()), _initializer("n1", norm), _initializer("s1", norm + 1)]
    weights.bound(first[0], Binding("layer.1.w", TRANSPOSE), torch.from_numpy(square))
    weights.bound(first[1], Binding("layer.1.norm", IDENTITY), torch.from_numpy(norm))
    weights.bound(first[2], Binding("layer.1.norm", SHIFT, 1.0), torch.from_numpy(norm))
    if wait_between:  # the first ones on disk before the equal ones are placed: compared with the file
        while weights.writing():
            threading.Event().wait(0.01)
    again = [_initializer("w2", square.T.copy()), _initializer("n2", norm), _initializer("other", square.T.copy())]
    weights.bound(again[0], Binding("layer.2.w", TRANSPOSE), torch.from_numpy(square.copy()))  # equal, not the same
    weights.bound(again[1], Binding("layer.2.norm", IDENTITY), torch.from_numpy(norm.copy()))
    changed = square.copy()
    changed.reshape(-1)[_unsampled_element(changed)] += 1  # the same key (samples), one element differs: apart
    assert bytes_key(memoryview(changed).cast("B")) == bytes_key(memoryview(square).cast("B"))
    weights.bound(again[2], Binding("layer.3.w", TRANSPOSE), torch.from_numpy(changed))
    weights.close()
    offsets = [{e.key: e.value for e in t.external_data}["offset"] for t in first + again]
    assert offsets[0] == offsets[3] and offsets[1] == offsets[4] and len(set(offsets)) == 4
    np.testing.assert_array_equal(_stored(tmp_path, first[0]), square.T)
    np.testing.assert_array_equal(_stored(tmp_path, first[1]), norm)
    np.testing.assert_array_equal(_stored(tmp_path, first[2]), norm + 1)
    np.testing.assert_array_equal(_stored(tmp_path, again[2]), changed.T)
    assert (tmp_path / "weights.data").stat().st_size == weights.end
    assert not weights.same  # no source is held after the close


def test_a_failed_write_is_raised_by_close_and_the_rest_is_not_written(tmp_path, monkeypatch):
    from elx.exporter.capture import weights_writer

    calls = []

    def full(self, data, offset):
        calls.append(offset)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(weights_writer.BackgroundWriter, "_pwrite", full)
    weights = WeightsFile(tmp_path)
    with pytest.raises(OSError, match="No space left"):
        try:  # where the thread failed before the last placement, that placement says so (then close again)
            for i in range(4):
                array = np.full((64, 32), i, dtype=np.float32)
                weights.bound(_initializer(f"w{i}", array.T.copy()), Binding(f"w{i}", TRANSPOSE),
                              torch.from_numpy(array))
        finally:
            weights.close()
    assert len(calls) == 1 and weights.handle.closed and not weights.writer.thread.is_alive()
    weights.close()  # again: nothing left to do


def test_abort_stops_the_thread_without_writing_what_is_queued(tmp_path, monkeypatch):
    from elx.exporter.capture import weights_writer

    started, release = threading.Event(), threading.Event()
    original = weights_writer.BackgroundWriter._pwrite

    def slow(self, data, offset):
        started.set()
        release.wait(5)
        original(self, data, offset)

    monkeypatch.setattr(weights_writer.BackgroundWriter, "_pwrite", slow)
    weights = WeightsFile(tmp_path)
    for i in range(3):
        array = np.full(4096, i, dtype=np.float32)
        weights.bound(_initializer(f"n{i}", array), Binding(f"n{i}", IDENTITY), torch.from_numpy(array))
    assert started.wait(5) and weights.writing()
    threading.Timer(0.2, release.set).start()
    weights.abort()
    assert not weights.writer.thread.is_alive() and weights.handle.closed
    assert (tmp_path / "weights.data").stat().st_size <= 4096 * 4  # the job under way, not the queued ones
