"""n-gram blocking references vs transformers' NoRepeatNGramLogitsProcessor."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import NoRepeatNGramLogitsProcessor

from elx.runners.search.ngram_reference import banned_tokens, block_ngrams, block_ngrams_inplace

SETTINGS = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def hf_block(history: np.ndarray, scores: np.ndarray, n: int) -> np.ndarray:
    proc = NoRepeatNGramLogitsProcessor(n)
    out = proc(torch.from_numpy(history.astype(np.int64)), torch.from_numpy(scores.copy()))
    return out.numpy()


@st.composite
def cases(draw, max_rows=8, max_len=60):
    """History with many repeats (small alphabet, planted copies) plus scores."""
    n = draw(st.integers(1, 5))
    rows = draw(st.integers(1, max_rows))
    cur_len = draw(st.integers(0, max_len))
    alphabet = draw(st.integers(1, 8))
    # may be smaller than the alphabet (out-of-vocab ids are ignored) or much larger
    vocab = draw(st.one_of(st.integers(1, 12), st.sampled_from([100, 1000])))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    history = rng.integers(0, alphabet, size=(rows, cur_len), dtype=np.int64)
    # Plant repeats: copy an earlier segment to the end of some rows so that the
    # suffix has at least one earlier match even with a larger alphabet.
    for r in range(rows):
        if cur_len >= 2 and rng.random() < 0.6:
            seg = int(rng.integers(1, min(n + 2, cur_len) + 1))
            if cur_len - seg > 0:
                src = int(rng.integers(0, cur_len - seg + 1))
                history[r, cur_len - seg :] = history[r, src : src + seg].copy()
    dtype = draw(st.sampled_from([np.float32, np.float16]))
    scores = rng.standard_normal((rows, vocab)).astype(dtype)
    return history, scores, n


@SETTINGS
@given(cases())
def test_reference_matches_hf(case):
    history, scores, n = case
    expected = hf_block(history, scores, n)
    got = block_ngrams(history, scores, n)
    assert got.dtype == scores.dtype
    np.testing.assert_array_equal(got, expected)


@SETTINGS
@given(cases())
def test_vectorized_matches_hf(case):
    history, scores, n = case
    expected = hf_block(history, scores, n)
    buf = scores.copy()
    got = block_ngrams_inplace(history, buf, n)
    assert got is buf and got.dtype == scores.dtype
    np.testing.assert_array_equal(got, expected)
    # int32 histories give the same result
    buf32 = scores.copy()
    np.testing.assert_array_equal(block_ngrams_inplace(history.astype(np.int32), buf32, n), expected)


@settings(max_examples=30, deadline=None)
@given(cases(max_rows=4, max_len=400))
def test_vectorized_matches_hf_long(case):
    history, scores, n = case
    np.testing.assert_array_equal(block_ngrams_inplace(history, scores.copy(), n), hf_block(history, scores, n))


def test_hand_example():
    # bigrams: (1,2) (2,3) (3,1) (1,2); suffix (2,) -> its earlier successors are 3
    h = np.array([[1, 2, 3, 1, 2]])
    assert banned_tokens(h, 2) == [{3}]
    # trigrams: suffix (1, 2) occurred at 0 followed by 3
    assert banned_tokens(h, 3) == [{3}]
    # 4-grams: suffix (3, 1, 2) never occurred before
    assert banned_tokens(h, 4) == [set()]
    # unigrams: every seen token
    assert banned_tokens(h, 1) == [{1, 2, 3}]
    scores = np.zeros((1, 5), np.float32)
    out = block_ngrams(h, scores, 2)
    assert out[0].tolist() == [0, 0, 0, -np.inf, 0]
    assert (scores == 0).all(), "input must not be modified without inplace=True"
    block_ngrams(h, scores, 2, inplace=True)
    assert scores[0, 3] == -np.inf


def test_short_history_untouched():
    # cur_len < n: nothing banned even though the tokens repeat
    h = np.array([[4, 4]])
    assert banned_tokens(h, 3) == [set()]
    s = np.ones((1, 6), np.float16)
    np.testing.assert_array_equal(block_ngrams_inplace(h, s.copy(), 3), s)
    # cur_len == n: a single complete window, it can only match the suffix if it
    # repeats itself, e.g. n=2 with history [4, 4]: suffix (4,) matches window (4, 4)
    assert banned_tokens(h, 2) == [{4}]


def test_out_of_vocab_and_negative_ids_are_ignored():
    h = np.array([[7, -1, 7, -1, 7]])
    # n=2: suffix (7,) -> successors of earlier 7s: -1, -1
    assert banned_tokens(h, 2) == [{-1}]
    s = np.zeros((1, 4), np.float32)
    np.testing.assert_array_equal(block_ngrams(h, s, 2), s)
    np.testing.assert_array_equal(block_ngrams_inplace(h, s.copy(), 2), s)
    # n=1 bans 7 and -1, both outside [0, 4)
    np.testing.assert_array_equal(block_ngrams_inplace(h, s.copy(), 1), s)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_invalid_n(bad):
    h = np.zeros((1, 3), np.int64)
    with pytest.raises(ValueError):
        banned_tokens(h, bad)
    with pytest.raises(ValueError):
        block_ngrams_inplace(h, np.zeros((1, 3), np.float32), bad)


def test_shape_and_dtype_errors():
    h = np.zeros((2, 3), np.int64)
    with pytest.raises(ValueError):
        block_ngrams_inplace(h, np.zeros((3, 5), np.float32), 2)
    with pytest.raises(TypeError):
        block_ngrams_inplace(h, np.zeros((2, 5), np.int32), 2)
    with pytest.raises(ValueError):
        block_ngrams_inplace(np.zeros(3, np.int64), np.zeros((1, 5), np.float32), 2)
