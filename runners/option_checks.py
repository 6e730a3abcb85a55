"""Types and ranges of the sampling, penalty, constraint, stopping and output options, checked as HF checks them.

HF validates a processor's argument when ``generate`` builds the processor, so a value it would not use
passes unchecked (``top_p=5`` without sampling; ``typical_p >= 1`` or ``epsilon_cutoff`` outside (0, 1),
which HF leaves out).  elx checks the same values at the same conditions, before any graph runs, and
names the option in one ``ElxError`` line where HF raises a ``ValueError``.
"""
from __future__ import annotations

import math
from numbers import Integral, Real

from elx.runners.errors import ElxError


def _real(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise ElxError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _integer(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < minimum:
        raise ElxError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _flag(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ElxError(f"{name} must be true or false, got {value!r}")


def _token_lists(name: str, value) -> None:
    """HF's NoBadWords checks: a non-empty list of non-empty lists of token ids >= 0."""
    if not isinstance(value, (list, tuple)) or not value:
        raise ElxError(f"{name} must be a non-empty list of token id lists, got {value!r}")
    for ids in value:
        if not isinstance(ids, (list, tuple)) or not ids or not all(
                isinstance(t, Integral) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise ElxError(f"{name} must hold non-empty lists of token ids >= 0, got {ids!r}")


def sequence_bias_pairs(value) -> list:
    """HF's ``sequence_bias`` (a dict of token-id tuples to floats, or its list form [[ids], bias]) as list pairs."""
    pairs = list(value.items()) if isinstance(value, dict) else value
    if not isinstance(pairs, (list, tuple)) or not pairs:
        raise ElxError(f"sequence_bias must be a non-empty dict {{(token ids): bias}} or list [[token ids], bias], "
                       f"got {value!r}")
    out = []
    for pair in pairs:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ElxError(f"sequence_bias entries are [[token ids], bias] pairs, got {pair!r}")
        _token_lists("sequence_bias", [pair[0]])
        out.append([[int(t) for t in pair[0]], _real("a sequence_bias bias", pair[1])])
    return out


def check_sampling(s) -> None:
    """The warpers HF builds with ``do_sample`` (``GenerationMixin._get_logits_processor``), their arguments' ranges."""
    if s.temperature != 1.0 and not _real("temperature", s.temperature) > 0:
        raise ElxError(f"temperature must be > 0 (do_sample=False is greedy decoding), got {s.temperature}")
    _integer("top_k", s.top_k, 0)  # 0: off
    if _real("top_p", s.top_p) < 1.0 and s.top_p < 0:
        raise ElxError(f"top_p must be in [0, 1], got {s.top_p}")
    if s.min_p is not None and not 0.0 <= _real("min_p", s.min_p) <= 1.0:
        raise ElxError(f"min_p must be in [0, 1], got {s.min_p}")
    if s.top_h is not None and not 0.0 < _real("top_h", s.top_h) <= 1.0:
        raise ElxError(f"top_h must be in (0, 1], got {s.top_h}")
    if _real("typical_p", s.typical_p) < 1.0 and not s.typical_p > 0:
        raise ElxError(f"typical_p must be in (0, 1) (1 or more: off), got {s.typical_p}")
    _real("epsilon_cutoff", s.epsilon_cutoff)  # outside (0, 1) it is off, as in HF
    _real("eta_cutoff", s.eta_cutoff)


def check_generation_options(s) -> None:
    """Everything beyond lengths and beams (``elx.runners.inputs.validation.check_settings`` checks those)."""
    _flag("do_sample", s.do_sample)
    if s.seed is not None:
        _integer("seed", s.seed, 0)
        if s.seed >= 2**63:
            raise ElxError(f"seed must be < 2**63, got {s.seed}")
    if s.do_sample:
        check_sampling(s)
    for name in ("repetition_penalty", "encoder_repetition_penalty"):
        value = _real(name, getattr(s, name))
        if value != 1.0 and not value > 0:
            raise ElxError(f"{name} must be > 0 (1.0: off), got {value}")
    _integer("encoder_no_repeat_ngram_size", s.encoder_no_repeat_ngram_size, 0)
    if s.bad_words_ids is not None:
        _token_lists("bad_words_ids", s.bad_words_ids)
    if s.sequence_bias is not None:
        s.sequence_bias = sequence_bias_pairs(s.sequence_bias)
    if s.exponential_decay_length_penalty is not None:
        pair = s.exponential_decay_length_penalty
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ElxError(f"exponential_decay_length_penalty must be (start_index, decay_factor), got {pair!r}")
        s.exponential_decay_length_penalty = [_integer("its start_index", pair[0], 0),
                                              _real("its decay_factor", pair[1])]
        if not s.eos_token_id:
            raise ElxError("exponential_decay_length_penalty raises the EOS score: this run has no eos_token_id")
    for name in ("renormalize_logits", "remove_invalid_values", "output_scores", "output_logits",
                 "return_dict_in_generate"):
        _flag(name, getattr(s, name))
    if s.max_time is not None and _real("max_time", s.max_time) < 0:
        raise ElxError(f"max_time must be >= 0 seconds, got {s.max_time}")
    if s.stop_strings is not None:
        strings = [s.stop_strings] if isinstance(s.stop_strings, str) else s.stop_strings
        if not isinstance(strings, (list, tuple)) or not strings or not all(isinstance(t, str) and t for t in strings):
            raise ElxError(f"stop_strings must be a non-empty string or list of them, got {s.stop_strings!r}")
        s.stop_strings = list(strings)
