"""Teacher-forced logits of a decoder-only export along HF's sequences (``elx compare``).

HF's returned rows hold the left-padded prompt and the generated tokens.  The runner takes the
prompt as its first step (the prefill, copied to the item's rows), then one token per step;
PyTorch runs each whole row at once with HF's mask (the prompt mask, then ones) and position ids
(``runners/inputs/prompt.py``).  Step s compares the scores that chose generated token s: their max abs difference
and whether both sides' highest-scoring token is the same (the top-1 agreement an int8 export records).
"""
from __future__ import annotations

import numpy as np
import torch

from elx.runners.generate import Generator
from elx.runners.inputs.prompt import sequence_positions


def decoder_only_teacher_forced(generator: Generator, model, inputs: dict, sequences: np.ndarray,
                                per_item: int) -> tuple[np.ndarray, np.ndarray, None]:
    """Per (row, generated step) along ``sequences`` [items·per_item, T]: the max abs logits diff and whether the
    top-1 tokens agree; no encoder diff."""
    runner = generator.model.for_run(0)
    state = runner.encode(inputs)
    rows, length = sequences.shape
    width = inputs["input_ids"].shape[1]
    cache = runner.empty_cache(rows)
    logits, cache = runner.step(np.ascontiguousarray(sequences[:, :width]), state, cache)
    ours = [logits]
    for t in range(width, length - 1):
        logits, cache = runner.step(np.ascontiguousarray(sequences[:, t: t + 1]), state, cache)
        ours.append(logits)
    prompt_mask = np.repeat(inputs["attention_mask"], per_item, axis=0)
    mask = np.concatenate([prompt_mask, np.ones((rows, length - width), dtype=np.int64)], axis=1)
    positions = sequence_positions(prompt_mask, length)
    with torch.no_grad():
        ref = model(input_ids=torch.from_numpy(sequences[:, :-1]), attention_mask=torch.from_numpy(mask[:, :-1]),
                    position_ids=torch.from_numpy(positions[:, :-1])).logits[:, width - 1:].numpy()
    diffs = [np.abs(ours[s] - ref[:, s]).max(axis=1) for s in range(len(ours))]
    top1 = [np.argmax(ours[s], axis=1) == np.argmax(ref[:, s], axis=1) for s in range(len(ours))]
    return np.stack(diffs, axis=1), np.stack(top1, axis=1), None
