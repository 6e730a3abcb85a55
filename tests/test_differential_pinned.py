"""Divergences the differential test (``test_differential.py``) found, pinned as plain cases.

Each case is the exact config, inputs and settings of a found example (or its reduction), fixed
in elx, and asserts the behaviour it got wrong.
"""
from __future__ import annotations

import numpy as np
import torch

from exporter.compare import _hf_generate
from tests.differential import Stats, build_fp64, run_search_example

# search-only, Whisper: issue-10 differential run, ELX_DIFF_SEED=1
WHISPER_TINY = {"vocab_size": 25, "d_model": 4, "encoder_attention_heads": 1, "decoder_attention_heads": 1,
                "encoder_ffn_dim": 32, "decoder_ffn_dim": 32, "encoder_layers": 1, "decoder_layers": 1,
                "init_std": 0.02, "max_source_positions": 16, "num_mel_bins": 8, "suppress_tokens": None,
                "begin_suppress_tokens": [2, 9]}


def _features(seed: int, batch: int = 1) -> dict:
    return {"input_features": np.random.default_rng(seed).standard_normal((batch, 8, 32)).astype(np.float32)}


def _search_case(family, seed, config, inputs, options):
    stats = Stats("pinned")
    run_search_example(stats, family, seed, config, inputs, options)
    assert stats.examples == 1 and not stats.failures, stats.summary()


def test_whisper_eos_list_keeps_the_final_eos():
    """HF Whisper cuts a final EOS only when ``eos_token_id`` is an int: it compares the last token with
    the option as given, and ``tensor == [19, 2]`` is False.  elx cut it for lists too (HF [15, 19], elx [15])."""
    options = dict(num_beams=6, num_return_sequences=6, no_repeat_ngram_size=1, length_penalty=3.0,
                   early_stopping=True, max_new_tokens=2)
    inputs = _features(0)
    model = build_fp64("whisper", 1982, WHISPER_TINY)
    as_list = _hf_generate(model, inputs, dict(options, eos_token_id=[19, 2], use_cache=False))
    as_int = _hf_generate(model, inputs, dict(options, eos_token_id=19, use_cache=False))
    assert (as_list[:, -1] == 19).all() and not (as_int == 19).any()  # the case exercises the quirk
    for eos in ([19, 2], [19], 19, [2, 19]):
        _search_case("whisper", 1982, WHISPER_TINY, inputs, dict(options, eos_token_id=eos))
    _search_case("whisper", 1982, WHISPER_TINY, _features(1, batch=3),
                 dict(num_beams=1, max_new_tokens=5, eos_token_id=[19, 2]))
