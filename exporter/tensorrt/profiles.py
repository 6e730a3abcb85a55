"""Optimization profiles for TensorRT engines: a [min, opt, max] range per named axis of the manifest.

The manifest names every dynamic dimension of every graph input (``runners/manifest.py``); the runner
feeds them as follows, and the ranges cover exactly that:

========================  ====================================================  =========================
axis                      what the runner feeds                                 [min, opt, max]
========================  ====================================================  =========================
``batch``                 input sequences still generating (finished ones are   [1, B, B]
                          dropped from the batch)
``rows``                  batch · beams                                          [1, B·K, B·K]
``encoder_sequence``      source length (padded to the longest in the batch)    [1, ⌈N/2⌉, N]
``decoder_sequence``      tokens per decoder step: the prompt at the first       [1, 1, 4]
                          step (Whisper: up to 4), then 1
``past_sequence``         self-attention cache length, 0 at the first step      [0, ⌈P/2⌉, P], P = T + 3
``history_length``        tokens so far (n-gram blocking in the graph)          [1, ⌈H/2⌉, H], H = T + 4
``prompt_sequence``       decoder-only: the (left-padded) prompt                [1, ⌈N/2⌉, N]
========================  ====================================================  =========================

with B = ``max_batch_size``, K = ``max_beams``, N = ``max_input_length``, T = ``max_new_tokens``.
Whisper's encoder takes a fixed number of log-mel frames; its source length (the encoder's output frames,
half the input frames) is fixed: min = opt = max.  Batch and rows are optimised for the full size (beam
search keeps them full until items finish), lengths for the middle of their range.

Decoder-only exports whose cache holds the prompt per beam (``--prompt-cache per-beam``: cache entries
filled from the prefill) cache prompt and generated tokens together: there ``past_sequence`` reaches
N + T + 3, and the step's ``attention_mask`` spans ``past_sequence + 1`` positions.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from elx.runners.errors import ElxError
from elx.runners.manifest import Manifest

MAX_STEP_TOKENS = 4  # longest decoder prompt fed in one step (Whisper: start, language, task, notimestamps)


@dataclass(frozen=True)
class Limits:
    max_batch_size: int = 8
    max_beams: int = 4
    max_input_length: int = 512
    max_new_tokens: int = 128

    def checked(self) -> "Limits":
        for name, value in asdict(self).items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ElxError(f"{name.replace('_', '-')} must be a positive integer (got {value!r})")
        return self

    def as_dict(self) -> dict:
        return asdict(self)


def _half(n: int) -> int:
    return max(1, (n + 1) // 2)


def _fixed_source_length(manifest: Manifest) -> int | None:
    """Whisper-style encoders: fixed frames in, half as many positions out."""
    for role, spec in manifest.encoder_inputs().items():
        if role == "input_features" and len(spec["shape"]) == 3 and isinstance(spec["shape"][2], int):
            return spec["shape"][2] // 2
    return None


def axis_ranges(manifest: Manifest, limits: Limits) -> dict[str, list[int]]:
    b, k, n, t = limits.max_batch_size, limits.max_beams, limits.max_input_length, limits.max_new_tokens
    past = t + MAX_STEP_TOKENS - 1
    history = t + MAX_STEP_TOKENS
    axes = {
        "batch": [1, b, b],
        "rows": [1, b * k, b * k],
        "encoder_sequence": [1, _half(n), n],
        "decoder_sequence": [1, 1, MAX_STEP_TOKENS],
        "past_sequence": [0, _half(past), past],
        "history_length": [1, _half(history), history],
    }
    fixed = _fixed_source_length(manifest)
    if fixed is not None:
        axes["encoder_sequence"] = axes["encoder_frames"] = [fixed, fixed, fixed]
    if not manifest.data.get("is_encoder_decoder", True):
        axes["prompt_sequence"] = [1, _half(n), n]
        if any(entry.get("init") for entry in manifest.cache_entries):  # the prompt in the per-beam cache
            past = n + past
            axes["past_sequence"] = [0, _half(past), past]
        axes["past_sequence + 1"] = [axes["past_sequence"][0] + 1, axes["past_sequence"][1] + 1,
                                     axes["past_sequence"][2] + 1]
    return axes


def input_profiles(manifest: Manifest, graph: str, axes: dict[str, list[int]]) -> dict[str, dict]:
    """Per input of ``graph``: dtype, axis names (ints where fixed) and one [min, opt, max] profile."""
    out = {}
    for name, spec in manifest.graphs[graph]["inputs"].items():
        shape = spec.get("shape")
        if shape is None:
            raise ElxError(f"manifest graph {graph!r} input {name!r} has no shape; re-run 'elx export'")
        bounds = []
        for dim in shape:
            if isinstance(dim, int):
                bounds.append([dim, dim, dim])
            elif dim in axes:
                bounds.append(list(axes[dim]))
            else:
                raise ElxError(f"graph {graph!r} input {name!r} has an axis {dim!r} that elx build-engine has no "
                               f"range for (known axes: {', '.join(axes)})")
        out[name] = {"dtype": spec["dtype"], "axes": list(shape),
                     "profiles": [[[b[i] for b in bounds] for i in range(3)]]}
    return out
