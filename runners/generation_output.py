"""What ``Generator.generate`` returns: HF ``generate``'s output fields, in HF's layout for the family."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from elx.runners.search.settings import GenerationSettings


@dataclass
class GenerationOutput:
    sequences: np.ndarray  # [rows, length] int64 in HF generate's layout for the family
    sequences_scores: np.ndarray | None  # beam search: HF's length-penalized scores per returned row; greedy: None
    text: list | None  # decoded ``sequences`` when the folder has a tokenizer
    raw_sequences: np.ndarray  # [rows, length] with the decoder prompt (the search's own layout)
    settings: GenerationSettings
    steps: int = 0
    memory: list = field(default_factory=list)  # per step {"state_bytes", "cache_bytes", "rows"} (track_memory)
    # return_dict_in_generate with output_scores / output_logits: HF's per-step ``scores`` (processed; beam search:
    # log-probs) and ``logits`` (raw), each a tuple of [rows, vocab] float32, rows = batch · max(beams, sequences)
    scores: tuple | None = None
    logits: tuple | None = None
    beam_indices: np.ndarray | None = None  # beam search with return_dict_in_generate: HF's [rows, generated] int32
    # Whisper's loop (runners/whisper_longform.py): per item, HF's segments (start, end, tokens, idxs)
    segments: list | None = None
