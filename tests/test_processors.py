"""Each host logits processor against HF's own class on the same arrays, bit for bit (issue 25 items 2 and 3).

Hypothesis draws rows, vocabularies, histories, encoder ids and float32 scores with the awkward values
the searches meet (exact ties, -inf from earlier bans, negative and positive scores); HF's processor runs on
torch tensors of the same arrays, elx's on numpy (in place, the searches' arrays).  The warpers' numpy
fallbacks (no PyTorch) are checked against the PyTorch path on seeded rows.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers.generation import logits_process as hf

from elx.runners.search.log_softmax import ENV
from elx.runners.search.processors import bias
from elx.runners.search.processors import masks
from elx.runners.search.processors import penalties
from elx.runners.search.processors import warpers

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@st.composite
def arrays(draw, min_vocab: int = 2):
    """(items, beams, tokens [items·beams, cur_len], scores [items·beams, vocab], encoder ids [items, S], rng)."""
    items, beams = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    vocab, cur_len = draw(st.integers(min_vocab, 40)), draw(st.integers(1, 9))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    rows = items * beams
    scores = (rng.standard_normal((rows, vocab)) * draw(st.sampled_from([0.5, 3.0, 20.0]))).astype(np.float32)
    scores[rng.random((rows, vocab)) < draw(st.sampled_from([0.0, 0.1, 0.4]))] = -np.inf
    if draw(st.booleans()):  # exact ties
        scores = np.round(scores)
    tokens = rng.integers(0, vocab + draw(st.integers(0, 2)), size=(rows, cur_len))  # ids past the vocab too
    encoder = rng.integers(0, vocab, size=(items, draw(st.integers(1, 8))))
    return items, beams, tokens, scores, encoder, rng


def _same(hf_out: torch.Tensor, elx_out: np.ndarray) -> None:
    expected = hf_out.numpy()
    assert elx_out.dtype == expected.dtype == np.float32
    np.testing.assert_array_equal(elx_out, expected)


def _run(processor, tokens, scores, items=None):
    return processor(tokens, scores.copy(), items)


def _hf(processor, tokens, scores):
    return processor(torch.from_numpy(tokens), torch.from_numpy(scores.copy()))


@SETTINGS
@given(arrays(), st.sampled_from([0.3, 0.77, 1.3, 2.0]), st.booleans())
def test_repetition_penalty(data, penalty, padded):
    items, beams, tokens, scores, _, rng = data
    padding = rng.integers(0, tokens.shape[1] + 1, size=items) if padded else None
    rows_padding = None if padding is None else torch.from_numpy(np.repeat(padding, beams))
    expected = _hf(hf.RepetitionPenaltyLogitsProcessor(penalty, prompt_ignore_length=rows_padding), tokens, scores)
    _same(expected, _run(penalties.RepetitionPenalty(penalty, padding), tokens, scores,
                         np.repeat(np.arange(items), beams)))


@SETTINGS
@given(arrays(), st.sampled_from([0.5, 1.3, 3.0]))
def test_encoder_repetition_penalty(data, penalty):
    items, beams, tokens, scores, encoder, _ = data
    expected = _hf(hf.EncoderRepetitionPenaltyLogitsProcessor(penalty, torch.from_numpy(encoder)), tokens, scores)
    _same(expected, _run(penalties.EncoderRepetitionPenalty(penalty, encoder), tokens, scores,
                         np.repeat(np.arange(items), beams)))


@SETTINGS
@given(arrays(), st.integers(1, 4))
def test_encoder_no_repeat_ngram(data, n):
    items, beams, tokens, scores, encoder, _ = data
    tokens = tokens % scores.shape[1]
    expected = _hf(hf.EncoderNoRepeatNGramLogitsProcessor(n, torch.from_numpy(encoder)), tokens, scores)
    _same(expected, _run(masks.EncoderNoRepeatNGram(n, encoder), tokens, scores, np.repeat(np.arange(items), beams)))


@st.composite
def sequences(draw, vocab: int, biased: bool):
    """[[ids], bias] pairs: one- to three-token sequences, some sharing last tokens and prefixes."""
    pairs = []
    for _ in range(draw(st.integers(1, 6))):
        ids = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=3))
        value = draw(st.sampled_from([-2.5, -0.5, 0.75, 3.0, float(np.float32(0.1))])) if biased else float("-inf")
        pairs.append([ids, value])
    return pairs


@SETTINGS
@given(st.data())
def test_sequence_bias(data):
    items, beams, tokens, scores, _, _ = data.draw(arrays())
    vocab = scores.shape[1]
    tokens = tokens % vocab
    pairs = data.draw(sequences(vocab, biased=True))
    expected = _hf(hf.SequenceBiasLogitsProcessor(sequence_bias=pairs), tokens, scores)
    _same(expected, _run(bias.SequenceBias(pairs), tokens, scores))


@SETTINGS
@given(st.data())
def test_bad_words(data):
    items, beams, tokens, scores, _, _ = data.draw(arrays())
    vocab = scores.shape[1]
    tokens = tokens % vocab
    words = [ids for ids, _ in data.draw(sequences(vocab, biased=False))]
    eos = [data.draw(st.integers(0, vocab - 1))]
    if all(w == eos for w in words):
        words.append([(eos[0] + 1) % vocab, eos[0]])
    expected = _hf(hf.NoBadWordsLogitsProcessor(words, eos), tokens, scores)
    _same(expected, _run(bias.BadWords(words, eos), tokens, scores))


@SETTINGS
@given(arrays(), st.integers(2, 5))
def test_prefix_constrained(data, m):
    items, beams, tokens, scores, _, _ = data
    vocab = scores.shape[1]

    def allowed(batch_id, sent):
        return [t for t in range(vocab) if (t + int(sent[-1]) + batch_id) % m != 0] or [0]

    expected = _hf(hf.PrefixConstrainedLogitsProcessor(allowed, beams), tokens, scores)
    _same(expected, _run(masks.PrefixConstrained(allowed, beams), tokens, scores))


@SETTINGS
@given(arrays(), st.integers(0, 6), st.sampled_from([0.8, 1.01, 1.5, 2, 3.0]), st.integers(0, 3))
def test_exponential_decay_length_penalty(data, start, factor, prompt_len):
    _, _, tokens, scores, _, rng = data
    eos = sorted(set(rng.integers(0, scores.shape[1], size=2).tolist()))
    expected = _hf(hf.ExponentialDecayLengthPenalty((start, factor), eos, prompt_len), tokens, scores)
    _same(expected, _run(penalties.ExponentialDecayLengthPenalty(start, factor, eos, prompt_len), tokens, scores))


@SETTINGS
@given(arrays())
def test_remove_invalid_values_and_renormalize(data):
    _, _, tokens, scores, _, rng = data
    scores[rng.random(scores.shape) < 0.1] = np.nan
    scores[rng.random(scores.shape) < 0.1] = np.inf
    _same(_hf(hf.InfNanRemoveLogitsProcessor(), tokens, scores),
          _run(penalties.RemoveInvalidValues(), tokens, scores))
    finite = np.nan_to_num(scores, nan=0.0, posinf=1.0, neginf=-np.inf)
    _same(_hf(hf.LogitNormalization(), tokens, finite), _run(penalties.Renormalize(), tokens, finite))


WARPERS = {
    "temperature": (lambda keep: hf.TemperatureLogitsWarper(0.7), lambda keep: warpers.Temperature(0.7)),
    "temperature-2": (lambda keep: hf.TemperatureLogitsWarper(2.3), lambda keep: warpers.Temperature(2.3)),
    "top_k": (lambda keep: hf.TopKLogitsWarper(3, min_tokens_to_keep=keep), lambda keep: warpers.TopK(3, keep)),
    "top_p": (lambda keep: hf.TopPLogitsWarper(0.8, min_tokens_to_keep=keep), lambda keep: warpers.TopP(0.8, keep)),
    "top_p-0": (lambda keep: hf.TopPLogitsWarper(0.0, min_tokens_to_keep=keep), lambda keep: warpers.TopP(0.0, keep)),
    "min_p": (lambda keep: hf.MinPLogitsWarper(0.1, min_tokens_to_keep=keep), lambda keep: warpers.MinP(0.1, keep)),
    "typical": (lambda keep: hf.TypicalLogitsWarper(0.6, min_tokens_to_keep=keep),
                lambda keep: warpers.Typical(0.6, keep)),
    "epsilon": (lambda keep: hf.EpsilonLogitsWarper(0.02, min_tokens_to_keep=keep),
                lambda keep: warpers.Epsilon(0.02, keep)),
    "eta": (lambda keep: hf.EtaLogitsWarper(0.02, min_tokens_to_keep=keep), lambda keep: warpers.Eta(0.02, keep)),
    "top_h": (lambda keep: hf.TopHLogitsWarper(0.5), lambda keep: warpers.TopH(0.5)),
}


@pytest.mark.parametrize("name", sorted(WARPERS))
@SETTINGS
@given(data=arrays(min_vocab=3), keep=st.integers(1, 3))
def test_warpers_are_hf(name, data, keep):
    _, _, tokens, scores, _, _ = data
    scores[:, 0] = np.maximum(scores[:, 0], 0.0)  # a finite best token per row, as sampling needs
    make_hf, make_elx = WARPERS[name]
    _same(_hf(make_hf(keep), tokens, scores), _run(make_elx(keep), tokens, scores))


@pytest.mark.parametrize("name", sorted(WARPERS))
def test_warpers_numpy_fallback(name, monkeypatch):
    """Without PyTorch the same definition in numpy keeps the same tokens on rows without rounding-level ties."""
    rng = np.random.default_rng(25)
    scores = (rng.standard_normal((64, 300)) * 2.0).astype(np.float32)
    tokens = rng.integers(0, 300, size=(64, 4))
    _, make_elx = WARPERS[name]
    with_torch = _run(make_elx(2), tokens, scores)
    monkeypatch.setenv(ENV, "numpy")
    without = _run(make_elx(2), tokens, scores)
    np.testing.assert_array_equal(np.isneginf(without), np.isneginf(with_torch))
    np.testing.assert_allclose(without, with_torch, rtol=1e-6)


def test_warpers_in_hf_order():
    """``build_warpers`` builds HF's list for the same settings, in HF's order, with HF's min_tokens_to_keep."""
    from transformers import GenerationConfig, T5Config, T5ForConditionalGeneration

    from elx.runners.search.settings import GenerationSettings

    options = dict(do_sample=True, temperature=0.5, top_h=0.4, top_k=7, top_p=0.9, min_p=0.1, typical_p=0.8,
                   epsilon_cutoff=0.01, eta_cutoff=0.02)
    model = T5ForConditionalGeneration(T5Config(vocab_size=32, d_model=8, d_kv=2, d_ff=8, num_layers=1, num_heads=2,
                                                eos_token_id=[1, 2], decoder_start_token_id=0))
    for beams in (1, 3):
        config = GenerationConfig(**options, num_beams=beams, decoder_start_token_id=0, eos_token_id=[1, 2])
        model._prepare_special_tokens(config, device="cpu")
        built = model._get_logits_processor(config, input_ids_seq_length=1, device="cpu")
        ours = warpers.build_warpers(GenerationSettings(**options, num_beams=beams, eos_token_id=[1, 2]), 2)
        assert [p.hf for p in ours] == [type(p).__name__ for p in built]
        assert [getattr(p, "min_keep", None) for p in ours] == [getattr(p, "min_tokens_to_keep", None) for p in built]
