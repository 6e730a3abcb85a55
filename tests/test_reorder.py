"""Beam reorders of the self cache (``Model.reorder`` → ``Backend.permute_rows``): the ONNX Runtime CPU
backend moves only the rows that change, in place; the result must equal ``np.take`` for every pattern a
beam search produces (duplicated parents, chains and cycles of moves, identity, most rows moving)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elx.runners.backends.base import Backend
from elx.runners.model import DecoderCache, Model
from elx.runners.backends.ort import OrtBackend


def _backend() -> OrtBackend:
    return OrtBackend.__new__(OrtBackend)  # no sessions needed to move rows


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 24).flatmap(lambda n: st.lists(st.integers(0, n - 1), min_size=n, max_size=n)))
def test_permute_rows_equals_take(rows):
    rows = np.asarray(rows, dtype=np.int64)
    value = np.random.default_rng(rows.size).standard_normal((rows.size, 3, 2)).astype(np.float32)
    expected = np.take(value, rows, axis=0)
    assert np.array_equal(_backend().permute_rows(value.copy(), rows), expected)


def test_few_moves_are_done_in_place_and_many_into_a_new_array():
    backend = _backend()
    value = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)
    few = np.array([0, 0, 2, 3, 4, 5, 1, 7])  # 2 of 8 rows move: row 1 ← 0, row 6 ← 1 (a chain)
    out = backend.permute_rows(value, few)
    assert out is value and np.array_equal(out[[1, 6]], np.arange(32, dtype=np.float32).reshape(8, 4)[[0, 1]])
    value = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)
    many = np.array([1, 0, 3, 2, 5, 4, 6, 7])  # 6 of 8 move: a copy is cheaper than gathering and writing
    out = backend.permute_rows(value, many)
    assert out is not value and np.array_equal(value, np.arange(32, dtype=np.float32).reshape(8, 4))
    frozen = np.arange(8, dtype=np.float32).reshape(8, 1)
    frozen.flags.writeable = False  # never written: a read-only array gets a new one
    assert np.array_equal(backend.permute_rows(frozen, few), np.take(frozen, few, axis=0))


@pytest.mark.parametrize("rows", [[0, 0, 2, 3], [0, 1], [2, 0, 0, 1]])
def test_model_reorder_uses_permute_only_when_the_row_count_is_kept(rows):
    class Recording(Backend):
        name, device = "recording", "cpu"
        calls: list = []

        def run(self, graph, feeds, outputs, host_outputs=()):
            raise NotImplementedError

        def to_device(self, array):
            return array

        def to_host(self, value):
            return value

        def take(self, value, rows):
            self.calls.append("take")
            return np.take(value, rows, axis=0)

        def permute_rows(self, value, rows):
            self.calls.append("permute")
            return super().permute_rows(value, rows)

        def nbytes(self, value):
            return value.nbytes

    model = Model.__new__(Model)
    model.backend = Recording()
    cache = DecoderCache({"k": np.arange(4.0).reshape(4, 1)}, 4)
    rows = np.asarray(rows)
    out = model.reorder(cache, rows)
    assert np.array_equal(out.arrays["k"], np.take(np.arange(4.0).reshape(4, 1), rows, axis=0))
    assert Recording.calls == (["permute", "take"] if rows.size == 4 else ["take"])
