"""Logits processors on the host: HF ``generate``'s, in HF's order, with HF's semantics (transformers 5.24).

Each processor is a callable ``(tokens [rows, cur_len] int64, scores [rows, vocab] float32, items [rows] | None)
-> scores`` that may modify ``scores`` in place (the searches own the array); ``items`` is the batch item each
row belongs to (None: row i is item i), read by processors with per-item data (encoder input ids, prompt
padding).  ``build_processors`` builds the list ``GenerationMixin._get_logits_processor`` builds, in its order:

  sequence bias, encoder repetition penalty, repetition penalty, no-repeat n-gram, encoder no-repeat n-gram,
  bad words, min length / min new tokens, prefix constraint, forced BOS, forced EOS, invalid-value removal,
  exponential decay length penalty, suppress tokens, suppress at begin, then the caller's processors
  (``runners/search/processors/user.py``), then with ``do_sample`` the warpers (``warpers.py``), and the
  renormalization last.

A processor the run does not ask for is not built: an unused option costs nothing per step.  A processor a
graph already applies (the ``ngram`` pass) is left out.  Modules: ``masks.py`` (bans and forced tokens),
``bias.py`` (sequence bias, bad words), ``penalties.py`` (rescaling), ``warpers.py`` (sampling), ``user.py``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from elx.runners.search.settings import GenerationSettings
from elx.runners.search.processors.bias import BadWords, SequenceBias
from elx.runners.search.processors.masks import BanUntilLength, EncoderNoRepeatNGram, ForceTokenAt, NoRepeatNGram, PrefixConstrained, Suppress
from elx.runners.search.processors.penalties import (EncoderRepetitionPenalty, ExponentialDecayLengthPenalty, RemoveInvalidValues, Renormalize,
                        RepetitionPenalty)
from elx.runners.search.processors.user import merge_user_processors
from elx.runners.search.processors.warpers import build_warpers

NEG_INF = np.float32(-np.inf)


@dataclass
class ProcessorInputs:
    """What some processors read besides the settings: the run's inputs and the caller's callables.

    ``encoder_ids``: HF's ``encoder_input_ids`` [B, S], the token ids ``generate`` got (an encoder-decoder
    model's encoder input, a decoder-only model's left-padded prompt), padding included; None for audio.
    ``prompt_padding``: per item, a decoder-only prompt's left padding (HF's repetition penalty skips it);
    None without padding.  ``logits_processor``: the caller's; ``prefix_allowed_tokens_fn``: HF's."""

    encoder_ids: np.ndarray | None = None
    prompt_padding: np.ndarray | None = None
    logits_processor: tuple = ()
    prefix_allowed_tokens_fn: object = None


def build_processors(settings: GenerationSettings, prompt_len: int, graph_blocks_ngrams: bool = False,
                     inputs: ProcessorInputs | None = None) -> list:
    """The host processors HF would build for ``settings``; ``prompt_len``: the decoder prompt's length."""
    s, out = settings, []
    inputs = inputs or ProcessorInputs()
    if s.sequence_bias is not None:
        out.append(SequenceBias(s.sequence_bias))
    if s.encoder_repetition_penalty != 1.0 and inputs.encoder_ids is not None:
        out.append(EncoderRepetitionPenalty(s.encoder_repetition_penalty, inputs.encoder_ids))
    if s.repetition_penalty != 1.0:
        out.append(RepetitionPenalty(s.repetition_penalty, inputs.prompt_padding))
    if s.no_repeat_ngram_size and not graph_blocks_ngrams:
        out.append(NoRepeatNGram(s.no_repeat_ngram_size))
    if s.encoder_no_repeat_ngram_size > 0 and inputs.encoder_ids is not None:
        out.append(EncoderNoRepeatNGram(s.encoder_no_repeat_ngram_size, inputs.encoder_ids))
    if s.bad_words_ids is not None and BadWords.banned(s.bad_words_ids, s.eos_token_id):  # only EOS ids: HF bans none
        out.append(BadWords(s.bad_words_ids, s.eos_token_id))
    min_length = s.total_min_length(prompt_len)
    if min_length > 0 and s.eos_token_id:  # HF's MinLength and MinNewTokens processors ban the same
        out.append(BanUntilLength(s.eos_token_id, min_length))
    if inputs.prefix_allowed_tokens_fn is not None:
        out.append(PrefixConstrained(inputs.prefix_allowed_tokens_fn, max(s.num_beams, s.num_return_sequences)))
    if s.forced_bos_token_id is not None:
        out.append(ForceTokenAt(s.forced_bos_token_id, 1))
    if s.forced_eos_token_id is not None:
        # HF passes generation_config.max_length, which generate has already set from max_new_tokens.
        out.append(ForceTokenAt(s.forced_eos_token_id, s.total_max_length(prompt_len) - 1))
    if s.remove_invalid_values:
        out.append(RemoveInvalidValues())
    if s.exponential_decay_length_penalty is not None:
        start, factor = s.exponential_decay_length_penalty
        out.append(ExponentialDecayLengthPenalty(start, factor, s.eos_token_id, prompt_len))
    if s.suppress_tokens:
        out.append(Suppress(s.suppress_tokens))
    if s.begin_suppress_tokens:
        begin = prompt_len if (prompt_len > 1 or s.forced_bos_token_id is None) else prompt_len + 1
        out.append(Suppress(s.begin_suppress_tokens, at_length=begin))
    out = merge_user_processors(out, inputs.logits_processor)
    if s.do_sample:
        out.extend(build_warpers(s, len(s.eos_token_id)))
    if s.renormalize_logits:
        out.append(Renormalize())
    return out


def apply_processors(processors: list, tokens: np.ndarray, scores: np.ndarray, items: np.ndarray | None = None):
    for processor in processors:
        scores = processor(tokens, scores, items)
    return scores
