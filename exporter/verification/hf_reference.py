"""HF's side of a comparison: HF ``generate`` on numpy inputs, and elx's searches fed HF's own PyTorch logits.

``HfLogitsBackend`` is a stand-in for ``elx.runners.model.Model`` (what the searches drive) built on the HF
model itself: no cache, the decoder recomputed over the whole history every step (as
``generate(use_cache=False)`` does; M2M100 and FSMT, whose uncached forward computes something else:
replayed token by token through HF's cache, as their cached ``generate`` does, ``exporter/verification/hf_decoding.py``),
in the model's precision (float64 for the stability rule).  Its
logits go to the search as HF hands them to its own search: cast to float32.  If elx's search on these
logits differs from HF ``generate`` on the same model, the difference is in the search, not in ONNX.

``perturbation`` (amplitude, seed) adds seeded uniform noise in [-amplitude, amplitude] to every logit
before that cast: the stability rule (``exporter/verification/stability.py``) asks whether HF's answer survives logits
errors as large as an export's.

``search_backend(model, manifest)`` wraps either backend with a manifest, so that
``elx.runners.generate.Generator`` runs elx's settings, processors and searches on it.
"""
from __future__ import annotations

import numpy as np
import torch

from elx.runners.backends.base import DecoderCache, EncoderState
from elx.runners.manifest import Manifest

from elx.exporter.families.catalog import hf_full_sequence_is_stepwise
from elx.exporter.verification.hf_decoding import hf_decoder_logits


def torch_inputs(inputs: dict, dtype=torch.float32) -> dict:
    """numpy inputs → tensors; floating inputs (Whisper's features) in the model's dtype."""
    out = {}
    for key, value in inputs.items():
        tensor = torch.from_numpy(np.ascontiguousarray(value))
        out[key] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    return out


def hf_generate(model, inputs: dict, options: dict) -> np.ndarray:
    """HF ``generate``'s sequences for numpy encoder inputs, as a numpy array."""
    dtype = next(model.parameters()).dtype
    with torch.no_grad():
        out = model.generate(**torch_inputs(inputs, dtype), **options)
    return out.numpy()


class _Perturbed:
    """Seeded uniform noise in [-amplitude, amplitude] added to each step's logits (amplitude 0: none)."""

    def __init__(self, perturbation: tuple[float, int] | None):
        self.amplitude, seed = perturbation or (0.0, 0)
        self.rng = np.random.default_rng(seed)

    def __call__(self, logits: torch.Tensor) -> np.ndarray:
        values = logits.numpy().copy()
        if self.amplitude:
            values += self.rng.uniform(-self.amplitude, self.amplitude, size=values.shape).astype(values.dtype)
        return values.astype(np.float32)  # HF's searches take the logits in float32


class HfLogitsBackend:
    needs_history = False
    returns_log_probs = False

    def __init__(self, model, perturbation: tuple[float, int] | None = None):
        self.model = model
        self.logits = _Perturbed(perturbation)
        self.replay = not hf_full_sequence_is_stepwise(model)  # M2M100, FSMT: exporter/verification/hf_decoding.py

    def encode(self, inputs: dict) -> EncoderState:
        feeds = {role: np.asarray(a) for role, a in inputs.items()}
        return EncoderState(feeds, int(next(iter(feeds.values())).shape[0]))

    def empty_cache(self, rows: int) -> DecoderCache:
        return DecoderCache({"history": np.zeros((rows, 0), dtype=np.int64)}, rows)

    def step(self, input_ids, state: EncoderState, cache: DecoderCache, history=None):
        tokens = np.concatenate([cache.arrays["history"], input_ids], axis=1)
        per_item = tokens.shape[0] // state.batch
        encoder_inputs = {role: torch.from_numpy(np.repeat(a, per_item, axis=0)) for role, a in state.feeds.items()}
        with torch.no_grad():
            if self.replay:
                encoder = self.model.get_encoder()(**encoder_inputs).last_hidden_state
                logits = hf_decoder_logits(self.model, encoder, encoder_inputs.get("attention_mask"),
                                           torch.from_numpy(tokens))[:, -1]
            else:
                logits = self.model(**encoder_inputs, decoder_input_ids=torch.from_numpy(tokens)).logits[:, -1]
        return self.logits(logits), DecoderCache({"history": tokens}, cache.rows)

    def reorder(self, cache: DecoderCache, rows: np.ndarray) -> DecoderCache:
        return DecoderCache({"history": cache.arrays["history"][rows]}, int(rows.shape[0]))

    def select(self, state: EncoderState, items: np.ndarray) -> EncoderState:
        return EncoderState({k: v[items] for k, v in state.feeds.items()}, int(items.shape[0]))

    def state_bytes(self, state: EncoderState) -> int:
        return sum(a.nbytes for a in state.feeds.values())

    def cache_bytes(self, cache: DecoderCache) -> int:
        return int(cache.arrays["history"].nbytes)


def hf_reference_options(model, options: dict) -> dict:
    """``options`` for HF's reference run beside ``HfLogitsBackend``: ``use_cache=False`` (the decoder recomputed
    over the whole history, as the backend does), except where HF's uncached decoder computes something else
    (M2M100, FSMT: ``exporter/verification/hf_decoding.py``): there HF's cached generate, which the backend replays."""
    return dict(options, use_cache=not hf_full_sequence_is_stepwise(model))


class HfDecoderOnlyLogitsBackend(HfLogitsBackend):
    """``HfLogitsBackend`` for a decoder-only model: the prompt (left-padded, with its mask) is the first
    step's input; each step recomputes the whole sequence with HF's mask and position ids."""

    def encode(self, inputs: dict) -> EncoderState:
        mask = np.asarray(inputs["attention_mask"], dtype=np.int64)
        return EncoderState({"attention_mask": mask}, int(mask.shape[0]))

    @staticmethod
    def sequence(input_ids, state: EncoderState, cache: DecoderCache) -> tuple:
        """(the whole history with ``input_ids``, its attention mask, its position ids), as HF builds them."""
        from elx.runners.inputs.prompt import sequence_positions

        tokens = np.concatenate([cache.arrays["history"], input_ids], axis=1)
        prompt_mask = np.repeat(state.feeds["attention_mask"], tokens.shape[0] // state.batch, axis=0)
        width = prompt_mask.shape[1]
        mask = np.concatenate([prompt_mask, np.ones((tokens.shape[0], tokens.shape[1] - width), dtype=np.int64)], 1)
        return tokens, mask, sequence_positions(prompt_mask, tokens.shape[1])

    def step(self, input_ids, state: EncoderState, cache: DecoderCache, history=None):
        tokens, mask, positions = self.sequence(input_ids, state, cache)
        with torch.no_grad():
            logits = self.model(input_ids=torch.from_numpy(tokens), attention_mask=torch.from_numpy(mask),
                                position_ids=torch.from_numpy(positions)).logits[:, -1]
        return self.logits(logits), DecoderCache({"history": tokens}, cache.rows)


def _forked(cache):
    """A copy of HF cache object ``cache`` whose layers can take a step or a reorder without changing ``cache``:
    HF's layers replace their tensors (``torch.cat``, ``index_select``), never write into them, so shallow copies of
    the cache and of each layer suffice."""
    import copy

    fork = copy.copy(cache)
    fork.layers = [copy.copy(layer) for layer in cache.layers]
    return fork


class HfDecoderOnlyCachedBackend(HfDecoderOnlyLogitsBackend):
    """``HfDecoderOnlyLogitsBackend`` on HF's own key/value cache, as ``generate(use_cache=True)`` runs: the first
    step feeds the prompt, each later step only the new token, with the whole mask and the new positions.  Its
    logits are HF's cached ``generate``'s; in float64 they differ from the uncached ones by float64 rounding only
    (~1e-13, far below any perturbation the stability rule applies), and a step costs one token instead of the whole
    history: the float64 stability probe of a 30-layer model at beam 4 takes minutes instead of hours."""

    def empty_cache(self, rows: int) -> DecoderCache:
        return DecoderCache({"history": np.zeros((rows, 0), dtype=np.int64), "past": None}, rows)

    def step(self, input_ids, state: EncoderState, cache: DecoderCache, history=None):
        from transformers import DynamicCache

        tokens, mask, positions = self.sequence(input_ids, state, cache)
        new = input_ids.shape[1]
        past = cache.arrays["past"]
        past = DynamicCache(config=self.model.config) if past is None else _forked(past)
        with torch.no_grad():
            out = self.model(input_ids=torch.from_numpy(np.ascontiguousarray(tokens[:, -new:])),
                             attention_mask=torch.from_numpy(mask),
                             position_ids=torch.from_numpy(np.ascontiguousarray(positions[:, -new:])),
                             past_key_values=past, use_cache=True)
        return self.logits(out.logits[:, -1]), DecoderCache({"history": tokens, "past": out.past_key_values},
                                                            cache.rows)

    def reorder(self, cache: DecoderCache, rows: np.ndarray) -> DecoderCache:
        past = cache.arrays["past"]
        if past is not None:
            past = _forked(past)
            past.reorder_cache(torch.from_numpy(np.asarray(rows, dtype=np.int64)))
        return DecoderCache({"history": cache.arrays["history"][rows], "past": past}, int(rows.shape[0]))

    def cache_bytes(self, cache: DecoderCache) -> int:
        past = cache.arrays["past"]
        layers = [] if past is None else past.layers
        return int(cache.arrays["history"].nbytes) + sum(
            t.numel() * t.element_size() for layer in layers for t in (getattr(layer, "keys", None),
                                                                      getattr(layer, "values", None))
            if isinstance(t, torch.Tensor))


class SearchBackend(HfLogitsBackend):
    """``HfLogitsBackend`` with a manifest (so ``Generator`` runs on it) and float inputs in the model's dtype."""

    def __init__(self, model, manifest: Manifest, perturbation: tuple[float, int] | None = None):
        super().__init__(model, perturbation)
        self.manifest = manifest
        self.dtype = np.float64 if next(model.parameters()).dtype == torch.float64 else np.float32

    def encode(self, inputs: dict):
        return super().encode({k: v.astype(self.dtype) if v.dtype.kind == "f" else v for k, v in inputs.items()})

    def for_run(self, no_repeat_ngram_size):
        return self  # plain logits: the search does its own n-gram blocking


class DecoderOnlySearchBackend(HfDecoderOnlyLogitsBackend):
    """``HfDecoderOnlyLogitsBackend`` with a manifest, so that ``Generator`` runs on it."""

    def __init__(self, model, manifest: Manifest, perturbation: tuple[float, int] | None = None):
        super().__init__(model, perturbation)
        self.manifest = manifest

    for_run = SearchBackend.for_run


class DecoderOnlyCachedSearchBackend(HfDecoderOnlyCachedBackend, DecoderOnlySearchBackend):
    """``HfDecoderOnlyCachedBackend``'s steps with ``DecoderOnlySearchBackend``'s manifest, so that ``Generator`` runs
    on it."""


def search_backend(model, manifest: Manifest, perturbation: tuple[float, int] | None = None, cached: bool = False):
    """elx's model interface on ``model``'s own logits (``perturbation``: (amplitude, seed) of added noise);
    ``cached``: a decoder-only model runs on HF's key/value cache (``HfDecoderOnlyCachedBackend``)."""
    if manifest.data.get("is_encoder_decoder", True):
        return SearchBackend(model, manifest, perturbation)
    return (DecoderOnlyCachedSearchBackend if cached else DecoderOnlySearchBackend)(model, manifest, perturbation)


def cached_search_applies(manifest: Manifest) -> bool:
    """Whether ``search_backend(..., cached=True)`` runs on HF's cache (decoder-only models) rather than
    recomputing the whole history each step."""
    return not manifest.data.get("is_encoder_decoder", True)
