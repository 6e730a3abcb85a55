"""Whisper's decoding rules, as transformers' ``WhisperGenerationMixin.generate`` applies them to
short-form audio (≤ 30 s, one 3000-frame segment), without timestamps.

Read from ``transformers/models/whisper/generation_whisper.py`` (transformers 5.23):

* **Decoder prompt** (``_retrieve_init_tokens``): ``[decoder_start]``; when neither ``language``
  nor ``task`` is given, the legacy ``forced_decoder_ids`` of the generation config fill
  positions 1, 2, … (openai's tiny.en: ``[[1, <|notimestamps|>]]``; multilingual checkpoints:
  ``[[1, None], [2, <|transcribe|>]]``).  A language id goes to position 1 (``language`` given,
  or detected when the config has ``lang_to_id`` and position 1 is still empty); ``task``
  appends its id; a language without a task id in the prompt appends ``<|transcribe|>``; then
  ``<|notimestamps|>`` is appended unless it is already last.  English-only configs
  (``is_multilingual: false``) refuse ``language``/``task``.
  elx does not run HF's language detection: where HF would detect (multilingual config, no
  ``language``, no language in ``forced_decoder_ids``), elx proceeds as if ``language="en"``
  (``DEFAULT_LANGUAGE``) had been passed; pass ``language`` to choose.  ``hf_language`` gives
  the language to pass to HF so that both build the same prompt.
* **Processors** (``_retrieve_logit_processors``): ``SuppressTokens(suppress_tokens)`` at every
  step and ``SuppressTokensAtBegin(begin_suppress_tokens)`` when the sequence length equals the
  prompt length (``begin_index = init_tokens.shape[1]``, reset by ``set_begin_index`` to
  ``decoder_input_ids.shape[-1]``, the same for short-form without ``prompt_ids``); the
  timestamp processor only with ``return_timestamps`` (refused here), the no-speech detector
  only with ``no_speech_threshold`` (not part of the exported defaults).  The common processors
  of ``GenerationMixin`` (no-repeat n-gram, min length) work as for other families.
* **Length** (``_set_max_new_tokens_and_length``): ``max_new_tokens`` + prompt must not exceed
  ``max_target_positions`` (HF raises); otherwise the total length is
  ``min(max_length + min(max_target_positions // 2 - 1, prompt_len), max_target_positions)``
  with ``max_length`` from the call, the generation config (openai: 448), or HF's global default
  20 — so a user's ``max_length`` counts generated tokens for Whisper.
* **num_return_sequences** (``_expand_variables_for_generation``): HF repeats each input r times
  and runs the search with ``num_return_sequences=1``; elx does the same (``input_repeats``).
* **Returned tokens** (``_postprocess_outputs``, ``generate_with_fallback``,
  ``_pad_to_max_length``): the prompt is cut off, trailing padding removed (but the EOS kept when
  pad == EOS), then a final EOS removed, and the rows right-padded with ``pad_token_id`` to the
  longest.  ``hf_sequences`` turns elx's sequences (prompt included, like other families) into
  exactly that, which is what tests and ``elx compare`` compare.
"""
from __future__ import annotations

import numpy as np

from elx.runners.errors import ElxError

from elx.runners.manifest import Manifest

TASKS = ("translate", "transcribe")  # HF's TASK_IDS
DEFAULT_LANGUAGE = "en"
HF_GLOBAL_MAX_LENGTH = 20  # GenerationConfig._get_default_generation_params()["max_length"]


def max_target_positions(manifest: Manifest) -> int:
    value = manifest.dims.get("max_target_positions")
    if value is None:
        raise ElxError(f"{manifest.folder or 'this export'} predates Whisper support (no max_target_positions in "
                       "its manifest); re-run 'elx export'")
    return int(value)


def language_id(defaults: dict, language: str) -> int:
    """HF's ``language_to_id``: ``"<|en|>"``, ``"en"`` or ``"english"`` (any case) → the token id."""
    lang_to_id = defaults.get("lang_to_id") or {}
    lowered = str(language).lower()
    if lowered in lang_to_id:
        token = lowered
    else:
        codes = defaults.get("language_codes") or {}  # language name → code, saved at export from transformers
        if lowered in codes:
            token = f"<|{codes[lowered]}|>"
        elif lowered in codes.values() or f"<|{lowered}|>" in lang_to_id:
            token = f"<|{lowered}|>"
        else:
            raise ElxError(f"unsupported Whisper language {language!r}; use a code like 'en' or a name like 'english'")
    if token not in lang_to_id:
        raise ElxError(f"language {token} is not supported by this model (not in its lang_to_id)")
    return int(lang_to_id[token])


def check_language_task(defaults: dict, language, task) -> None:
    """HF's ``_set_language_and_task`` checks, as one-line errors."""
    if defaults.get("is_multilingual") is False and (language is not None or task is not None):
        raise ElxError("this Whisper model is English-only: --language/--task do not apply (HF generate refuses "
                       "them too)")
    if language is not None and not defaults.get("lang_to_id"):
        raise ElxError("this model's generation config has no lang_to_id: --language is not available")
    if task is not None:
        if task not in TASKS:
            raise ElxError(f"unknown Whisper task {task!r}; use one of {', '.join(TASKS)}")
        if not defaults.get("task_to_id"):
            raise ElxError("this model's generation config has no task_to_id: --task is not available")


def _forced_language(defaults: dict) -> bool:
    """Whether ``forced_decoder_ids`` put a language token at position 1."""
    return any(int(pair[0]) == 1 and pair[1] is not None for pair in (defaults.get("forced_decoder_ids") or []))


def effective_language(manifest: Manifest, language: str | None, task: str | None) -> str | None:
    """``language``, or ``DEFAULT_LANGUAGE`` where HF would run its language detection instead."""
    defaults = manifest.data.get("generation_defaults", {})
    if language is not None or not defaults.get("lang_to_id") or defaults.get("is_multilingual") is False:
        return language
    if task is None and _forced_language(defaults):
        return None  # the config fixes the language; HF does not detect
    return DEFAULT_LANGUAGE


def init_tokens(manifest: Manifest, language: str | None = None, task: str | None = None,
                return_timestamps: bool = False) -> list[int]:
    """The decoder prompt (start token included) HF builds for one batch item (``_retrieve_init_tokens``)."""
    defaults = manifest.data.get("generation_defaults", {})
    check_language_task(defaults, language, task)
    language = effective_language(manifest, language, task)
    tokens = [manifest.tokens.get("decoder_start_token_id")]
    if tokens[0] is None:
        raise ElxError("no decoder_start_token_id in the manifest; re-run 'elx export'")
    if task is None and language is None:
        forced = [list(pair) for pair in (defaults.get("forced_decoder_ids") or [])]
        if forced and forced[0][0] == 1:
            position = 1
            while forced and forced[0][0] == position:
                tokens.append(forced.pop(0)[1])
                position += 1
            if forced:
                raise ElxError(f"forced_decoder_ids {defaults['forced_decoder_ids']} do not follow Whisper's prompt "
                               "pattern (positions 1, 2, ... without gaps)")
    if language is not None:  # HF also lands here after detect_language(), which elx replaces by English
        lang = language_id(defaults, language)
        if len(tokens) > 1:
            tokens[1] = lang
        else:
            tokens.append(lang)
    task_to_id = defaults.get("task_to_id") or {}
    if task is not None:
        tokens.append(int(task_to_id[task]))
    elif language is not None and task_to_id and not any(t in tokens for t in task_to_id.values()):
        tokens.append(int(task_to_id["transcribe"]))
    no_timestamps = defaults.get("no_timestamps_token_id")
    if not return_timestamps and no_timestamps is not None and tokens[-1] != no_timestamps:
        tokens.append(int(no_timestamps))
    return [int(t) for t in tokens if t is not None]  # HF drops None placeholders too


def total_max_length(manifest: Manifest, prompt_len: int, max_length: int | None,
                     max_new_tokens: int | None) -> int:
    """HF's ``_set_max_new_tokens_and_length`` followed by ``_prepare_generated_length``: the total length."""
    limit = max_target_positions(manifest)
    if max_new_tokens is not None:
        if max_new_tokens + prompt_len > limit:
            raise ElxError(f"max_new_tokens {max_new_tokens} + the {prompt_len} prompt tokens exceed this Whisper "
                           f"model's max_target_positions ({limit}); lower max_new_tokens")
        return prompt_len + max_new_tokens
    if max_length is None:
        max_length = HF_GLOBAL_MAX_LENGTH
    return min(int(max_length) + min(limit // 2 - 1, prompt_len), limit)


def apply_rules(manifest: Manifest, values: dict, language=None, task=None, return_timestamps=None) -> dict:
    """Turn resolved generation ``values`` (defaults + overrides) into Whisper's: prompt, length, repeats."""
    defaults = manifest.data.get("generation_defaults", {})
    timestamps = defaults.get("return_timestamps") if return_timestamps is None else return_timestamps
    if timestamps:
        raise ElxError("Whisper timestamps (return_timestamps) are not supported by elx runners; unset them")
    if not values.get("decoder_prompt"):
        prompt = init_tokens(manifest, language, task)
        values["decoder_start_token_id"], values["decoder_prompt"] = prompt[0], prompt[1:]
    elif language is not None or task is not None:
        raise ElxError("pass either decoder_prompt or language/task, not both")
    prompt_len = 1 + len(values["decoder_prompt"])
    values["max_length"] = total_max_length(manifest, prompt_len, values.get("max_length"),
                                            values.get("max_new_tokens"))
    values["max_new_tokens"] = None
    repeats = int(values.get("num_return_sequences") or 1)
    if repeats > 1:  # HF repeats the inputs and searches each copy with num_return_sequences=1
        values["input_repeats"], values["num_return_sequences"] = repeats, 1
    return values


def hf_language(manifest: Manifest, language: str | None, task: str | None) -> str | None:
    """The ``language`` to pass to HF generate so that it builds the prompt elx builds (no detection)."""
    return effective_language(manifest, language, task)


def generated_rows(sequences: np.ndarray, prompt_len: int, eos_id: int | None, pad: int | None) -> list[list[int]]:
    """Per row, the tokens HF Whisper keeps: prompt cut, padding stripped (EOS kept if pad == EOS), a final
    ``eos_id`` cut (None: none is cut; ``WhisperRules.final_eos`` says which)."""
    rows = []
    for row in np.asarray(sequences)[:, prompt_len:]:
        row = [int(t) for t in row]
        if pad is not None and row and row[-1] == pad:
            paddings = sum(t == pad for t in row)
            if pad == eos_id:
                paddings -= 1
            if paddings:
                row = row[:-paddings]
        if row and eos_id is not None and row[-1] == eos_id:
            row = row[:-1]
        rows.append(row)
    return rows


def hf_sequences(sequences: np.ndarray, settings, eos_id: int | None) -> np.ndarray:
    """elx sequences (prompt included) → what HF Whisper ``generate`` returns: [B, longest] right-padded.

    ``eos_id``: the final EOS HF cuts (``WhisperRules.final_eos``)."""
    pad = settings.pad_token_id
    rows = generated_rows(sequences, len(settings.prompt()), eos_id, pad)
    width = max((len(r) for r in rows), default=0)
    out = np.full((len(rows), width), pad if pad is not None else -1, dtype=np.int64)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


def full_sequences(hf: np.ndarray, settings) -> np.ndarray:
    """HF Whisper's output → prompt + tokens (+ padding, which is EOS for Whisper), for teacher forcing."""
    prompt = np.asarray(settings.prompt(), dtype=np.int64)
    return np.concatenate([np.broadcast_to(prompt, (hf.shape[0], prompt.size)), hf.astype(np.int64)], axis=1)
