"""Generation settings resolved the way HF ``generate`` resolves them.

The manifest carries the model's ``generation_config`` values; the user overrides them per call.
Lengths follow HF: ``max_length`` and ``min_length`` count the decoder prompt (encoder-decoder
models: the start token; decoder-only models: the left-padded prompt), ``max_new_tokens``/
``min_new_tokens`` do not, and ``max_new_tokens`` wins over ``max_length``.  Options the runners do not implement are refused, not ignored.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from runners.errors import ElxError

from .families import RULES, rules_for
from .manifest import Manifest
from .validation import check_settings

HF_DEFAULT_MAX_LENGTH = 20
_UNSUPPORTED = {"do_sample": False, "repetition_penalty": 1.0, "bad_words_ids": None,
                "encoder_no_repeat_ngram_size": 0}


@dataclass
class GenerationSettings:
    num_beams: int = 1
    max_length: int | None = None  # includes the decoder prompt; None: HF's default of 20 new tokens
    min_length: int = 0
    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    num_return_sequences: int = 1
    no_repeat_ngram_size: int = 0
    eos_token_id: list = field(default_factory=list)
    pad_token_id: int | None = None
    decoder_start_token_id: int | None = None
    forced_bos_token_id: int | None = None
    forced_eos_token_id: int | None = None
    suppress_tokens: list | None = None
    begin_suppress_tokens: list | None = None
    decoder_prompt: list = field(default_factory=list)  # tokens after the start token (Whisper's lang/task)
    input_repeats: int = 1  # Whisper: HF runs num_return_sequences=r as r copies of each input (runners/whisper.py)
    # the caller passed eos_token_id as a list (HF keeps the form it was given; Whisper's output depends on it:
    # WhisperRules.output_sequences)
    eos_listed: bool = False

    def prompt(self) -> list[int]:
        return [int(self.decoder_start_token_id), *map(int, self.decoder_prompt)]

    max_positions: int | None = None  # the model's max_position_embeddings, caps HF's default length

    def total_max_length(self, prompt_len: int) -> int:
        """HF's ``_prepare_generated_length``: max_new_tokens wins; an unset max_length means 20 new tokens."""
        if self.max_new_tokens is not None:
            return prompt_len + self.max_new_tokens
        if self.max_length is not None:
            return self.max_length
        default = HF_DEFAULT_MAX_LENGTH + prompt_len
        return min(default, self.max_positions) if self.max_positions else default

    def total_min_length(self, prompt_len: int) -> int:
        return prompt_len + self.min_new_tokens if self.min_new_tokens is not None else self.min_length


_NAMES = {f.name for f in fields(GenerationSettings)}


def _eos_list(value) -> list:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def resolve_settings(manifest: Manifest, **overrides) -> GenerationSettings:
    """Model defaults from the manifest, then the caller's non-None overrides, then the family's rules; validated.

    Family-specific options (Whisper's ``language``/``task``) go to the family's rules
    (``runners/families.py``); other families refuse them."""
    rules = rules_for(manifest)
    extra = {name: overrides.pop(name, None) for name in rules.options}
    for name, value in overrides.items():
        if name not in _NAMES and value is not None:
            owners = sorted(family.capitalize() for family, r in RULES.items() if name in r.options)
            if owners:
                raise ElxError(f"generation option {name!r} applies to {', '.join(owners)} models only")
            raise ElxError(f"unknown generation option {name!r}")
    defaults = dict(manifest.data.get("generation_defaults", {}))
    for name, neutral in _UNSUPPORTED.items():
        value = overrides.get(name, defaults.get(name))
        if value not in (None, neutral):
            raise ElxError(f"generation option {name}={value!r} is not supported by elx runners; unset it")
    tokens = manifest.tokens
    values = {k: v for k, v in defaults.items() if k in _NAMES and v is not None}
    values.update(eos_token_id=_eos_list(tokens.get("eos_token_id")), pad_token_id=tokens.get("pad_token_id"),
                  decoder_start_token_id=tokens.get("decoder_start_token_id"),
                  max_positions=manifest.dims.get("max_position_embeddings"))
    for name, value in overrides.items():
        if value is not None:
            values[name] = _eos_list(value) if name == "eos_token_id" else value
    if overrides.get("eos_token_id") is not None:
        values["eos_listed"] = isinstance(overrides["eos_token_id"], (list, tuple))
    settings = GenerationSettings(**rules.resolve(manifest, values, extra))
    if settings.pad_token_id is None and settings.eos_token_id:
        settings.pad_token_id = settings.eos_token_id[0]
    rules.validate(settings)
    _validate(settings, rules.prompt_length(settings))
    return settings


def _validate(s: GenerationSettings, prompt_len: int | None) -> None:
    check_settings(s, prompt_len)  # runners/validation.py: types, ranges, total length vs the model's positions
    if s.input_repeats < 1:
        raise ElxError(f"input_repeats must be >= 1, got {s.input_repeats}")
    if s.num_beams < 1:
        raise ElxError(f"num_beams must be >= 1, got {s.num_beams}")
    if s.num_return_sequences > s.num_beams:
        raise ElxError(f"num_return_sequences ({s.num_return_sequences}) must be <= num_beams ({s.num_beams})")
    if s.early_stopping not in (True, False, "never"):
        raise ElxError(f"early_stopping must be True, False or 'never', got {s.early_stopping!r}")
    if s.max_new_tokens is not None and s.max_new_tokens < 1:
        raise ElxError(f"max_new_tokens must be >= 1, got {s.max_new_tokens}")
    if s.no_repeat_ngram_size < 0:
        raise ElxError(f"no_repeat_ngram_size must be >= 0, got {s.no_repeat_ngram_size}")
