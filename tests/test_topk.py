"""``elx.runners.search.topk.topk`` returns what ``torch.topk`` returns on the CPU, ties included."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from elx.runners.search.topk import topk


def _torch(x: np.ndarray, k: int):
    values, indices = torch.topk(torch.from_numpy(x), k)
    return values.numpy(), indices.numpy()


def _check(x: np.ndarray, k: int):
    got_v, got_i = topk(x, k)
    want_v, want_i = _torch(x, k)
    np.testing.assert_array_equal(got_i, want_i)
    np.testing.assert_array_equal(got_v, want_v)


@st.composite
def tied_rows(draw):
    rows = draw(st.integers(1, 4))
    n = draw(st.sampled_from([1, 2, 3, 5, 8, 16, 17, 24, 40, 64, 100, 129, 300, 700, 2000]))
    k = draw(st.integers(1, min(n, 40)))
    alphabet = draw(st.integers(1, 6))  # few distinct values: ties everywhere
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    palette = np.array([0.0, -1e9, -np.inf, -0.5, 3.0, np.nan], dtype=np.float32)[:alphabet]
    x = palette[rng.integers(0, alphabet, size=(rows, n))]
    if draw(st.booleans()):  # mix in distinct values
        noise = rng.standard_normal((rows, n)).astype(np.float32)
        x = np.where(rng.random((rows, n)) < 0.3, noise, x)
    return x.astype(np.float32), k


@settings(max_examples=600, deadline=None)
@given(tied_rows())
def test_matches_torch_topk_with_ties(case):
    x, k = case
    _check(x, k)


@pytest.mark.parametrize("n,k", [(32128 * 4, 8), (300 * 3, 6), (300 * 3, 3), (9, 3), (12, 4), (24, 8), (4 * 128, 8)])
def test_beam_search_shapes(n, k):
    rng = np.random.default_rng(n + k)
    x = rng.standard_normal((3, n)).astype(np.float32)
    x[0, rng.integers(0, n, size=n // 3)] = 0.0  # many exact ties at the top
    x[1, :] = -1e9
    _check(x, k)


def test_distinct_values_take_the_fast_path(monkeypatch):
    import elx.runners.search.topk as module

    monkeypatch.setattr(module, "topk_row_torch", lambda *a: pytest.fail("emulation used without ties"))
    x = np.random.default_rng(0).standard_normal((4, 5000)).astype(np.float32)
    _check(x, 8)


def test_topk_threads_follow_omp_num_threads(monkeypatch):
    """The TopK kernel uses ``$OMP_NUM_THREADS`` threads where set (a Ray actor's CPUs), else ONNX Runtime's default."""
    import elx.runners.search.topk as module

    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert module._threads() == 3
    for unset in ("", "0", "two", "-1"):
        monkeypatch.setenv("OMP_NUM_THREADS", unset)
        assert module._threads() == 0
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert module._threads() == 0
