"""Numerical checks: exported graphs against PyTorch, and rewritten graphs against the originals.

Both run the runner's own backend (so the manifest contract is checked along with the graphs) on
seeded random inputs at several (batch, beam, source length, past length, step length) shapes,
with padded sources and non-empty random self-attention pasts, and report the max abs
difference of the step logits.  The tolerance is fixed at 1e-4 (fp32) and never loosened.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from transformers.cache_utils import DynamicCache, EncoderDecoderCache

from runners.backend import DecoderCache
from runners.inputs import random_inputs
from runners.manifest import Manifest
from runners.ort_backend import OrtBackend

from runners.errors import ElxError

TOLERANCE = 1e-4


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


def _random_step(manifest: Manifest, shape: Shape, rng) -> tuple[np.ndarray, dict]:
    rows = shape.batch * shape.beams
    tokens = rng.integers(3, manifest.dims["vocab_size"], size=(rows, shape.step), dtype=np.int64)
    past = {}
    for entry in manifest.cache_entries:
        dims = [rows if d == "rows" else (shape.past if i == entry["seq_axis"] else d)
                for i, d in enumerate(entry["shape"])]
        past[entry["input"]] = rng.standard_normal(dims).astype(np.float32)
    return tokens, past


def compare_backends(a: OrtBackend, b: OrtBackend, shapes=SHAPES, seed: int = 0, past_from=None) -> dict:
    """Run two backends on identical inputs; max abs logits diff over ``shapes``.

    ``past_from(entries_a, past_a) -> past_b`` maps a random past for ``a`` to ``b``'s cache layout
    (a pass that changes the cache, like ``slim``, supplies it); by default the layouts match.
    """
    worst, per_shape = 0.0, []
    for shape in shapes:
        rng = np.random.default_rng(seed)
        inputs = random_inputs(a.manifest, shape.batch, shape.source, rng)
        tokens, past = _random_step(a.manifest, shape, rng)
        state_a, state_b = a.encode(inputs), b.encode(inputs)
        rows = shape.batch * shape.beams
        past_b = past_from(past) if past_from else past
        logits_a, _ = a.step(tokens, state_a, DecoderCache(past, rows))
        logits_b, _ = b.step(tokens, state_b, DecoderCache(past_b, rows))
        diff = float(np.abs(logits_a - logits_b).max())
        worst = max(worst, diff)
        per_shape.append({**shape.as_dict(), "max_abs_logits_diff": diff})
    return {"max_abs_logits_diff": worst, "shapes": per_shape, "tolerance": TOLERANCE}


def torch_reference_step(model, inputs: dict, tokens: np.ndarray, past: dict, beams: int, layers: int):
    """HF's own forward with per-row caches (the semantics the export must match)."""
    rep = {role: torch.from_numpy(a).repeat_interleave(beams, 0) for role, a in inputs.items()}
    with torch.no_grad():
        encoder = model.get_encoder()(**rep).last_hidden_state
        pairs = [(torch.from_numpy(past[f"past_key_values.{i}.decoder.key"]),
                  torch.from_numpy(past[f"past_key_values.{i}.decoder.value"])) for i in range(layers)]
        cache = EncoderDecoderCache(DynamicCache(pairs), DynamicCache())
        out = model(encoder_outputs=(encoder,), attention_mask=rep.get("attention_mask"),
                    decoder_input_ids=torch.from_numpy(tokens), past_key_values=cache, use_cache=True)
    return encoder, out.logits[:, -1, :].numpy()


def verify_export(model, backend: OrtBackend, shapes=SHAPES, seed: int = 0) -> dict:
    """ORT (the exported graphs, driven through the manifest) against HF PyTorch."""
    manifest = backend.manifest
    layers = manifest.dims["num_decoder_layers"]
    worst_logits, worst_encoder, per_shape = 0.0, 0.0, []
    for shape in shapes:
        rng = np.random.default_rng(seed)
        inputs = random_inputs(manifest, shape.batch, shape.source, rng)
        tokens, past = _random_step(manifest, shape, rng)
        state = backend.encode(inputs)
        logits, _ = backend.step(tokens, state, DecoderCache(past, shape.batch * shape.beams))
        encoder, ref = torch_reference_step(model, inputs, tokens, past, shape.beams, layers)
        enc_ort = state.extras["encoder:last_hidden_state"]
        enc_diff = float(np.abs(enc_ort - encoder[:: shape.beams].numpy()).max())
        diff = float(np.abs(logits - ref).max())
        worst_logits, worst_encoder = max(worst_logits, diff), max(worst_encoder, enc_diff)
        per_shape.append({**shape.as_dict(), "max_abs_logits_diff": diff, "max_abs_encoder_diff": enc_diff})
    return {"max_abs_logits_diff": worst_logits, "max_abs_encoder_diff": worst_encoder, "shapes": per_shape,
            "tolerance": TOLERANCE}


def require_within_tolerance(report: dict, what: str) -> None:
    if not report["max_abs_logits_diff"] <= TOLERANCE:  # also catches NaN
        raise ElxError(f"{what}: max abs logits diff {report['max_abs_logits_diff']:.3g} exceeds {TOLERANCE:g}; "
                       f"nothing was written (report this model and pass)")
