"""The shapes the verification runs: (batch, beams, source length, past length, step length) per case.

A module of its own so that config checks (``exporter/families/rope.py``: a sliding window must cover the longest
verified sequence) can read them without importing the verification.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    batch: int
    beams: int
    source: int
    past: int
    step: int = 1

    def as_dict(self) -> dict:
        return dict(batch=self.batch, beams=self.beams, source=self.source, past=self.past, step=self.step)


SHAPES = (Shape(1, 1, 5, 0), Shape(2, 3, 9, 4), Shape(3, 2, 6, 0, 2), Shape(2, 4, 11, 7))
# decoder-only step graphs take one token per row; ``source`` is the prompt width, ``past`` the generated tokens
DECODER_ONLY_SHAPES = (Shape(1, 1, 5, 0), Shape(2, 3, 9, 4), Shape(3, 2, 6, 1), Shape(2, 4, 11, 7), Shape(4, 1, 8, 3))
