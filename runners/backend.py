"""What a search needs from an execution backend, and the state it hands around.

A backend (ONNX Runtime now, TensorRT later) implements four things: run the once-per-input
stages (``encode``), run one decoder step (``step``), reorder the self-attention cache along the
rows (``reorder``) and drop finished batch items (``select``).  Everything else (log-softmax,
logits processors, beam bookkeeping) lives in the searches and is backend-independent.

Arrays are host numpy arrays in the reference backends; a device backend may hold its own
array type as long as ``nbytes`` and the indexing in ``reorder``/``select`` work on it.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np


_ORT_ITEMSIZE = {"tensor(float)": 4, "tensor(float16)": 2, "tensor(int64)": 8, "tensor(int32)": 4}


def array_nbytes(array) -> int:
    """Bytes of a host array, or of a device ``OrtValue`` (IOBinding backends)."""
    if hasattr(array, "nbytes"):
        return int(array.nbytes)
    return int(np.prod(array.shape())) * _ORT_ITEMSIZE[array.data_type()]


@dataclass
class EncoderState:
    """Per-input state the decoder reads every step, at batch B (shared by the beams of an item).

    ``feeds`` maps decoder input names to arrays; these are the "input-related state" bytes.
    """

    feeds: dict
    batch: int
    extras: dict = field(default_factory=dict)  # stage outputs not fed to the decoder (e.g. for compare)

    def nbytes(self) -> int:
        return sum(array_nbytes(a) for a in self.feeds.values())


@dataclass
class DecoderCache:
    """The self-attention cache: decoder input name → array [rows, ...], reordered with the beams."""

    arrays: dict
    rows: int

    def nbytes(self) -> int:
        return sum(array_nbytes(a) for a in self.arrays.values())

    def length(self, seq_axis: int = 2) -> int:
        first = next(iter(self.arrays.values()), None)
        return 0 if first is None else int(first.shape[seq_axis])


class Backend(ABC):
    manifest = None
    needs_history = False  # the step graph reads the token history (in-graph n-gram blocking)
    returns_log_probs = False  # the step graph already applies log-softmax

    @abstractmethod
    def encode(self, inputs: dict) -> EncoderState:
        """Run the per-input stages on user inputs given by role (input_ids, attention_mask, input_features)."""

    @abstractmethod
    def empty_cache(self, rows: int) -> DecoderCache:
        """An empty self-attention cache for ``rows`` decoder rows."""

    @abstractmethod
    def step(self, input_ids: np.ndarray, state: EncoderState, cache: DecoderCache,
             history: np.ndarray | None = None) -> tuple[np.ndarray, DecoderCache]:
        """One decoder step: tokens [rows, t] → (last-position logits [rows, vocab] float32, new cache).

        ``history`` [rows, cur_len] is the token history, passed when ``needs_history``."""

    def reorder(self, cache: DecoderCache, rows: np.ndarray) -> DecoderCache:
        """Rows of the new cache are rows ``rows`` of the old one (beam reordering)."""
        if rows.shape[0] == cache.rows and np.array_equal(rows, np.arange(cache.rows)):
            return cache
        return DecoderCache({k: np.take(a, rows, axis=0) for k, a in cache.arrays.items()}, int(rows.shape[0]))

    def select(self, state: EncoderState, items: np.ndarray) -> EncoderState:
        """Keep only batch items ``items`` of the per-input state (finished items are dropped)."""
        feeds = {k: np.take(a, items, axis=0) for k, a in state.feeds.items()}
        return EncoderState(feeds, int(items.shape[0]), state.extras)
