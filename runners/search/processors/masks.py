"""Processors that only ban or force tokens (scores set to -inf, or everything but the forced token).

Each is HF's processor of the same job (``transformers/generation/logits_process.py``), on numpy arrays
in place: ``(tokens [rows, cur_len] int64, scores [rows, vocab] float32, items [rows] | None) -> scores``.
``items`` is the batch item of each row (``runners/search/processors/__init__.py``); only processors with
per-item data read it.  Setting -inf needs no floating-point kernel, so these are exact without PyTorch.
"""
from __future__ import annotations

import numpy as np

from elx.runners.errors import ElxError
from elx.runners.search.ngram_reference import block_ngrams_inplace

NEG_INF = np.float32(-np.inf)


class NoRepeatNGram:
    """HF's ``NoRepeatNGramLogitsProcessor``: no n-gram of the row's own tokens occurs twice."""

    hf = "NoRepeatNGramLogitsProcessor"

    def __init__(self, n: int):
        self.n = n

    def __call__(self, tokens, scores, items=None):
        return block_ngrams_inplace(tokens, scores, self.n)


class EncoderNoRepeatNGram:
    """HF's ``EncoderNoRepeatNGramLogitsProcessor``: no n-gram of the item's encoder input ids is generated.

    HF takes the n-grams of ``input_ids`` as given, padding included (the encoder's input of an
    encoder-decoder model, the left-padded prompt of a decoder-only model), and bans the last token of
    every such n-gram whose first n - 1 tokens end the row."""

    hf = "EncoderNoRepeatNGramLogitsProcessor"

    def __init__(self, n: int, encoder_ids: np.ndarray):
        self.n = n
        self.table = []  # per item: first n - 1 tokens → the tokens that followed them
        for row in np.asarray(encoder_ids).tolist():
            following: dict = {}
            for start in range(len(row) - n + 1):
                following.setdefault(tuple(row[start:start + n - 1]), []).append(row[start + n - 1])
            self.table.append(following)

    def __call__(self, tokens, scores, items=None):
        cur_len = tokens.shape[1]
        if cur_len < self.n - 1:  # the suffix is shorter than an n-gram's head: nothing matches
            return scores
        items = np.arange(tokens.shape[0]) if items is None else items
        suffixes = tokens[:, cur_len - self.n + 1:].tolist()
        vocab = scores.shape[1]
        for row, (item, suffix) in enumerate(zip(items.tolist(), suffixes)):
            banned = [t for t in self.table[item].get(tuple(suffix), ()) if t < vocab]
            if banned:
                scores[row, banned] = NEG_INF
        return scores


class BanUntilLength:
    """MinLength (``cur_len < min_length``) and MinNewTokens (``cur_len - prompt < min_new``): ban EOS."""

    hf = "MinLengthLogitsProcessor"

    def __init__(self, eos: list, min_total_length: int):
        self.eos = np.asarray(eos, dtype=np.int64)
        self.min_total_length = min_total_length

    def __call__(self, tokens, scores, items=None):
        if tokens.shape[1] < self.min_total_length:
            scores[:, self.eos[self.eos < scores.shape[1]]] = NEG_INF
        return scores


class ForceTokenAt:
    """ForcedBOS (at cur_len == 1) and ForcedEOS (at cur_len == max_length - 1): only ``tokens`` stay."""

    hf = "ForcedBOSTokenLogitsProcessor"

    def __init__(self, token, at_length: int):
        self.tokens = np.asarray(token if isinstance(token, (list, tuple)) else [token], dtype=np.int64)
        self.at_length = at_length

    def __call__(self, tokens, scores, items=None):
        if tokens.shape[1] == self.at_length:
            scores[:] = NEG_INF
            scores[:, self.tokens] = 0.0
        return scores


class Suppress:
    """SuppressTokens (always, ``at_length=None``) and SuppressTokensAtBegin (at cur_len == begin index)."""

    hf = "SuppressTokensLogitsProcessor"

    def __init__(self, token_ids, at_length: int | None = None):
        self.ids = np.asarray(sorted(set(int(t) for t in token_ids)), dtype=np.int64)
        self.at_length = at_length

    def __call__(self, tokens, scores, items=None):
        if self.at_length is None or tokens.shape[1] == self.at_length:
            scores[:, self.ids[self.ids < scores.shape[1]]] = NEG_INF
        return scores


class PrefixConstrained:
    """HF's ``PrefixConstrainedLogitsProcessor``: only the tokens ``fn(item, row_tokens)`` allows.

    HF groups the rows ``group`` at a time (``max(num_beams, num_return_sequences)``, the rows of one input)
    and, where every row of a group would be left with nothing, allows the listed tokens at score 0.
    ``fn`` gets the item index and the row's tokens (an int64 numpy array) and returns token ids (a list, tuple or
    integer array); anything else (None, a string, a number, floats, bools, ids outside the vocabulary) is refused
    in one line naming the function (``allowed_ids``), where HF raises a TypeError / IndexError from its indexing
    or, for floats and negative ids, silently uses other tokens."""

    hf = "PrefixConstrainedLogitsProcessor"

    def __init__(self, fn, group: int):
        self.fn, self.group = fn, group

    def __call__(self, tokens, scores, items=None):
        rows, vocab = scores.shape
        mask = np.full((rows, vocab), NEG_INF, dtype=scores.dtype)
        for row in range(rows):
            mask[row, allowed_ids(self.fn(row // self.group, tokens[row]), vocab, row // self.group)] = 0.0
        processed = scores + mask
        unsatisfiable = np.isneginf(processed.max(axis=1)).reshape(-1, self.group).all(axis=1)
        rows_of = np.repeat(unsatisfiable, self.group)
        processed[rows_of] = mask[rows_of]
        scores[...] = processed
        return scores


def allowed_ids(value, vocab: int, item: int) -> np.ndarray:
    """What ``prefix_allowed_tokens_fn`` returned for batch item ``item``, as int64 token ids; an ``ElxError`` naming
    the function for anything that is not a non-empty sequence of ids in ``0 .. vocab - 1`` (nested lists are
    flattened, as HF's indexing reads them)."""
    def refuse(what: str, fix: str = "return a list of token ids (ints)"):
        raise ElxError(f"prefix_allowed_tokens_fn returned {what} for batch item {item}; {fix}")

    if value is None or isinstance(value, (str, bytes, dict, set, frozenset)) or not hasattr(value, "__len__"):
        refuse(_shown(value))
    if len(value) == 0:
        refuse("no token", "the constraint cannot be satisfied; fix the function")
    try:
        array = np.asarray(value)
    except (TypeError, ValueError):  # ragged nested lists
        refuse(f"{_shown(value)}, not a flat sequence of ids")
    if array.dtype.kind not in "iu":
        kinds = {"f": "floats", "b": "bools", "c": "complex numbers"}
        refuse(f"{_shown(value)} ({kinds.get(array.dtype.kind, f'values of type {array.dtype}')}, not token ids)",
               "token ids are ints: return ints (floats are not rounded or truncated)")
    array = array.reshape(-1).astype(np.int64, copy=False)
    if array.size == 0:  # nested empty lists
        refuse("no token", "the constraint cannot be satisfied; fix the function")
    outside = array[(array < 0) | (array >= vocab)]
    if outside.size:
        refuse(f"token id {int(outside[0])}, outside the vocabulary (0 to {vocab - 1})", "return ids of this model")
    return array


def _shown(value) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}" if value is not None else "None"
