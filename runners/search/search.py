"""Greedy and beam search over a ``elx.runners.model.Model`` (any backend), with the semantics of HF ``generate`` (transformers 5.x).

The beam search mirrors ``GenerationMixin._beam_search`` step for step, in float32 like HF:
top ``max(2, 1 + n_eos)·beams`` continuations per item over the accumulated log-probs, the
running beams are the best candidates that did not just hit a stopping criterion (−1e9 mask),
finished hypotheses are merged by length-penalized score, and the early-stop heuristic is HF's
(``early_stopping`` True / False / "never").

Two things differ, neither changes a token:

* A batch item that can no longer change (HF's heuristic says no running beam can beat its
  finished ones, or ``early_stopping=True`` and all its beams are finished) is dropped from the
  batch: its rows leave the cache and the per-input state, so the decoder stops computing them.
  HF keeps computing them and discards the results (its masks guarantee they cannot enter).
  Except where two of its finished scores are exactly equal: HF's later merges run ``torch.topk``
  over them again, which may swap equal scores (it is not stable), so such an item stays.
* Host work is numpy on arrays owned by the search (processors in place); the log-softmax is
  PyTorch's CPU kernel where PyTorch is installed, HF's rounding bit for bit (``elx.runners.search.log_softmax``).

Where the logits are: for a device backend (``ort-io``, ``tensorrt``) the vocabulary-wide part of each step
(float32 cast, log-softmax, processors, running scores, the candidates' top-k; greedy's argmax) runs on the
device with PyTorch, HF's own operators, and only the candidates come to the host
(``runners/search/device.py``: the mechanism, what it covers, ``ELX_SEARCH``).  The bookkeeping below is
the same on both paths.

The decoder prompt is per item (``prompt`` [B, P]): the start token for every item of an
encoder-decoder model (the default, from the settings), the left-padded input ids of a
decoder-only model.  Lengths, the length penalty and the processors count it, as in HF.

Every top-k is ``elx.runners.search.topk.topk``: ``torch.topk``'s CPU order, ties included.  Peaked models
produce exactly equal scores (log-probs of 0.0, candidates masked to -1e9, blocked tokens at
-inf), and which of them comes first decides the tokens; a top-k that breaks ties by index
returns other sequences than HF for some beam counts (issue 10's first finding).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from elx.runners.backends.base import EncoderState
from elx.runners.search.log_softmax import log_softmax_function
from elx.runners.search.topk import topk
from elx.runners.search.processors import apply_processors
from elx.runners.search.device import device_scorer
from elx.runners.search.search_hooks import NO_HOOKS, SearchHooks
from elx.runners.search.settings import GenerationSettings

NEG_1E9 = np.float32(-1.0e9)


@dataclass
class SearchResult:
    sequences: np.ndarray  # [items · num_return_sequences, length] int64, decoder prompt included
    steps: int
    memory: list = field(default_factory=list)  # per step: {"state_bytes", "cache_bytes", "rows"}
    scores: np.ndarray | None = None  # beam search: HF's sequences_scores (length-penalized), per returned row
    step_scores: tuple | None = None  # hooks.record_scores: HF's ``scores``, per step [rows, vocab] (processed)
    step_logits: tuple | None = None  # hooks.record_logits: HF's ``logits``, per step [rows, vocab] (raw)
    beam_indices: np.ndarray | None = None  # hooks.beam_indices: HF's ``beam_indices`` [returned rows, generated]


def _has_ties(scores: np.ndarray) -> np.ndarray:
    """Per row: whether two of its values are exactly equal."""
    ordered = np.sort(scores, axis=1)
    return (ordered[:, 1:] == ordered[:, :-1]).any(axis=1)


def as_float32(logits: np.ndarray) -> np.ndarray:
    """HF's searches take ``logits.to(copy=True, dtype=torch.float32)`` whatever the model's precision."""
    return logits if logits.dtype == np.float32 else logits.astype(np.float32)


def add_beam_scores(log_probs: np.ndarray, running: np.ndarray) -> np.ndarray:
    """HF's ``next_token_scores + running_beam_scores[:, :, None]`` flattened per item: [n·k, V] + [n, k] → [n, k·V].

    In place where ``log_probs`` is a writable contiguous array (the search owns it, and nothing reads the
    log-probs after this): the same float32 sums, without a fresh array of the step's size (1.4 ms instead
    of 2.9 ms on a 128 × 32128 step here)."""
    n, k = running.shape
    view = log_probs.reshape(n, k, -1)
    if log_probs.flags.c_contiguous and log_probs.flags.writeable:
        view += running[:, :, None]
        return log_probs.reshape(n, -1)
    return (view + running[:, :, None]).reshape(n, -1)


def _prompt_rows(settings: GenerationSettings, batch: int, prompt: np.ndarray | None) -> np.ndarray:
    if prompt is None:  # one decoder prompt for every item (encoder-decoder models)
        return np.tile(np.asarray(settings.prompt(), dtype=np.int64), (batch, 1))
    return np.asarray(prompt, dtype=np.int64)


def _on_device(device) -> dict:
    """``Model.step``'s argument that leaves the scores on the device, where the device path reads them there."""
    return {"device": True} if device is not None and device.reads_device_values else {}


def _record(memory: list, model, state: EncoderState, cache, track: bool) -> None:
    if track:
        memory.append({"state_bytes": model.state_bytes(state), "cache_bytes": model.cache_bytes(cache),
                       "rows": cache.rows})


def greedy_search(model, state: EncoderState, settings: GenerationSettings, processors: list,
                  track_memory: bool = False, prompt: np.ndarray | None = None,
                  hooks: SearchHooks = NO_HOOKS) -> SearchResult:
    """HF's ``_sample``: argmax, or a draw with ``hooks.sampler``; one row per input (``hooks.repeats`` with
    sampling), until every row hit EOS or a stopping criterion, or the maximum length."""
    prompt = _prompt_rows(settings, state.batch, prompt)
    if hooks.repeats > 1:  # num_return_sequences sampled rows per input, consecutive (HF's expansion)
        expand = np.repeat(np.arange(state.batch), hooks.repeats)
        state, prompt = model.select(state, expand), prompt[expand]
    batch = state.batch
    p_len = prompt.shape[1]
    max_len = settings.total_max_length(p_len)
    eos = np.asarray(settings.eos_token_id, dtype=np.int64)
    pad = settings.pad_token_id
    out = np.full((batch, max_len), pad if pad is not None else -1, dtype=np.int64)
    out[:, :p_len] = prompt
    active = np.arange(batch)  # rows still generating (all of them with hooks.keep_rows)
    unfinished = np.ones(batch, dtype=bool)
    cache = model.empty_cache(batch)
    step_tokens = out[:, :p_len].copy()
    cur_len, memory = p_len, []
    recorded = _Recorder(hooks)
    device = device_scorer(model, processors, hooks, prompt, 1)
    if hooks.sampler is not None:  # a refused draw names the caller's processor that returned NaN / inf
        hooks.sampler.processors = processors
    if hooks.streamer is not None:
        hooks.streamer.put(prompt.copy())
    while cur_len < max_len and active.size:
        history = out[active, :cur_len]
        logits, cache = model.step(step_tokens, state, cache, history if model.needs_history else None,
                                   **_on_device(device))
        _record(memory, model, state, cache, track_memory)
        if device is not None:
            next_tokens = device.greedy_tokens(logits, cur_len)
        else:
            logits = recorded.logits(as_float32(logits))
            items = active if hooks.repeats == 1 else active // hooks.repeats  # each row's input
            scores = recorded.scores(apply_processors(processors, history, logits, items))
            next_tokens = hooks.sampler.tokens(scores, active) if hooks.sampler is not None else scores.argmax(axis=1)
        if hooks.keep_rows and eos.size:  # HF: finished rows get the pad token (when EOS can finish them)
            next_tokens = np.where(unfinished, next_tokens, pad)
        out[active, cur_len] = next_tokens
        cur_len += 1
        done = np.isin(next_tokens, eos) if eos.size else np.zeros(active.size, dtype=bool)
        if hooks.stopping is not None:
            done |= hooks.stopping(out[active, :cur_len], recorded.step_scores)
        if hooks.streamer is not None:
            hooks.streamer.put(out[:, cur_len - 1].copy())
        keep = None
        if hooks.keep_rows:
            unfinished &= ~done
            if not unfinished.any():
                break
        elif done.any():
            keep = np.flatnonzero(~done)
            active = active[keep]
            if keep.size:
                state, cache = model.select(state, keep), model.reorder(cache, keep)
            next_tokens = next_tokens[keep]
        step_tokens = next_tokens[:, None]
        if device is not None and active.size:
            device.advance(keep, next_tokens)
    if hooks.streamer is not None:
        hooks.streamer.end()
    return SearchResult(out[:, :cur_len], cur_len - p_len, memory, step_scores=recorded.step_scores,
                        step_logits=recorded.step_logits)


class _Recorder:
    """HF's per-step ``scores`` (processed) and ``logits`` (raw) when asked for: copies, since the search then
    works on the arrays in place."""

    def __init__(self, hooks: SearchHooks):
        self.step_scores = () if hooks.record_scores else None
        self.step_logits = () if hooks.record_logits else None

    def logits(self, logits: np.ndarray) -> np.ndarray:
        if self.step_logits is not None:
            self.step_logits += (logits.copy(),)
        return logits

    def scores(self, scores: np.ndarray) -> np.ndarray:
        if self.step_scores is not None:
            self.step_scores += (scores.copy(),)
        return scores


def beam_search(model, state: EncoderState, settings: GenerationSettings, processors: list,
                track_memory: bool = False, prompt: np.ndarray | None = None,
                hooks: SearchHooks = NO_HOOKS) -> SearchResult:
    s = settings
    k = s.num_beams
    batch = state.batch
    prompt = _prompt_rows(s, batch, prompt)
    p_len = prompt.shape[1]
    max_len = s.total_max_length(p_len)
    eos = np.asarray(s.eos_token_id, dtype=np.int64)
    keep_k = max(2, 1 + eos.size) * k
    # HF: `pad_token_id or eos_token_id[0] if eos_token_id is not None else -1` (a pad id of 0 is falsy)
    fill = (s.pad_token_id or int(eos[0])) if eos.size else -1
    early, lp = s.early_stopping, s.length_penalty

    running = np.full((batch, k, max_len), fill, dtype=np.int64)
    running[:, :, :p_len] = prompt[:, None, :]
    finished_seq = running.copy()
    finished_len = np.zeros((batch, k), dtype=np.int64)  # generated tokens of each finished hypothesis
    running_scores = np.zeros((batch, k), dtype=np.float32)
    running_scores[:, 1:] = NEG_1E9
    beam_scores = np.full((batch, k), NEG_1E9, dtype=np.float32)
    is_finished = np.zeros((batch, k), dtype=bool)
    unsatisfied = np.ones((batch, 1), dtype=bool)
    top_mask = np.arange(keep_k) < k

    recorded = _Recorder(hooks)
    origins = _BeamOrigins(batch, k, max_len - p_len) if hooks.beam_indices else None
    active = np.arange(batch)  # rows of the per-item arrays still in the model's batch
    log_softmax = log_softmax_function()  # resolved once, not per step
    device = device_scorer(model, processors, hooks, prompt, k)
    if hooks.sampler is not None:  # a refused draw names the caller's processor that returned NaN / inf
        hooks.sampler.processors = processors
    cache = model.empty_cache(batch * k)
    step_tokens = running[:, :, :p_len].reshape(batch * k, p_len).copy()
    cur_len, memory = p_len, []
    while True:
        n = active.size
        history = running[active, :, :cur_len].reshape(n * k, cur_len)
        logits, cache = model.step(step_tokens, state, cache, history if model.needs_history else None,
                                   **_on_device(device))
        _record(memory, model, state, cache, track_memory)
        if device is not None:
            top_lp, top_idx, vocab = device.beam_candidates(logits, cur_len, running_scores[active], keep_k)
        else:
            vocab = logits.shape[1]
            logits = recorded.logits(as_float32(logits))
            log_probs = logits if model.returns_log_probs else log_softmax(logits)
            if processors:
                log_probs = apply_processors(processors, history, log_probs, np.repeat(active, k))
            scores = add_beam_scores(recorded.scores(log_probs), running_scores[active])
            if hooks.sampler is not None:
                top_lp, top_idx = hooks.sampler.candidates(scores, active, keep_k)
            else:
                top_lp, top_idx = topk(scores, keep_k)
        top_beam, top_tok = top_idx // vocab, top_idx % vocab
        top_seq = np.take_along_axis(running[active], top_beam[:, :, None], axis=1)
        top_seq[:, :, cur_len] = top_tok
        hits = np.isin(top_tok, eos) | (cur_len + 1 >= max_len)
        if hooks.stopping is not None:
            candidates = top_seq[:, :, : cur_len + 1].reshape(n * keep_k, cur_len + 1)
            hits |= hooks.stopping(candidates, recorded.step_scores).reshape(n, keep_k)

        # running beams for the next step: best candidates that did not just stop
        run_lp = top_lp + hits.astype(np.float32) * NEG_1E9
        _, nxt = topk(run_lp, k)
        running[active] = np.take_along_axis(top_seq, nxt[:, :, None], axis=1)
        running_scores[active] = np.take_along_axis(run_lp, nxt, axis=1)
        parents = np.take_along_axis(top_beam, nxt, axis=1)
        if origins is not None:
            origins.step(active, top_beam, cur_len - p_len, nxt)

        # finished hypotheses: merge by length-penalized score
        just_done = hits & top_mask[None, :]
        fin_lp = top_lp / np.float32((cur_len + 1 - p_len) ** lp)
        full = is_finished[active].all(axis=1, keepdims=True) & (early is True)
        fin_lp = fin_lp + full.astype(np.float32) * NEG_1E9
        fin_lp = fin_lp + (~unsatisfied[active]).astype(np.float32) * NEG_1E9
        fin_lp = fin_lp + (~just_done).astype(np.float32) * NEG_1E9
        merged_scores = np.concatenate([beam_scores[active], fin_lp], axis=1)
        _, best = topk(merged_scores, k)
        merged_seq = np.concatenate([finished_seq[active], top_seq], axis=1)
        merged_len = np.concatenate([finished_len[active], np.full_like(top_tok, cur_len + 1 - p_len)], axis=1)
        merged_fin = np.concatenate([is_finished[active], just_done], axis=1)
        finished_seq[active] = np.take_along_axis(merged_seq, best[:, :, None], axis=1)
        beam_scores[active] = np.take_along_axis(merged_scores, best, axis=1)
        finished_len[active] = np.take_along_axis(merged_len, best, axis=1)
        is_finished[active] = np.take_along_axis(merged_fin, best, axis=1)
        if origins is not None:
            origins.merge(active, best)

        cur_len += 1
        # HF's early-stop heuristic (``_check_early_stop_heuristic``)
        if early == "never" and lp > 0.0:
            best_len = max_len - p_len
        else:
            best_len = cur_len - p_len
        best_running = running_scores[active][:, :1] / np.float32(best_len ** lp)
        worst_done = np.where(is_finished[active], beam_scores[active].min(axis=1, keepdims=True), NEG_1E9)
        unsatisfied[active] &= (best_running > worst_done).any(axis=1, keepdims=True)

        if hits.all():  # every continuation hits a stopping criterion (max length)
            break
        item_done = ~unsatisfied[active, 0] | (is_finished[active].all(axis=1) & (early is True))
        rows = (np.arange(n)[:, None] * k + parents).reshape(-1)  # new row r comes from old row rows[r]
        if item_done.all():
            break
        # HF goes on merging a done item's finished hypotheses every step (its candidates masked), and
        # torch.topk may reorder exactly equal scores in each merge: an item whose finished scores tie stays
        # in the batch, so that it gets the same merges; the others leave it (their order cannot change)
        leave = item_done & ~_has_ties(beam_scores[active])
        if leave.any() and not hooks.keep_rows:
            keep = np.flatnonzero(~leave)
            state = model.select(state, keep)
            rows = rows.reshape(n, k)[keep].reshape(-1)
            active = active[keep]
        cache = model.reorder(cache, rows)
        step_tokens = running[active, :, cur_len - 1].reshape(-1, 1)
        if device is not None:
            device.advance(rows, step_tokens)

    r = s.num_return_sequences
    seqs = finished_seq[:, :r].reshape(batch * r, max_len)
    gen_len = int(finished_len[:, :r].max())
    return SearchResult(seqs[:, : p_len + gen_len], cur_len - p_len, memory, beam_scores[:, :r].reshape(-1).copy(),
                        recorded.step_scores, recorded.step_logits,
                        origins.returned(r, gen_len) if origins is not None else None)


class _BeamOrigins:
    """HF's ``beam_indices``: for each hypothesis, the flat row (item · beams + beam) each of its tokens came from.

    Kept like HF's ``running_beam_indices`` and ``beam_indices`` [batch, beams, max new tokens] (int32, -1
    where nothing was generated): gathered with the candidates, the running beams and the merged finished
    hypotheses, as the sequences are."""

    def __init__(self, batch: int, beams: int, length: int):
        self.beams = beams
        self.running = np.full((batch, beams, length), -1, dtype=np.int32)
        self.finished = self.running.copy()
        self.candidates = None

    def step(self, active: np.ndarray, top_beam: np.ndarray, position: int, nxt: np.ndarray) -> None:
        self.candidates = np.take_along_axis(self.running[active], top_beam[:, :, None], axis=1)
        self.candidates[:, :, position] = top_beam + active[:, None] * self.beams
        self.running[active] = np.take_along_axis(self.candidates, nxt[:, :, None], axis=1)

    def merge(self, active: np.ndarray, best: np.ndarray) -> None:
        merged = np.concatenate([self.finished[active], self.candidates], axis=1)
        self.finished[active] = np.take_along_axis(merged, best[:, :, None], axis=1)

    def returned(self, r: int, generated: int) -> np.ndarray:
        return self.finished[:, :r].reshape(-1, self.finished.shape[2])[:, :generated].copy()
