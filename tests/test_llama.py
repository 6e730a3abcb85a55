"""Llama-family (RoPE decoder-only) exports: graphs and manifest, verification, HF-identical generation.

conftest's tiny models of each family (``ROPE_BUILDERS``): Llama with GQA and Llama 3's rotary
scaling, Mistral (MQA, a sliding window), Qwen2 (MHA, non-zero q/k/v biases, tied head), Qwen3
(q/k norms, head_dim ≠ d/h), Phi-3 (fused projections, partial rotary), Gemma (embedding scale,
GeGLU, MQA), GPT-NeoX (partial rotary, parallel residual).  The CI run exports Llama in both
prompt-cache forms (the shared one is conftest's, shared with the differential test) and Qwen2;
``ELX_LONG_TESTS=1`` exports and checks every family.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from elx.exporter.verification.compare import compare
from elx.exporter.verification.verify import DECODER_ONLY_SHAPES, Shape, verify_export, verify_rewrite
from elx.runners.errors import ElxError
from elx.runners.generate import Generator
from elx.runners.inputs.random_inputs import random_inputs
from elx.runners.manifest import Manifest
from tests.conftest import ROPE_BUILDERS, make_model_folder
from tests.differential import decoder_only_lengths, generation_options

LONG = bool(os.environ.get("ELX_LONG_TESTS"))
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def llama(exported, model_folders):
    """Llama (GQA, llama3 RoPE): {"folder": model folder, "shared": conftest's export}."""
    return {"folder": model_folders["llama"], "shared": exported("llama")}


@pytest.fixture(scope="module")
def qwen2(qwen2_exports):
    return qwen2_exports


def _check(report):
    assert report.all_identical, [(r.hf_tokens, r.elx_tokens) for r in report.rows if not r.identical]
    assert max(max(r.step_logits_diff) for r in report.rows) <= 1e-4


# -- export ------------------------------------------------------------------------------------

def test_manifest_gqa_cache(llama):
    """Llama with 4 query heads and 2 key/value heads: the cache and the shared prompt's K/V have 2 heads."""
    manifest = Manifest.load(llama["shared"])
    data = manifest.data
    assert data["family"] == "llama" and data["architecture"] == "LlamaForCausalLM"
    assert data["is_encoder_decoder"] is False and data["padding_side"] == "left"
    dims = manifest.dims
    assert (dims["num_heads"], dims["num_kv_heads"], dims["d_kv"], dims["rotary_dim"]) == (4, 2, 8, 8)
    assert dims["rope_type"] == "llama3" and "sliding_window" not in dims
    for entry in manifest.cache_entries:
        assert entry["shape"] == ["rows", 2, "past_sequence", 8]
    step = manifest.graphs["decoder"]["inputs"]
    assert step["prompt_key_values.1.value"]["shape"] == ["batch", 2, "prompt_sequence", 8]
    assert manifest.graphs["prefill"]["outputs"]["present.0.key"]["shape"] == ["batch", 2, "prompt_sequence", 8]
    report = data["verification"]["export"]
    assert report["max_abs_logits_diff"] <= 1e-4 and len(report["shapes"]) == len(DECODER_ONLY_SHAPES)


def _verified(model, form: str, shapes: tuple, seed: int) -> float:
    from elx.exporter.source.load import resolve_model

    torch_model = resolve_model(str(model["folder"])).model
    return verify_export(torch_model, Manifest.load(model[form]), shapes=shapes, seed=seed)["max_abs_logits_diff"]


@pytest.mark.parametrize("which", ["llama-shared", "qwen2-per-beam"])
def test_verified_at_new_shapes_and_positions(llama, qwen2, which):
    """Batch 1 and 5, beams 1..5, prompts of 3..40 (left-padded; positions past the llama3 scaling's 32)."""
    model, form = (llama, "shared") if which == "llama-shared" else (qwen2, "per-beam")
    shapes = (Shape(1, 5, 3, 0), Shape(5, 1, 13, 9), Shape(2, 2, 40, 1), Shape(3, 4, 6, 30))
    assert _verified(model, form, shapes, seed=7) <= 1e-4


def test_verification_sees_rotary_positions(llama, monkeypatch):
    """The check can fail: with the prompt's positions two apart (HF: consecutive) the rotations differ and the
    same graphs disagree with PyTorch.  (RoPE scores depend on position differences only: positions counted from
    the padded start, a shift per row, would give the same logits.)"""
    from elx.runners.inputs.prompt import prompt_positions
    import elx.runners.model as model_module

    monkeypatch.setattr(model_module.Prompt, "from_mask",
                        classmethod(lambda cls, m: cls(np.asarray(m, dtype=np.int64), 2 * prompt_positions(m))))
    assert _verified(llama, "shared", (Shape(2, 2, 9, 0),), seed=3) > 2e-4  # the tolerance is 1e-4


def test_shared_prompt_equals_per_beam_cache(qwen2):
    shapes = (*DECODER_ONLY_SHAPES, Shape(3, 5, 16, 10))
    report = verify_rewrite(Manifest.load(qwen2["per-beam"]), Manifest.load(qwen2["shared"]), shapes=shapes, seed=11)
    assert report["max_abs_logits_diff"] <= 1e-5


def test_live_cache_bytes_count_key_value_heads(llama):
    """Per token and layer the cache holds K and V of the 2 key/value heads (not the 4 query heads): the prompt
    once per item, the generated tokens per row."""
    batch, width, beams, new = 3, 10, 4, 5
    dims = Manifest.load(llama["shared"]).dims
    per_token = 2 * dims["num_decoder_layers"] * dims["num_kv_heads"] * dims["d_kv"] * 4
    generator = Generator.from_folder(llama["shared"])
    inputs = random_inputs(generator.manifest, batch, width, np.random.default_rng(0))
    memory = generator.generate(inputs, num_beams=beams, max_new_tokens=new, min_new_tokens=new,
                                track_memory=True).memory
    for step, live in enumerate(memory):
        assert live["state_bytes"] == batch * width * per_token + batch * width * 8  # + the prompt mask
        assert live["cache_bytes"] == batch * beams * step * per_token


# -- generation vs HF --------------------------------------------------------------------------

@st.composite
def runs(draw):
    """A compare run (the differential test's option draws: beams 1–8, return sequences, n-grams, length penalty,
    early stopping, lengths), which export, batch, prompt width, seed, and an EOS list (Llama 3 has several)."""
    width = draw(st.integers(2, 12))
    options = decoder_only_lengths(draw(generation_options()), width)
    which = draw(st.sampled_from(["llama-shared", "qwen2-per-beam"]))
    eos = draw(st.sampled_from([None, "frequent", "frequent+default"]))
    return options, which, draw(st.integers(1, 4)), width, draw(st.integers(0, 2 ** 16)), eos


def _frequent_tokens(folder) -> list[int]:
    generator = Generator.from_folder(folder)
    inputs = random_inputs(generator.manifest, 3, 11, np.random.default_rng(1))
    generated = generator.generate(inputs, max_new_tokens=12).sequences[:, 11:]
    values, counts = np.unique(generated, return_counts=True)
    return [int(v) for v in values[np.argsort(-counts, kind="stable")]]


@example(run=(dict(num_beams=4, num_return_sequences=2, no_repeat_ngram_size=2, max_new_tokens=9), "llama-shared",
              3, 11, 1, "frequent+default"))
@example(run=(dict(num_beams=5, num_return_sequences=3, no_repeat_ngram_size=3, max_new_tokens=8), "qwen2-per-beam",
              3, 9, 2, None))
@example(run=(dict(max_new_tokens=10), "qwen2-per-beam", 2, 7, 5, "frequent"))
@settings(max_examples=5, deadline=None, derandomize=True, database=None)
@given(run=runs())
def test_identical_to_hf(llama, qwen2, run):
    """Drawn settings: elx's tokens and scores are HF generate's for left-padded prompts (Llama: GQA, the shared
    prompt; Qwen2: biases, HF's per-beam cache), with an EOS list of several ids (a frequent token first, so rows
    end at different steps)."""
    options, which, batch, width, seed, eos = run
    folder = llama["shared"] if which == "llama-shared" else qwen2["per-beam"]
    if eos is not None:
        frequent = _frequent_tokens(folder)[:2]
        options = {**options, "eos_token_id": frequent if eos == "frequent" else [*frequent, 2]}
    _check(compare(folder, batch_size=batch, input_length=width, seed=seed, **options))


# -- the other families ---------------------------------------------------------------------------

@pytest.mark.skipif(not LONG, reason="exports every RoPE family (minutes); set ELX_LONG_TESTS=1")
@pytest.mark.parametrize("family", sorted(set(ROPE_BUILDERS) - {"llama", "qwen2"}))
def test_family_export_and_generation(family, tmp_path, one_torch_thread):
    from elx.exporter.export import export_model

    folder = make_model_folder(tmp_path, family, seed=1)
    export = export_model(str(folder), tmp_path / "export", quiet=True)
    manifest = Manifest.load(export)
    assert manifest.family == family and manifest.data["verification"]["export"]["max_abs_logits_diff"] <= 1e-4
    _check(compare(export, batch_size=3, input_length=9, seed=1, num_beams=4, num_return_sequences=2,
                   no_repeat_ngram_size=2, max_new_tokens=8))
    _check(compare(export, batch_size=2, input_length=6, seed=3, max_new_tokens=6))


@pytest.mark.skipif(not LONG, reason="exports several RoPE settings (minutes); set ELX_LONG_TESTS=1")
@pytest.mark.parametrize("rope", [dict(rope_type="linear", factor=2.0, rope_theta=500.0),
                                  dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32,
                                       rope_theta=10000.0),
                                  dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5)],
                         ids=["linear", "yarn", "partial"])
def test_rope_variants(rope, tmp_path, one_torch_thread):
    """Linear and YaRN scaling (Llama), a partial rotary factor (Phi-3): verified and HF-identical."""
    from elx.exporter.export import export_model

    family = "phi3" if "partial_rotary_factor" in rope else "llama"
    folder = make_model_folder(tmp_path, family, seed=2, rope_scaling=rope, num_key_value_heads=4)
    export = export_model(str(folder), tmp_path / "export", quiet=True)
    dims = Manifest.load(export).dims
    assert dims["rope_type"] == rope["rope_type"] and dims["rotary_dim"] == (4 if family == "phi3" else 8)
    _check(compare(export, batch_size=3, input_length=40, seed=1, num_beams=3, max_new_tokens=6))


# -- refusals -------------------------------------------------------------------------------------

def _folder(tmp_path, family="llama", **overrides):
    return make_model_folder(tmp_path, family, **overrides)


@pytest.mark.parametrize("overrides,key", [
    (dict(rope_scaling=dict(rope_type="dynamic", factor=2.0, rope_theta=10000.0)), "rope_type is 'dynamic'"),
    (dict(rope_scaling=dict(rope_type="longrope", short_factor=[1.0] * 2, long_factor=[2.0] * 2,
                            original_max_position_embeddings=64, rope_theta=10000.0)), "rope_type is 'longrope'"),
    (dict(attn_logit_softcapping=30.0), "attn_logit_softcapping"),
    (dict(final_logit_softcapping=30.0), "final_logit_softcapping"),
], ids=["dynamic-rope", "longrope", "attn-softcap", "logit-softcap"])
def test_export_refuses_what_it_cannot_reproduce(tmp_path, capsys, overrides, key):
    """One line naming the config key, exit 2, nothing written (checked before any weights are loaded)."""
    from elx.cli import main

    family = "phi3" if "longrope" in key else "llama"
    folder = _folder(tmp_path, family, **overrides)
    capsys.readouterr()  # save_pretrained's progress bar
    assert main(["export", "--model", str(folder), "--output", str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("elx: error: ") and key in err and "\n" not in err
    assert not (tmp_path / "out").exists()


def test_sliding_window_refused_where_it_would_act():
    """Mistral's sliding_window W: a run feeding more than W tokens is refused (one line naming the key); up to
    W tokens the window changes nothing and the run goes ahead."""
    from types import SimpleNamespace

    from elx.runners.families import RULES

    rules = RULES["mistral"]
    manifest = SimpleNamespace(dims={"sliding_window": 40, "max_position_embeddings": 128})
    inputs = {"input_ids": np.ones((2, 30), dtype=np.int64)}
    rules.check_lengths(manifest, inputs, SimpleNamespace(total_max_length=lambda width: width + 11))  # feeds 40
    with pytest.raises(ElxError, match="sliding_window is 40") as info:
        rules.check_lengths(manifest, inputs, SimpleNamespace(total_max_length=lambda width: width + 12))
    assert "\n" not in str(info.value)


def test_sliding_window_recorded(tmp_path):
    """Mistral records its window; Qwen2 only when use_sliding_window marks layers sliding."""
    from elx.exporter.families.rope import rope_dims
    from tests.conftest import BUILDERS

    assert rope_dims(BUILDERS["mistral"]().config)["sliding_window"] == 40
    assert "sliding_window" not in rope_dims(BUILDERS["qwen2"]().config)
    windowed = BUILDERS["qwen2"](use_sliding_window=True, sliding_window=16, max_window_layers=1).config
    assert rope_dims(windowed)["sliding_window"] == 16


def test_bf16_checkpoint_loads_as_fp32(tmp_path):
    """A checkpoint saved in bfloat16 (as Llama weights ship) is exported from fp32 weights."""
    import torch

    from elx.exporter.source.load import resolve_model
    from tests.conftest import BUILDERS

    torch.manual_seed(0)
    BUILDERS["llama"]().to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    model = resolve_model(str(tmp_path / "bf16")).model
    assert {p.dtype for p in model.parameters()} == {torch.float32}


# -- presets (--random-init with the real architectures' dims) --------------------------------------

PRESETS = {  # name: (architecture, layers, d_model, heads, key/value heads, head width, tied head)
    "smollm2-135m": ("LlamaForCausalLM", 30, 576, 9, 3, 64, True),
    "smollm2-1.7b": ("LlamaForCausalLM", 24, 2048, 32, 32, 64, True),
    "tinyllama-1.1b": ("LlamaForCausalLM", 22, 2048, 32, 4, 64, False),
    "qwen2.5-0.5b": ("Qwen2ForCausalLM", 24, 896, 14, 2, 64, True),
    "phi-3-mini": ("Phi3ForCausalLM", 32, 3072, 32, 32, 96, False),
    "llama-3.2-1b": ("LlamaForCausalLM", 16, 2048, 32, 8, 64, True),
    "gemma-2b": ("GemmaForCausalLM", 18, 2048, 8, 1, 256, True),
}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets(name):
    """Each preset builds its architecture's config (not the weights: gigabytes), passes the family's checks and
    has the real model's dims; Llama 3.2's carries its llama3 rotary scaling and three EOS ids."""
    from elx.exporter.families.catalog import family_for_architecture
    from elx.exporter.source.load import _config_class, _find_preset, preset_names

    assert name in preset_names()
    preset = _find_preset(name)
    architecture, layers, d_model, heads, kv_heads, head_dim, tied = PRESETS[name]
    assert preset["architecture"] == architecture and _find_preset(preset["aliases"][0])["name"] == name
    config = _config_class(architecture)[1](**preset["config"])
    family = family_for_architecture(architecture)
    family.check_config(config)
    dims = family.dims(config)
    assert (dims["num_decoder_layers"], dims["d_model"], dims["num_heads"], dims["num_kv_heads"], dims["d_kv"]) == (
        layers, d_model, heads, kv_heads, head_dim)
    assert config.tie_word_embeddings is tied
    if name == "llama-3.2-1b":
        assert dims["rope_type"] == "llama3" and config.eos_token_id == [128001, 128008, 128009]


# -- the differential test's machinery on Llama ------------------------------------------------------

def test_differential_examples_on_llama(differential_pool):
    """The differential export variant (tests/differential.py: drawn batches, options and EOS modes, the
    stability rule) on its CI-slice Llama spec, a few examples for certain (the variant draws specs at random)."""
    from hypothesis import HealthCheck

    from tests.differential import SPECS, ModelInfo, Stats, batches, run_export_example
    from tests.test_differential import _draw_run

    spec = next(s for s in SPECS if s.name == "llama")
    stats = Stats("export")

    @settings(max_examples=4, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def example(data):
        inputs = data.draw(batches(ModelInfo.of(differential_pool.loaded(spec).generator.manifest)))
        options, eos_mode, eos_rank = _draw_run(data, spec.family, inputs)
        run_export_example(stats, differential_pool, spec, "", inputs, options, eos_mode, eos_rank)

    example()
    assert not stats.failures and stats.examples == 4, stats.summary()
    assert stats.identical_rows + stats.fragile_rows == stats.rows and stats.excused_examples <= 1, stats.summary()
