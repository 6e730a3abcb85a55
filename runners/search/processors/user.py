"""The caller's ``logits_processor`` and ``stopping_criteria``: numpy in, numpy out (HF's objects: torch in, out).

A plain callable is called as ``fn(input_ids, scores)`` with numpy arrays (int64 [rows, cur_len], float32
[rows, vocab]) and returns the processed scores (it may modify ``scores`` in place; NaN is refused, -inf bans a
token); a stopping criterion returns one bool per row (or one bool for all; lists and numpy bools count, as numpy
reads them).  What else they return is refused in one line naming the callable, where HF raises from deep inside
its search.  An object of transformers' own ``LogitsProcessor`` / ``StoppingCriteria`` classes is called with
torch tensors of the same arrays, as HF calls it.

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
        # whether the last call returned scores nothing can be sampled from (+inf, or a row of -inf): HF's greedy and
        # beam search run on them, its sampling fails in torch.multinomial (runners/search/sampling.py names this
        # processor then).  NaN is refused at once, in every mode.
        self.returned_invalid = False

    @property
    def name(self) -> str:
        return getattr(self.fn, "__name__", None) or self.hf

    def __call__(self, tokens, scores, items=None):
        if self.torch:
            torch = _torch()
            out = self.fn(torch.from_numpy(np.ascontiguousarray(tokens)), torch.from_numpy(scores))
            out = out.numpy() if hasattr(out, "numpy") else out
        else:
            out = self.fn(tokens, scores)
        if out is None or isinstance(out, (str, bytes, dict)):
            raise ElxError(f"logits processor {self.name} returned {_shown(out)}; return the processed scores (an "
                           f"array of shape {list(scores.shape)})")
        try:
            out = np.asarray(out)
        except (TypeError, ValueError):
            raise ElxError(f"logits processor {self.name} returned {_shown(out)}, not an array of scores; return the "
                           f"processed scores (shape {list(scores.shape)})")
        if out.shape != scores.shape:
            raise ElxError(f"logits processor {self.name} returned an array of shape {list(out.shape)} for scores of "
                           f"shape {list(scores.shape)}; return the processed scores")
        if out.dtype.kind not in "fiu":
            raise ElxError(f"logits processor {self.name} returned an array of {out.dtype}; return the processed "
                           "scores (floats)")
        out = out if out.dtype == np.float32 else out.astype(np.float32)
        if out.size:
            top = out.max(axis=1)  # NaN anywhere in a row makes its max NaN
            nan = np.flatnonzero(np.isnan(top))
            if nan.size:  # HF's argmax / topk / multinomial would each do their own thing with it
                raise ElxError(f"logits processor {self.name} returned NaN scores (row {int(nan[0])}); return numbers "
                               "(-inf bans a token)")
            self.returned_invalid = bool((~np.isfinite(top)).any())
        return out


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
        return stop_flags(done, sequences.shape[0], getattr(self.fn, "__name__", None) or type(self.fn).__name__)


def stop_flags(done, rows: int, name: str) -> np.ndarray:
    """A stopping criterion's answer as one bool per row: a bool (Python or numpy), or an array or list of bools of
    one value or one per row.  Anything else is refused in one line naming the criterion, where HF raises from
    ``is_done | criterion(...)`` (None, strings, floats) or reads integers its own way (its beam search takes a uint8
    answer as a mask and stops every beam; 2 keeps a row running)."""
    fix = f"return a bool, or one bool per row ({rows})"
    if done is None or isinstance(done, (str, bytes, dict, set)):
        raise ElxError(f"stopping criterion {name} returned {_shown(done)}; {fix}")
    try:
        array = np.asarray(done)
    except (TypeError, ValueError):
        raise ElxError(f"stopping criterion {name} returned {_shown(done)}; {fix}")
    if array.dtype.kind != "b":  # HF's beam search reads 0/1 integers otherwise than bools (uint8: as a mask)
        raise ElxError(f"stopping criterion {name} returned {_shown(done)} ({array.dtype}, not bools); {fix}")
    if array.ndim == 0 or array.shape == (1,) and rows != 1:
        return np.full(rows, bool(array.reshape(-1)[0]))
    if array.shape != (rows,):
        raise ElxError(f"stopping criterion {name} returned shape {list(array.shape)}; {fix}")
    return array.astype(bool)


def _shown(value) -> str:
    if value is None:
        return "None"
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"
