"""Seeded random encoder inputs of varied lengths (padded, with attention masks), by role.

Token inputs: row 0 has the full length, later rows random lengths in [length/2, length]; padded
positions hold the pad token and a 0 in the mask.  Encoder inputs are right-padded; the prompts
of decoder-only models (manifest ``padding_side: left``) left-padded, as HF ``generate`` wants
them, with HF's pad for models without one (the first EOS id).  Feature inputs (Whisper's
log-mel frames) are standard normal at the graph's fixed shape.  Used by export verification,
``elx compare`` and ``elx bench`` so that all three see the same kind of batch.
"""
from __future__ import annotations

import numpy as np

from elx.runners.manifest import Manifest
from elx.runners.inputs.validation import source_vocab_size


def random_inputs(manifest: Manifest, batch: int, length: int, rng: np.random.Generator) -> dict:
    roles = manifest.encoder_inputs()
    out = {}
    if "input_ids" in roles:
        vocab = source_vocab_size(manifest)  # the encoder's (FSMT: its own source vocabulary)
        pad = manifest.tokens.get("pad_token_id")
        if pad is None:  # HF generate pads with eos_token_id[0] then (GPT-2)
            pad = (manifest.tokens.get("eos_token_id") or [0])[0]
        special = {t for t in [pad, manifest.tokens.get("bos_token_id"), *(manifest.tokens.get("eos_token_id") or [])]
                   if t is not None}
        low = max(special) + 1 if special and max(special) < vocab // 2 else 0
        ids = rng.integers(low, vocab, size=(batch, length), dtype=np.int64)
        lengths = [length] + [int(rng.integers(max(1, length // 2), length + 1)) for _ in range(batch - 1)]
        mask = (np.arange(length)[None, :] < np.asarray(lengths)[:, None]).astype(np.int64)
        if manifest.data.get("padding_side") == "left":
            mask = mask[:, ::-1].copy()
        ids[mask == 0] = pad
        out["input_ids"] = ids
        if "attention_mask" in roles:
            out["attention_mask"] = mask
    for role, spec in roles.items():
        if role not in ("input_ids", "attention_mask"):
            shape = [batch, *spec["shape"][1:]]
            out[role] = rng.standard_normal(shape).astype(np.float32)
    return out
