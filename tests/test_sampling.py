"""Seeded sampling gives HF's tokens (issue 25 item 2): ``torch.manual_seed(s); model.generate(do_sample=True)``
equals elx's ``generate(do_sample=True, seed=s)``, greedy and beam sampling, with HF's warpers.

elx's searches run on HF's own float64 logits (``tests/differential.py``), so a difference can only come
from the draws, the warpers or the search.  Rows that finish early leave elx's batch; the draws still
cover HF's whole matrix (``runners/search/sampling.py``), which the early-EOS cases check.  Without PyTorch (or
with ``ELX_LOG_SOFTMAX=numpy``) numpy's generator is reproducible for a seed.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import elx.runners.search.sampling as sampling
from elx.runners.generate import Generator
from elx.runners.search.log_softmax import ENV
from tests.differential import DECODER_ONLY, bare_manifest, build_fp64, frequent_tokens, hf_search, search_backend

CONFIGS = {
    "t5": dict(vocab_size=80, d_model=16, d_kv=4, num_heads=4, d_ff=16, num_layers=1, num_decoder_layers=1,
               initializer_factor=2.0),
    "gpt2": dict(vocab_size=70, n_embd=16, n_head=2, n_layer=1, n_positions=64, bos_token_id=69, eos_token_id=69,
                 initializer_range=0.6),
    "bart": dict(vocab_size=90, d_model=16, encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=8,
                 decoder_ffn_dim=8, encoder_layers=1, decoder_layers=1, init_std=0.6),
}
RUNS = [dict(max_new_tokens=10),
        dict(max_new_tokens=10, temperature=0.6, top_k=12, top_p=0.9),
        dict(max_new_tokens=10, num_return_sequences=3, min_p=0.05, typical_p=0.8, repetition_penalty=1.3),
        dict(max_new_tokens=10, epsilon_cutoff=0.01, eta_cutoff=0.02, top_h=0.7),
        dict(max_new_tokens=8, num_beams=3, num_return_sequences=2, top_k=10, temperature=1.5),
        dict(max_new_tokens=8, num_beams=2, top_p=0.8, no_repeat_ngram_size=2)]


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model_and_inputs(request):
    torch.set_num_threads(1)
    family = request.param
    model = build_fp64(family, 7, CONFIGS[family])
    vocab = CONFIGS[family]["vocab_size"]
    ids = np.random.default_rng(7).integers(3, vocab - 2, size=(3, 6))
    mask = np.ones_like(ids)
    if family in DECODER_ONLY:  # left-padded prompt
        ids[1, :2], mask[1, :2] = vocab - 1, 0
    return family, model, Generator(search_backend(model, bare_manifest(model))), {"input_ids": ids,
                                                                                   "attention_mask": mask}


@pytest.mark.parametrize("run", RUNS, ids=lambda r: ",".join(r))
@pytest.mark.parametrize("seed", [0, 2026])
def test_seeded_sampling_is_hf(model_and_inputs, run, seed):
    family, model, generator, inputs = model_and_inputs
    options = dict(run, do_sample=True, seed=seed)
    hf, _ = hf_search(model, inputs, options, model.config.vocab_size)
    np.testing.assert_array_equal(generator.generate(inputs, **options).sequences, hf)


@pytest.mark.parametrize("beams", [1, 3])
def test_rows_that_finish_early_keep_hf_draws(model_and_inputs, beams):
    """A frequent token as EOS: rows (items) finish at different steps and leave elx's batch, HF's keep drawing."""
    family, model, generator, inputs = model_and_inputs
    eos = frequent_tokens(model, inputs, family)[:2]
    options = dict(do_sample=True, seed=11, max_new_tokens=12, num_beams=beams, eos_token_id=eos, temperature=2.0)
    hf, _ = hf_search(model, inputs, options, model.config.vocab_size)
    out = generator.generate(inputs, **options)
    np.testing.assert_array_equal(out.sequences, hf)
    prompt = inputs["input_ids"].shape[1] if family in DECODER_ONLY else 1
    assert np.isin(out.sequences[:, prompt:-1], eos).any(), "the case must finish a row before the last step"


def test_without_a_seed_torch_manual_seed_decides(model_and_inputs):
    """seed unset: PyTorch's global generator, as HF uses it (so ``torch.manual_seed`` works for both)."""
    family, model, generator, inputs = model_and_inputs
    options = dict(do_sample=True, max_new_tokens=10)
    hf, _ = hf_search(model, inputs, dict(options, seed=5), model.config.vocab_size)
    torch.manual_seed(5)
    np.testing.assert_array_equal(generator.generate(inputs, **options).sequences, hf)


def test_numpy_generator_is_reproducible(model_and_inputs, monkeypatch):
    family, model, generator, inputs = model_and_inputs
    monkeypatch.setenv(ENV, "numpy")
    state = torch.get_rng_state()
    runs = {seed: generator.generate(inputs, do_sample=True, seed=seed, max_new_tokens=12, temperature=2.0).sequences
            for seed in (1, 1, 2)}
    again = generator.generate(inputs, do_sample=True, seed=1, max_new_tokens=12, temperature=2.0).sequences
    np.testing.assert_array_equal(runs[1], again)
    assert not np.array_equal(runs[1], runs[2])
    assert torch.equal(torch.get_rng_state(), state), "the numpy generator leaves PyTorch's alone"
    assert sampling.Sampler(1, 3).torch is None


def test_the_full_matrix_matters(model_and_inputs, monkeypatch):
    """Drawing over the running rows only (not HF's whole matrix) gives other tokens once rows finish: the
    early-EOS case above checks something real."""
    family, model, generator, inputs = model_and_inputs
    eos = frequent_tokens(model, inputs, family)[:2]
    options = dict(do_sample=True, seed=11, max_new_tokens=12, eos_token_id=eos, temperature=2.0)
    hf, _ = hf_search(model, inputs, options, model.config.vocab_size)
    monkeypatch.setattr(sampling.Sampler, "_full", lambda self, probs, active: probs)
    monkeypatch.setattr(sampling.Sampler, "tokens", _running_rows_only)
    assert not np.array_equal(generator.generate(inputs, **options).sequences, hf)


def _running_rows_only(self, scores, active):
    probs = torch.softmax(torch.from_numpy(scores), dim=-1)
    return torch.multinomial(probs, 1, generator=self.generator).squeeze(1).numpy()


@pytest.mark.parametrize("family,passes", [("t5", None), ("bart", "ngram=2"), ("gpt2", None)])
def test_exports_sample_hf_tokens(exported, family, passes):
    """On ONNX Runtime too (fp32 graphs, logits within 1e-4 of PyTorch's): seeded greedy and beam sampling, a
    repeated input for num_return_sequences, the ngram pass's blocked log-probs under beam sampling."""
    from elx.exporter.verification.hf_reference import torch_inputs as _torch_inputs
    from elx.exporter.source.load import reload_model

    generator = Generator.from_folder(exported(family, passes), threads=1)
    model = reload_model(generator.manifest.data["source"]).eval()
    vocab = generator.manifest.dims["vocab_size"]
    ids = np.random.default_rng(1).integers(3, vocab - 2, size=(2, 6))
    mask = np.ones_like(ids)
    if family in DECODER_ONLY:
        ids[1, :2], mask[1, :2] = generator.rules.pad_token(generator.manifest), 0
    inputs = {"input_ids": ids, "attention_mask": mask}
    for options in (dict(do_sample=True, num_return_sequences=3, max_new_tokens=8, top_k=10),
                    dict(do_sample=True, num_beams=3, max_new_tokens=8, no_repeat_ngram_size=2, top_p=0.9)):
        torch.manual_seed(9)
        with torch.no_grad():
            hf = model.generate(**_torch_inputs(inputs), **options).numpy()
        np.testing.assert_array_equal(generator.generate(inputs, seed=9, **options).sequences, hf)


def test_sampling_and_processors_without_torch(tmp_path, exported):
    """The runtime without PyTorch (an interpreter where importing it fails): numpy's generator and warpers,
    the same tokens for the same seed, other tokens for another seed."""
    from tests.test_runtime_imports import _run

    proc = _run(tmp_path, """
        import sys, elx
        g = elx.Generator.from_folder(sys.argv[1])
        run = lambda seed, beams: g.generate(input_ids=[[5, 6, 7, 8], [9, 10]], do_sample=True, seed=seed,
                                             num_beams=beams, max_new_tokens=8, top_p=0.9, typical_p=0.95,
                                             min_p=0.01, eta_cutoff=0.001, repetition_penalty=1.3,
                                             num_return_sequences=2).sequences.tolist()
        assert run(3, 1) == run(3, 1) and run(3, 2) == run(3, 2) and run(3, 1) != run(4, 1)
        assert "torch" not in sys.modules and "transformers" not in sys.modules
        print("ok")
        """, str(exported("t5")))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ok")
