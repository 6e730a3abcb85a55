"""Divergences the differential test (``test_differential.py``) found, pinned as plain cases.

Each case is the exact config, inputs and settings of a found example (or its reduction), fixed
in elx, and asserts the behaviour it got wrong.
"""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from elx.exporter.verification.compare import _hf_generate, compare_loaded
from elx.runners.errors import ElxError
from tests.differential import SPECS, Stats, build_fp64, run_search_example

pytestmark = pytest.mark.usefixtures("one_torch_thread")

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


@pytest.fixture(scope="module")
def pool(differential_pool):
    return differential_pool


# export, t5-gated-square (gated-gelu, untied head, logits up to ~15): CI slice, default derandomized seed
GATED_SQUARE_INPUTS = {
    "input_ids": np.array([[58, 75, 0, 0, 0, 0, 0, 0, 0, 0], [74, 36, 46, 0, 0, 0, 0, 0, 0, 0],
                           [91, 80, 11, 6, 16, 77, 92, 68, 90, 94], [6, 4, 10, 79, 84, 61, 86, 20, 0, 0]]),
    "attention_mask": np.array([[1, 1, 0, 0, 0, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0, 0, 0],
                                [1, 1, 1, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1, 0, 0]])}


@pytest.mark.parametrize("passes", ["slim=skip-bad", "el,slim=skip-bad,ngram=4", "slim-cross=skip-bad",
                                    "slim-cross=skip-bad,slim=skip-bad"])
def test_slim_exports_meet_the_tolerance_in_generation(pool, passes):
    """``slim`` verified this model's layers at 8.4e-5 (one seed, 4 shapes) and wrote them; a real decode
    then gave 1.1e-4 > 1e-4 at the first step and ``elx compare`` failed the export (tokens all HF's).
    Now the pass verifies at three seeds within half the tolerance: what it writes meets 1e-4 in
    generation, and here it refuses ``slim`` (every layer alone is beyond 5e-5) and says why."""
    spec = next(s for s in SPECS if s.name == "t5-gated-square")
    try:
        loaded = pool.loaded(spec, passes)
    except ElxError as err:
        # the export's bar: 1e-4 here, or fp32's own measured error times 4 where that is more (fp32_noise.py)
        assert "slim" in passes.replace("slim-cross", "") and re.search(r"half the 0\.0001\d* tolerance", str(err))
        return
    assert "slim" not in passes.replace("slim-cross", ""), "slim was written for a model it cannot keep in 1e-4"
    ngram = 4 if "ngram" in passes else 0
    for options in (dict(num_beams=2, max_length=2), dict(num_beams=4, max_new_tokens=20, min_new_tokens=20)):
        report = compare_loaded(loaded.generator, loaded.model, inputs=GATED_SQUARE_INPUTS, variants=None,
                                no_repeat_ngram_size=ngram, **options)
        assert report.logits_within_tolerance and report.encoder_within_tolerance, report.max_logits_diff


# search-only, T5 (gated-gelu, tied, initializer_factor 4): CI slice of test_differential_search
T5_TIED_PEAKED = {"vocab_size": 256, "d_model": 48, "d_kv": 16, "num_heads": 2, "d_ff": 64, "num_layers": 1,
                  "num_decoder_layers": 1, "feed_forward_proj": "gated-gelu", "tie_word_embeddings": True,
                  "initializer_factor": 4.0, "relative_attention_num_buckets": 8}


def test_search_near_tie_is_decided_by_log_softmax_rounding():
    """Beams 5, 5 returned, no EOS reached: HF's 4th and 5th hypotheses score 1 float32 ulp apart
    (-0x1.33dcbep-1, -0x1.33dcc0p-1).  elx's search calls HF's log-softmax kernel and returns HF's rows
    and scores bit for bit.  With numpy's log-softmax (``ELX_LOG_SOFTMAX=numpy``) the two tie exactly
    and come out swapped.  And HF's own answer depends on the CPU: on PyTorch's scalar kernels
    (``ATEN_CPU_CAPABILITY=default``) HF swaps the two rows as numpy does, on AVX2 and AVX-512 it does not."""
    from elx.runners.generate import Generator
    from tests.differential import SearchBackend, bare_manifest, log_softmax_kernel
    from tests.hf_on_cpu_kernel import hf_on_cpu_kernels

    if torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        pytest.skip("this CPU has only PyTorch's scalar kernels: nothing to compare them with")
    model = build_fp64("t5", 420, T5_TIED_PEAKED)
    inputs = {"input_ids": np.array([[61, 128, 146, 92, 125]]), "attention_mask": np.ones((1, 5), np.int64)}
    options = dict(num_beams=5, num_return_sequences=5, max_length=18, eos_token_id=4)
    with torch.no_grad():
        hf = model.generate(**{k: torch.from_numpy(v) for k, v in inputs.items()}, **options, use_cache=False,
                            output_scores=True, return_dict_in_generate=True)
    generator = Generator(SearchBackend(model, bare_manifest(model)))
    elx = generator.generate(inputs, **options)
    assert np.array_equal(elx.sequences, hf.sequences.numpy())
    assert np.array_equal(elx.sequences_scores, hf.sequences_scores.float().numpy())
    with log_softmax_kernel("numpy"):
        numpy_ls = generator.generate(inputs, **options)
    assert np.array_equal(numpy_ls.sequences[:3], elx.sequences[:3])
    assert not np.array_equal(numpy_ls.sequences, elx.sequences)
    assert numpy_ls.sequences_scores[3] == numpy_ls.sequences_scores[4]  # the tie numpy's rounding made
    scalar = hf_on_cpu_kernels("t5", 420, T5_TIED_PEAKED, inputs, options)["DEFAULT"]
    assert np.array_equal(scalar, numpy_ls.sequences) and not np.array_equal(scalar, elx.sequences)
    stats = Stats("pinned")
    run_search_example(stats, "t5", 420, T5_TIED_PEAKED, inputs, dict(options, early_stopping="never"))
    assert not stats.failures and stats.kernel_examples == 0 and stats.identical_rows == stats.rows == 5, \
        stats.summary()


# search-only, T5 (gated-gelu, tied, d_model 4, initializer_factor 4): long run, ELX_DIFF_SEED=2027
T5_TINY_PEAKED = {"vocab_size": 225, "d_model": 4, "d_kv": 4, "num_heads": 1, "d_ff": 64, "num_layers": 2,
                  "num_decoder_layers": 1, "feed_forward_proj": "gated-gelu", "tie_word_embeddings": True,
                  "initializer_factor": 4.0, "relative_attention_num_buckets": 8}


def test_near_tie_hf_decides_alike_on_every_cpu_kernel():
    """Found by the seed-2027 long run (issue 10's last item): beams 2, 2 returned; HF's scalar, AVX2
    and AVX-512 kernels agree.  numpy's log-softmax rounds one near-tie the other way (a row differs);
    HF's kernel, which elx's search calls, gives HF's rows."""
    from tests.differential import log_softmax_kernel

    inputs = {"input_ids": np.array([[33, 0, 0, 0, 0, 0, 0, 0], [49, 143, 129, 55, 0, 0, 0, 0],
                                     [116, 133, 58, 60, 162, 160, 19, 129]]),
              "attention_mask": np.array([[1, 0, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0, 0], [1] * 8])}
    options = dict(num_beams=2, num_return_sequences=2, no_repeat_ngram_size=4, length_penalty=0.050306483465116125,
                   early_stopping="never", max_length=19)
    stats = Stats("pinned")
    run_search_example(stats, "t5", 346, T5_TINY_PEAKED, inputs, options)
    assert not stats.failures and stats.kernel_examples == 0 and stats.identical_rows == stats.rows == 6, \
        stats.summary()
    with log_softmax_kernel("numpy"):
        numpy_stats = Stats("pinned")
        run_search_example(numpy_stats, "t5", 346, T5_TINY_PEAKED, inputs, options)
    assert [f["kind"] for f in numpy_stats.failures] == ["divergence"], numpy_stats.summary()
    assert 0 < numpy_stats.identical_rows < numpy_stats.rows


# search-only, T5 (relu, untied, initializer_factor 4): long run, ELX_DIFF_SEED=2026
T5_RELU_UNTIED = {"vocab_size": 359, "d_model": 16, "d_kv": 4, "num_heads": 2, "d_ff": 32, "num_layers": 1,
                  "num_decoder_layers": 1, "feed_forward_proj": "relu", "tie_word_embeddings": False,
                  "initializer_factor": 4.0, "relative_attention_num_buckets": 32}


def test_done_item_with_tied_scores_gets_hf_later_merges():
    """Item 0 is done at step 17 with two finished hypotheses of exactly equal score (one has an extra
    token of log-prob 0.0).  elx dropped the item from the batch; HF ran one more merge for it, whose
    ``torch.topk`` swapped the two equal scores (returned rows 1 and 2 came out swapped).  An item whose
    finished scores tie now stays in the batch until HF's search stops.  Alone, the item passed."""
    ids = np.array([[54, 201, 210, 34, 43, 340, 229, 75, 16, 323, 90, 272, 28, 321, 121],
                    [50, 11, 344, 142, 264, 313, 151, 206, 179, 87, 248, 232, 229, 0, 0]])
    inputs = {"input_ids": ids, "attention_mask": np.array([[1] * 15, [1] * 13 + [0, 0]])}
    options = dict(num_beams=3, num_return_sequences=3, no_repeat_ngram_size=2, length_penalty=0.0,
                   early_stopping="never", max_new_tokens=17, min_new_tokens=13, eos_token_id=351)
    stats = Stats("pinned")
    run_search_example(stats, "t5", 562, T5_RELU_UNTIED, inputs, options)
    assert stats.identical_rows == stats.rows == 6 and not stats.failures, stats.summary()


def test_repetition_penalty_skips_left_padding_as_transformers_5_24():
    """The GPU check's differential (H200, transformers 5.17 there): GPT-2, a left-padded batch, repetition
    penalty, top_k=1 beam sampling (greedy in effect), n-gram blocking, sequence bias.  HF 5.17 and 5.23 give
    the padded items other beams in the last steps (``tools/check_transformers_range.sh 5.23.0``); elx follows
    5.24, the start of pyproject's range."""
    config = {"vocab_size": 244, "n_embd": 16, "n_head": 4, "n_layer": 2, "n_positions": 64, "n_inner": 32,
              "bos_token_id": 243, "eos_token_id": 243, "initializer_range": 0.6}
    ids = [[243] * 10 + [124, 93, 188, 43, 204, 161], [243] * 8 + [0, 78, 160, 100, 228, 50, 55, 52],
           [243] * 12 + [103, 160, 203, 139], [156, 180, 85, 54, 48, 63, 53, 196, 140, 16, 140, 70, 103, 221, 116, 106]]
    mask = [[0] * 10 + [1] * 6, [0] * 8 + [1] * 8, [0] * 12 + [1] * 4, [1] * 16]
    inputs = {"input_ids": np.array(ids, dtype=np.int64), "attention_mask": np.array(mask, dtype=np.int64)}
    options = {"num_beams": 3, "num_return_sequences": 2, "no_repeat_ngram_size": 3,
               "length_penalty": -1.0917011338344337e-290, "early_stopping": True, "max_new_tokens": 10,
               "min_new_tokens": 8, "do_sample": True, "seed": 776365252, "temperature": 0.7, "top_k": 1,
               "epsilon_cutoff": 0.05, "repetition_penalty": 2.414,
               "sequence_bias": [[[176], 1.08], [[228, 240], 0.23]], "renormalize_logits": True,
               "eos_token_id": [117, 243]}
    _search_case("gpt2", 468, config, inputs, options)
