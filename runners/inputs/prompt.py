"""The prompt of a decoder-only model: HF's position ids and attention masks, and the prefill's outputs.

A decoder-only model reads its prompt as the first part of its own sequence.  HF ``generate``
(transformers 5.23: ``_prepare_position_ids_for_generation``, ``_update_model_kwargs_for_generation``)
feeds it, for a left-padded prompt ``x`` [B, P] with attention mask ``m`` [B, P]:

* prompt token j at position ``pos[b, j] = cumsum(m[b])[j] - 1`` where ``m[b, j] = 1``, and 0 where
  ``m[b, j] = 0`` (padding; its keys are masked anyway);
* generated token g (0-based) at position ``pos[b, P-1] + 1 + g``: the last prompt position plus one
  (for a left-padded prompt that is the number of real prompt tokens, plus g);
* an attention mask over everything seen so far: ``m`` for the prompt, then ones.

Both depend only on the item (every beam of an item has the same prompt), so ``Prompt`` keeps them
at batch B and expands them to the search's rows (row r belongs to item ``r // (rows / B)``).

When the manifest runs the prompt through a stage at batch B (the ``prefill`` graph), that stage
also gives the first step's scores and, for exports whose cache holds the prompt per beam, the
cache's initial contents.  ``Prompt`` carries them until the first step consumes them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


def prompt_positions(mask: np.ndarray) -> np.ndarray:
    """HF's position ids of the prompt tokens: ``cumsum(mask) - 1``, 0 at masked positions. [B, P] int64."""
    mask = np.asarray(mask, dtype=np.int64)
    return np.where(mask == 1, np.cumsum(mask, axis=1) - 1, 0).astype(np.int64)


def sequence_positions(mask: np.ndarray, length: int) -> np.ndarray:
    """HF's position ids of a whole sequence of ``length`` tokens whose first ``P`` are the prompt. [B, length]"""
    prompt = prompt_positions(mask)
    width = prompt.shape[1]
    generated = prompt[:, -1:] + 1 + np.arange(max(length - width, 0), dtype=np.int64)[None, :]
    return np.concatenate([prompt, generated], axis=1)[:, :length]


@dataclass
class Prompt:
    """Per item: the prompt's mask and positions (host), and the prefill's outputs until the first step."""

    mask: np.ndarray  # [B, P] int64, the user's attention mask
    positions: np.ndarray  # [B, P] int64, HF's prompt position ids
    scores: np.ndarray | None = None  # [B, vocab] host: the first step's scores (the prefill's last position)
    initial: dict = field(default_factory=dict)  # cache input name → device value [B, ...] (per-beam prompt cache)

    @classmethod
    def from_mask(cls, mask: np.ndarray) -> "Prompt":
        mask = np.ascontiguousarray(mask, dtype=np.int64)
        return cls(mask, prompt_positions(mask))

    @property
    def width(self) -> int:
        return int(self.mask.shape[1])

    @property
    def batch(self) -> int:
        return int(self.mask.shape[0])

    def items_of_rows(self, rows: int) -> np.ndarray:
        """Item index of each of ``rows`` rows (the beams of an item are consecutive rows)."""
        return np.repeat(np.arange(self.batch, dtype=np.int64), rows // self.batch)

    def step_positions(self, rows: int, start: int, count: int) -> np.ndarray:
        """Position ids [rows, count] of the tokens at sequence indices ``start .. start + count - 1``."""
        full = sequence_positions(self.mask, start + count)[:, start:]
        return np.ascontiguousarray(full[self.items_of_rows(rows)])

    def step_mask(self, rows: int, length: int) -> np.ndarray:
        """The attention mask [rows, length] over the first ``length`` sequence indices: prompt mask, then ones."""
        width = min(length, self.width)
        out = np.ones((self.batch, length), dtype=np.int64)
        out[:, :width] = self.mask[:, :width]
        return np.ascontiguousarray(out[self.items_of_rows(rows)])

    def take(self, items: np.ndarray, take_device) -> "Prompt":
        """Only batch items ``items`` (``take_device(value, items)`` takes rows of a device value)."""
        return Prompt(self.mask[items], self.positions[items],
                      None if self.scores is None else self.scores[items],
                      {k: take_device(v, items) for k, v in self.initial.items()})
