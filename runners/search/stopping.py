"""Stopping criteria beyond EOS and the maximum length (which the searches check themselves), HF's semantics.

* ``max_time`` (HF's ``MaxTimeCriteria``): every row stops once more than ``max_time`` seconds have passed
  since the search started (HF starts the clock when it builds its criteria, after the encoder); the
  step running then still finishes.
* ``stop_strings`` (HF's ``StopStringCriteria``, ``runners/search/stop_strings.py``).
* the caller's ``stopping_criteria`` (``runners/search/processors/user.py``).

``Stopping(sequences, scores)`` ORs them, as HF's ``StoppingCriteriaList``: one bool per row of
``sequences`` [rows, length] (the greedy rows, or the beam candidates); ``scores``: the per-step scores
recorded so far (``output_scores``), else None, as HF passes them.
"""
from __future__ import annotations

import time

import numpy as np


class MaxTime:
    def __init__(self, seconds: float):
        self.seconds = seconds
        self.start = time.time()

    def __call__(self, sequences: np.ndarray, scores=None) -> np.ndarray:
        return np.full(sequences.shape[0], time.time() - self.start > self.seconds)


class Stopping:
    def __init__(self, criteria: list):
        self.criteria = criteria

    def __call__(self, sequences: np.ndarray, scores=None) -> np.ndarray:
        done = np.zeros(sequences.shape[0], dtype=bool)
        for criterion in self.criteria:
            done |= criterion(sequences, scores)
        return done
