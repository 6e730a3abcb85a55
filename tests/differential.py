"""Differential testing of elx against HF ``generate`` (issue 10): the machinery behind ``test_differential.py``.

Two variants draw what no hand-picked list covers:

* **export**: a pool of tiny model specs of every family (``SPECS``) × pass sets (baseline, el,
  slim=skip-bad, slim-cross=skip-bad, ngram=N and their compositions) × random generation
  settings and padded batches.  Each example runs ``elx.exporter.verification.compare.compare_loaded``: elx on
  ONNX Runtime against HF ``generate`` (fp32, the model's default attention), teacher-forced
  logits and encoder diffs within 1e-4, and ``elx compare``'s stability rule
  (``exporter/verification/stability.py``): a row that differs is excused only where HF's own answer for it is
  not stable (its eager fp32, sdpa fp32 and fp64 disagree, the input alone gets another answer, or
  its answer moves under logits perturbations as large as the export's measured error).
  Exports are the cost, so each (spec, pass set) is exported once per session (``ExportPool``):
  the baseline with ``export_model``, pass sets with ``apply_passes`` on a copy of it.
* **search**: a random tiny config per example (no export): elx's searches run on HF's own
  float64 logits (``HfLogitsBackend``: the model recomputed over the whole history, logits cast
  to float32 as HF casts them) against HF ``generate(use_cache=False)`` on the same float64
  model.  Both see the same logits, so nothing is excused: any difference is a search bug.

Every outcome goes into ``Stats``; nothing raises inside an example, so one run reports every
divergence it finds (the test asserts at the end).
"""
from __future__ import annotations

import json
import os
import random
import traceback
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from hypothesis import strategies as st

from elx.exporter.verification.compare import HfVariants, _hf_generate, compare_loaded
from elx.exporter.verification.hf_reference import (DecoderOnlySearchBackend, SearchBackend, hf_reference_options,  # noqa: F401
                                 search_backend)
from elx.runners.errors import ElxError
from elx.runners.generate import Generator
from elx.runners.search.log_softmax import ENV
from elx.runners.manifest import Manifest
from tests.conftest import BUILDERS, make_model_folder
from tests.hf_on_cpu_kernel import hf_on_cpu_kernels


# -- the pool of exported specs ------------------------------------------------------------------
@dataclass(frozen=True)
class ModelSpec:
    name: str
    family: str
    seed: int
    overrides: tuple = ()  # sorted (key, value) pairs over conftest's defaults for the family
    shared: bool = False  # conftest's model of the family: its baseline export is shared with other tests
    ci: bool = False  # part of the CI slice

    @property
    def config(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.overrides}

    @property
    def square(self) -> bool:
        """Whether W_K is square (slim / slim-cross can rewrite): T5 needs num_heads·d_kv = d_model."""
        if self.family != "t5":
            return True
        c = {"d_model": 32, "d_kv": 8, "num_heads": 4, **self.config}
        return c["num_heads"] * c["d_kv"] == c["d_model"]


def _spec(name, family, seed, shared=False, ci=False, **overrides) -> ModelSpec:
    items = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in overrides.items()))
    return ModelSpec(name, family, seed, items, shared, ci)


ROPE_DECODER_ONLY = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gpt_neox")  # issue 24
DECODER_ONLY = ("gpt2", "opt") + ROPE_DECODER_ONLY

SPECS = (
    # conftest's models (their baseline exports are shared with the rest of the suite)
    _spec("t5", "t5", 0, shared=True, ci=True),  # relu, tied, h·d_kv = d_model, 128 tokens
    _spec("bart", "bart", 0, shared=True),  # no scale_embedding, no forced EOS
    _spec("whisper", "whisper", 0, shared=True, ci=True),
    _spec("gpt2", "gpt2", 0, shared=True, ci=True),  # left-padded prompts, the prompt cache shared by all beams
    # peaked (initializer_range 0.3), odd head count, a small FFN
    _spec("gpt2-peaked", "gpt2", 6, vocab_size=96, n_embd=24, n_head=3, n_inner=40, initializer_range=0.3),
    # OPT: learned positions with HF's offset of 2, pad 1 (not EOS), separate q/k/v projections
    _spec("opt-peaked", "opt", 4, ci=True, vocab_size=80, hidden_size=24, word_embed_proj_dim=24, num_attention_heads=3,
          ffn_dim=40, init_std=0.3),
    # issue 10's model: gated-gelu, untied head, a few hundred tokens (very peaked), h·d_kv ≠ d_model
    _spec("t5-peaked", "t5", 11, vocab_size=300, d_model=64, d_kv=8, d_ff=64, num_heads=4,
          feed_forward_proj="gated-gelu", tie_word_embeddings=False),
    # the same config at seed 3: HF's own tokens change between eager / sdpa / fp64 on some rows (compare's
    # fragile rows; tests/test_compare.py)
    _spec("t5-fragile", "t5", 3, ci=True, vocab_size=300, d_model=64, d_kv=8, d_ff=64, num_heads=4,
          feed_forward_proj="gated-gelu", tie_word_embeddings=False),
    # peaked and square (slim can apply; it refuses this model's layers: issue 10's differential run)
    _spec("t5-gated-square", "t5", 5, ci=True, vocab_size=96, d_model=32, d_kv=8, d_ff=48, num_heads=4,
          feed_forward_proj="gated-gelu", tie_word_embeddings=False),
    # relu, tied, h·d_kv ≠ d_model, deeper encoder than decoder
    _spec("t5-relu-wide", "t5", 7, vocab_size=160, d_model=24, d_kv=16, d_ff=40, num_heads=2, num_layers=3,
          num_decoder_layers=1),
    # gated, tied, many small heads
    _spec("t5-gated-tied", "t5", 9, vocab_size=64, d_model=32, d_kv=4, d_ff=32, num_heads=8,
          feed_forward_proj="gated-gelu", relative_attention_num_buckets=16),
    _spec("bart-scaled", "bart", 3, ci=True, vocab_size=100, d_model=24, encoder_attention_heads=3,
          decoder_attention_heads=3, encoder_ffn_dim=40, decoder_ffn_dim=40, encoder_layers=1, decoder_layers=2,
          scale_embedding=True, forced_eos_token_id=2, max_position_embeddings=48),
    _spec("whisper-suppress", "whisper", 4, vocab_size=90, d_model=24, encoder_attention_heads=3,
          decoder_attention_heads=3, max_source_positions=40, num_mel_bins=16, suppress_tokens=[5, 6],
          begin_suppress_tokens=[2, 9]),
    # the translation families (issue 25); language codes are drawn with the run (``language_options``)
    _spec("fsmt", "fsmt", 0, shared=True, ci=True),  # its own attention, source vocabulary 96, target 128
    _spec("mbart", "mbart", 0, shared=True),  # no decoder_start_token_id: HF starts with the BOS
    _spec("m2m100", "m2m100", 0, shared=True),
    _spec("pegasus", "pegasus", 0, shared=True),
    _spec("mbart50-peaked", "mbart", 5, vocab_size=90, d_model=24, encoder_attention_heads=3, decoder_attention_heads=3,
          encoder_ffn_dim=40, decoder_ffn_dim=40, decoder_start_token_id=2, scale_embedding=True, init_std=0.2,
          max_position_embeddings=48),
    _spec("m2m100-peaked", "m2m100", 6, vocab_size=80, d_model=24, encoder_attention_heads=3,
          decoder_attention_heads=3, encoder_ffn_dim=40, decoder_ffn_dim=40, encoder_layers=1, init_std=0.2),
    _spec("pegasus-peaked", "pegasus", 7, vocab_size=70, d_model=16, encoder_attention_heads=2,
          decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, scale_embedding=True, init_std=0.2),
    _spec("fsmt-peaked", "fsmt", 8, src_vocab_size=60, tgt_vocab_size=90, d_model=24, encoder_attention_heads=3,
          decoder_attention_heads=3, encoder_ffn_dim=40, decoder_ffn_dim=40, decoder_layers=1, init_std=0.2),
)
TRANSLATION = ("mbart", "m2m100", "pegasus", "fsmt")
LANGUAGE = 20  # a "language code" id inside every drawn vocabulary (>= 24 ids), past the special tokens

# issue 24: the RoPE decoder-only families (conftest's tiny models, and peaked variants; Llama in the CI slice:
# GQA with Llama 3's rotary scaling, the prompt shared by the beams)
SPECS = SPECS + (
    _spec("llama", "llama", 0, shared=True, ci=True),
    _spec("mistral", "mistral", 0, shared=True),  # MQA (sliding window 40: runs stay within it)
    _spec("qwen2", "qwen2", 0, shared=True),  # MHA, q/k/v biases, tied
    _spec("qwen3", "qwen3", 0, shared=True),
    _spec("phi3", "phi3", 0, shared=True),
    _spec("gemma", "gemma", 0, shared=True),
    _spec("gpt_neox", "gpt_neox", 0, shared=True),
    # peaked, MHA (slim applies), short rotary wavelengths, odd head count
    _spec("llama-peaked-mha", "llama", 8, vocab_size=96, hidden_size=24, num_attention_heads=3, num_key_value_heads=3,
          intermediate_size=40, initializer_range=0.3, rope_theta=100.0),
    # peaked GQA with linear rotary scaling, biases (Qwen2)
    _spec("qwen2-peaked-linear", "qwen2", 9, vocab_size=80, num_key_value_heads=2, initializer_range=0.25,
          rope_scaling={"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0}),
    # issue 40: Llama with linear RoPE, MHA (slim applies)
    _spec("llama-linear-mha", "llama", 10, vocab_size=90, num_key_value_heads=4, initializer_range=0.15,
          rope_scaling={"rope_type": "linear", "factor": 4.0, "rope_theta": 500.0}),
    # issue 40: Qwen3 with as many key/value heads as query heads: slim is drawn and must refuse (its k_norm)
    _spec("qwen3-mha", "qwen3", 12, num_key_value_heads=4, head_dim=8, initializer_range=0.1),
    # issue 40: MarianMT as opus-mt configures it (pad = decoder start = the last id, EOS 0 forced, the pad banned
    # by the generation config's bad_words_ids, sinusoidal positions, scaled embeddings)
    _spec("marian", "marian", 0),
    _spec("marian-peaked", "marian", 13, init_std=0.2, d_model=24, encoder_attention_heads=3,
          decoder_attention_heads=3),
)
# families built here, not in conftest (their own generation config)
MARIAN_PAD = 63


def _marian(**overrides):
    from transformers import MarianConfig, MarianMTModel

    config = dict(vocab_size=MARIAN_PAD + 1, d_model=16, encoder_layers=1, decoder_layers=2, encoder_attention_heads=2,
                  decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64,
                  pad_token_id=MARIAN_PAD, decoder_start_token_id=MARIAN_PAD, eos_token_id=0, forced_eos_token_id=0)
    config.update(overrides)
    return MarianMTModel(MarianConfig(**config))


LOCAL_BUILDERS = {"marian": _marian}
# generation_config.json beside the model (opus-mt's fields), for the families built here
GENERATION_CONFIGS = {"marian": dict(bad_words_ids=[[MARIAN_PAD]], bos_token_id=0, decoder_start_token_id=MARIAN_PAD,
                                     pad_token_id=MARIAN_PAD, eos_token_id=0, forced_eos_token_id=0, num_beams=4,
                                     max_length=64)}


def make_folder(root: Path, family: str, seed: int = 0, **overrides) -> Path:
    """conftest's ``make_model_folder``, and the families built here (with their generation config)."""
    if family not in LOCAL_BUILDERS:
        return make_model_folder(root, family, seed=seed, **overrides)
    from transformers import GenerationConfig

    torch.manual_seed(seed)
    model = LOCAL_BUILDERS[family](**overrides).eval()
    model.generation_config = GenerationConfig(**GENERATION_CONFIGS[family])
    folder = root / f"{family}-{seed}"
    model.save_pretrained(folder)
    return folder

BASE_PASS_SETS = ("", "el", "slim=skip-bad", "slim-cross=skip-bad", "slim-cross=skip-bad,slim=skip-bad",
                  "el,slim=skip-bad")


def pass_sets(spec: ModelSpec) -> tuple:
    """The non-ngram pass sets that apply to ``spec`` (slim variants need square W_K; decoder-only models
    take el-self only: the other passes refuse them)."""
    if spec.family in ROPE_DECODER_ONLY:  # slim: MHA only (it refuses GQA/MQA); el-self refuses RoPE
        return ("", "slim=skip-bad") if rope_mha(spec) else ("",)
    if spec.family in DECODER_ONLY:
        return ("", "el-self")
    return tuple(p for p in BASE_PASS_SETS if spec.square or "slim" not in p)


# refusals the draws expect: a pass set drawn for a spec that refuses it for a reason named here is counted (and
# listed), any other refusal is a failure (issue 40: slim refusing GPT-NeoX went unnoticed, refused sets were
# dropped silently).  Accuracy: random weights where no layer verifies (skip-bad leaves out the others).
EXPECTED_REFUSALS = {
    "accuracy": ("is accurate enough", "is ill-conditioned", "is singular"),
    "qwen3/slim": ("normalizes each head's key",),  # its k_norm: V is no function of the cached K
}


def expected_refusal(spec: ModelSpec, passes: str, error: str) -> str | None:
    """Why ``error`` (``passes`` refused ``spec``) is expected (a key of ``EXPECTED_REFUSALS``), or None."""
    names = {p.partition("=")[0] for p in passes.split(",") if p}
    keys = ["accuracy", *(f"{spec.family}/{name}" for name in sorted(names))]
    return next((key for key in keys if any(text in error for text in EXPECTED_REFUSALS.get(key, ()))), None)


def rope_mha(spec: ModelSpec) -> bool:
    """Whether a RoPE spec's model has as many key/value heads as query heads (conftest's defaults + overrides)."""
    from tests.conftest import ROPE_CONFIGS, rope_config

    config = rope_config(ROPE_CONFIGS[spec.family][2], **spec.config)
    return config.get("num_key_value_heads", config["num_attention_heads"]) == config["num_attention_heads"]


def with_ngram(passes: str, n: int | None) -> str:
    return ",".join(p for p in (passes, f"ngram={n}" if n else "") if p)


@dataclass
class Loaded:
    generator: Generator
    model: torch.nn.Module
    variants: HfVariants


class ExportPool:
    """Model folders, exports and loaded runners, each built once per session."""

    def __init__(self, root: Path, shared_export=None, reuse: bool = False):
        self.root = Path(root)
        self.shared_export = shared_export  # conftest's ``exported`` fixture, for shared specs
        self.reuse = reuse  # take exports already in ``root`` (scripts that investigate one finding)
        self._folders, self._exports, self._models, self._loaded, self._refused = {}, {}, {}, {}, {}

    def model_folder(self, spec: ModelSpec) -> Path:
        if spec.name not in self._folders:
            root = self.root / "models" / spec.name
            root.mkdir(parents=True, exist_ok=True)
            self._folders[spec.name] = make_folder(root, spec.family, seed=spec.seed, **spec.config)
        return self._folders[spec.name]

    def export(self, spec: ModelSpec, passes: str = "") -> Path:
        """The export of ``spec`` with ``passes``; a pass that refuses raises its ``ElxError`` (remembered)."""
        from elx.exporter.export import apply_passes, export_model

        key = (spec.name, passes)
        if key in self._refused:
            raise self._refused[key]
        name = passes.replace(",", "+").replace("=", "")
        existing = self.root / "exports" / (f"{spec.name}.{name}" if passes else spec.name)
        if key not in self._exports and self.reuse and (existing / "manifest.json").is_file():
            self._exports[key] = existing
        if key not in self._exports:
            if not passes:
                if spec.shared and self.shared_export is not None:
                    folder = self.shared_export(spec.family)
                else:
                    folder = export_model(str(self.model_folder(spec)), self.root / "exports" / spec.name,
                                          quiet=True)
            else:
                try:
                    folder = apply_passes(self.export(spec, ""), existing, passes)
                except ElxError as err:
                    self._refused[key] = err
                    raise
            self._exports[key] = folder
        return self._exports[key]

    def refused(self, spec: ModelSpec, passes: str) -> bool:
        """Whether ``passes`` or a pass in it already refused this spec (the draws then pick another set)."""
        if (spec.name, passes) in self._refused:
            return True
        names = {p.partition("=")[0] for p in passes.split(",") if p}
        return any(name == spec.name and _refusing_pass(err) in names for (name, _), err in self._refused.items())

    def loaded(self, spec: ModelSpec, passes: str = "") -> Loaded:
        key = (spec.name, passes)
        if key not in self._loaded:
            folder = self.export(spec, passes)
            generator = Generator.from_folder(folder, threads=1)
            if spec.name not in self._models:
                from elx.exporter.source.load import reload_model

                model = reload_model(generator.manifest.data["source"])
                self._models[spec.name] = (model, HfVariants(model))
            model, variants = self._models[spec.name]
            self._loaded[key] = Loaded(generator, model, variants)
        return self._loaded[key]


def _refusing_pass(err: ElxError) -> str | None:
    """The pass a refusal names (``pass slim: ...``)."""
    text = str(err)
    return text[5:].split(":")[0].strip() if text.startswith("pass ") else None


# -- strategies ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelInfo:
    """What the strategies need to know about a model: family, vocabulary, specials, input shape."""
    family: str
    vocab: int
    pad: int
    specials: tuple
    features: tuple | None = None  # Whisper: (mel bins, frames)
    source_vocab: int | None = None  # the encoder's vocabulary where it is not the decoder's (FSMT)

    @classmethod
    def of(cls, manifest: Manifest) -> "ModelInfo":
        tokens = manifest.tokens
        pad = tokens.get("pad_token_id")
        if pad is None and not manifest.data.get("is_encoder_decoder", True):  # HF pads with EOS (GPT-2)
            pad = (tokens.get("eos_token_id") or [0])[0]
        pad = 0 if pad is None else int(pad)
        specials = tuple(sorted({int(t) for t in [pad, tokens.get("bos_token_id"), *(tokens.get("eos_token_id") or [])]
                                 if t is not None}))
        features = None
        spec = manifest.encoder_inputs().get("input_features")
        if spec is not None:
            features = tuple(int(d) for d in spec["shape"][1:])
        source = manifest.dims.get("source_vocab_size")
        return cls(manifest.family, int(manifest.dims["vocab_size"]), pad, specials, features,
                   None if source is None else int(source))


def uniform():
    """A ``random.Random`` seeded by hypothesis, for choices that must cover their range evenly.

    Hypothesis favours small and early values (``integers``, ``sampled_from``, even ``randoms()``):
    num_beams came out 1 in 40% of the examples and Whisper in 6-9%.  A drawn seed keeps the example
    reproducible (the failure records hold the values) and the choices uniform.
    """
    return st.integers(0, 2**64 - 1).map(random.Random)


class Batch(dict):
    """Encoder inputs by role, plus ``recipe``: how to rebuild them (failure records keep it, not megabytes)."""
    recipe: dict = {}


def features(batch: int, shape: tuple, seed: int, scale: float) -> Batch:
    out = Batch(input_features=(scale * np.random.default_rng(seed).standard_normal((batch, *shape))).astype(np.float32))
    out.recipe = {"features": dict(batch=batch, shape=list(shape), seed=seed, scale=scale)}
    return out


@st.composite
def batches(draw, info: ModelInfo) -> dict:
    """1–4 inputs: token rows of 1–16 tokens padded with a mask (right; left for decoder-only models, whose
    prompt it is), or Whisper features (various scales)."""
    batch = draw(st.integers(1, 4), label="batch")
    seed = draw(st.integers(0, 2**31 - 1), label="input_seed")
    rng = np.random.default_rng(seed)
    if info.features is not None:
        return features(batch, info.features, seed, draw(st.sampled_from([0.5, 1.0, 3.0]), label="feature_scale"))
    lengths = draw(st.lists(st.integers(1, 16), min_size=batch, max_size=batch), label="lengths")
    width = max(lengths)
    vocab = info.source_vocab or info.vocab
    low = max(info.specials) + 1 if max(info.specials) < vocab // 2 else 0
    ids = rng.integers(low, vocab, size=(batch, width), dtype=np.int64)
    mask = (np.arange(width)[None, :] < np.asarray(lengths)[:, None]).astype(np.int64)
    if info.family in DECODER_ONLY:
        mask = mask[:, ::-1].copy()
    ids[mask == 0] = info.pad
    return {"input_ids": ids, "attention_mask": mask}


@st.composite
def generation_options(draw, ngram: int | None = None) -> dict:
    """HF generate options: beams 1–8, return sequences, n-gram size, length penalty, early stopping, lengths.

    ``ngram``: the size an ``ngram=N`` export blocks in its graph; the run then asks for exactly
    that size (the graph blocks N-grams whatever the run asks, issue 10 item 3).
    """
    rnd = draw(uniform(), label="uniform")
    beams = rnd.randint(1, 8)
    options = {"num_beams": beams}
    if beams > 1:
        options["num_return_sequences"] = rnd.randint(1, beams)
    if ngram is not None:
        options["no_repeat_ngram_size"] = ngram
    else:
        size = draw(st.integers(0, 4), label="no_repeat_ngram_size")
        if size or draw(st.booleans(), label="pass_zero_ngram"):
            options["no_repeat_ngram_size"] = size
    if beams > 1 or draw(st.integers(0, 4), label="greedy_beam_options") == 0:  # greedy: both ignore them
        options["length_penalty"] = draw(st.one_of(st.sampled_from([-1.0, 0.0, 0.5, 1.0, 2.0, 3.0]),
                                                   st.floats(-1.0, 3.0, allow_nan=False)), label="length_penalty")
        options["early_stopping"] = draw(st.sampled_from([True, False, "never"]), label="early_stopping")
    if draw(st.integers(0, 4), label="length_mode") > 0:
        new = draw(st.integers(1, 20), label="max_new_tokens")
        options["max_new_tokens"] = new
        if draw(st.booleans(), label="use_min_new"):
            options["min_new_tokens"] = draw(st.integers(0, new + 1), label="min_new_tokens")
    else:  # lengths that count the decoder prompt (Whisper: its own rule, runners/whisper.py)
        total = draw(st.integers(2, 21), label="max_length")
        options["max_length"] = total
        if draw(st.booleans(), label="use_min_length"):
            options["min_length"] = draw(st.integers(0, total), label="min_length")
    return options


@st.composite
def issue25_options(draw, info: ModelInfo, beams: int) -> dict:
    """The options of issue 25, drawn for the search variant on top of ``generation_options``: seeded sampling
    with HF's warpers, penalties and constraints, the caller's processors and criteria (as picklable specs,
    ``call_arguments`` builds them), per-step outputs, a decoder prefix, max_time=0.

    Whisper runs draw neither sampling (HF's Whisper decides it from ``temperature``, elx refuses it) nor
    per-step outputs or decoder prefixes (HF's Whisper has its own)."""
    rnd = draw(uniform(), label="issue25")
    out = {}
    audio = info.features is not None
    if not audio and rnd.random() < 0.35:
        out["do_sample"] = True
        out["seed"] = rnd.randrange(2**31)
        if rnd.random() < 0.5:
            out["temperature"] = rnd.choice([0.5, 0.7, 1.3, 2.0, round(rnd.uniform(0.2, 3.0), 3)])
        if rnd.random() < 0.5:
            out["top_k"] = rnd.choice([0, 1, 2, 5, 20, 50, rnd.randint(1, info.vocab)])
        if rnd.random() < 0.4:
            out["top_p"] = rnd.choice([0.0, 0.5, 0.9, 0.95, round(rnd.uniform(0.0, 1.0), 3)])
        if rnd.random() < 0.25:
            out["min_p"] = rnd.choice([0.0, 0.05, 0.1, 0.3])
        if rnd.random() < 0.2:
            out["typical_p"] = rnd.choice([0.2, 0.5, 0.9, 0.99])
        if rnd.random() < 0.2:
            out["epsilon_cutoff"] = rnd.choice([3e-4, 0.01, 0.05])
        if rnd.random() < 0.2:
            out["eta_cutoff"] = rnd.choice([3e-4, 0.01, 0.05])
        if rnd.random() < 0.15:
            out["top_h"] = rnd.choice([0.3, 0.6, 1.0])
        if beams == 1 and rnd.random() < 0.4:
            out["num_return_sequences"] = rnd.randint(1, 4)
    token = lambda: rnd.randrange(info.vocab)  # noqa: E731
    if rnd.random() < 0.2:
        out["repetition_penalty"] = rnd.choice([0.5, 1.2, 1.5, 2.0, round(rnd.uniform(0.3, 3.0), 3)])
    if not audio and rnd.random() < 0.15:
        out["encoder_repetition_penalty"] = rnd.choice([0.7, 1.3, 2.0])
    if not audio and rnd.random() < 0.15:
        out["encoder_no_repeat_ngram_size"] = rnd.randint(1, 3)
    if rnd.random() < 0.15:
        out["bad_words_ids"] = [[token() for _ in range(rnd.randint(1, 2))] for _ in range(rnd.randint(1, 3))]
    if rnd.random() < 0.15:
        out["sequence_bias"] = [[[token() for _ in range(rnd.randint(1, 2))], round(rnd.uniform(-3.0, 3.0), 2)]
                                for _ in range(rnd.randint(1, 3))]
    if rnd.random() < 0.15:
        out["exponential_decay_length_penalty"] = (rnd.randint(0, 6), rnd.choice([0.8, 1.05, 1.5, 2.0]))
    if rnd.random() < 0.1:
        out["renormalize_logits"] = True
    if rnd.random() < 0.1:
        out["remove_invalid_values"] = True
    if rnd.random() < 0.1:
        out["_prefix_allowed_tokens"] = rnd.randint(2, 5)
    if rnd.random() < 0.1:
        out["_logits_processor"] = rnd.randint(2, 7)
    if rnd.random() < 0.1:
        out["_stopping_criterion"] = rnd.randint(3, 11)
    if not audio and rnd.random() < 0.15:
        out.update(return_dict_in_generate=True, output_scores=rnd.random() < 0.8, output_logits=rnd.random() < 0.5)
    # FSMT: elx refuses prefixes (HF runs them without a causal mask: test_translation_families.py)
    if not audio and info.family not in (*DECODER_ONLY, "fsmt") and rnd.random() < 0.1:
        out["_decoder_prefix"] = [rnd.randint(1, 3), rnd.randrange(2**31)]
    if rnd.random() < 0.02:
        out["max_time"] = 0.0
    return out


class PrefixRule:
    """A ``prefix_allowed_tokens_fn``: tokens t with ``(t + last token + item) % m != 0`` (torch or numpy rows)."""

    def __init__(self, m: int, vocab: int):
        self.m, self.vocab = m, vocab

    def __call__(self, batch_id, sent):
        last = int(sent[-1])
        return [t for t in range(self.vocab) if (t + last + batch_id) % self.m != 0]


class LastTokenBump:
    """A caller's logits processor: + 0.25 · (last token % m), numpy in numpy out, or torch as HF calls it."""

    def __init__(self, m: int):
        self.m = m

    def __call__(self, ids, scores):
        if isinstance(scores, np.ndarray):
            return scores + (ids[:, -1:] % self.m).astype(np.float32) * np.float32(0.25)
        return scores + (ids[:, -1:] % self.m).to(scores.dtype) * 0.25


class LastTokenStop:
    """A caller's stopping criterion: a row stops when its last token is a multiple of m."""

    def __init__(self, m: int):
        self.m = m

    def __call__(self, ids, scores, **kwargs):
        return ids[:, -1] % self.m == 0


def call_arguments(options: dict, vocab: int, batch: int, torch_tensors: bool) -> dict:
    """``options`` with ``issue25_options``' specs turned into HF generate's call arguments (and no ``seed``
    for HF, whose draws ``torch.manual_seed`` seeds instead)."""
    out = {k: v for k, v in options.items() if not k.startswith("_") and (k != "seed" or not torch_tensors)}
    if "_prefix_allowed_tokens" in options:
        out["prefix_allowed_tokens_fn"] = PrefixRule(options["_prefix_allowed_tokens"], vocab)
    if "_logits_processor" in options:
        out["logits_processor"] = [LastTokenBump(options["_logits_processor"])]
    if "_stopping_criterion" in options:
        out["stopping_criteria"] = [LastTokenStop(options["_stopping_criterion"])]
    if "_decoder_prefix" in options:
        length, seed = options["_decoder_prefix"]
        ids = np.random.default_rng(seed).integers(0, vocab, size=(batch, length), dtype=np.int64)
        out["decoder_input_ids"] = torch.from_numpy(ids) if torch_tensors else ids
    return out


def hf_search(model, inputs: dict, options: dict, vocab: int, device: str = "cpu") -> tuple:
    """HF ``generate(use_cache=False)`` with ``options`` (specs built, seeded with ``torch.manual_seed``):
    (sequences, {scores, logits, beam_indices, sequences_scores} as numpy where HF returned them).  ``device``:
    where HF runs (model and inputs moved there for the call, the model moved back after)."""
    from elx.exporter.verification.hf_reference import torch_inputs as _torch_inputs

    batch = int(next(iter(inputs.values())).shape[0])
    kwargs = call_arguments(hf_reference_options(model, options), vocab, batch, torch_tensors=True)
    kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    if "seed" in options:
        torch.manual_seed(options["seed"])
    tensors = {k: v.to(device) for k, v in _torch_inputs(inputs, next(model.parameters()).dtype).items()}
    try:
        with torch.no_grad():
            out = model.to(device).generate(**tensors, **kwargs)
    finally:
        model.to("cpu")
    if isinstance(out, torch.Tensor):
        return out.cpu().numpy(), {}
    extras = {}
    for name in ("scores", "logits"):
        if getattr(out, name, None) is not None:
            extras[name] = [t.cpu().numpy() for t in getattr(out, name)]
    for name in ("beam_indices", "sequences_scores"):
        if getattr(out, name, None) is not None:
            extras[name] = getattr(out, name).cpu().numpy()
    return out.sequences.cpu().numpy(), extras


def elx_extras(out) -> dict:
    """The per-step outputs of an elx ``GenerationOutput`` in ``hf_search``'s form."""
    extras = {name: list(getattr(out, name)) for name in ("scores", "logits") if getattr(out, name) is not None}
    if out.beam_indices is not None:
        extras["beam_indices"] = out.beam_indices
    if out.sequences_scores is not None and out.settings.returns_scores:
        extras["sequences_scores"] = out.sequences_scores
    return extras


def same_extras(hf: dict, elx: dict) -> list[str]:
    """The per-step outputs that differ (names), bit for bit and in shape."""
    differ = []
    for name in sorted(set(hf) | set(elx)):
        a, b = hf.get(name), elx.get(name)
        if a is None or b is None:
            differ.append(name)
        elif isinstance(a, list):
            if len(a) != len(b) or any(x.shape != y.shape or not np.array_equal(x, y, equal_nan=True)
                                       for x, y in zip(a, b)):
                differ.append(name)
        elif a.shape != b.shape or not np.array_equal(a, b):
            differ.append(name)
    return differ


@st.composite
def language_options(draw, family: str) -> dict:
    """The target language as the translation families' model cards set it: ``forced_bos_token_id`` (mBART-50,
    M2M100 / NLLB), or the language as ``decoder_start_token_id`` (mBART-cc25); {} for other families."""
    if family not in TRANSLATION:
        return {}
    options = {}
    if draw(st.booleans(), label="forced_bos"):
        options["forced_bos_token_id"] = LANGUAGE
    if family == "mbart" and draw(st.booleans(), label="language_starts_decoder"):
        options["decoder_start_token_id"] = LANGUAGE
    return options


EOS_MODES = ("default", "frequent", "frequent+default")


def frequent_tokens(model, inputs: dict, family: str, new_tokens: int = 12) -> list[int]:
    """Tokens HF's greedy search emits on ``inputs``, most frequent first (candidates for an early EOS)."""
    out = _hf_generate(model, inputs, {"max_new_tokens": new_tokens, "num_beams": 1})
    prompt = inputs["input_ids"].shape[1] if family in DECODER_ONLY else 0 if family == "whisper" else 1
    generated = out[:, prompt:]
    values, counts = np.unique(generated, return_counts=True)
    order = np.lexsort((values, -counts))
    return [int(v) for v in values[order]]


def eos_override(mode: str, rank: int, model, inputs: dict, manifest: Manifest) -> int | list | None:
    if mode == "default":
        return None
    tokens = frequent_tokens(model, inputs, manifest.family)
    frequent = tokens[min(rank, len(tokens) - 1)]
    if mode == "frequent":
        return frequent
    default = [int(t) for t in manifest.tokens.get("eos_token_id") or []]
    return [frequent, *[t for t in default if t != frequent]]


def setting_class(options: dict) -> str:
    """The kind of run ``options`` ask for: sampling, processors (penalties, constraints, the caller's callables),
    scores (per-step outputs), beam, greedy, the first that applies, "+ngram" when n-grams are blocked."""
    processors = ("repetition_penalty", "encoder_repetition_penalty", "encoder_no_repeat_ngram_size", "bad_words_ids",
                  "sequence_bias", "exponential_decay_length_penalty", "renormalize_logits", "remove_invalid_values",
                  "_prefix_allowed_tokens", "_logits_processor", "_stopping_criterion", "_decoder_prefix")
    if options.get("do_sample"):
        kind = "sampling"
    elif any(options.get(k) is not None for k in processors):
        kind = "processors"
    elif options.get("return_dict_in_generate"):
        kind = "scores"
    else:
        kind = "beam" if options.get("num_beams", 1) > 1 else "greedy"
    return kind + ("+ngram" if options.get("no_repeat_ngram_size") else "")


# -- outcomes ---------------------------------------------------------------------------------------
def _jsonable(value):
    if isinstance(value, Batch) and value.recipe:
        return value.recipe
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    return value


@dataclass
class Stats:
    variant: str
    examples: int = 0
    rows: int = 0
    identical_rows: int = 0
    fragile_rows: int = 0
    excused_examples: int = 0  # examples with >= 1 fragile row and no failure
    # search variant: rows where HF's own tokens depend on PyTorch's CPU kernels (scalar, AVX2, AVX-512 round
    # the float32 log-softmax differently and decide a near-tie of scores) and elx gives one of HF's answers
    # (see ``tests.hf_on_cpu_kernel``).  elx's search calls this CPU's kernel (``elx.runners.search.log_softmax``), so
    # none are expected; with ELX_LOG_SOFTMAX=numpy they are (and the near-ties numpy rounds its own way fail)
    kernel_rows: int = 0
    kernel_examples: int = 0
    hf_refused: int = 0  # HF raised on the drawn settings (and so did elx)
    pass_refused: Counter = field(default_factory=Counter)  # spec/pass set -> examples skipped: the pass refused
    refusals: dict = field(default_factory=dict)  # spec/pass set -> "expected (why): ..." or "UNEXPECTED: ..."
    classes: Counter = field(default_factory=Counter)  # spec/pass set/setting class (export), family/class (search)
    excused: Counter = field(default_factory=Counter)  # export: "spec/pass set: why HF's answer is fragile" -> rows
    failures: list = field(default_factory=list)
    kinds: Counter = field(default_factory=Counter)  # spec/pass set (export) or family (search) -> examples
    beams: Counter = field(default_factory=Counter)
    max_logits_diff: float = 0.0
    options: Counter = field(default_factory=Counter)  # search variant: examples per drawn option (issue 25's)

    def record_failure(self, kind: str, **details) -> None:
        self.failures.append({"kind": kind, **_jsonable(details)})
        self._append({"variant": self.variant, "failure": self.failures[-1]})  # kept even if the run dies

    def progress(self) -> None:
        """A progress line in the report every 50 examples (long runs)."""
        if self.examples % 50 == 0:  # the counts so far (a long run stopped early still reports them)
            self._append({"variant": self.variant, "progress": self.examples, "failures": len(self.failures),
                          "fragile_rows": self.fragile_rows, "rows": self.rows, "identical_rows": self.identical_rows,
                          "classes": dict(self.classes), "refusals": dict(self.refusals)})

    @staticmethod
    def _append(record: dict) -> None:
        path = os.environ.get("ELX_DIFF_REPORT")
        if path:
            with open(path, "a") as f:
                f.write(json.dumps(record) + "\n")

    def summary(self) -> str:
        lines = [f"differential[{self.variant}]: {self.examples} examples, {self.rows} rows; "
                 f"{self.identical_rows} rows identical, {self.fragile_rows} fragile rows excused "
                 f"(HF's own answer not stable: exporter/verification/stability.py) in {self.excused_examples} examples; "
                 f"HF refused {self.hf_refused}; {len(self.failures)} failures"]
        if self.variant == "search":
            lines.append(f"  fragile on the CPU kernels (HF's tokens differ between PyTorch's scalar / AVX2 / "
                         f"AVX-512 kernels; elx gives one of them): {self.kernel_rows} rows in "
                         f"{self.kernel_examples} examples")
        if self.pass_refused:
            lines.append(f"  skipped, the pass refused the model ({sum(self.pass_refused.values())}): "
                         + ", ".join(f"{k} {v}" for k, v in sorted(self.pass_refused.items())))
            lines.extend(f"    refused {k}: {v[:300]}" for k, v in sorted(self.refusals.items()))
        if self.variant == "export":
            lines.append(f"  worst teacher-forced logits diff {self.max_logits_diff:.2e}")
            lines.extend(f"    excused {v} rows: {k[:300]}" for k, v in sorted(self.excused.items()))
        lines.append("  beams: " + " ".join(f"{k}:{v}" for k, v in sorted(self.beams.items())))
        if self.options:
            lines.append("  options: " + ", ".join(f"{k} {v}" for k, v in sorted(self.options.items())))
        lines.append("  by " + ("spec/passes" if self.variant == "export" else "family") + ": "
                     + ", ".join(f"{k} {v}" for k, v in sorted(self.kinds.items())))
        if self.classes:
            lines.append("  by " + ("spec/passes/setting" if self.variant == "export" else "family/setting") + ": "
                         + ", ".join(f"{k} {v}" for k, v in sorted(self.classes.items())))
        for failure in self.failures[:20]:
            lines.append("  FAILURE " + json.dumps(failure)[:1500])
        return "\n".join(lines)

    def dump(self) -> None:
        """Append the stats to ``$ELX_DIFF_REPORT`` (JSON lines) when set: the record of a long run."""
        self._append({k: _jsonable(dict(v) if isinstance(v, Counter) else v) for k, v in self.__dict__.items()})


def run_export_example(stats: Stats, pool: ExportPool, spec: ModelSpec, passes: str, inputs: dict, options: dict,
                       eos_mode: str = "default", eos_rank: int = 0) -> None:
    """One export example: compare elx with HF generate, record the outcome."""
    where = dict(spec=spec.name, passes=passes or "baseline", options=options, inputs=inputs)
    try:
        loaded = pool.loaded(spec, passes)
    except ElxError as err:  # a pass may refuse a model (slim: not accurate enough): it writes nothing, says why
        if not passes:
            raise
        stats.pass_refused[f"{spec.name}/{passes}"] += 1
        why = expected_refusal(spec, passes, str(err))
        stats.refusals[f"{spec.name}/{passes}"] = f"{'expected (' + why + ')' if why else 'UNEXPECTED'}: {err}"
        if why is None:
            stats.record_failure("pass-refused", error=str(err), spec=spec.name, passes=passes)
        return
    stats.examples += 1
    stats.progress()
    stats.kinds[f"{spec.name}/{passes or 'baseline'}"] += 1
    stats.classes[f"{spec.name}/{passes or 'baseline'}/{setting_class(options)}"] += 1
    stats.beams[options.get("num_beams", 1)] += 1
    try:
        options = dict(options)
        eos = eos_override(eos_mode, eos_rank, loaded.model, inputs, loaded.generator.manifest)
        if eos is not None:
            options["eos_token_id"] = eos
        where["options"] = options
    except Exception as err:  # noqa: BLE001
        stats.record_failure("crash", error=f"{type(err).__name__}: {err}", traceback=traceback.format_exc(limit=6),
                             **where)
        return
    try:
        report = compare_loaded(loaded.generator, loaded.model, inputs=inputs, variants=loaded.variants, **options)
    except ElxError as err:
        stats.record_failure("elx-refused", error=str(err), **where)
        return
    except ValueError as err:  # HF generate refusing the settings; elx must refuse them too
        try:
            loaded.generator.generate(inputs, **options)
        except ElxError:
            stats.hf_refused += 1
            return
        except Exception:  # noqa: BLE001
            pass
        stats.record_failure("hf-refused-elx-accepted", error=str(err).splitlines()[0], **where)
        return
    except Exception as err:  # noqa: BLE001 - a crash is a finding, with its traceback
        stats.record_failure("crash", error=f"{type(err).__name__}: {err}",
                             traceback=traceback.format_exc(limit=6), **where)
        return
    stats.rows += len(report.rows)
    stats.identical_rows += sum(r.identical for r in report.rows)
    stats.fragile_rows += len(report.fragile)
    stats.max_logits_diff = max(stats.max_logits_diff, report.max_logits_diff)
    if report.problems:
        stats.record_failure(
            "divergence", problems=report.problems, **where,
            rows=[dict(row=i, hf=r.hf_tokens, elx=r.elx_tokens, stable=r.hf_stable, variants=r.hf_variant_tokens,
                       **({} if r.stability is None else dict(alone=r.stability.alone_tokens,
                                                               margin=r.stability.margin_text())))
                  for i, r in enumerate(report.rows) if not r.identical])
    elif report.fragile:
        stats.excused_examples += 1
        for row in report.fragile:  # why each was excused, by spec / pass set (the closing notes count them)
            why = ("; ".join(r.split(" of ±")[0] for r in row.stability.reasons) if row.stability is not None
                   else "not checked")
            stats.excused[f"{spec.name}/{passes or 'baseline'}: {why}"] += 1


# -- the search-only variant -------------------------------------------------------------------------
@st.composite
def random_configs(draw) -> tuple[str, int, dict]:
    """(family, seed, config overrides) of a random tiny model; ``init`` scales the weights (peakedness)."""
    family = draw(uniform(), label="uniform").choice(["t5", "t5", "bart", "whisper", "gpt2", "opt", "rope",
                                                      "translation"])
    if family == "rope":
        return rope_config(draw)
    if family == "translation":  # one slot for the four translation families (issue 25)
        family = draw(uniform(), label="translation").choice(TRANSLATION)
    seed = draw(st.integers(0, 10_000), label="model_seed")
    vocab = draw(st.integers(24, 400), label="vocab_size")
    layers = draw(st.integers(1, 2), label="layers")
    if family == "t5":
        heads = draw(st.sampled_from([1, 2, 4]), label="heads")
        d_kv = draw(st.sampled_from([4, 8, 16]), label="d_kv")
        square = draw(st.booleans(), label="square")
        d_model = heads * d_kv if square else draw(st.sampled_from([8, 16, 24, 32, 48]), label="d_model")
        return family, seed, dict(
            vocab_size=vocab, d_model=d_model, d_kv=d_kv, num_heads=heads, d_ff=draw(st.sampled_from([8, 32, 64])),
            # HF 5.23's T5 sizes its self-attention cache by num_layers: more decoder than encoder layers
            # crash HF generate (IndexError in DynamicCache.update), so the decoder is never deeper here
            num_layers=layers, num_decoder_layers=draw(st.integers(1, layers), label="decoder_layers"),
            feed_forward_proj=draw(st.sampled_from(["relu", "gated-gelu"]), label="ffn"),
            tie_word_embeddings=draw(st.booleans(), label="tied"),
            initializer_factor=draw(st.sampled_from([0.5, 1.0, 2.0, 4.0]), label="init"),
            relative_attention_num_buckets=draw(st.sampled_from([8, 32]), label="buckets"))
    heads = draw(st.sampled_from([1, 2, 4]), label="heads")
    d_model = heads * draw(st.sampled_from([4, 8]), label="head_dim")
    if family == "gpt2":  # EOS (= BOS, and the pad HF uses) is the last id, as in GPT-2's vocabulary
        return family, seed, dict(vocab_size=vocab, n_embd=d_model, n_head=heads, n_layer=layers, n_positions=64,
                                  n_inner=draw(st.sampled_from([None, 8, 32]), label="n_inner"),
                                  bos_token_id=vocab - 1, eos_token_id=vocab - 1,
                                  initializer_range=draw(st.sampled_from([0.02, 0.2, 0.6]), label="init"))
    if family == "opt":  # pad 1, BOS = EOS 2 (OPT's own ids)
        return family, seed, dict(vocab_size=vocab, hidden_size=d_model, word_embed_proj_dim=d_model,
                                  num_attention_heads=heads, num_hidden_layers=layers, max_position_embeddings=64,
                                  ffn_dim=draw(st.sampled_from([8, 32])), pad_token_id=1, bos_token_id=2,
                                  eos_token_id=2, init_std=draw(st.sampled_from([0.02, 0.2, 0.6]), label="init"))
    common = dict(vocab_size=vocab, d_model=d_model, encoder_attention_heads=heads, decoder_attention_heads=heads,
                  encoder_ffn_dim=draw(st.sampled_from([8, 32])), decoder_ffn_dim=draw(st.sampled_from([8, 32])),
                  encoder_layers=layers, decoder_layers=draw(st.integers(1, 2), label="decoder_layers"),
                  init_std=draw(st.sampled_from([0.02, 0.2, 0.6]), label="init"))
    if family == "bart":
        return family, seed, dict(common, scale_embedding=draw(st.booleans(), label="scale_embedding"),
                                  forced_eos_token_id=draw(st.sampled_from([None, 2]), label="forced_eos"))
    if family in TRANSLATION:
        return family, seed, translation_config(draw, family, common)
    return family, seed, dict(common, vocab_size=max(vocab, 12), max_source_positions=draw(st.sampled_from([6, 16])),
                              num_mel_bins=draw(st.sampled_from([4, 8])),
                              suppress_tokens=draw(st.sampled_from([None, [5, 7]]), label="suppress"),
                              begin_suppress_tokens=draw(st.sampled_from([None, [2, 9]]), label="begin_suppress"))


def rope_config(draw) -> tuple[str, int, dict]:
    """A random tiny RoPE decoder-only model (issue 24): MHA, GQA or MQA, a random rotary embedding (type, θ,
    partial factor where the family reads one), head widths other than d/h (Qwen3, Gemma), HF's special ids."""
    rnd = draw(uniform(), label="uniform")
    family = rnd.choice(ROPE_DECODER_ONLY)
    heads = rnd.choice([1, 2, 3, 4])
    kv_heads = rnd.choice([d for d in range(1, heads + 1) if heads % d == 0])
    head_dim = rnd.choice([4, 8])
    config = dict(vocab_size=draw(st.integers(24, 400), label="vocab_size"), hidden_size=heads * head_dim,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=rnd.choice([8, 32]),
                  num_hidden_layers=rnd.randint(1, 2), max_position_embeddings=64,
                  initializer_range=rnd.choice([0.02, 0.2, 0.6]))
    if family in ("qwen3", "gemma") and rnd.random() < 0.5:
        config["head_dim"] = 2 * head_dim  # ≠ hidden / heads
    # Phi-3's config takes only default (or longrope, which elx refuses) rotary types
    kinds = ["default"] if family == "phi3" else ["default", "default", "linear", "llama3", "yarn"]
    rope = dict(rope_type=rnd.choice(kinds), rope_theta=rnd.choice([100.0, 10000.0, 1e6]))
    if rope["rope_type"] != "default":
        rope["factor"] = rnd.choice([2.0, 8.0])
    if rope["rope_type"] == "llama3":
        rope.update(low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16)
    if rope["rope_type"] == "yarn":
        rope["original_max_position_embeddings"] = 16
    if family in ("phi3", "gpt_neox"):  # an even rotary width of at least 2
        rope["partial_rotary_factor"] = rnd.choice([f for f in (0.25, 0.5, 1.0) if (head_dim * f) % 2 == 0])
    config["rope_scaling"] = rope
    if family == "gpt_neox":  # multi-head only
        del config["num_key_value_heads"]
    config.update(ROPE_SPECIALS[family])
    return family, draw(st.integers(0, 10_000), label="model_seed"), config


ROPE_SPECIALS = {family: dict(bos_token_id=1, eos_token_id=2) for family in ROPE_DECODER_ONLY}
ROPE_SPECIALS.update(gemma=dict(bos_token_id=2, eos_token_id=1, pad_token_id=0),
                     phi3=dict(bos_token_id=1, eos_token_id=2, pad_token_id=0))


def rope_info(family: str, config: dict) -> ModelInfo:
    """``ModelInfo`` of ``rope_config``'s model without building it (HF pads with the EOS without a pad id)."""
    pad = config.get("pad_token_id", config["eos_token_id"])
    return ModelInfo(family, config["vocab_size"], pad, tuple(sorted({pad, config["bos_token_id"],
                                                                       config["eos_token_id"]})))


def translation_config(draw, family: str, common: dict) -> dict:
    """A random tiny config of a translation family: conftest's special tokens (mBART / M2M100 / FSMT: BOS 0,
    pad 1, EOS 2; Pegasus: pad 0, EOS 1), drawn embedding scaling and forced EOS; FSMT: its own source
    vocabulary (the drawn one is the target's)."""
    config = dict(common, max_position_embeddings=64, scale_embedding=draw(st.booleans(), label="scale_embedding"))
    eos = 1 if family == "pegasus" else 2
    if family != "m2m100":  # M2M100 / NLLB configs set no forced EOS
        config["forced_eos_token_id"] = draw(st.sampled_from([None, eos]), label="forced_eos")
    if family == "mbart":  # mBART-cc25 (no start token: HF starts with the BOS) or mBART-50 (starts with EOS)
        config["decoder_start_token_id"] = draw(st.sampled_from([None, 2]), label="decoder_start")
    if family == "fsmt":
        vocab = config.pop("vocab_size")
        config.update(tgt_vocab_size=vocab, src_vocab_size=draw(st.integers(24, 400), label="src_vocab_size"))
    return config


def build_fp64(family: str, seed: int, config: dict):
    torch.manual_seed(seed)
    return BUILDERS[family](**config).eval().double()


def decoder_only_lengths(options: dict, prompt_width: int) -> dict:
    """``max_length``/``min_length`` drawn for an encoder-decoder prompt (1 token), moved past a decoder-only
    model's prompt (HF counts it: a ``max_length`` within the prompt leaves nothing to generate)."""
    return {k: v + prompt_width - 1 if k in ("max_length", "min_length") and v else v for k, v in options.items()}


def bare_manifest(model) -> Manifest:
    """A manifest without graphs (what ``elx export`` would record), for the generator's settings and inputs."""
    from elx.exporter.export import base_manifest
    from elx.exporter.families.catalog import family_for_architecture

    family = family_for_architecture(type(model).__name__)
    data = base_manifest(model, family, {"kind": "in-memory"})
    if not family.is_encoder_decoder:  # the prompt is the first step's input
        data["graphs"] = {"prefill": {"file": "-", "inputs": {
            role: {"dtype": "int64", "shape": ["batch", "prompt"], "from": f"input:{role}"}
            for role in ("input_ids", "attention_mask")}}, "decoder": {"file": "-", "inputs": {}}}
        data.update(stages=["prefill"], step="decoder", padding_side="left")
        return Manifest(data)
    data["graphs"] = {"encoder": {"file": "-", "inputs": {
        s.name: {"dtype": s.dtype, "shape": list(s.shape), "from": f"input:{s.role}"}
        for s in family.encoder_inputs(model.config)}}, "decoder": {"file": "-", "inputs": {}}}
    data["stages"], data["step"] = ["encoder"], "decoder"
    return Manifest(data)


@contextmanager
def log_softmax_kernel(name: str):
    """elx's search with the given log-softmax kernel (``elx.runners.search.log_softmax``: "torch", HF's rounding, or "numpy")."""
    saved = os.environ.get(ENV)
    os.environ[ENV] = name
    try:
        yield
    finally:
        if saved is None:
            del os.environ[ENV]
        else:
            os.environ[ENV] = saved


def _same_rows(hf: np.ndarray, elx: np.ndarray) -> list[bool]:
    if elx.shape[1:] != hf.shape[1:]:
        return [False] * hf.shape[0]
    return [r < elx.shape[0] and bool(np.array_equal(hf[r], elx[r])) for r in range(hf.shape[0])]


def _unsamplable(err: RuntimeError) -> bool:
    """HF's sampling failing on scores nothing can be drawn from (NaN / inf: e.g. the exponential decay penalty's
    abs(-inf) on an EOS banned by min_length); elx refuses such runs in one line (``Sampler.check``)."""
    return "probability tensor contains" in str(err) or "invalid multinomial distribution" in str(err)


def run_search_example(stats: Stats, family: str, seed: int, config: dict, inputs: dict, options: dict,
                       eos_mode: str = "default", eos_rank: int = 0, search_device=None) -> None:
    """One search-only example: elx's search on HF's fp64 logits against HF generate(use_cache=False), fp64.

    ``search_device``: a callable telling, once elx has run, the torch device its search ran on (None: the host
    path): HF's answer is then HF generate's on that device, whose float32 kernels (log-softmax, the
    repetition penalty's division) are the ones elx's device path ran; the host path is held to HF on the CPU."""
    where = dict(family=family, seed=seed, config=config, options=options, inputs=inputs)
    stats.examples += 1
    stats.progress()
    stats.kinds[family] += 1
    stats.beams[options.get("num_beams", 1)] += 1
    stats.options.update(k.lstrip("_") for k in options)
    stats.classes[f"{family}/{setting_class(options)}"] += 1
    try:
        model = build_fp64(family, seed, config)
        manifest = bare_manifest(model)
        generator = Generator(search_backend(model, manifest))
        options = dict(options)
        eos = eos_override(eos_mode, eos_rank, model, inputs, manifest)
        if eos is not None:
            options["eos_token_id"] = eos
        where["options"] = options
    except Exception as err:  # noqa: BLE001 - a crash is a finding, with its traceback
        stats.record_failure("crash", error=f"{type(err).__name__}: {err}", traceback=traceback.format_exc(limit=6),
                             **where)
        return
    vocab = model.config.vocab_size
    elx_arguments = call_arguments(options, vocab, int(next(iter(inputs.values())).shape[0]), torch_tensors=False)
    try:
        hf, hf_extras = hf_search(model, inputs, options, vocab)
    except (ValueError, RuntimeError) as err:
        if isinstance(err, RuntimeError) and not _unsamplable(err):
            raise
        try:
            generator.generate(inputs, **elx_arguments)
        except ElxError:
            stats.hf_refused += 1
            return
        stats.record_failure("hf-refused-elx-accepted", error=str(err).splitlines()[0], **where)
        return
    try:
        out = generator.generate(inputs, **elx_arguments)
        elx = out.sequences
    except Exception as err:  # noqa: BLE001
        stats.record_failure("crash", error=f"{type(err).__name__}: {err}", traceback=traceback.format_exc(limit=6),
                             **where)
        return
    device = search_device() if search_device is not None else None
    if device is not None and device != "cpu":
        hf, hf_extras = hf_search(model, inputs, options, vocab, device)
        where["hf_device"] = device
    stats.rows += hf.shape[0]
    same = _same_rows(hf, elx)
    stats.identical_rows += sum(same)
    if elx.shape == hf.shape and all(same):
        differ = same_extras(hf_extras, elx_extras(out))
        if differ:
            stats.record_failure("outputs-differ", outputs=differ, **where)
        return
    answers = {torch.backends.cpu.get_cpu_capability(): hf,
               **hf_on_cpu_kernels(family, seed, config, inputs, options,
                                   skip=torch.backends.cpu.get_cpu_capability())}
    hf_stable = all(a.shape == hf.shape and np.array_equal(a, hf) for a in answers.values())
    if not hf_stable and any(a.shape == elx.shape and np.array_equal(a, elx) for a in answers.values()):
        stats.kernel_rows += len(same) - sum(same)
        stats.kernel_examples += 1
        return
    stats.record_failure("divergence", hf=hf, elx=elx, hf_by_cpu_kernels=answers, **where)
