"""Token draws for ``do_sample=True``: HF's calls on PyTorch's generator, or a documented numpy generator.

HF draws once per step over the whole batch (``GenerationMixin._sample``: ``torch.multinomial(softmax(scores),
1)`` on ``[batch·num_return_sequences, vocab]``; ``_beam_search`` with ``do_sample``:
``torch.multinomial(softmax(scores), 2·beams)`` on ``[batch, beams·vocab]``, the draws then sorted by score).
PyTorch's CPU multinomial draws ``Exp(1)`` variables for every cell of the matrix and keeps the largest
``p / q``: what a row gets depends on the matrix's shape, not on other rows' values.

* **With PyTorch** (the host kernel, ``elx.runners.search.log_softmax.torch_module``): elx makes the same calls on a
  matrix of HF's shape, with ``torch.Generator().manual_seed(seed)``, which draws what
  ``torch.manual_seed(seed)`` makes the global generator draw; without a seed, PyTorch's global generator
  itself (so ``torch.manual_seed`` before ``generate`` works as it does for HF).  Rows the search no longer
  runs (finished sequences, finished items) are filled with a uniform distribution, so the rows it does
  run get HF's draws: the tokens are HF's, given HF's seed.
* **Without PyTorch** (or ``ELX_LOG_SOFTMAX=numpy``): numpy's ``Generator(PCG64(seed))`` (seed None: fresh OS
  entropy), the same exponential race (``argmax p / q`` with ``q = standard_exponential`` float32 over HF's
  matrix shape, without replacement: the largest ``p / q``).  Reproducible for a seed, not HF's tokens.
"""
from __future__ import annotations

import numpy as np

from elx.runners.errors import ElxError
from elx.runners.search.log_softmax import numpy_softmax, torch_module


class Sampler:
    """One run's generator; ``total`` is the number of rows (greedy) or items (beam) HF draws for."""

    def __init__(self, seed: int | None, total: int):
        self.total = total
        self.torch = torch_module()
        if self.torch is not None:
            self.generator = None if seed is None else self.torch.Generator().manual_seed(int(seed))
        else:
            self.generator = np.random.Generator(np.random.PCG64(seed))
        self.processors = ()  # the run's processors (the searches set them): a refusal names the caller's culprit

    def check(self, scores: np.ndarray) -> None:
        """Refuse scores nothing can be drawn from (a NaN or +inf, or every score -inf in a row) in one line naming
        the caller's logits processor that returned them, where HF's ``torch.multinomial`` raises a RuntimeError
        ("probability tensor contains either inf, nan or element < 0")."""
        top = scores.max(axis=1)  # a NaN anywhere in a row makes its max NaN
        bad = np.flatnonzero(~np.isfinite(top))
        if not bad.size:
            return
        value = top[bad[0]]
        what = "hold a NaN" if np.isnan(value) else "hold +inf" if value > 0 else "are all -inf (no token is left)"
        culprits = [p.name for p in self.processors if getattr(p, "returned_invalid", False)]
        if culprits:
            source = (f"logits processor {', '.join(culprits)} returned such scores: return finite scores (HF's "
                      "torch.multinomial fails on them too)")
        else:
            source = ("nothing can be sampled (HF's torch.multinomial fails too): check the model's logits and the "
                      "options that ban tokens (bad_words_ids, suppress_tokens, ...)")
        raise ElxError(f"do_sample=True: row {int(bad[0])}'s scores {what}, which cannot be sampled from; {source}")

    def _full(self, probs, active: np.ndarray):
        """``probs`` of the active rows inside HF's full matrix (uniform rows elsewhere)."""
        if active.size == self.total:
            return probs
        if self.torch is not None:
            full = self.torch.ones((self.total, probs.shape[1]), dtype=probs.dtype)
            full[self.torch.from_numpy(active)] = probs
            return full
        full = np.ones((self.total, probs.shape[1]), dtype=probs.dtype)
        full[active] = probs
        return full

    def tokens(self, scores: np.ndarray, active: np.ndarray) -> np.ndarray:
        """One token per active row from ``softmax(scores)`` (HF's ``_sample``); ``active``: the rows' indices
        among HF's ``total`` rows."""
        self.check(scores)
        torch = self.torch
        if torch is not None:
            probs = torch.nn.functional.softmax(torch.from_numpy(scores), dim=-1)
            drawn = torch.multinomial(self._full(probs, active), num_samples=1, generator=self.generator)
            return drawn.squeeze(1).numpy()[active if active.size < self.total else slice(None)]
        ratio = self._race(numpy_softmax(scores), active)
        return ratio.argmax(axis=1)

    def candidates(self, scores: np.ndarray, active: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
        """``count`` continuations per active item drawn without replacement from ``softmax(scores)`` [n, beams·vocab],
        sorted by score, best first: (scores, flat indices) as HF's ``_get_top_k_continuations`` returns them."""
        self.check(scores)
        torch = self.torch
        if torch is not None:
            accumulated = torch.from_numpy(scores)
            probs = torch.nn.functional.softmax(accumulated, dim=-1)
            drawn = torch.multinomial(self._full(probs, active), num_samples=count, generator=self.generator)
            if active.size < self.total:
                drawn = drawn[torch.from_numpy(active)]
            picked = torch.gather(accumulated, 1, drawn)
            picked, order = picked.sort(dim=-1, descending=True)
            return picked.numpy(), drawn.gather(-1, order).numpy()
        ratio = self._race(numpy_softmax(scores), active)
        drawn = np.argsort(-ratio, axis=1, kind="stable")[:, :count]
        picked = np.take_along_axis(scores, drawn, axis=1)
        order = np.argsort(-picked, axis=1, kind="stable")
        return np.take_along_axis(picked, order, axis=1), np.take_along_axis(drawn, order, axis=1)

    def _race(self, probs: np.ndarray, active: np.ndarray) -> np.ndarray:
        """numpy: ``p / q`` with ``q ~ Exp(1)`` drawn over HF's whole matrix, at the active rows."""
        q = self.generator.standard_exponential((self.total, probs.shape[1]), dtype=np.float32)
        return probs / q[active]
