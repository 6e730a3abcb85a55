"""The run plan: what the manifest says about running its graphs, read in one place.

``RunPlan.from_manifest`` turns the manifest's graph descriptions into what a run needs to know:

* the **stages**, run once per input at batch B (encoder, cross K/V projection), each input fed
  from a user input (``input:<role>``) or an earlier stage's output (``<graph>:<output>``);
* the **step** graph, run once per generated token, and where each of its inputs comes from:
  the step's tokens (``step:input_ids``), the token history (``step:history``, for in-graph
  n-gram blocking), the self-attention cache (``cache:<output>``: fed back from the step's own
  output, empty along ``seq_axis`` at the first step), or per-input state computed once
  (anything else, at batch B, shared by the beams of an item);
* which step output holds the plain last-position logits, and, after the ``ngram`` pass, which
  one holds log-softmaxed scores with n-grams of one fixed size blocked in the graph.

Decoder-only models (``is_encoder_decoder: false``) add three sources derived from the prompt's
attention mask the way HF ``generate`` derives them (``runners/inputs/prompt.py``): ``prompt:position_ids``
(the prompt's position ids, batch B, for a stage), ``step:position_ids`` and ``step:attention_mask``
(this step's position ids and the mask over all positions so far, per row).  A stage may run the
whole prompt once per input (the ``prefill``): the manifest's ``first_step_scores`` then names the
stage output holding the first step's scores, and a cache entry's ``init`` names the stage output
(batch B) that fills it, one copy per row, at the first step (a per-beam prompt cache); without
``init`` a cache entry starts empty (the prompt's K/V then live in the per-input state).

Backends run graphs and move tensors; ``elx.runners.model.Model`` follows this plan on a backend.
Nothing here assumes an encoder exists, or that the encoder takes token ids.
"""
from __future__ import annotations

from dataclasses import dataclass

from elx.runners.errors import ElxError
from elx.runners.manifest import Manifest

STEP_TOKENS = "step:input_ids"
STEP_HISTORY = "step:history"
STEP_MASK = "step:attention_mask"
STEP_POSITIONS = "step:position_ids"
PROMPT_POSITIONS = "prompt:position_ids"
STEP = "step:"
CACHE = "cache:"
INPUT = "input:"
KEPT = ("encoder:last_hidden_state",)  # stage outputs kept on the host after encoding (compare reads them)


@dataclass(frozen=True)
class Feed:
    """One graph input and where its value comes from."""

    name: str
    source: str
    dtype: str


@dataclass(frozen=True)
class GraphPlan:
    name: str
    feeds: tuple[Feed, ...]
    outputs: tuple[str, ...]


@dataclass(frozen=True)
class CacheSlot:
    """A self-attention cache entry: step input ``input`` is fed from step output ``output`` of the last step."""

    input: str
    output: str
    dtype: str
    shape: tuple  # symbolic: "rows" for the row axis, ints for fixed sizes
    seq_axis: int
    init: str | None = None  # a stage output (batch B) copied to every row at the first step; None: empty
    # the step writes its new positions into the buffer it reads this entry from (ONNX Runtime's GroupQueryAttention
    # with past and present bound to one buffer, ``--pass fused-attention``): a backend that can bind them may feed a
    # longer buffer (spare room after the cache) and read the present back in it (``runners/model.py``)
    in_place: bool = False

    def empty_shape(self, rows: int) -> list[int]:
        return [rows if d == "rows" else (0 if i == self.seq_axis else int(d)) for i, d in enumerate(self.shape)]


@dataclass(frozen=True)
class RunPlan:
    stages: tuple[GraphPlan, ...]
    step: GraphPlan
    token_input: str
    history_input: str | None
    state_feeds: tuple[Feed, ...]  # step inputs computed once per input (batch B)
    cache: tuple[CacheSlot, ...]
    logits: str  # the step output holding plain last-position logits [rows, vocab]
    blocked: str | None  # the step output holding log-softmaxed, n-gram-blocked scores (the ngram pass)
    ngram_size: int  # the n-gram size ``blocked`` blocks (0: no such output)
    kept: tuple[str, ...]  # stage outputs kept on the host after encoding (for compare)
    first_scores: str | None = None  # a stage output holding the first step's scores (decoder-only prefill)
    step_mask: str | None = None  # the step input fed from step:attention_mask
    step_positions: str | None = None  # the step input fed from step:position_ids
    uses_prompt: bool = False  # whether a graph reads prompt-derived inputs (runners/inputs/prompt.py)

    @classmethod
    def from_manifest(cls, manifest: Manifest) -> "RunPlan":
        graphs = manifest.graphs
        stages = tuple(_graph_plan(name, graphs[name]) for name in manifest.stages)
        step = _graph_plan(manifest.step, graphs[manifest.step])
        by_source = {}
        for feed in step.feeds:
            by_source.setdefault(feed.source, []).append(feed)
        tokens = by_source.get(STEP_TOKENS)
        if not tokens or len(tokens) != 1:
            raise ElxError(f"{_where(manifest)}: the step graph has no single {STEP_TOKENS} input; re-run 'elx export'")
        history = by_source.get(STEP_HISTORY, [None])[0]
        cache = tuple(CacheSlot(e["input"], e["output"], e.get("dtype", "float32"), tuple(e["shape"]), int(e["seq_axis"]),
                                e.get("init"), bool(e.get("in_place", False))) for e in manifest.cache_entries)
        outputs = {f"{s.name}:{o}" for s in stages for o in s.outputs}
        first_scores = manifest.data.get("first_step_scores")
        for source in [first_scores, *(slot.init for slot in cache)]:
            if source is not None and source not in outputs:
                raise ElxError(f"{_where(manifest)}: {source!r} is no stage output; re-run 'elx export'")
        cached = {slot.input for slot in cache}
        for feed in step.feeds:
            if feed.source.startswith(CACHE) and feed.name not in cached:
                raise ElxError(f"{_where(manifest)}: step input {feed.name} is fed from the cache but has no cache entry; "
                               "re-run 'elx export'")
        for feed in step.feeds:
            if feed.source.startswith(STEP) and feed.source not in (STEP_TOKENS, STEP_HISTORY, STEP_MASK, STEP_POSITIONS):
                raise ElxError(f"{_where(manifest)}: step input {feed.name} has an unknown source {feed.source!r}; "
                               "upgrade elx or re-export")
        state = tuple(f for f in step.feeds if not f.source.startswith(STEP) and not f.source.startswith(CACHE))
        derived = {f.source: f.name for f in step.feeds if f.source in (STEP_MASK, STEP_POSITIONS)}
        uses_prompt = (bool(derived) or first_scores is not None
                       or any(f.source == PROMPT_POSITIONS for s in stages for f in s.feeds))
        spec = graphs[manifest.step]
        blocked = spec.get("blocked") or {}
        kept = tuple(f"{s.name}:{o}" for s in stages for o in s.outputs if f"{s.name}:{o}" in KEPT)
        return cls(stages, step, tokens[0].name, history.name if history else None, state, cache,
                   spec.get("logits", "logits"), blocked.get("output"), int(blocked.get("ngram_size") or 0), kept,
                   first_scores, derived.get(STEP_MASK), derived.get(STEP_POSITIONS), uses_prompt)

    @property
    def graph_names(self) -> list[str]:
        return [*(s.name for s in self.stages), self.step.name]

    def reads_blocked(self, no_repeat_ngram_size: int | None) -> bool:
        """Whether a run asking for ``no_repeat_ngram_size`` reads the graph's blocked scores.

        The graph blocks exactly one n-gram size; a run asking for that size gets the graph's
        work, any other size (0 included) reads the plain logits and blocks on the host."""
        return self.blocked is not None and int(no_repeat_ngram_size or 0) == self.ngram_size


def _graph_plan(name: str, spec: dict) -> GraphPlan:
    feeds = tuple(Feed(inp, s["from"], s.get("dtype", "float32")) for inp, s in spec["inputs"].items())
    return GraphPlan(name, feeds, tuple(spec["outputs"]))


def _where(manifest: Manifest) -> str:
    return str(manifest.folder or "this export")
