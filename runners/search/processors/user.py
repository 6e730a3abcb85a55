"""The caller's ``logits_processor`` and ``stopping_criteria``: numpy in, numpy out (HF's objects: torch in, out).

A plain callable is called as ``fn(input_ids, scores)`` with numpy arrays (int64 [rows, cur_len], float32
[rows, vocab]) and returns the processed scores (it may modify ``scores`` in place); a stopping criterion
returns one bool per row (or one bool for all).  An object of transformers' own ``LogitsProcessor`` /
``StoppingCriteria`` classes is called with torch tensors of the same arrays, as HF calls it.

HF's merge rule (``GenerationMixin._merge_criteria_processor_list``): a caller's processor of the same class
as one ``generate`` builds replaces it in place; the others follow the built ones, in the caller's order.
"""
from __future__ import annotations

import sys

import numpy as np

from elx.runners.errors import ElxError


def _transformers_class(obj, base: str) -> bool:
    """Whether ``obj`` is an instance of transformers' ``base`` class (only if transformers is already imported)."""
    module = sys.modules.get("transformers")
    cls = getattr(module, base, None) if module is not None else None
    return cls is not None and isinstance(obj, cls)


def _torch():
    import torch

    return torch


class UserProcessor:
    def __init__(self, fn):
        self.fn = fn
        self.hf = type(fn).__name__
        self.torch = _transformers_class(fn, "LogitsProcessor")

    def __call__(self, tokens, scores, items=None):
        if self.torch:
            torch = _torch()
            out = self.fn(torch.from_numpy(np.ascontiguousarray(tokens)), torch.from_numpy(scores)).numpy()
        else:
            out = self.fn(tokens, scores)
        out = np.asarray(out)
        if out.shape != scores.shape:
            raise ElxError(f"logits processor {self.hf} returned an array of shape {list(out.shape)} for scores of "
                           f"shape {list(scores.shape)}; return the processed scores")
        return out if out.dtype == np.float32 else out.astype(np.float32)


def merge_user_processors(built: list, custom) -> list:
    if not custom:
        return built
    custom = [UserProcessor(fn) for fn in custom]
    out = []
    for processor in built:
        same = next((c for c in custom if c.torch and c.hf == processor.hf), None)
        out.append(same if same is not None else processor)
    return out + [c for c in custom if c not in out]


class UserCriterion:
    def __init__(self, fn):
        self.fn = fn
        self.torch = _transformers_class(fn, "StoppingCriteria")

    def __call__(self, sequences: np.ndarray, scores) -> np.ndarray:
        if self.torch:
            torch = _torch()
            step_scores = None if scores is None else tuple(torch.from_numpy(s) for s in scores)
            done = self.fn(torch.from_numpy(np.ascontiguousarray(sequences)), step_scores)
            done = done.numpy() if hasattr(done, "numpy") else done
        else:
            done = self.fn(sequences, scores)
        done = np.asarray(done, dtype=bool)
        if done.ndim == 0:
            return np.full(sequences.shape[0], bool(done))
        if done.shape != (sequences.shape[0],):
            raise ElxError(f"stopping criterion {type(self.fn).__name__} returned shape {list(done.shape)}; return one "
                           f"bool per row ({sequences.shape[0]})")
        return done
