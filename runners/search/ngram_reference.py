"""CPU reference for n-gram repeat blocking ("no_repeat_ngram_size").

Definition (identical to transformers' ``NoRepeatNGramLogitsProcessor``)
-----------------------------------------------------------------------
Input: a token history ``h`` of shape ``[rows, L]`` (every row has the same
length ``L`` = ``cur_len``), next-token scores of shape ``[rows, vocab]`` and
an n-gram size ``n >= 1``.

For one row, the next token would complete the n-gram whose first ``n - 1``
tokens are the current suffix ``p = h[L-n+1 : L]``.  Every window
``h[s : s+n]`` with ``0 <= s <= L - n`` whose first ``n - 1`` tokens equal
``p`` has already produced that n-gram once, so its last token ``h[s+n-1]`` is
banned: its score becomes ``-inf``.  Consequences:

* ``L < n``: there is no complete n-gram yet, nothing is banned (HF tests
  ``cur_len < ngram_size``; older HF versions tested ``cur_len + 1 <
  ngram_size`` and then found no n-gram in a history of ``n - 1`` tokens, so
  both give the same result).
* ``n == 1``: the suffix is empty and matches every window, so every token seen
  in the row is banned.
* The window starting at the suffix itself (``s = L - n + 1``) would need the
  future token, so it is never considered.
* Banned ids outside ``[0, vocab)`` are ignored (HF sends ids ``>= vocab`` to a
  spare column; negative ids are not valid token ids and HF would fail on
  them, here they are ignored as well).

This is Algorithm 1 of the FastSeq paper (Yan et al., 2021, section 4.2): one
thread per window compares the window with the suffix and bans the window's
last token on a match.  The CUDA kernel in ``plugins_cuda/`` implements the
same definition and is tested against this module.

Three entry points:

``banned_tokens(history, n)``
    Plain Python loops, obviously correct; returns one ``set`` per row.
``block_ngrams(history, scores, n, inplace=False)``
    Applies ``banned_tokens``; returns a new array unless ``inplace``.
``block_ngrams_inplace(history, scores, n)``
    Vectorized numpy version for a host beam-search loop: the only Python loop
    is over the ``n - 1`` positions inside a window, each comparing all windows
    of all rows at once.
"""

from __future__ import annotations

import numpy as np

__all__ = ["banned_tokens", "block_ngrams", "block_ngrams_inplace"]


def _check_n(n) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"ngram size must be an integer >= 1, got {n!r}")
    return int(n)


def _check_history(history) -> np.ndarray:
    history = np.asarray(history)
    if history.ndim != 2:
        raise ValueError(f"history must have shape [rows, cur_len], got {history.shape}")
    if history.size and not np.issubdtype(history.dtype, np.integer):
        raise TypeError(f"history must hold integer token ids, got {history.dtype}")
    return history


def _check_scores(history: np.ndarray, scores) -> np.ndarray:
    if not isinstance(scores, np.ndarray):
        raise TypeError("scores must be a numpy array")
    if scores.ndim != 2:
        raise ValueError(f"scores must have shape [rows, vocab], got {scores.shape}")
    if not np.issubdtype(scores.dtype, np.floating):
        raise TypeError(f"scores must be floating point, got {scores.dtype}")
    if scores.shape[0] != history.shape[0]:
        raise ValueError(
            f"history has {history.shape[0]} rows but scores has {scores.shape[0]}"
        )
    return scores


def banned_tokens(history, n: int) -> list[set[int]]:
    """Tokens banned for the next step of each row (plain Python reference)."""
    n = _check_n(n)
    history = _check_history(history)
    rows, cur_len = history.shape
    result: list[set[int]] = []
    for r in range(rows):
        tokens = [int(t) for t in history[r]]
        banned: set[int] = set()
        if cur_len >= n:
            suffix = tokens[cur_len - n + 1 :]
            for start in range(cur_len - n + 1):
                if tokens[start : start + n - 1] == suffix:
                    banned.add(tokens[start + n - 1])
        result.append(banned)
    return result


def block_ngrams(history, scores: np.ndarray, n: int, *, inplace: bool = False) -> np.ndarray:
    """Scores with banned entries set to -inf (reference implementation).

    Returns a copy (same dtype) unless ``inplace`` is true, in which case
    ``scores`` itself is modified and returned.
    """
    history = _check_history(history)
    scores = _check_scores(history, scores)
    out = scores if inplace else scores.copy()
    vocab = out.shape[1]
    for r, banned in enumerate(banned_tokens(history, n)):
        for tok in banned:
            if 0 <= tok < vocab:
                out[r, tok] = -np.inf
    return out


def block_ngrams_inplace(history, scores: np.ndarray, n: int) -> np.ndarray:
    """Vectorized n-gram blocking; modifies ``scores`` in place and returns it.

    Cost: ``n - 1`` element-wise comparisons of a ``[rows, cur_len - n + 1]``
    slice of the history, one fancy-index assignment.  No Python loop over
    rows or positions.
    """
    n = _check_n(n)
    history = _check_history(history)
    scores = _check_scores(history, scores)
    rows, cur_len = history.shape
    if cur_len < n or rows == 0:
        return scores
    num_windows = cur_len - n + 1
    # Window s is history[:, s:s+n]; its i-th token over all windows is the
    # contiguous slice history[:, i:i+num_windows].
    next_tok = history[:, n - 1 : n - 1 + num_windows]
    if n == 1:
        row_idx = np.repeat(np.arange(rows), num_windows)
        tok = next_tok.reshape(-1)
    else:
        suffix_start = cur_len - n + 1
        match = history[:, 0:num_windows] == history[:, suffix_start : suffix_start + 1]
        for i in range(1, n - 1):
            match &= history[:, i : i + num_windows] == history[:, suffix_start + i : suffix_start + i + 1]
        row_idx, win_idx = np.nonzero(match)
        tok = next_tok[row_idx, win_idx]
    vocab = scores.shape[1]
    keep = (tok >= 0) & (tok < vocab)
    if not keep.all():
        row_idx, tok = row_idx[keep], tok[keep]
    scores[row_idx, tok] = -np.inf
    return scores
