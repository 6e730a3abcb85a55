"""What a search does beyond HF's plain greedy / beam loop, decided once per run (``runners/hooks.py`` builds it).

Every field's default is "off", and an off field costs the searches nothing per step: the default beam
search runs exactly the loop it ran before these options existed.

* ``sampler``: ``do_sample`` (``runners/search/sampling.py``) instead of argmax / top-k.
* ``stopping``: stopping criteria beyond EOS and the maximum length (``runners/search/stopping.py``): ``max_time``,
  ``stop_strings``, the caller's ``stopping_criteria``; called on the rows' sequences, as HF's
  ``StoppingCriteriaList``.
* ``record_scores`` / ``record_logits`` / ``beam_indices``: HF's ``output_scores``, ``output_logits`` and
  ``beam_indices`` of ``return_dict_in_generate``.
* ``streamer``: HF's streamer protocol (``put`` the prompt, then each step's tokens; ``end``).
* ``keep_rows``: never drop finished rows (greedy) or items (beam search) from the decoder's batch.  HF keeps
  computing them; elx drops them where nothing returned depends on them.  Per-step scores and logits
  include them, and the caller's processors and criteria may look at every row, so those runs keep them.
* ``repeats``: greedy sampling with ``num_return_sequences = r``: each input runs as r rows (HF expands
  the batch by ``max(num_beams, num_return_sequences)``).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SearchHooks:
    sampler: object | None = None
    stopping: object | None = None
    record_scores: bool = False
    record_logits: bool = False
    beam_indices: bool = False
    streamer: object | None = None
    keep_rows: bool = False
    repeats: int = 1


NO_HOOKS = SearchHooks()
