"""Processors that rescale scores: HF's repetition penalties, exponential decay length penalty, invalid-value
removal and renormalization, on numpy arrays in place.

HF computes ``score * penalty`` with a float32 tensor and a Python float: PyTorch rounds the float to
float32 and multiplies in float32, which is numpy's ``score * np.float32(penalty)`` bit for bit (and
likewise for ``/``, checked in ``tests/test_processors.py``).  Renormalization is a log-softmax, with the
search's kernel (``runners/search/log_softmax.py``).
"""
from __future__ import annotations

import numpy as np

from elx.runners.search.log_softmax import log_softmax_function


def _penalize(values: np.ndarray, penalty: np.float32) -> np.ndarray:
    """HF's ``torch.where(score < 0, score * penalty, score / penalty)``."""
    return np.where(values < 0, values * penalty, values / penalty)


class RepetitionPenalty:
    """HF's ``RepetitionPenaltyLogitsProcessor``: every token already in the row is penalized once.

    ``padding``: per item, the left-padding length of a decoder-only prompt (HF passes the attention mask's
    first non-zero index as ``prompt_ignore_length`` when the mask has padding); those positions are not
    counted."""

    hf = "RepetitionPenaltyLogitsProcessor"

    def __init__(self, penalty: float, padding: np.ndarray | None = None):
        self.value = float(penalty)  # the user's number: the device version divides by it as HF does
        self.penalty = np.float32(penalty)
        self.padding = padding

    def __call__(self, tokens, scores, items=None):
        rows = np.broadcast_to(np.arange(tokens.shape[0])[:, None], tokens.shape)
        keep = tokens < scores.shape[1]
        if self.padding is not None:
            items = np.arange(tokens.shape[0]) if items is None else items
            keep = keep & (np.arange(tokens.shape[1])[None, :] >= self.padding[items][:, None])
        rows, columns = rows[keep], tokens[keep]
        scores[rows, columns] = _penalize(scores[rows, columns], self.penalty)
        return scores


class EncoderRepetitionPenalty:
    """HF's ``EncoderRepetitionPenaltyLogitsProcessor``: tokens of the item's encoder input ids (padding
    included, as HF takes them) are favoured: HF stores ``1 / penalty`` and applies it as above."""

    hf = "EncoderRepetitionPenaltyLogitsProcessor"

    def __init__(self, penalty: float, encoder_ids: np.ndarray):
        self.penalty = np.float32(1 / penalty)
        self.encoder_ids = np.asarray(encoder_ids, dtype=np.int64)

    def __call__(self, tokens, scores, items=None):
        items = np.arange(tokens.shape[0]) if items is None else items
        columns = self.encoder_ids[items]
        values = np.take_along_axis(scores, columns, axis=1)
        np.put_along_axis(scores, columns, _penalize(values, self.penalty), axis=1)
        return scores


class ExponentialDecayLengthPenalty:
    """HF's ``ExponentialDecayLengthPenalty``: past ``start`` generated tokens, the EOS scores grow by
    ``|score| * (factor ** (cur_len - start - prompt) - 1)`` (non-finite scores unchanged)."""

    hf = "ExponentialDecayLengthPenalty"

    def __init__(self, start: int, factor: float, eos: list, prompt_len: int):
        self.start = start + prompt_len
        self.factor = factor
        self.eos = np.asarray(eos, dtype=np.int64)

    def __call__(self, tokens, scores, items=None):
        cur_len = tokens.shape[1]
        if cur_len > self.start:
            growth = np.float32(pow(self.factor, cur_len - self.start) - 1)
            values = scores[:, self.eos]
            penalty = np.abs(values) * growth
            penalty[~np.isfinite(values)] = 0.0
            scores[:, self.eos] = values + penalty
        return scores


class RemoveInvalidValues:
    """HF's ``InfNanRemoveLogitsProcessor``: NaN → 0, ±inf → the largest finite float32 of that sign."""

    hf = "InfNanRemoveLogitsProcessor"

    def __call__(self, tokens, scores, items=None):
        info = np.finfo(scores.dtype)
        return np.nan_to_num(scores, copy=False, nan=0.0, posinf=info.max, neginf=info.min)


class Renormalize:
    """HF's ``LogitNormalization`` (``renormalize_logits``): a log-softmax after every other processor."""

    hf = "LogitNormalization"

    def __init__(self):
        self.log_softmax = log_softmax_function()

    def __call__(self, tokens, scores, items=None):
        return self.log_softmax(scores)
