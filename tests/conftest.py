"""Shared fixtures: tiny random HF models saved as local folders, and their exports (built once per session)."""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# elx's caches (exporter/cache_root.py: traced graphs and templates, from_pretrained's exports) in a folder of the
# session's own, the user's ~/.cache/elx untouched; subprocesses inherit it.  The traced-graph cache on: the same
# seeded tiny models are exported by many modules, and a tiny model traced whole spends its export in the trace
# (45-60 s on the 2-core machines; 2.5-5 s from the cache, byte for byte the same graphs:
# tests/test_template_cache.py).  Since the 20th session the tiny models a builder describes (T5, BART, Marian,
# mBART, Pegasus, M2M100, Whisper, Llama, Mistral, Qwen2/3, GPT-2, OPT) are built whole instead, in milliseconds
# (exporter/capture/stitched.py; the full suite 2797 -> 1870 s on the same kind of VM); FSMT is still
# traced (Gemma, Phi-3 and GPT-NeoX built since the 21st session).  Tests of the trace itself turn the builders and the cache off (tests/test_capture.py,
# ELX_TEMPLATE_BUILDER=0); tests/test_template_cache.py uses a folder of its own.
_SESSION_CACHE = tempfile.mkdtemp(prefix="elx-tests-cache-")
atexit.register(shutil.rmtree, _SESSION_CACHE, ignore_errors=True)
os.environ["ELX_CACHE_DIR"] = _SESSION_CACHE
os.environ["ELX_TEMPLATE_CACHE"] = "1"

# -- the CI slice ------------------------------------------------------------------------------------------
# CI must stay under 40 minutes on the 2-core machine: it runs one case of each kind, in two pytest-xdist workers
# (the README's command: ``-n 2 --dist loadfile``; each worker has its own session, so a session fixture's exports
# are made once per worker that uses them; 21st session, this VM: 1870 s in one process, 1282 s in two).  The cases below repeat
# a kind another test already runs in CI (named after each), and run only with ELX_LONG_TESTS=1.  Measured
# with `pytest --durations=0` (issue 23-28 merge, 2026-11-25): together about a third of the suite's time.  Session 14 (suite 2275 s
# here, CI 2517 s) moved whisper-biased el-self generation and the fp16 release case (~60 s).
LONG = os.environ.get("ELX_LONG_TESTS") == "1"
LONG_ONLY = {
    # fp16 export records: t5-None stays (passes under fp16: test_slim_cross_keeps_its_key_state_fp32,
    # test_state_bytes_halve_except_the_mask[bart], test_a_broken_conversion_is_refused_and_nothing_is_written)
    "tests/test_fp16.py::test_fp16_export_records_io_checks_and_halves_the_cache[bart-None]": "t5-None",
    "tests/test_fp16.py::test_fp16_export_records_io_checks_and_halves_the_cache[bart-slim=skip-bad]": "t5-None",
    "tests/test_fp16.py::test_fp16_export_records_io_checks_and_halves_the_cache[t5-ngram=2]": "t5-None",
    "tests/test_fp16.py::test_fp16_export_records_io_checks_and_halves_the_cache[whisper-None]": "t5-None",
    "tests/test_fp16.py::test_fp16_export_records_io_checks_and_halves_the_cache[whisper-el]": "t5-None",
    "tests/test_fp16.py::test_fp16_export_records_io_checks_and_halves_the_cache[t5-el,el-self]": "t5-None",
    "tests/test_fp16.py::test_state_bytes_halve_except_the_mask[whisper]": "[bart]",
    # slim / el-self on further families
    "tests/test_slim.py::test_slim_matches_original[whisper]": "[t5] and [bart]",
    "tests/test_el_self.py::test_fp64_scores[t5-wide]": "[bart-biased]",
    # real whisper tiny.en: slim refuses its weights today (the test skips after a 100 s export); the el and
    # el-self transcriptions stay
    "tests/test_whisper.py::test_tiny_en_slim_identical_to_hf[1]": "test_tiny_en_el_self_identical_to_hf",
    "tests/test_whisper.py::test_tiny_en_slim_identical_to_hf[4]": "test_tiny_en_el_self_identical_to_hf",
    # el-self generation on whisper's random biased model: t5, t5-wide and bart-biased stay, and whisper's
    # el-self generation runs in CI on real weights (test_whisper.py::test_tiny_en_el_self_identical_to_hf)
    **{f"tests/test_el_self.py::test_generation_identical_to_hf[{o}-{p}-whisper-biased]":
       "[*-bart-biased] and test_whisper.py::test_tiny_en_el_self_identical_to_hf"
       for o in ("greedy", "greedy-ngram3", "beam4-ngram3") for p in ("el-self", "el,el-self")},
    # the export releasing HF's model before the passes: fp32 (the case that frees it) stays; fp16 keeps it
    "tests/test_export.py::test_the_model_is_released_before_the_passes_run[fp16-False]":
        "test_external_data_path (the fp32 case)",
    # ... and the fp32 case's export is test_external_data_path's (which asserts the release): one t5+el export, not two
    "tests/test_export.py::test_the_model_is_released_before_the_passes_run[fp32-True]":
        "test_external_data_path (the same check on its fp32 export)",
    # el / el-self graph checks on a second and third family
    "tests/test_el.py::test_el_graph_has_no_cross_cache[whisper]": "[bart]",
    "tests/test_el_self.py::test_el_self_matches_original[t5-wide]": "[bart-biased]",
    "tests/test_el_self.py::test_el_self_matches_original[whisper-biased]": "[bart-biased]",
    # the stability rule: a stable failure and a fragile row stay (test_compare.py)
    "tests/test_compare.py::test_fragile_rows_on_a_peaked_model": "test_fragile_difference_is_reported_not_counted",
    "tests/test_compare.py::test_the_input_alone_must_agree": "test_stable_difference_is_a_failure",
    "tests/test_compare.py::test_a_near_tie_within_the_export_error_is_fragile":
        "test_fragile_difference_is_reported_not_counted",
    "tests/test_cli.py::test_compare_fails_when_tokens_differ": "test_compare.py::test_cli_compare_exit_status_and_atol",
    # CI time (stop 44: the suite ran 1968 s here, the budget is 35 min): exports only these tests make
    "tests/test_bench.py::test_a_pass_set_is_made_from_the_baseline_without_loading_the_model_again":
        "the apply_passes tests of test_el_self.py, test_fp16.py, test_int8.py (passes on a cached baseline)",
    "tests/test_el_self.py::test_generation_with_ngram_pass[whisper-biased]": "[t5-wide]",
    "tests/test_slim.py::test_slim_cross_matches_original[whisper]": "[t5] and [bart]",
    "tests/test_slim.py::test_non_square_refused": "test_singular_layer_refused (slim refusing a layer)",
    "tests/test_progress.py::test_export_quiet_prints_nothing":
        "test_export_plain_lines_list_the_stages_in_order and test_callbacks_v3.py's --quiet test",
    "tests/test_el.py::test_el_whisper_style_generation": "test_whisper.py::test_random_whisper_identical",
    "tests/test_ngram_pass.py::test_graph_blocking_is_hf_identical[bart-ngram=2-2]": "[t5-el,ngram=3-3]",
    # bench: the full --quick run (HF, every peer, plots) is long; the bench's parts are tested one by one
    "tests/test_bench.py::test_bench_quick": "the other tests of test_bench.py",
    "tests/test_bench.py::test_compare_prints_no_one_run_speed_ratio": "test_compare.py's report tests",
    "tests/test_bench.py::test_iobinding_backend_matches_plain_backend[ngram=2]": "[el]",
    "tests/test_bench.py::test_iobinding_backend_matches_plain_backend[None]": "[el]",
    # generation from a config / early EOS on more families and passes
    "tests/test_generation_config.py::test_gpt2_that_samples": "tests/test_sampling.py",
    "tests/test_generation.py::test_identical_with_early_eos[None-t5]": "[el-t5]",
    "tests/test_generation.py::test_identical_with_early_eos[None-bart]": "[el-bart]",
    # int8 per-layer graphs: both cases run in CI (t5: dynamic quantization, cross K/V's shared quantized input;
    # llama: MatMulNBits, the decoder-only kernel; it caught a one-layer conversion quantizing 15 MatMuls, not 7)
    # unpad: the encoder-decoder (T5) and decoder-only (Llama prefill) cases stay; BART's biases and the int8
    # composition (test_int8.py keeps a pass composed with int8) run with the long tests
    "tests/test_unpad.py::test_unpad_is_bit_identical_and_hf_identical[bart]": "[t5] and [llama]",
    "tests/test_unpad.py::test_unpad_composes_with_int8": "test_int8.py's pass compositions",
    # CI time (stop 45: CI 2916 s): the only CI users of test_slim's own Whisper export and of el_self's
    # whisper-biased export.  slim on Whisper stays in CI through test_whisper.py's [*-el,slim] rows (HF identity,
    # a stronger check than "unchanged"), el-self on Whisper through its real tiny.en rows
    "tests/test_slim.py::test_whisper_generation_unchanged": "test_whisper.py::test_random_whisper_identical[*-el,slim]",
    "tests/test_slim.py::test_measured_cache_bytes_halve[whisper]": "[t5] and [bart]",
    "tests/test_el_self.py::test_measured_self_cache_bytes[whisper-biased]": "[t5], [t5-wide] and [bart-biased]",
    # CI time (stop 51: the full suite ran 3189 s on an AMD EPYC VM): two exports only these cases make; the batched
    # references of every decoder-only export in CI are checked against fp32 at run time (verify._agrees_with)
    **{f"tests/test_verification_memory.py::test_the_reference_cases_in_two_forwards_give_what_each_case_gives_"
       f"alone[{family}]": "[llama] and [gpt2]"
       for family in ("opt", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gpt_neox")},
    # CI time (stop 51: CI 3311 s on an AMD EPYC VM): a second thread-failure export of the same kind
    "tests/test_capture.py::test_a_weight_write_failing_in_its_thread_is_one_line_and_leaves_no_folder[3]": "[1]",
    # CI time (stop 56: CI 2037 s, near the 35-minute mark): an export of its own each.  The reference computed
    # while the second process traces is what every decoder-only export in CI does (its numbers checked against
    # the graphs); h·d_kv ≠ d_model under el is the differential's t5-fragile spec (CI)
    "tests/test_capture.py::test_the_reference_computed_while_the_template_traces_is_the_later_one":
        "test_a_small_model_traced_whole_has_its_step_graph_traced_by_the_second_process and the CI exports",
    "tests/test_el.py::test_el_where_heads_times_dkv_differs_from_d_model":
        "tests/test_differential.py's t5-fragile (h·d_kv ≠ d_model, el drawn)",
    # CI time (stop 62: CI 2090 s; the 17th session adds T5/Marian builder tests): el-self generation on t5-wide
    # (h·d_kv ≠ d_model) keeps its greedy el-self case; the other searches and pass sets run on t5 and bart-biased
    **{f"tests/test_el_self.py::test_generation_identical_to_hf[{o}-{p}-t5-wide]":
       "[greedy-el-self-t5-wide] and [*-t5], [*-bart-biased]"
       for o, p in (("greedy", "el,el-self"), ("greedy-ngram3", "el-self"), ("greedy-ngram3", "el,el-self"),
                    ("beam4-ngram3", "el-self"), ("beam4-ngram3", "el,el-self"))},
}


def pytest_collection_modifyitems(config, items):
    if LONG:
        return
    for item in items:
        instead = LONG_ONLY.get(item.nodeid)
        if instead is not None:
            item.add_marker(pytest.mark.skip(reason=f"CI runs {instead} of this kind; set ELX_LONG_TESTS=1"))


def _t5(**overrides):
    from transformers import T5Config, T5ForConditionalGeneration

    config = dict(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                  decoder_start_token_id=0, eos_token_id=1, pad_token_id=0, relative_attention_num_buckets=8)
    config.update(overrides)
    return T5ForConditionalGeneration(T5Config(**config))


def _bart(**overrides):
    from transformers import BartConfig, BartForConditionalGeneration

    config = dict(vocab_size=128, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                  forced_eos_token_id=None)
    config.update(overrides)
    return BartForConditionalGeneration(BartConfig(**config))


def _whisper(**overrides):
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    config = dict(vocab_size=128, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_target_positions=64,
                  decoder_start_token_id=3, eos_token_id=2, pad_token_id=2, bos_token_id=2,
                  begin_suppress_tokens=None, suppress_tokens=None)
    config.update(overrides)
    return WhisperForConditionalGeneration(WhisperConfig(**config))


def _gpt2(**overrides):
    from transformers import GPT2Config, GPT2LMHeadModel

    # EOS = BOS = the last id (and HF pads with it), as in GPT-2's own vocabulary
    vocab = overrides.get("vocab_size", 128)
    config = dict(vocab_size=vocab, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=vocab - 1,
                  eos_token_id=vocab - 1)
    config.update(overrides)
    return GPT2LMHeadModel(GPT2Config(**config))


def _opt(**overrides):
    from transformers import OPTConfig, OPTForCausalLM

    # OPT's own special ids: pad 1, BOS = EOS 2
    config = dict(vocab_size=128, hidden_size=32, word_embed_proj_dim=32, num_hidden_layers=2, ffn_dim=64,
                  num_attention_heads=4, max_position_embeddings=64, pad_token_id=1, bos_token_id=2, eos_token_id=2)
    config.update(overrides)
    return OPTForCausalLM(OPTConfig(**config))


def _bart_like_config(overrides: dict, **defaults) -> dict:
    """BART-like tiny dims and the family's ``defaults``, then the caller's ``overrides``."""
    config = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                  encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64, **defaults)
    config.update(overrides)
    return config


def _mbart(**overrides):
    from transformers import MBartConfig, MBartForConditionalGeneration

    # HF's defaults otherwise: pre-LN with final layer norms, no decoder_start_token_id (HF starts with the BOS),
    # forced EOS 2, pad 1
    return MBartForConditionalGeneration(MBartConfig(**_bart_like_config(overrides, vocab_size=128)))


def _m2m100(**overrides):
    from transformers import M2M100Config, M2M100ForConditionalGeneration

    # sinusoidal positions counted past the pad id, scaled embeddings, start token 2 (= EOS), pad 1
    return M2M100ForConditionalGeneration(M2M100Config(**_bart_like_config(overrides, vocab_size=128)))


def _pegasus(**overrides):
    from transformers import PegasusConfig, PegasusForConditionalGeneration

    # sinusoidal positions, start token = pad 0, EOS 1 (forced)
    return PegasusForConditionalGeneration(PegasusConfig(**_bart_like_config(overrides, vocab_size=128)))


def _fsmt(**overrides):
    from transformers import FSMTConfig, FSMTForConditionalGeneration

    # separate source (96) and target (128) vocabularies; HF's generation defaults of the config (beams 5,
    # max_length 200) left as FSMT sets them
    return FSMTForConditionalGeneration(FSMTConfig(**_bart_like_config(
        overrides, langs=["en", "de"], src_vocab_size=96, tgt_vocab_size=128)))


def _biased(model, std: float = 0.5):
    """Every bias drawn from N(0, std²) (HF initializes them to zero, which would hide bias handling)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, std)
    return model


def _rope(config_name: str, model_name: str, defaults: dict, biased: bool = False):
    """A builder of a tiny decoder-only RoPE model (issue 24): ``defaults`` over the family's config."""
    def build(**overrides):
        import transformers

        config = getattr(transformers, config_name)(**rope_config(defaults, **overrides))
        model = getattr(transformers, model_name)(config)
        return _biased(model, 0.2) if biased else model
    return build


def rope_config(defaults: dict, **overrides) -> dict:
    return {**ROPE_COMMON, **defaults, **overrides}


# special ids 0..2 (no pad token unless the family has one: HF then pads with the first EOS, as for Llama)
ROPE_COMMON = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   max_position_embeddings=128, bos_token_id=1, eos_token_id=2)
LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=32, rope_theta=10000.0)
ROPE_CONFIGS = {  # family: (config class, model class, defaults over ROPE_COMMON, non-zero biases)
    # GQA, untied head, Llama 3's rotary scaling (frequencies of wavelengths past 32 positions slowed 8×)
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=2, rope_scaling=LLAMA3_ROPE), False),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(num_key_value_heads=1, sliding_window=40), False),  # MQA
    # MHA with non-zero q/k/v biases, tied head, Qwen2.5's rope_theta
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=4, tie_word_embeddings=True,
                                                      rope_theta=1e6), True),
    # q/k RMSNorm per head, head_dim 16 ≠ hidden/heads
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
              False),
    # fused qkv_proj / gate_up_proj, MHA, partial rotary (half the head)
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(num_key_value_heads=4, pad_token_id=0, partial_rotary_factor=0.5),
             False),
    # embedding scale, GeGLU, (1 + w) RMSNorm, MQA, head_dim 16 ≠ hidden/heads, Gemma's ids (pad 0, EOS 1, BOS 2)
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(num_key_value_heads=1, head_dim=16, pad_token_id=0,
                                                      eos_token_id=1, bos_token_id=2), False),
    # partial rotary (a quarter of the head), parallel residual, per-head fused q/k/v with biases
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(rotary_pct=0.25), True),
}
ROPE_BUILDERS = {family: _rope(*spec) for family, spec in ROPE_CONFIGS.items()}


BUILDERS = {"t5": _t5, "bart": _bart, "whisper": _whisper, "gpt2": _gpt2, "opt": _opt,
            # heads·d_kv = 48 ≠ d_model = 32 (as in T5-3B/11B, where h·d_kv > d_model)
            "t5-wide": lambda **o: _t5(**{"d_kv": 12, **o}),
            # sharper attention (init_std 0.1) and non-zero biases: b_K, b_V and the K projection without bias
            "bart-biased": lambda **o: _biased(_bart(**{"init_std": 0.1, **o})),
            "whisper-biased": lambda **o: _biased(_whisper(**{"init_std": 0.1, **o})),
            **ROPE_BUILDERS,
            # the translation families (issue 25)
            "mbart": _mbart, "m2m100": _m2m100, "pegasus": _pegasus, "fsmt": _fsmt}


def make_model_folder(root: Path, family: str, seed: int = 0, **overrides) -> Path:
    torch.manual_seed(seed)
    model = BUILDERS[family](**overrides).eval()
    folder = root / f"{family}-{seed}"
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def model_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {family: make_model_folder(root, family) for family in BUILDERS}


_EXPORTS = {}


@pytest.fixture(scope="session")
def exported(tmp_path_factory, model_folders):
    """``exported(family, passes)`` → folder; each (family, passes) is made once per session: the family's
    baseline is exported (built or traced, and verified against PyTorch) once, and each pass set is applied to a copy of
    it (``apply_passes``, what ``elx export --pass`` runs after its own baseline), instead of a whole export per
    pass set.  The export-with-passes path itself is run by ``tests/test_cli.py`` and the README's blocks."""
    from elx.exporter.export import apply_passes, export_model

    root = tmp_path_factory.mktemp("exports")

    def get(family: str, passes: str | None = None) -> Path:
        key = (family, passes or "")
        if key not in _EXPORTS:
            out = root / f"{family}-{(passes or 'base').replace(',', '_').replace('=', '')}"
            if passes:
                _EXPORTS[key] = apply_passes(get(family), out, passes, quiet=True)
            else:
                _EXPORTS[key] = export_model(str(model_folders[family]), out, quiet=True)
        return _EXPORTS[key]

    return get


@pytest.fixture(scope="session")
def qwen2_exports(exported, model_folders, tmp_path_factory):
    """Qwen2 (MHA, q/k/v biases; issue 24): {"folder", "shared": ``exported("qwen2")``, "per-beam": HF's layout}."""
    from elx.exporter.export import export_model

    per_beam = export_model(str(model_folders["qwen2"]), tmp_path_factory.mktemp("qwen2") / "per-beam", quiet=True,
                            prompt_cache="per-beam")
    return {"folder": model_folders["qwen2"], "shared": exported("qwen2"), "per-beam": per_beam}


@pytest.fixture(scope="session")
def differential_pool(tmp_path_factory, exported):
    """The differential tests' exports (tests/differential.py), one pool per session."""
    from tests.differential import ExportPool

    return ExportPool(tmp_path_factory.mktemp("differential"), shared_export=exported)


@pytest.fixture(scope="module")
def one_torch_thread():
    """PyTorch on one thread for a module: 4x less CPU for tiny models on a busy 2-core machine (measured)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
