"""Every argument of HF ``generate`` (transformers 5.24), and what elx does with it.

HF ``generate`` reads the fields of ``GenerationConfig`` (the model's ``generation_config``, then
the caller's keyword arguments) and a few call arguments of its own.  elx

* implements most of them with HF's semantics: the fields of ``elx.runners.search.settings.GenerationSettings``
  (``SETTINGS``) and the call arguments in ``CALL_ARGUMENTS`` (``runners/hooks.py``);
* accepts as no-ops those that cannot change what ``generate`` returns (``NO_OPS``: cache layout and
  compilation choices, parameters of modes that are not running), each with the reason;
* refuses the rest, in one line saying why (``refusal``): decoding modes transformers 5.24 itself
  only runs from Hub code (group beam search, contrastive search, constrained beam search, DoLa: HF
  raises "requires trust_remote_code"), assisted decoding, classifier-free guidance, watermarking,
  attentions/hidden states in the output.

A refusal depends on the values, as HF's mode selection does (``GenerationConfig.get_generation_mode``):
``penalty_alpha`` only means contrastive search for greedy runs with ``top_k > 1``, ``dola_layers`` only
changes greedy and sampling runs, ``num_beam_groups > 1`` only beam runs.  A value equal to HF's default
never errors.  ``tests/test_generation_options.py`` enumerates the installed ``GenerationConfig``'s
fields: a field this module does not place fails it.
"""
from __future__ import annotations

from elx.runners.errors import ElxError

# GenerationConfig fields implemented as GenerationSettings fields (runners/search/settings.py) with HF's semantics
SETTINGS = (
    "max_length", "max_new_tokens", "min_length", "min_new_tokens", "early_stopping", "max_time", "stop_strings",
    "do_sample", "num_beams", "temperature", "top_k", "top_p", "min_p", "top_h", "typical_p", "epsilon_cutoff",
    "eta_cutoff", "repetition_penalty", "encoder_repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "bad_words_ids", "renormalize_logits", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens", "sequence_bias",
    "num_return_sequences", "output_scores", "output_logits", "return_dict_in_generate", "pad_token_id",
    "bos_token_id", "eos_token_id", "encoder_no_repeat_ngram_size", "decoder_start_token_id",
)

_OTHER_MODE = "a parameter of {mode}, which this run does not use (HF ignores it too)"
_ASSISTED = "assisted decoding"

# accepted, without effect on the output: why
NO_OPS = {
    "use_cache": "elx always decodes with its exported cache; HF returns the same tokens with or without one",
    "cache_implementation": "the layout of HF's cache (dynamic, static, offloaded) does not change the tokens",
    "cache_config": "configures HF's cache class; elx keeps its own cache",
    "max_cache_len": "pre-sizes HF's static cache; elx sizes its buffers per run",
    "compile_config": "torch.compile settings; elx runs exported graphs",
    "disable_compile": "torch.compile settings; elx runs exported graphs",
    "prefill_chunk_size": "how HF splits a long prompt's forward pass; elx runs the prompt in one pass",
    "continuous_batching_config": "configures HF's continuous batching (generate_batch), not generate",
    "num_assistant_tokens": _OTHER_MODE.format(mode=_ASSISTED),
    "num_assistant_tokens_schedule": _OTHER_MODE.format(mode=_ASSISTED),
    "assistant_confidence_threshold": _OTHER_MODE.format(mode=_ASSISTED),
    "max_matching_ngram_size": _OTHER_MODE.format(mode=_ASSISTED),
    "assistant_lookbehind": _OTHER_MODE.format(mode=_ASSISTED),
    "target_lookbehind": _OTHER_MODE.format(mode=_ASSISTED),
    "assistant_ensemble_weight": _OTHER_MODE.format(mode=_ASSISTED),
    "speculation_type": _OTHER_MODE.format(mode=_ASSISTED),
    "diversity_penalty": _OTHER_MODE.format(mode="group beam search (num_beam_groups > 1)"),
    # the fields below are refused where they would select another mode (``refusal``), no-ops otherwise
    "num_beam_groups": _OTHER_MODE.format(mode="group beam search"),
    "penalty_alpha": _OTHER_MODE.format(mode="contrastive search"),
    "dola_layers": _OTHER_MODE.format(mode="DoLa decoding"),
    "low_memory": "only meaningful for beam search, where HF refuses it",
    "use_mtp": _OTHER_MODE.format(mode=_ASSISTED),
    "prompt_lookup_num_tokens": _OTHER_MODE.format(mode=_ASSISTED),
    "assistant_early_exit": _OTHER_MODE.format(mode=_ASSISTED),
    "constraints": "", "force_words_ids": "", "guidance_scale": "", "watermarking_config": "", "token_healing": "",
    "output_attentions": "", "output_hidden_states": "", "is_assistant": "",
}

# entries some families' generation configs carry beyond GenerationConfig's fields, read by their rules
CUSTOM_FIELDS = {
    "forced_decoder_ids": "Whisper's prompt (runners/whisper.py); HF 5.x ignores it for other families",
    "is_multilingual": "Whisper (runners/whisper.py)",
    "lang_to_id": "Whisper (runners/whisper.py)",
    "task_to_id": "Whisper (runners/whisper.py)",
    "language_codes": "Whisper language names, saved by elx export (runners/whisper.py)",
    "no_timestamps_token_id": "Whisper (runners/whisper.py)",
    "return_timestamps": "Whisper (runners/whisper.py)",
    "alignment_heads": "Whisper word timestamps only; no effect on the tokens",
    "max_initial_timestamp_index": "Whisper timestamps only; no effect without them",
    "prev_sot_token_id": "Whisper prompt_ids only; no effect without them",
}

# HF generate's own arguments, beside GenerationConfig's fields; implemented in runners/hooks.py
CALL_ARGUMENTS = ("logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn", "streamer", "tokenizer",
                  "decoder_input_ids", "generation_config", "seed", "trust_remote_code")
# HF generate's arguments elx refuses when set (not None / not False): why
REFUSED_ARGUMENTS = {
    "assistant_model": "assisted decoding needs a second (draft) model; elx runs one exported model",
    "assistant_tokenizer": "assisted decoding needs a second (draft) model; elx runs one exported model",
    "negative_prompt_ids": "classifier-free guidance (negative prompts) is not supported by elx runners",
    "negative_prompt_attention_mask": "classifier-free guidance (negative prompts) is not supported by elx runners",
    "custom_generate": "custom_generate runs another decoding loop (Python or Hub code); elx runs HF's own",
    "synced_gpus": "synced_gpus keeps several PyTorch processes in step; elx runs one process",
    "decoder_attention_mask": "elx's decoder prefix (decoder_input_ids) takes no mask: pass unpadded rows",
}

_HUB = ("{mode} is not part of transformers 5.24 itself: HF loads it from the Hub ({repo}, trust_remote_code=True) "
        "and elx does not run it; unset {field}")


def _hub(mode: str, repo: str, field: str) -> str:
    return _HUB.format(mode=mode, repo=f"transformers-community/{repo}", field=field)


def _greedy_or_sample(values: dict) -> bool:
    return (values.get("num_beams") or 1) == 1


def refusal(values: dict) -> tuple[str, str] | None:
    """(field, one-line reason) for the first field of the effective generation values elx refuses, else None.

    ``values``: the model's generation config overlaid with the caller's options (unset fields absent or None)."""
    set_ = {k: v for k, v in values.items() if v is not None}
    if "constraints" in set_ or "force_words_ids" in set_:
        field = "constraints" if "constraints" in set_ else "force_words_ids"
        return field, _hub("constrained beam search", "constrained-beam-search", field)
    greedy = _greedy_or_sample(set_)
    if not greedy and (set_.get("num_beam_groups") or 1) > 1:
        return "num_beam_groups", _hub("group beam search", "group-beam-search", "num_beam_groups")
    if (greedy and set_.get("do_sample") is not True and set_.get("top_k", 50) > 1
            and set_.get("penalty_alpha", 0) > 0):
        return "penalty_alpha", _hub("contrastive search", "contrastive-search", "penalty_alpha")
    assisted = [k for k in ("use_mtp", "prompt_lookup_num_tokens", "assistant_early_exit")
                if (set_.get(k) if k == "use_mtp" else k in set_)]
    if greedy and assisted:
        return assisted[0], f"assisted decoding ({assisted[0]}) is not supported by elx runners; unset it"
    if greedy and "dola_layers" in set_:
        return "dola_layers", _hub("DoLa decoding", "dola", "dola_layers")
    if not greedy and set_.get("low_memory"):
        return "low_memory", "low_memory=True: HF's beam search refuses it since its refactor (transformers #35802)"
    if set_.get("guidance_scale", 1) != 1:
        return "guidance_scale", ("classifier-free guidance (guidance_scale) runs the model a second time on an "
                                  "unconditional prompt; elx runners do not support it")
    flags = {"watermarking_config": "watermarking is not supported by elx runners",
             "token_healing": "token healing rewrites the prompt with the tokenizer; elx runners do not support it",
             "output_attentions": "elx's graphs return logits only, not attentions",
             "output_hidden_states": "elx's graphs return logits only, not hidden states",
             "is_assistant": "generating as an assistant (draft) model is not supported by elx runners"}
    for field, why in flags.items():
        if set_.get(field) not in (None, False):
            return field, f"{field}={set_[field]!r}: {why}; unset it"
    cache = set_.get("cache_implementation")
    if cache in ("quantized", "paged"):
        why = ("a quantized cache changes the logits" if cache == "quantized"
               else "the paged cache runs HF's continuous batching instead of generate")
        return "cache_implementation", f"cache_implementation={cache!r}: {why}; elx keeps its own cache: unset it"
    return None


def check_call_arguments(arguments: dict) -> None:
    """Refuse the HF ``generate`` arguments elx does not implement when they are set."""
    for name, why in REFUSED_ARGUMENTS.items():
        if arguments.get(name) not in (None, False):
            raise ElxError(f"{name}: {why}")


def known(name: str) -> bool:
    """Whether ``name`` is a generation option elx places (setting, no-op, refused field, custom field, argument)."""
    return (name in SETTINGS or name in NO_OPS or name in CUSTOM_FIELDS or name in CALL_ARGUMENTS
            or name in REFUSED_ARGUMENTS)


# -- flags a run ignores: HF's warning (GenerationConfig.validate's "minor issues", transformers 5.24) -------------

# sampling-only flags and the value that means "off" (None: any value set is a flag), checked when do_sample is not
# True; beam-only flags when num_beams is 1; per-step outputs without return_dict_in_generate; HF's order
_SAMPLING_ONLY = (("temperature", 1.0), ("top_p", 1.0), ("min_p", None), ("top_h", None), ("typical_p", 1.0),
                  ("top_k", 50), ("epsilon_cutoff", 0.0), ("eta_cutoff", 0.0))
_BEAM_ONLY = (("early_stopping", False), ("length_penalty", 1.0))
_OUTPUT_FLAGS = ("output_scores", "output_logits")
_WARNED: set = set()


def _should_warn(outer: str, inner: str, user_set: set | None) -> bool:
    """HF's ``_should_warn``: not when the caller set the mode (``do_sample`` / ``num_beams``) but the flag came from
    the model's generation config."""
    return user_set is None or not (outer in user_set and inner not in user_set)


def ignored_flags(values: dict, user_set: set | None = None) -> list[str]:
    """The flags HF's ``GenerationConfig.validate`` reports as "not valid and may be ignored" for ``values`` (the
    generation config's set fields; ``user_set``: the names the caller gave, None: all of them), in HF's order."""
    out = []
    if values.get("do_sample") is not True:
        for name, off in _SAMPLING_ONLY:
            value = values.get(name)
            if value is not None and value != off and _should_warn("do_sample", name, user_set):
                out.append(name)
    if (values.get("num_beams") or 1) == 1:
        for name, off in _BEAM_ONLY:
            value = values.get(name)
            if value is not None and value != off and _should_warn("num_beams", name, user_set):
                out.append(name)
    if values.get("return_dict_in_generate") is not True:
        out.extend(name for name in _OUTPUT_FLAGS if values.get(name) is True)
    return out


def warn_ignored_flags(values: dict, user_set: set | None = None) -> None:
    """Warn once per process and message, as HF's ``logger.warning_once`` does, about flags this run ignores: top_p
    without do_sample is greedy search, silently, unless someone says so.  Written to stderr as ``elx: warning:
    ...`` through the ``elx`` logger (``logging.getLogger("elx")``: silence or redirect it there)."""
    flags = ignored_flags(values, user_set)
    if not flags:
        return
    modes = []
    if any(f in dict(_SAMPLING_ONLY) for f in flags):
        modes.append("sampling (do_sample=True)")
    if any(f in dict(_BEAM_ONLY) for f in flags):
        modes.append("beam search (num_beams > 1)")
    if any(f in _OUTPUT_FLAGS for f in flags):
        modes.append("return_dict_in_generate=True")
    shown = ", ".join(f"{f}={values[f]!r}" for f in flags)
    message = (f"{shown}: {'these flags only apply' if len(flags) > 1 else 'this flag only applies'} with "
               f"{' / '.join(modes)}, which this run does not use, so {'they are' if len(flags) > 1 else 'it is'} "
               "ignored (HF warns the same); set the mode or unset the flag")
    if tuple(flags) in _WARNED:  # HF's message names the flags, not their values: once per set of flags
        return
    _WARNED.add(tuple(flags))
    _logger().warning(message)


def _logger():
    import logging
    import sys

    logger = logging.getLogger("elx")
    if not logger.handlers:
        class _Stderr(logging.Handler):  # the current sys.stderr at each record (it may be replaced after import)
            def emit(self, record):
                try:
                    sys.stderr.write(f"elx: warning: {record.getMessage()}\n")
                except Exception:  # noqa: BLE001 - a warning never breaks a run
                    self.handleError(record)

        logger.addHandler(_Stderr())
        logger.propagate = False
    return logger
