"""The stability rule's cached float64 reference (``HfDecoderOnlyCachedBackend``): elx's searches on HF's logits
computed with HF's own key/value cache give what they give on the uncached history, and HF's cached ``generate``,
for every search the rule runs (greedy, beams with reorders and several returned rows, seeded sampling, and
perturbed logits)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from elx.exporter.verification.hf_reference import (DecoderOnlyCachedSearchBackend, DecoderOnlySearchBackend,
                                                    hf_generate)
from elx.runners.generate import Generator
from tests.differential import bare_manifest, build_fp64

SETTINGS = [dict(max_new_tokens=7), dict(max_new_tokens=7, num_beams=3, num_return_sequences=2),
            dict(max_new_tokens=6, num_beams=4, no_repeat_ngram_size=2, length_penalty=0.7),
            dict(max_new_tokens=6, do_sample=True, top_k=20, seed=3)]


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def model(request):
    torch.set_num_threads(1)
    return build_fp64(request.param, 4, {})


def _prompts(model):
    vocab = model.config.vocab_size
    ids = np.random.default_rng(7).integers(3, vocab, size=(2, 5))
    mask = np.ones_like(ids)
    mask[1, :2] = 0  # left padding
    ids[1, :2] = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize("options", SETTINGS, ids=lambda o: "-".join(f"{k}{v}" for k, v in o.items()))
def test_cached_reference_is_the_uncached_one(model, options):
    manifest = bare_manifest(model)
    inputs = _prompts(model)
    runs = {}
    for perturbation in (None, (3e-2, 1)):
        uncached = Generator(DecoderOnlySearchBackend(model, manifest, perturbation)).generate(inputs, **options)
        cached = Generator(DecoderOnlyCachedSearchBackend(model, manifest, perturbation)).generate(inputs, **options)
        np.testing.assert_array_equal(cached.sequences, uncached.sequences)
        runs[perturbation] = cached.sequences
    if "seed" not in options:
        hf = hf_generate(model, inputs, dict(options, use_cache=True, pad_token_id=model.config.eos_token_id))
        np.testing.assert_array_equal(runs[None], hf)


def test_cached_logits_and_a_cache_stepped_twice(model):
    """The cached step's logits = the uncached step's (float64 rounding), and a cache stepped from twice (or
    reordered) is left as it was: each step works on a fork."""
    manifest = bare_manifest(model)
    inputs = _prompts(model)
    cached, uncached = DecoderOnlyCachedSearchBackend(model, manifest), DecoderOnlySearchBackend(model, manifest)
    states = [b.encode(inputs) for b in (cached, uncached)]
    caches = [b.empty_cache(2) for b in (cached, uncached)]
    first = [b.step(inputs["input_ids"], s, c) for b, s, c in zip((cached, uncached), states, caches)]
    np.testing.assert_allclose(first[0][0], first[1][0], atol=1e-6)  # the logits leave as float32
    start = first[0][1]
    length = start.arrays["past"].get_seq_length()
    for token in (5, 9):
        step = np.full((2, 1), token)
        a = cached.step(step, states[0], start)[0]
        b = uncached.step(step, states[1], first[1][1])[0]
        np.testing.assert_allclose(a, b, atol=1e-6)
        assert start.arrays["past"].get_seq_length() == length
    swapped = cached.reorder(start, np.array([1, 0]))
    assert torch.equal(swapped.arrays["past"].layers[0].keys[0], start.arrays["past"].layers[0].keys[1])
    assert cached.cache_bytes(start) > start.arrays["history"].nbytes


def test_compare_runs_the_rule_on_the_cache(exported, model_folders, monkeypatch):
    """``compare``'s stability rule on a decoder-only export's differing rows goes through the cached reference: an
    export that decided ties otherwise (here: elx's search on HF's float64 logits with large seeded noise) has rows
    that differ; for each, elx's search on the unperturbed float64 cache reproduces HF's cached float64 ``generate``
    (rule 3's first half), and the margin ladder ran."""
    import elx.exporter.verification.hf_reference as hf_reference
    from elx.exporter.verification.compare import compare_loaded
    from elx.exporter.verification.stability import HfVariants
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_folders["llama"]).eval()
    generator = Generator.from_folder(exported("llama"), threads=1)
    fp64 = HfVariants(model).get("fp64")
    generator.generate = lambda *args, **kwargs: Generator(
        hf_reference.search_backend(fp64, generator.manifest, (2.0, 0))).generate(*args, **kwargs)  # uncached
    steps = []
    real_step = hf_reference.HfDecoderOnlyCachedBackend.step
    monkeypatch.setattr(hf_reference.HfDecoderOnlyCachedBackend, "step",
                        lambda self, *a, **k: steps.append(1) or real_step(self, *a, **k))
    report = compare_loaded(generator, model, batch_size=3, input_length=6, seed=1, num_beams=2, max_new_tokens=6,
                            variants=HfVariants(model))
    moved = [r for r in report.rows if not r.identical]
    assert moved, "noise of ±2 moved no row"
    assert steps, "the rule's float64 searches did not run on HF's cache"
    for row in moved:
        assert row.stability.search_agrees is True
        assert row.stability.margin is not None or row.stability.margin_bound is not None
