"""HF's Whisper ``generate`` loop (transformers 5.24 ``WhisperGenerationMixin.generate``): timestamps, long-form
audio, language detection and temperature fallback, over elx's searches.

``Generator.generate`` hands a Whisper run here when it needs more than one plain search (``needs_loop``):
``return_timestamps`` (the call's or the generation config's), input features longer than one window
(3000 frames, 30 s), a multilingual model without a language (HF detects it), ``temperature`` (HF Whisper
samples exactly when the temperature of the current try is > 0; ``do_sample`` is ignored, as HF ignores it),
``compression_ratio_threshold`` / ``logprob_threshold``, or ``return_segments``.  What it mirrors, step by step:

* **Language detection** (``detect_language``): one decoder step on ``[decoder_start]`` over the first window;
  the raw logits outside ``lang_to_id`` are masked and the argmax is each item's language token.  Done once
  per call, for every item, before ``num_return_sequences`` repeats the inputs.
* **Windows** (the sequential algorithm): each unfinished item's features from its ``seek`` frame, at most one
  window, zero-padded to it; items whose ``seek`` reached their frame count (``attention_mask.sum(-1)``, needed
  for batched long-form, as in HF) leave the batch.  ``max_length`` is HF's: it grows by
  ``min(max_target_positions // 2 - 1, prompt length)`` at every window (HF rewrites its generation config
  in place each time), capped at ``max_target_positions``; ``max_new_tokens`` stays as given.
* **Temperature fallback** (``generate_with_fallback``): for each temperature in turn, the rows that still need a
  fallback are searched (greedy/beam at 0 or None; sampling with ``num_beams = 1`` above 0, which stays 1 for the
  rest of the call, an HF quirk mirrored); a row needs one when the zlib compression ratio of its tokens (EOS
  included) exceeds ``compression_ratio_threshold`` or their average log-probability (the processed scores
  times the temperature, log-softmaxed, summed in float32) is below ``logprob_threshold``.  Seeded draws
  continue one generator across tries and windows, as HF's global generator does.
* **Segments** (``runners/whisper_timestamps.py``): each window's tokens (padding and a final EOS removed) are
  cut after timestamp pairs; the item's ``seek`` moves on by the frames HF computes.

Returned: the segments' tokens concatenated per item, right-padded with the pad token (HF's ``sequences``), and
with ``return_segments`` HF's segments: ``start``/``end`` (seconds), ``tokens``, ``idxs`` (HF's ``result``, the
inner ``generate`` output, is not returned).  Refused in one line each: ``condition_on_prev_tokens`` (the
previous window's tokens, left-padded under a decoder attention mask, which elx's step graphs do not take),
``prompt_ids``, ``no_speech_threshold`` (HF's no-speech detector re-runs the model inside a processor),
``return_token_timestamps`` (cross-attention weights; elx's graphs return logits), beam search with
``logprob_threshold`` (HF reads its per-beam scores through ``beam_indices`` padded with -1), and the
dict outputs, streamer and ``decoder_input_ids``.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import replace

import numpy as np

from elx.runners.errors import ElxError
from elx.runners.wording import arg
from elx.runners.generation_output import GenerationOutput
from elx.runners.hooks import CallArguments, graph_may_block, search_hooks
from elx.runners.inputs.validation import check_memory, typed_encoder_inputs
from elx.runners.search.log_softmax import log_softmax, torch_module
from elx.runners.search.processors import ProcessorInputs, build_processors
from elx.runners.search.search import beam_search, greedy_search
from elx.runners.search.search_hooks import SearchHooks
from elx.runners.search.settings import config_values
from elx.runners.whisper import (OPTIONS, REFUSED, detects_language, init_tokens, max_target_positions,
                                 plain_options, total_max_length)
from elx.runners.whisper_timestamps import TimestampRules, cut_segments

# Whisper generate's own arguments (beside GenerationConfig's fields) this loop reads
INPUT_STRIDE = 2  # conv1.stride * conv2.stride of every Whisper encoder
TIME_PRECISION, TIME_PRECISION_FEATURES = 0.02, 0.01


def window_frames(manifest) -> int:
    """Frames per window: the exported encoder's fixed input length (HF: input_stride · max_source_positions)."""
    return int(manifest.encoder_inputs()["input_features"]["shape"][-1])


def timestamps_wanted(manifest, options: dict, frames: int) -> bool:
    """HF's ``_set_return_timestamps``: the option, else the generation config's; long-form forces them."""
    value = options.get("return_timestamps")
    if value is None:
        value = manifest.data.get("generation_defaults", {}).get("return_timestamps")
    if frames > window_frames(manifest):
        if value is False:
            raise ElxError(f"input features of {frames} frames (> {window_frames(manifest)}, 30 s) run HF's long-form "
                           "generation, which needs timestamps (this model's generation config sets them off, and HF's "
                           f"generate refuses it too): pass {arg('return_timestamps', True)}")
        return True
    return bool(value)


def needs_loop(manifest, options: dict, frames: int) -> bool:
    """Whether a Whisper run needs HF's loop rather than one plain search."""
    defaults = manifest.data.get("generation_defaults", {})
    return (timestamps_wanted(manifest, options, frames) or options.get("temperature") is not None
            or options.get("do_sample") is True  # HF's loop ignores it: greedy/beam unless a temperature > 0
            or any(options.get(name) not in (None, False) for name in OPTIONS)
            or detects_language(defaults, options.get("language"), options.get("task")))


class _Run:
    """One call's state beside the items': the searches' settings, the beam count (1 once sampling ran) and the
    generator the draws share."""

    def __init__(self, generator, settings, options: dict, timestamps: bool):
        self.generator, self.manifest, self.settings = generator, generator.manifest, settings
        self.beams = settings.num_beams
        self.args = CallArguments.of(options)
        self.timestamps = timestamps
        self.compression = options.get("compression_ratio_threshold")
        self.logprob = options.get("logprob_threshold")
        if self.logprob is not None and settings.num_beams > 1:
            raise ElxError("logprob_threshold with num_beams > 1: HF reads each beam's scores through beam_indices "
                           "padded with -1, which elx does not mirror; use num_beams=1 or drop logprob_threshold")
        self.draws = None
        if settings.seed is not None:
            torch = torch_module()
            self.draws = (torch.Generator().manual_seed(int(settings.seed)) if torch is not None
                          else np.random.Generator(np.random.PCG64(int(settings.seed))))

    def search(self, features: np.ndarray, prompt: np.ndarray, settings) -> tuple[np.ndarray, tuple | None]:
        """One plain search over ``features`` with per-row ``prompt``s: (sequences with prompt, step scores)."""

        manifest, begin = self.manifest, prompt.shape[1]
        user = list(self.args.logits_processor)
        if self.timestamps:
            eos = (settings.eos_token_id[0] if settings.eos_token_id else None) or settings.bos_token_id  # HF's `or`
            stamps = TimestampRules(manifest.data["generation_defaults"]["no_timestamps_token_id"], eos, begin,
                                    manifest.data["generation_defaults"].get("max_initial_timestamp_index"))
            user.insert(0, stamps)  # HF: [begin-suppress, suppress, timestamps, *the caller's]
        args = replace(self.args, logits_processor=tuple(user))
        inputs = typed_encoder_inputs(manifest, {"input_features": features})
        check_memory(manifest, settings, inputs, begin)  # as Generator.generate does: refuse what cannot fit
        model = self.generator.model.for_run(settings.no_repeat_ngram_size if graph_may_block(settings, args) else None)
        processors = build_processors(settings, begin, graph_blocks_ngrams=model.returns_log_probs,
                                      inputs=ProcessorInputs(None, None, args.logits_processor,
                                                             args.prefix_allowed_tokens_fn))
        hooks = search_hooks(settings, args, None, int(prompt.shape[0]), self.generator._stop_strings)
        if hooks.sampler is not None and self.draws is not None:
            hooks.sampler.generator = self.draws
        search = greedy_search if settings.num_beams == 1 else beam_search
        result = search(model, model.encode(inputs), settings, processors, prompt=prompt, hooks=hooks)
        return result.sequences, result.step_scores


def detect_language(run: _Run, features: np.ndarray) -> np.ndarray:
    """HF's ``detect_language``: per item, the language token with the largest first-step logit."""
    defaults = run.manifest.data["generation_defaults"]
    settings = replace(run.settings, decoder_prompt=[], max_length=2, max_new_tokens=None, num_beams=1,
                       do_sample=False, num_return_sequences=1, input_repeats=1)
    window = features[:, :, : window_frames(run.manifest)]
    model = run.generator.model.for_run(None)

    state = model.encode(typed_encoder_inputs(run.manifest, {"input_features": window}))
    prompt = np.full((features.shape[0], 1), settings.decoder_start_token_id, dtype=np.int64)
    result = greedy_search(model, state, settings, [], prompt=prompt, hooks=SearchHooks(record_logits=True,
                                                                                       keep_rows=True))
    logits = result.step_logits[0]
    languages = np.asarray(sorted(int(v) for v in defaults["lang_to_id"].values()))
    masked = np.full_like(logits, -np.inf)
    masked[:, languages] = logits[:, languages]
    return masked.argmax(axis=-1)


def compression_ratio(tokens: np.ndarray, vocab_size: int) -> float:
    """HF's ``_retrieve_compression_ratio``: raw token bytes over their zlib-compressed length."""
    width = int(math.log2(vocab_size) / 8) + 1
    raw = b"".join(int(t).to_bytes(width, "little") for t in tokens)
    return len(raw) / len(zlib.compress(raw))


def average_logprob(scores: list, tokens: np.ndarray, temperature) -> np.float32:
    """HF's ``_retrieve_avg_logprobs``: the tokens' log-probabilities under scores · temperature, float32 mean."""
    rescale = temperature if temperature is not None and temperature > 0.0 else 1
    stacked = np.stack(scores)
    if stacked.shape[0] > tokens.shape[0]:
        stacked = stacked[: tokens.shape[0]]
    else:
        tokens = tokens[-stacked.shape[0]:]
    torch = torch_module()
    scaled = (torch.from_numpy(stacked) * rescale).numpy() if torch is not None else stacked * np.float32(rescale)
    logprobs = log_softmax(np.ascontiguousarray(scaled, dtype=np.float32))
    picked = logprobs[np.arange(tokens.shape[0]), tokens]
    total = np.float32(0)
    for value in picked:
        total = np.float32(total + value)
    return np.float32(total / np.float32(len(tokens)))


def _strip(row: np.ndarray, pad, eos) -> np.ndarray:
    """HF's fallback step: trailing padding removed, the EOS kept where pad == EOS."""
    if pad is not None and row.size and row[-1] == pad:
        count = int((row == pad).sum()) - (1 if pad == eos else 0)
        if count:
            row = row[:-count]
    return row


def _with_fallback(run: _Run, features, prompts, settings, temperatures) -> list[np.ndarray]:
    """HF's ``generate_with_fallback`` for one window: each row's tokens (padding and final EOS removed)."""
    rules = run.generator.rules
    vocab = int(run.manifest.dims["vocab_size"])
    out = [None] * features.shape[0]
    pending = list(range(features.shape[0]))
    for index, temperature in enumerate(temperatures):
        sample = temperature is not None and temperature > 0.0
        if sample:
            run.beams = 1
        tried = replace(settings, do_sample=sample, temperature=temperature if sample else 1.0, num_beams=run.beams,
                        output_scores=run.logprob is not None, return_dict_in_generate=run.logprob is not None)
        eos = rules.final_eos(tried)
        sequences, scores = run.search(features[pending], prompts[pending], tried)
        again = []
        for row, item in enumerate(pending):
            tokens = _strip(sequences[row, prompts.shape[1]:], tried.pad_token_id, eos)
            fallback = False
            if run.compression is not None and compression_ratio(tokens, vocab) > run.compression:
                fallback = True
            if run.logprob is not None and average_logprob([s[row] for s in scores], tokens,
                                                           temperature) < run.logprob:
                fallback = True
            if eos is not None and tokens.size and tokens[-1] == eos:
                tokens = tokens[:-1]
            out[item] = tokens
            if fallback:
                again.append(item)
        pending = again
        if not pending or index == len(temperatures) - 1:
            return out
    return out


def _check_options(manifest, options: dict, settings, timestamps: bool) -> None:
    for name, why in REFUSED.items():
        if options.get(name) not in (None, False):
            raise ElxError(f"{name}: {why}; drop it")
    if settings.return_dict_in_generate or settings.output_scores or settings.output_logits:
        raise ElxError("HF's Whisper loop returns sequences (and segments), not a generate dict: drop "
                       "return_dict_in_generate / output_scores / output_logits (return_segments gives the segments)")
    if options.get("streamer") is not None or options.get("decoder_input_ids") is not None:
        raise ElxError("streamer / decoder_input_ids are not supported with Whisper timestamps, long-form audio, "
                       "language detection or temperature fallback; drop them")
    if timestamps and "no_timestamps_token_id" not in manifest.data.get("generation_defaults", {}):
        raise ElxError("this Whisper export's generation config has no no_timestamps_token_id: timestamps and "
                       "long-form audio are not available (HF refuses them too)")


def generate_loop(generator, features: np.ndarray, attention_mask, options: dict):
    """HF Whisper ``generate`` for ``features`` [B, mel, frames]: (sequences [B, longest], segments per item)."""
    manifest = generator.manifest
    features = np.ascontiguousarray(np.asarray(features, dtype=np.float32))
    if features.ndim != 3:
        raise ElxError(f"input_features must be [batch, mel bins, frames], got shape {list(features.shape)}")
    batch, frames = features.shape[0], features.shape[-1]
    window = window_frames(manifest)
    timestamps = timestamps_wanted(manifest, options, frames)
    temperature = options.get("temperature")
    temperatures = list(temperature) if isinstance(temperature, (list, tuple)) else [temperature]
    for t in temperatures:
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0):
            raise ElxError(f"temperature must be >= 0 or a list of them (Whisper's fallback), got {temperature!r}")
    plain = plain_options(options)
    language, task = options.get("language"), options.get("task")
    defaults = manifest.data.get("generation_defaults", {})
    settings = generator.settings(**plain)
    _check_options(manifest, options, settings, timestamps)
    if timestamps and settings.eos_listed and len(settings.eos_token_id) > 1:
        raise ElxError("timestamps need one eos_token_id (HF's timestamp processor bans the ids below it); pass one")
    if frames > window and batch > 1 and attention_mask is None:
        raise ElxError("batched long-form audio needs attention_mask [batch, frames] (1 on each clip's frames), as "
                       "in HF; pass it (features_from_files and the CLI build it)")
    if frames < window:
        raise ElxError(f"input_features has shape {list(features.shape)}; this model takes [batch, "
                       f"{features.shape[1]}, {window}] per window: pad shorter audio to {window} frames")
    run = _Run(generator, settings, options, timestamps)
    detected = detect_language(run, features) if detects_language(defaults, language, task) else [None] * batch
    prompts = np.asarray([init_tokens(manifest, language, task, timestamps, detected=d) for d in detected],
                         dtype=np.int64)
    max_frames = (np.asarray(attention_mask).sum(-1).astype(np.int64) if frames > window and batch > 1
                  else np.full(batch, frames, dtype=np.int64))
    repeats = settings.input_repeats
    if repeats > 1:
        features, prompts, max_frames = (np.repeat(a, repeats, axis=0) for a in (features, prompts, max_frames))
    resolved, settings = settings, replace(settings, input_repeats=1, num_return_sequences=1)
    seek = np.zeros(features.shape[0], dtype=np.int64)
    segments = [[] for _ in range(features.shape[0])]
    given = {**config_values(options.get("generation_config")), **{k: v for k, v in plain.items() if v is not None}}
    max_new_tokens = given.get("max_new_tokens", defaults.get("max_new_tokens"))
    length = total_max_length(manifest, prompts.shape[1], given.get("max_length", defaults.get("max_length")),
                              max_new_tokens)
    step = min(max_target_positions(manifest) // 2 - 1, prompts.shape[1])
    stamp_begin = int(defaults.get("no_timestamps_token_id", manifest.dims["vocab_size"])) + 1
    while (seek < max_frames).any():
        items = np.flatnonzero(seek < max_frames)
        counts = np.minimum(max_frames[items] - seek[items], window)
        pieces = np.zeros((items.size, features.shape[1], window), dtype=np.float32)
        for row, (item, count) in enumerate(zip(items, counts)):
            pieces[row, :, :count] = features[item, :, seek[item]: seek[item] + count]
        tokens = _with_fallback(run, pieces, prompts[items], replace(settings, max_length=length), temperatures)
        for item, count, row_tokens in zip(items, counts, tokens):
            offset = seek[item] * TIME_PRECISION / INPUT_STRIDE
            cut, advance = cut_segments(row_tokens, stamp_begin, offset, int(count), prompts.shape[1],
                                        TIME_PRECISION, TIME_PRECISION_FEATURES, INPUT_STRIDE)
            seek[item] += advance
            segments[item] += cut
        if max_new_tokens is None:
            length = min(length + step, max_target_positions(manifest))
    rows = [np.concatenate([s["tokens"] for s in item]) if item else np.zeros(0, np.int64) for item in segments]
    width = max((r.size for r in rows), default=0)
    pad = settings.pad_token_id if settings.pad_token_id is not None else -1
    sequences = np.full((len(rows), width), pad, dtype=np.int64)
    for i, r in enumerate(rows):
        sequences[i, : r.size] = r
    return sequences, segments, resolved


def run_loop(generator, options: dict, *, inputs=None, audio=None, input_features=None, attention_mask=None,
             decode: bool = True):
    """``Generator.generate``'s Whisper branch: HF's loop when the call needs it (``needs_loop``), else None."""

    if audio is not None:
        from elx.runners.inputs.audio import features_from_files

        given = features_from_files(generator.manifest.folder, audio, long_form=True)
        features, attention_mask = given["input_features"], given.get("attention_mask")
    elif input_features is not None:
        features = input_features
    elif inputs is not None and inputs.get("input_features") is not None:
        features = inputs["input_features"]
    else:
        return None
    frames = int(np.shape(features)[-1])
    if not needs_loop(generator.manifest, options, frames):
        return None  # the plain search (audio files: read again, short clips give the same features)
    sequences, segments, settings = generate_loop(generator, features, attention_mask, options)
    text = generator.text.decode(sequences) if decode and generator.text is not None else None
    wanted = options.get("return_segments") or timestamps_wanted(generator.manifest, options, frames)
    return GenerationOutput(sequences, None, text, sequences, settings, segments=segments if wanted else None)
