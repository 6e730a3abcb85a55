"""The PyTorch side of the fp16 checks for decoder-only exports (GPT-2, OPT, the RoPE families).

The fp16 checks (``exporter/precision/fp16_export.py``) let each side fill its own cache from a prefix: an fp16
export's cache holds fp16 values, so the fp32 check's random past cannot be fed to both.  For a decoder-only
export the runtime side (``exporter/verification/verify.py``'s ``RuntimeSide`` with ``prefill``) runs the left-padded
prompt (prefill, copied per beam), then the case's prefix tokens one step each, then the case's token.
``DecoderOnlyPrefixTorchSide`` computes the same two scores in HF's own PyTorch forward, the whole row at
once: the prompt repeated per beam, the prefix and the token, with HF's mask (the prompt's, then ones)
and position ids (``runners/inputs/prompt.py``); the scores of the last position (the token's step) and of the
prompt's last position (the first step's), stacked as ``RuntimeSide`` stacks them.
"""
from __future__ import annotations

import numpy as np

from elx.runners.manifest import Manifest
from elx.runners.inputs.prompt import sequence_positions


class DecoderOnlyPrefixTorchSide:
    """HF's forward of a decoder-only model along [prompt ; prefix ; token] per row (see the module doc)."""

    def __init__(self, model, manifest: Manifest):
        self.model = model

    def run(self, case, past: dict) -> tuple[np.ndarray, None]:
        import torch

        beams = case.shape.beams
        ids = np.repeat(case.inputs["input_ids"], beams, axis=0)
        prompt_mask = np.repeat(case.inputs["attention_mask"], beams, axis=0)
        width = ids.shape[1]
        sequence = np.concatenate([ids, case.prefix, case.tokens], axis=1)
        length = sequence.shape[1]
        mask = np.concatenate([prompt_mask, np.ones((case.rows, length - width), dtype=np.int64)], axis=1)
        positions = sequence_positions(prompt_mask, length)
        with torch.no_grad():
            logits = self.model(input_ids=torch.from_numpy(sequence), attention_mask=torch.from_numpy(mask),
                                position_ids=torch.from_numpy(positions)).logits
        return np.concatenate([logits[:, -1, :].numpy(), logits[:, width - 1, :].numpy()]), None


def torch_side(model, manifest: Manifest):
    """The fp16 checks' PyTorch side: the encoder-decoder one (``verify.TorchSide`` with ``prefill``) or the
    decoder-only one above."""
    from elx.exporter.verification.verify import TorchSide

    if manifest.data.get("is_encoder_decoder", True):
        return TorchSide(model, manifest, prefill=True)
    return DecoderOnlyPrefixTorchSide(model, manifest)
