"""Generation settings resolved the way HF ``generate`` resolves them.

The manifest carries the model's ``generation_config`` values; the user overrides them per call.
Lengths follow HF: ``max_length`` and ``min_length`` count the decoder prompt (encoder-decoder
models: the start token; decoder-only models: the left-padded prompt), ``max_new_tokens``/
``min_new_tokens`` do not, and ``max_new_tokens`` wins over ``max_length``.  Every option HF ``generate``
takes is implemented, accepted as a no-op, or refused in one line (``runners/options.py``): nothing is
silently ignored.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from elx.runners.errors import ElxError

from elx.runners import options
from elx.runners.families import RULES, rules_for
from elx.runners.manifest import Manifest
from elx.runners.inputs.validation import check_settings
from elx.runners.option_checks import check_generation_options

HF_DEFAULT_MAX_LENGTH = 20
# HF generate's options whose explicit None switches them off (HF's update() sets None, and the processor is not
# built); elsewhere None means "unset": the model's default
OFF_WHEN_NONE = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "typical_p": 1.0, "epsilon_cutoff": 0.0,
                 "eta_cutoff": 0.0, "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0}


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
    bos_token_id: int | None = None  # encoder-decoder models start with it when no decoder_start_token_id is set
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
    # sampling (HF's "warpers", applied only with do_sample); defaults are HF's global defaults
    do_sample: bool = False
    seed: int | None = None  # elx's own: the sampling generator's seed (runners/search/sampling.py)
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0
    min_p: float | None = None
    top_h: float | None = None
    typical_p: float = 1.0
    epsilon_cutoff: float = 0.0
    eta_cutoff: float = 0.0
    # penalties and constraints (runners/search/processors/)
    repetition_penalty: float = 1.0
    encoder_repetition_penalty: float = 1.0
    encoder_no_repeat_ngram_size: int = 0
    bad_words_ids: list | None = None
    sequence_bias: list | None = None  # HF's list form: [[token ids], bias] pairs
    exponential_decay_length_penalty: list | None = None  # [start_index, decay_factor]
    renormalize_logits: bool = False
    remove_invalid_values: bool = False
    # stopping (runners/search/stopping.py) and outputs
    max_time: float | None = None
    stop_strings: list | None = None
    output_scores: bool = False
    output_logits: bool = False
    return_dict_in_generate: bool = False

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

    @property
    def returns_scores(self) -> bool:
        """HF returns per-step scores (``output_scores``) only inside a returned dict."""
        return self.return_dict_in_generate and self.output_scores

    @property
    def returns_logits(self) -> bool:
        return self.return_dict_in_generate and self.output_logits


_NAMES = {f.name for f in fields(GenerationSettings)}
_TOKENS = ("eos_token_id", "pad_token_id", "decoder_start_token_id", "bos_token_id")


def _eos_list(value) -> list:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def config_values(config) -> dict:
    """The set fields of a ``generation_config=`` argument (an HF ``GenerationConfig`` or a dict), metadata left out."""
    if config is None:
        return {}
    if not isinstance(config, dict):
        if not hasattr(config, "to_dict"):
            raise ElxError(f"generation_config must be a transformers GenerationConfig or a dict, got "
                           f"{type(config).__name__}")
        config = config.to_dict()
    return {k: v for k, v in config.items() if v is not None and not k.startswith("_") and k != "transformers_version"}


# options of ``elx export`` a caller may pass to generate by mistake: chosen when the graphs are made
EXPORT_OPTIONS = ("prompt_cache", "passes", "precision")


def _place(name: str, where: str, rules=None) -> None:
    """Refuse a name elx does not know (a typo, or a field of a newer transformers), and (``rules``: the caller's
    options) a name only another family reads, such as Whisper's ``return_timestamps`` on T5 or Llama."""
    owners = sorted(family.capitalize() for family, r in RULES.items() if name in r.options or name in r.fields)
    if rules is not None and owners and name not in rules.options and name not in rules.fields:
        raise ElxError(f"generation option {name!r}{where} applies to {', '.join(owners)} models only; drop it")
    if options.known(name):
        return
    if owners:
        raise ElxError(f"generation option {name!r} applies to {', '.join(owners)} models only")
    if name in EXPORT_OPTIONS:
        raise ElxError(f"{name!r} is chosen when the model is exported (elx export --{name.replace('_', '-')}), not "
                       "at generate time: export again with it")
    raise ElxError(f"unknown generation option {name!r}{where}")


def _family_options(rules, given: dict, overrides: dict) -> None:
    """What the caller set that the family would not use: refused in one line instead of ignored."""
    for name, why in rules.inert_options.items():  # as an argument (a generation_config object may carry any field)
        value = overrides.get(name)
        if value is not None:
            raise ElxError(f"{name}={value!r} does nothing here: {why}; drop it")
    temperature = overrides.get("temperature", given.get("temperature"))
    if isinstance(temperature, (list, tuple)) and not rules.temperature_fallback:
        raise ElxError(f"temperature={list(temperature)!r}: a list of temperatures is Whisper's fallback (retried "
                       "windows); this model takes one temperature: pass one number")


def resolve_settings(manifest: Manifest, **overrides) -> GenerationSettings:
    """HF's defaults, the manifest's generation config, a ``generation_config=`` argument, then the caller's
    options (None: unset, except the sampling and penalty knobs of ``OFF_WHEN_NONE``, which HF switches off),
    then the family's rules; validated.  HF generate's call arguments (``elx.runners.options.CALL_ARGUMENTS``:
    streamer, processors, ...) are left to ``elx.runners.hooks``.

    Family-specific options (Whisper's ``language``/``task``) go to the family's rules
    (``runners/families.py``); other families refuse them."""
    rules = rules_for(manifest)
    extra = {name: overrides.pop(name, None) for name in rules.options}
    options.check_call_arguments(overrides)
    given = config_values(overrides.get("generation_config"))
    for name in given:
        _place(name, " in generation_config", rules)
    for name, value in overrides.items():
        if value is not None or name in OFF_WHEN_NONE:
            _place(name, "", rules)
    _family_options(rules, given, overrides)
    overrides = {k: v for k, v in overrides.items() if k not in options.CALL_ARGUMENTS or k == "seed"}
    defaults = dict(manifest.data.get("generation_defaults", {}))
    for name in defaults:
        _place(name, f" in {manifest.folder or 'the manifest'}'s generation defaults (re-export with this elx)")
    tokens = manifest.tokens
    values = {k: v for k, v in defaults.items() if k in _NAMES and k not in _TOKENS and v is not None}
    values.update(eos_token_id=_eos_list(tokens.get("eos_token_id")), pad_token_id=tokens.get("pad_token_id"),
                  decoder_start_token_id=tokens.get("decoder_start_token_id"), bos_token_id=tokens.get("bos_token_id"),
                  max_positions=manifest.dims.get("max_position_embeddings"))
    effective = {**defaults, **given}
    for name, value in [*given.items(), *overrides.items()]:
        if value is None and name in OFF_WHEN_NONE and name in overrides:
            value = OFF_WHEN_NONE[name]
        if value is None:
            continue
        effective[name] = value
        if name in _NAMES:
            values[name] = _eos_list(value) if name == "eos_token_id" else value
    if overrides.get("eos_token_id") is not None:
        values["eos_listed"] = isinstance(overrides["eos_token_id"], (list, tuple))
    refused = options.refusal(effective)
    if refused:
        raise ElxError(refused[1])
    if not rules.temperature_fallback:  # Whisper samples from its temperature list, not from do_sample
        options.warn_ignored_flags(defaults)  # HF validates the model's generation config on its own first
        options.warn_ignored_flags(effective, {*given, *overrides})
    if values.get("decoder_start_token_id") is None and values.get("bos_token_id") is not None:
        values["decoder_start_token_id"] = values["bos_token_id"]  # HF's _prepare_special_tokens fallback
    settings = GenerationSettings(**rules.resolve(manifest, values, extra))
    if settings.pad_token_id is None and settings.eos_token_id:
        settings.pad_token_id = settings.eos_token_id[0]
    rules.validate(settings)
    _validate(settings, rules.prompt_length(settings))
    return settings


def _validate(s: GenerationSettings, prompt_len: int | None) -> None:
    check_settings(s, prompt_len)  # runners/inputs/validation.py: types, ranges, total length vs the model's positions
    if s.input_repeats < 1:
        raise ElxError(f"input_repeats must be >= 1, got {s.input_repeats}")
    if s.num_beams < 1:
        raise ElxError(f"num_beams must be >= 1, got {s.num_beams}")
    if s.early_stopping not in (True, False, "never"):
        raise ElxError(f"early_stopping must be True, False or 'never', got {s.early_stopping!r}")
    if s.max_new_tokens is not None and s.max_new_tokens < 1:
        raise ElxError(f"max_new_tokens must be >= 1, got {s.max_new_tokens}")
    if s.no_repeat_ngram_size < 0:
        raise ElxError(f"no_repeat_ngram_size must be >= 0, got {s.no_repeat_ngram_size}")
    check_generation_options(s)  # runners/option_checks.py: sampling, penalties, constraints, outputs
    _forced_and_suppressed(s)


def _forced_and_suppressed(s: GenerationSettings) -> None:
    """HF's ``GenerationConfig.validate`` (5.24): a forced token (``forced_bos_token_id``, ``forced_eos_token_id``)
    whose every id is also in ``suppress_tokens`` leaves no token at the forcing step (HF raises; elx would generate
    from a row of -inf: greedy takes an arbitrary id, beams score -1e9)."""
    suppressed = set(s.suppress_tokens or ())
    for name in ("forced_bos_token_id", "forced_eos_token_id"):
        forced = getattr(s, name)
        if forced is None or not suppressed:
            continue
        forced = {int(t) for t in (forced if isinstance(forced, (list, tuple)) else [forced])}
        if forced and forced <= suppressed:
            raise ElxError(f"{name} = {sorted(forced) if len(forced) > 1 else next(iter(forced))} is also in "
                           "suppress_tokens: forcing a token while suppressing it leaves no token at that step (HF "
                           "refuses it too); remove it from one of them (to prevent an early EOS use min_new_tokens)")
