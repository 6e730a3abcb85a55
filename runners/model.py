"""An export folder's graphs on a backend, driven by the run plan: what the searches call.

``Model`` implements the manifest's meaning once, for every backend: run the stages and collect
the per-input state (``encode``), feed one step (tokens, history, state, cache) and read its
scores (``step``), start with an empty cache, reorder the cache with the beams and drop
finished items (``reorder``, ``select``).  The backend only runs graphs and moves tensors.

Which step output the search reads is decided per run (``for_run``): after the ``ngram`` pass
the step graph exposes both plain logits and log-softmaxed scores with n-grams of one size
blocked; a run asking for exactly that size reads the blocked scores (the searches then skip
their log-softmax and n-gram processor), any other run reads the plain logits.

Decoder-only exports (``runners/inputs/prompt.py``): ``encode`` keeps the prompt's mask and HF's
position ids, and runs the prefill stage on the prompt once per input.  The first ``step`` (the
searches hand it the prompt tokens, as for any model) then consumes the prefill's outputs instead
of running the step graph: its scores, copied to the item's rows, and, where the manifest fills
cache entries from the prefill (a per-beam prompt cache), those entries; afterwards each step
feeds the step's position ids and the attention mask derived from the prompt mask.
"""
from __future__ import annotations

import copy

import numpy as np

from elx.runners.backends.base import Backend, DecoderCache, EncoderState
from elx.runners.errors import ElxError
from elx.runners.manifest import Manifest
from elx.runners.plan import INPUT, PROMPT_POSITIONS, RunPlan
from elx.runners.inputs.prompt import Prompt


class Model:
    def __init__(self, manifest: Manifest, backend: Backend, plan: RunPlan | None = None,
                 audio_scores_bytes: int | None = None):
        """``audio_scores_bytes``: an audio encoder on host arrays runs as many rows at a time as keep its attention
        scores and probabilities within this (``encode``); None (the runtime's default): the whole batch."""
        self.manifest, self.backend = manifest, backend
        self.audio_scores_bytes = audio_scores_bytes
        self.plan = backend.adapt(plan or RunPlan.from_manifest(manifest))
        self._scores = self.plan.logits
        self.returns_log_probs = False  # the scores read are log-softmaxed with n-grams blocked (ngram pass)
        self.device_scores = False  # a decoder-only prompt's first scores stay on the device (``on_device``)

    # -- per run -----------------------------------------------------------------------------
    def release_run(self) -> None:
        """Let go of what the backend holds of the last run (``Backend.release_run``)."""
        self.backend.release_run()

    def for_run(self, no_repeat_ngram_size: int | None) -> "Model":
        """This model reading the step output a run with ``no_repeat_ngram_size`` needs (see the module doc)."""
        view = copy.copy(self)
        blocked = self.plan.reads_blocked(no_repeat_ngram_size)
        view._scores = self.plan.blocked if blocked else self.plan.logits
        view.returns_log_probs = blocked
        return view

    def on_device(self, device: bool) -> "Model":
        """This model for a run whose search reads the scores on the device (``runners/search/device.py``):
        a decoder-only prompt's first-step scores are then kept on the device rather than copied down."""
        view = copy.copy(self)
        view.device_scores = bool(device and self.backend.device_tensors)
        return view

    @property
    def needs_history(self) -> bool:
        return self.plan.history_input is not None

    # -- once per input ----------------------------------------------------------------------
    def encode(self, inputs: dict) -> EncoderState:
        """Run the stages on user inputs given by role (``input_ids``, ``attention_mask``, ``input_features``).

        With ``audio_scores_bytes`` an audio encoder on host arrays runs a few rows at a time (``audio_rows``), its
        outputs joined: its attention scores and probabilities are rows x heads x frames² each (whisper-base, 30 s:
        72 MB a row, 432 MB for three rows: the export verification's peak, past its memory bound), and its rows
        never interact (no padding, no mask).  The runtime keeps the batch whole: one row at a time encoded
        whisper-base's 4 x 30 s in 2.63 s against 2.31 s batched (medians of 4 on 2 cores)."""
        batch = int(next(iter(inputs.values())).shape[0])
        rows = self.audio_rows(inputs)
        if rows is None or rows >= batch:
            return self._encode(inputs)
        parts = [self._encode({role: a[i:i + rows] for role, a in inputs.items()}) for i in range(0, batch, rows)]
        return EncoderState({k: np.concatenate([p.feeds[k] for p in parts]) for k in parts[0].feeds}, batch,
                            {k: np.concatenate([p.kept[k] for p in parts]) for k in parts[0].kept})

    def audio_rows(self, inputs: dict) -> int | None:
        """How many rows of audio features one encoder run takes on a host backend (its scores and probabilities
        within ``audio_scores_bytes``, at least one); None without a budget, for text inputs, device backends and
        prompts."""
        features = inputs.get("input_features")
        if (self.audio_scores_bytes is None or features is None or self.backend.device_tensors
                or self.plan.uses_prompt):
            return None
        heads, frames = int(self.manifest.dims.get("num_heads") or 1), int(np.shape(features)[-1]) // 2
        return max(1, self.audio_scores_bytes // (2 * 4 * heads * frames * frames))

    def _encode(self, inputs: dict) -> EncoderState:
        backend = self.backend
        available = {f"{INPUT}{role}": backend.to_device(np.ascontiguousarray(a)) for role, a in inputs.items()}
        prompt = None
        if self.plan.uses_prompt:
            ids = inputs["input_ids"]
            prompt = Prompt.from_mask(inputs.get("attention_mask", np.ones(np.shape(ids), dtype=np.int64)))
            available[PROMPT_POSITIONS] = backend.to_device(prompt.positions)
        for stage in self.plan.stages:
            feeds = {f.name: _resolve(f.source, available, stage.name) for f in stage.feeds}
            outputs = list(stage.outputs)
            for name, value in zip(outputs, backend.run(stage.name, feeds, outputs)):
                available[f"{stage.name}:{name}"] = value
        feeds = {f.name: _resolve(f.source, available, self.plan.step.name) for f in self.plan.state_feeds}
        kept = {key: backend.to_host(available[key]) for key in self.plan.kept if key in available}
        batch = int(next(iter(inputs.values())).shape[0])
        if prompt is not None and self.plan.first_scores is not None:
            first = available[self.plan.first_scores]
            prompt.scores = first if self.device_scores else backend.to_host(first)
            prompt.initial = {slot.input: available[slot.init] for slot in self.plan.cache if slot.init}
        return EncoderState(feeds, batch, kept, prompt)

    # -- per step ----------------------------------------------------------------------------
    def empty_cache(self, rows: int) -> DecoderCache:
        return DecoderCache({s.input: self.backend.zeros(s.empty_shape(rows), s.dtype) for s in self.plan.cache}, rows, 0)

    def step(self, input_ids: np.ndarray, state: EncoderState, cache: DecoderCache,
             history: np.ndarray | None = None, device: bool = False) -> tuple[np.ndarray, DecoderCache]:
        """One step: tokens [rows, t] → (host scores [rows, vocab] of the last position, the new cache).

        ``history`` [rows, cur_len] is the token history, needed when ``needs_history``.  ``device``: the
        scores may stay a device value (the device search path reads them with ``backend.as_tensor``)."""
        plan = self.plan
        count = int(input_ids.shape[1])
        if plan.first_scores is not None and cache.length == 0:
            return self._first_step(count, state, cache)
        feeds = dict(state.feeds)
        feeds.update(cache.arrays)
        feeds[plan.token_input] = np.ascontiguousarray(input_ids, dtype=np.int64)
        if plan.step_positions is not None:
            feeds[plan.step_positions] = state.prompt.step_positions(cache.rows, cache.length, count)
        if plan.step_mask is not None:
            feeds[plan.step_mask] = state.prompt.step_mask(cache.rows, cache.length + count)
        if plan.history_input is not None:
            if history is None:
                raise ElxError("this decoder graph reads the token history (n-gram blocking); pass it")
            feeds[plan.history_input] = np.ascontiguousarray(history, dtype=np.int64)
        outputs = [self._scores, *(slot.output for slot in plan.cache)]
        length = cache.length + count
        in_place = {s.output: s.input for s in plan.cache if s.in_place} if self.backend.in_place_cache else {}
        if in_place:
            for slot in plan.cache:
                if slot.in_place:
                    feeds[slot.input] = room_for(cache.arrays[slot.input], slot.seq_axis, length)
            scores, *presents = self.backend.run_in_place(plan.step.name, feeds, outputs, in_place)
            presents = [filled(v, slot.seq_axis, length) if slot.in_place else v for slot, v in zip(plan.cache, presents)]
        else:
            on_host = () if device and self.backend.device_tensors else (self._scores,)
            scores, *presents = self.backend.run(plan.step.name, feeds, outputs, host_outputs=on_host)
        return scores, DecoderCache({slot.input: v for slot, v in zip(plan.cache, presents)}, cache.rows, length)

    def _first_step(self, count: int, state: EncoderState, cache: DecoderCache) -> tuple[np.ndarray, DecoderCache]:
        """The prompt's step, computed by the prefill stage at batch B: its scores and initial cache, per row.

        The prefill's outputs are consumed (released from the state): the per-beam copies replace them."""
        prompt = state.prompt
        if prompt is None or prompt.scores is None:
            raise ElxError("the prompt's first step was already taken from this state; encode the inputs again")
        if count != prompt.width:
            raise ElxError(f"the first step of a decoder-only model takes the {prompt.width} prompt tokens, got {count}")
        items = prompt.items_of_rows(cache.rows)
        if isinstance(prompt.scores, np.ndarray):
            scores = prompt.scores[items]
        else:  # kept on the device (``on_device``): copied to the rows there
            scores = self.backend.take(prompt.scores, items)
        arrays = dict(cache.arrays)
        for slot in self.plan.cache:
            if slot.init:
                arrays[slot.input] = self.backend.take(prompt.initial[slot.input], items)
        prompt.scores, prompt.initial = None, {}
        return scores, DecoderCache(arrays, cache.rows, cache.length + count)

    def append_to_cache(self, cache: DecoderCache, arrays: dict) -> DecoderCache:
        """The cache with host ``arrays`` [rows, ...] appended along each entry's sequence axis (verification)."""
        out, added = {}, 0
        for slot in self.plan.cache:
            old = self.backend.to_host(cache.arrays[slot.input])
            out[slot.input] = self.backend.to_device(np.concatenate([old, arrays[slot.input]], axis=slot.seq_axis))
            added = int(arrays[slot.input].shape[slot.seq_axis])
        return DecoderCache(out, cache.rows, cache.length + added)

    def reorder(self, cache: DecoderCache, rows: np.ndarray) -> DecoderCache:
        """Row r of the new cache is row ``rows[r]`` of the old one (beam reordering).  The old cache is
        consumed: a reorder that keeps the row count may be done in place (``Backend.permute_rows``)."""
        if rows.shape[0] == cache.rows:
            if np.array_equal(rows, np.arange(cache.rows)):
                return cache
            move = self.backend.permute_rows
        else:
            move = self.backend.take
        return DecoderCache({k: move(v, rows) for k, v in cache.arrays.items()}, int(rows.shape[0]), cache.length)

    def select(self, state: EncoderState, items: np.ndarray) -> EncoderState:
        """Keep only batch items ``items`` of the per-input state (finished items leave the batch)."""
        feeds = {k: self.backend.take(v, items) for k, v in state.feeds.items()}
        prompt = state.prompt.take(items, self.backend.take) if state.prompt is not None else None
        return EncoderState(feeds, int(items.shape[0]), state.kept, prompt)

    # -- accounting --------------------------------------------------------------------------
    def state_bytes(self, state: EncoderState) -> int:
        return sum(self.backend.nbytes(v) for v in state.feeds.values())

    def cache_bytes(self, cache: DecoderCache) -> int:
        """The cache's bytes; an entry appended in place counts its whole buffer (the room after it too)."""
        return sum(v.base.nbytes if isinstance(getattr(v, "base", None), CacheBuffer) else self.backend.nbytes(v)
                   for v in cache.arrays.values())


class CacheBuffer(np.ndarray):
    """A host buffer holding a cache entry with room after it (``CacheSlot.in_place``); the cache is the view of its
    first ``written`` positions along the sequence axis."""

    written: int = 0


def room_for(value: np.ndarray, axis: int, length: int) -> np.ndarray:
    """The buffer to feed for cache ``value`` when the step fills it to ``length`` positions along ``axis``: the
    buffer ``value`` is a view of, where that view is all the buffer holds so far (no other step has written past it:
    a cache stepped from twice must not see the second step's positions) and has room; else a new one, 1.5x the length
    (amortized: the whole cache is copied about log₁.₅ of the run's length times instead of every step)."""
    base = value.base
    if isinstance(base, CacheBuffer) and base.written == value.shape[axis] and base.shape[axis] >= length and \
            value.strides == base.strides and value.shape[:axis] == base.shape[:axis]:  # its prefix: from ``filled``
        return base
    shape = list(value.shape)
    shape[axis] = length + max(length // 2, 32)
    buffer = np.empty(shape, dtype=value.dtype).view(CacheBuffer)  # past the cache: never read (seqlens bound it)
    buffer[_prefix(axis, value.shape[axis])] = value
    buffer.written = value.shape[axis]
    return buffer


def filled(buffer: CacheBuffer, axis: int, length: int) -> np.ndarray:
    """The cache a step left in ``buffer``: its first ``length`` positions (a view)."""
    buffer.written = length
    return buffer[_prefix(axis, length)]


def _prefix(axis: int, length: int) -> tuple:
    return (slice(None),) * axis + (slice(0, length),)


def _resolve(source: str, available: dict, graph: str):
    if source not in available:
        role = source.partition(":")[2]
        raise ElxError(f"graph {graph!r} needs {source!r}; provide the encoder input {role!r}")
    return available[source]
