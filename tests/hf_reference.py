"""Run elx's searches on HF's own PyTorch logits: separates search bugs from export numerics.

``HfLogitsBackend`` is a stand-in for ``runners.model.Model`` (what the searches drive) built on
the HF model itself: no
cache, the decoder recomputed over the whole history every step (as ``generate(use_cache=False)``
does; M2M100 and FSMT: replayed token by token through HF's cache, as their cached ``generate``
computes it: ``exporter/hf_decoding.py``),
optionally in float64.  Its logits go to the search as HF hands them to its own search:
cast to float32.  If elx's search on these logits differs from HF ``generate`` on the same model,
the difference is in the search, not in ONNX.

``hf_numpy_features`` runs transformers' ``WhisperFeatureExtractor`` on its numpy path, the
reference elx's own log-mel features are bit-equal to.
"""
from __future__ import annotations

from unittest import mock

import numpy as np
import torch

from exporter.families import hf_full_sequence_is_stepwise
from exporter.hf_decoding import hf_decoder_logits
from runners.backend import DecoderCache, EncoderState


class HfLogitsBackend:
    needs_history = False
    returns_log_probs = False

    def __init__(self, model):
        self.model = model
        # HF's uncached forward over the whole history is not what its cached generate computes for every
        # family (M2M100, FSMT: ``exporter/hf_decoding.py``): there the history is replayed token by token
        self.replay = not hf_full_sequence_is_stepwise(model)

    def _replayed(self, encoder_inputs: dict, tokens: torch.Tensor) -> torch.Tensor:
        encoder = self.model.get_encoder()(**encoder_inputs).last_hidden_state
        return hf_decoder_logits(self.model, encoder, encoder_inputs.get("attention_mask"), tokens)[:, -1]

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
                logits = self._replayed(encoder_inputs, torch.from_numpy(tokens))
            else:
                logits = self.model(**encoder_inputs, decoder_input_ids=torch.from_numpy(tokens)).logits[:, -1]
        return logits.to(torch.float32).numpy().copy(), DecoderCache({"history": tokens}, cache.rows)

    def reorder(self, cache: DecoderCache, rows: np.ndarray) -> DecoderCache:
        return DecoderCache({"history": cache.arrays["history"][rows]}, int(rows.shape[0]))

    def select(self, state: EncoderState, items: np.ndarray) -> EncoderState:
        return EncoderState({k: v[items] for k, v in state.feeds.items()}, int(items.shape[0]))

    def state_bytes(self, state: EncoderState) -> int:
        return sum(a.nbytes for a in state.feeds.values())

    def cache_bytes(self, cache: DecoderCache) -> int:
        return int(cache.arrays["history"].nbytes)


def hf_numpy_features(extractor, audio: list, **kwargs):
    """``extractor(audio, sampling_rate=…, return_tensors="np")`` on HF's numpy path.

    With torch installed HF computes the STFT through ``torch.stft`` (float32) instead; its numpy path,
    the one it takes without torch, is what elx reproduces bit for bit.  Returns HF's BatchFeature.
    """
    from transformers.models.whisper import feature_extraction_whisper

    with mock.patch.object(feature_extraction_whisper, "is_torch_available", lambda: False):
        return extractor(audio, sampling_rate=extractor.sampling_rate, return_tensors="np", **kwargs)


class HfDecoderOnlyLogitsBackend:
    """``HfLogitsBackend`` for a decoder-only model: the prompt (left-padded, with its mask) is the first
    step's input; each step recomputes the whole sequence with HF's mask and position ids."""

    needs_history = False
    returns_log_probs = False

    def __init__(self, model):
        self.model = model

    def encode(self, inputs: dict) -> EncoderState:
        mask = np.asarray(inputs["attention_mask"], dtype=np.int64)
        return EncoderState({"attention_mask": mask}, int(mask.shape[0]))

    def empty_cache(self, rows: int) -> DecoderCache:
        return DecoderCache({"history": np.zeros((rows, 0), dtype=np.int64)}, rows)

    def step(self, input_ids, state: EncoderState, cache: DecoderCache, history=None):
        from runners.prompt import sequence_positions

        tokens = np.concatenate([cache.arrays["history"], input_ids], axis=1)
        prompt_mask = np.repeat(state.feeds["attention_mask"], tokens.shape[0] // state.batch, axis=0)
        width = prompt_mask.shape[1]
        mask = np.concatenate([prompt_mask, np.ones((tokens.shape[0], tokens.shape[1] - width), dtype=np.int64)], 1)
        positions = sequence_positions(prompt_mask, tokens.shape[1])
        with torch.no_grad():
            logits = self.model(input_ids=torch.from_numpy(tokens), attention_mask=torch.from_numpy(mask),
                                position_ids=torch.from_numpy(positions)).logits[:, -1]
        return logits.to(torch.float32).numpy().copy(), DecoderCache({"history": tokens}, cache.rows)

    reorder = HfLogitsBackend.reorder
    select = HfLogitsBackend.select
    state_bytes = HfLogitsBackend.state_bytes
    cache_bytes = HfLogitsBackend.cache_bytes
