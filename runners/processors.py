"""Logits processors on the host, in HF ``generate``'s order and with its semantics.

Each processor is a callable ``(tokens [rows, cur_len] int64, scores [rows, vocab] float32) ->
scores`` that may modify ``scores`` in place (the searches own the array).  HF builds the list in
``GenerationMixin._get_logits_processor``; the order below is that order for the options elx
supports: no-repeat-ngram, min length, min new tokens, forced BOS, forced EOS, suppress tokens,
suppress-at-begin.  A processor a graph already applies (the ``ngram`` pass) is left out.
"""
from __future__ import annotations

import numpy as np

from runners.ngram_reference import block_ngrams_inplace

from .settings import GenerationSettings

NEG_INF = np.float32(-np.inf)


class NoRepeatNGram:
    def __init__(self, n: int):
        self.n = n

    def __call__(self, tokens, scores):
        return block_ngrams_inplace(tokens, scores, self.n)


class BanUntilLength:
    """MinLength (``cur_len < min_length``) and MinNewTokens (``cur_len - prompt < min_new``): ban EOS."""

    def __init__(self, eos: list, min_total_length: int):
        self.eos = np.asarray(eos, dtype=np.int64)
        self.min_total_length = min_total_length

    def __call__(self, tokens, scores):
        if tokens.shape[1] < self.min_total_length:
            scores[:, self.eos[self.eos < scores.shape[1]]] = NEG_INF
        return scores


class ForceTokenAt:
    """ForcedBOS (at cur_len == 1) and ForcedEOS (at cur_len == max_length - 1): only ``tokens`` stay."""

    def __init__(self, token, at_length: int):
        self.tokens = np.asarray(token if isinstance(token, (list, tuple)) else [token], dtype=np.int64)
        self.at_length = at_length

    def __call__(self, tokens, scores):
        if tokens.shape[1] == self.at_length:
            scores[:] = NEG_INF
            scores[:, self.tokens] = 0.0
        return scores


class Suppress:
    """SuppressTokens (always, ``at_length=None``) and SuppressTokensAtBegin (at cur_len == begin index)."""

    def __init__(self, token_ids, at_length: int | None = None):
        self.ids = np.asarray(sorted(set(int(t) for t in token_ids)), dtype=np.int64)
        self.at_length = at_length

    def __call__(self, tokens, scores):
        if self.at_length is None or tokens.shape[1] == self.at_length:
            scores[:, self.ids[self.ids < scores.shape[1]]] = NEG_INF
        return scores


def build_processors(settings: GenerationSettings, prompt_len: int, graph_blocks_ngrams: bool = False) -> list:
    """The host processors HF would build for ``settings`` (encoder-decoder models)."""
    s, out = settings, []
    if s.no_repeat_ngram_size and not graph_blocks_ngrams:
        out.append(NoRepeatNGram(s.no_repeat_ngram_size))
    min_length = s.total_min_length(prompt_len)
    if min_length > 0 and s.eos_token_id:  # HF's MinLength and MinNewTokens processors ban the same
        out.append(BanUntilLength(s.eos_token_id, min_length))
    if s.forced_bos_token_id is not None:
        out.append(ForceTokenAt(s.forced_bos_token_id, 1))
    if s.forced_eos_token_id is not None:
        # HF passes generation_config.max_length, which generate has already set from max_new_tokens.
        out.append(ForceTokenAt(s.forced_eos_token_id, s.total_max_length(prompt_len) - 1))
    if s.suppress_tokens:
        out.append(Suppress(s.suppress_tokens))
    if s.begin_suppress_tokens:
        begin = prompt_len if (prompt_len > 1 or s.forced_bos_token_id is None) else prompt_len + 1
        out.append(Suppress(s.begin_suppress_tokens, at_length=begin))
    return out


def apply_processors(processors: list, tokens: np.ndarray, scores: np.ndarray) -> np.ndarray:
    for processor in processors:
        scores = processor(tokens, scores)
    return scores
