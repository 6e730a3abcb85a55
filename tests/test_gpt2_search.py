"""elx's searches for decoder-only models on HF's own logits (float64 GPT-2) give HF ``generate``'s tokens.

No ONNX here: ``HfDecoderOnlyLogitsBackend`` hands the searches HF's logits (cast to float32 as
HF's searches do), so these tests pin the search semantics of decoder-only generation: left-padded
prompts of different lengths, HF's layout (sequences with the prompt), lengths counting the
padded prompt (max_length, min_length, the length penalty), n-grams over prompt + generated
tokens (pads included), early stopping variants, num_return_sequences, EOS/pad handling for a
model without a pad token, and an EOS frequent enough that hypotheses finish at different steps.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import elx.runners.search.search as search
from elx.runners.search.processors import build_processors
from elx.runners.search.settings import GenerationSettings
from tests.hf_reference import HfDecoderOnlyLogitsBackend

EOS = 1


@pytest.fixture(scope="module")
def peaked_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(5)
    config = GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=EOS,
                        eos_token_id=EOS, initializer_range=0.3)
    model = GPT2LMHeadModel(config).eval().double()
    rng = np.random.default_rng(5)
    lengths = [9, 4, 7]
    ids = np.full((3, 9), EOS, dtype=np.int64)  # HF pads with EOS when the model has no pad token
    mask = np.zeros((3, 9), dtype=np.int64)
    for i, n in enumerate(lengths):  # left padding, different prompt lengths
        ids[i, 9 - n:] = rng.integers(2, 96, size=n)
        mask[i, 9 - n:] = 1
    return model, {"input_ids": ids, "attention_mask": mask}


def _elx(model, inputs, eos=EOS, **options):
    settings = GenerationSettings(eos_token_id=[eos], pad_token_id=eos, max_positions=64, **options)
    backend = HfDecoderOnlyLogitsBackend(model)
    run = search.beam_search if settings.num_beams > 1 else search.greedy_search
    prompt = inputs["input_ids"]
    processors = build_processors(settings, prompt.shape[1])
    return run(backend, backend.encode(inputs), settings, processors, prompt=prompt)


def _hf(model, inputs, **options):
    with torch.no_grad():
        out = model.generate(**{k: torch.from_numpy(v) for k, v in inputs.items()}, use_cache=False,
                             pad_token_id=options.pop("pad_token_id", options.get("eos_token_id", EOS)),
                             return_dict_in_generate=True, output_scores=True, **options)
    return out


SETTINGS = [
    dict(max_new_tokens=10),
    dict(max_new_tokens=9, no_repeat_ngram_size=2),
    dict(num_beams=2, max_new_tokens=9),
    dict(num_beams=3, max_new_tokens=10, num_return_sequences=3),
    dict(num_beams=5, max_new_tokens=8, num_return_sequences=2, no_repeat_ngram_size=3),
    dict(num_beams=4, max_new_tokens=10, no_repeat_ngram_size=2, length_penalty=0.6, early_stopping=True),
    dict(num_beams=3, max_new_tokens=8, length_penalty=1.7, early_stopping="never"),
    dict(num_beams=3, max_new_tokens=8, length_penalty=-0.5, early_stopping=False),
    dict(num_beams=2, min_new_tokens=5, max_new_tokens=9),
    dict(num_beams=3, max_length=15),  # counts the padded prompt (9)
    dict(num_beams=3, min_length=13, max_length=17),
    dict(max_length=14),
]


@pytest.mark.parametrize("eos_kind", ["rare", "frequent"])
@pytest.mark.parametrize("options", SETTINGS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_search_on_hf_logits_is_hf(peaked_gpt2, options, eos_kind):
    model, inputs = peaked_gpt2
    eos = EOS if eos_kind == "rare" else _frequent_token(model, inputs)  # (computed once)
    result = _elx(model, inputs, eos=eos, **options)
    hf = _hf(model, inputs, eos_token_id=eos, **options)
    np.testing.assert_array_equal(result.sequences, hf.sequences.numpy())
    if options.get("num_beams", 1) > 1:
        # HF's float32 log-softmax and elx's may differ in the last bit (summation order): scores to ~1 ulp
        np.testing.assert_allclose(result.scores, hf.sequences_scores.numpy(), rtol=1e-6, atol=1e-6)


_FREQUENT = {}


def _frequent_token(model, inputs) -> int:
    """A token the model emits often, so that as EOS it ends hypotheses at different steps."""
    if id(model) in _FREQUENT:
        return _FREQUENT[id(model)]
    generated = _hf(model, inputs, max_new_tokens=12).sequences.numpy()[:, inputs["input_ids"].shape[1]:]
    values, counts = np.unique(generated, return_counts=True)
    _FREQUENT[id(model)] = int(values[np.argmax(counts)])
    return _FREQUENT[id(model)]


def test_frequent_eos_finishes_hypotheses_early(peaked_gpt2):
    """The "frequent" EOS really ends sequences before max_new_tokens (the case the settings above exercise)."""
    model, inputs = peaked_gpt2
    eos = _frequent_token(model, inputs)
    width = inputs["input_ids"].shape[1]
    for options in (dict(max_new_tokens=10), dict(num_beams=3, max_new_tokens=10, num_return_sequences=3)):
        sequences = _elx(model, inputs, eos=eos, **options).sequences
        generated = sequences[:, width:]
        assert (generated == eos).any()
        assert any(eos in row[:-1] for row in generated.tolist())  # finished before the last step


def test_ngrams_count_the_prompt_and_its_padding(peaked_gpt2):
    """HF blocks n-grams over the whole row, the prompt and its left padding included: after
    ``[pad pad 7 9 7]`` with n=2 the prompt's bigram (7, 9) bans 9; after ``[pad pad 7 9 pad]`` the
    padding's bigrams (pad, pad) and (pad, 7) ban pad and 7.  elx's search then equals HF's."""
    from elx.runners.search.processors import NoRepeatNGram

    row = np.array([[EOS, EOS, 7, 9, 7]], dtype=np.int64)
    scores = np.zeros((1, 12), dtype=np.float32)
    NoRepeatNGram(2)(row, scores)
    assert np.isneginf(scores[0, 9]) and np.isfinite(scores[0, EOS])  # (7, 9) seen in the prompt: 9 banned
    row = np.array([[EOS, EOS, 7, 9, EOS]], dtype=np.int64)
    scores = np.zeros((1, 12), dtype=np.float32)
    NoRepeatNGram(2)(row, scores)
    assert np.isneginf(scores[0, EOS]) and np.isneginf(scores[0, 7])  # pads count: (pad, pad) and (pad, 7) seen
    model, inputs = peaked_gpt2
    options = dict(num_beams=2, max_new_tokens=6, no_repeat_ngram_size=2)
    ours = _elx(model, inputs, **options).sequences
    np.testing.assert_array_equal(ours, _hf(model, inputs, **options).sequences.numpy())
    assert (ours[:, : inputs["input_ids"].shape[1]] == inputs["input_ids"]).all()  # HF's layout: the prompt first


def test_positions_and_masks_are_hfs():
    """runners/inputs/prompt.py against transformers' own helpers: prompt positions (cumsum − 1, 0 at padding),
    generated positions (last prompt position + 1 + g, right padding included) and the growing mask."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from elx.runners.inputs.prompt import Prompt, prompt_positions, sequence_positions

    model = GPT2LMHeadModel(GPT2Config(vocab_size=16, n_embd=8, n_layer=1, n_head=2, n_positions=32))
    mask = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=np.int64)  # left, none, right
    ids = torch.ones(3, 5, dtype=torch.long)
    kwargs = {"attention_mask": torch.from_numpy(mask)}
    hf = model._prepare_position_ids_for_generation(ids, kwargs)
    np.testing.assert_array_equal(prompt_positions(mask), hf.numpy())
    kwargs["position_ids"] = hf
    for _ in range(4):  # four generated tokens
        kwargs = model._update_model_kwargs_for_generation(CausalLMOutputWithPast(), kwargs)
    np.testing.assert_array_equal(sequence_positions(mask, 9), kwargs["position_ids"].numpy())
    prompt = Prompt.from_mask(mask)
    rows = 6  # two beams per item
    np.testing.assert_array_equal(prompt.step_positions(rows, 7, 1), np.repeat(kwargs["position_ids"].numpy()[:, 7:8], 2, 0))
    np.testing.assert_array_equal(prompt.step_mask(rows, 9), np.repeat(kwargs["attention_mask"].numpy(), 2, 0))
