"""One verification flow: a reference and a candidate run the same random cases; the logits must agree.

Export and every pass verify the same way: seeded random inputs at several (batch, beam, source
length, past length, step length) shapes, with padded sources, non-empty random
self-attention pasts and token histories with planted repeats; each side computes the step's
last-position scores, and the max abs difference must stay within the fp32 tolerance
(``logits_tolerance``: 1e-4, or 64 float32 ulps of the largest reference logit where that is more).

* ``verify_export``: HF's own PyTorch forward (per-row caches, the semantics the export must
  match) against the exported graphs run through the runtime (``elx.runners.model.Model``), so the
  manifest contract is checked along with the graphs; also compares the encoder output.
* Decoder-only exports (``DecoderOnlyTorchSide``): the case's inputs are a left-padded prompt;
  both sides run it (the runtime through its prefill stage), then one more token per row over a
  cache of [the prompt's keys/values ; a random generated past]; the scores compared are both
  steps' (prompt and token).  ``verify_rewrite`` between the two prompt-cache forms (shared and
  per-beam) runs the same way.
* ``verify_rewrite``: the graphs before a pass against the graphs after it.  A pass that changes
  the cache layout supplies ``past_from`` (the candidate's past for the reference's random past,
  e.g. slim's K-only cache built from random hidden states); a pass that changes what the step
  returns supplies ``expect`` (e.g. the ngram pass: log-softmax and blocking of the reference's
  logits).  Equal −inf entries (blocked tokens) count as equal.
"""
from __future__ import annotations

import contextlib
import contextvars
import copy
import hashlib
import inspect
import json
from collections.abc import Collection
from dataclasses import dataclass, replace

import numpy as np

from elx.runners.backends.base import DecoderCache
from elx.runners.errors import ElxError
from elx.runners.inputs.random_inputs import random_inputs
from elx.runners.manifest import Manifest
from elx.runners.model import Model
from elx.runners.backends.ort import OrtBackend
from elx.exporter.verification.shapes import DECODER_ONLY_SHAPES, SHAPES, Shape  # noqa: F401 (re-exported)
from elx.exporter.memory import free_weights, return_free_pages

# -- the fp32 tolerance -----------------------------------------------------------------------------------
# Two float32 evaluations of the same network (PyTorch's kernels, ONNX Runtime's; or the graphs before and
# after a pass) differ by rounding, and rounding is relative: a logit z = Σ_{i≤D} h_i·w_i computed in two
# orders differs by about 2·√D·u·Σ|h_i·w_i| (u = 2^-24, Higham & Mary's probabilistic bound), and the
# errors carried in h scale with h the same way.  The logits' error grows with the magnitudes in the
# computation, of which the largest logit M = max |z| is the observable measure.  An absolute bar cannot
# mean the same for unit-scale logits and for T5's untied heads (flan-t5-base: M = 230, measured diff
# 2.3e-4 = 16 ulps of M, refused by the absolute 1e-4).  The bar:
#
#     max |z_candidate − z_reference|  ≤  max(1e-4, 2^-18 · M)  =  1e-4 · max(1, M / 26.2)
#
# 2^-18 = 64 ulps of M = 2·√1024·u: the disagreement of two evaluations of a sum of D ≤ 1024 products
# (d_model, the LM head's sum, is at most 1024 in every preset); measured whole-export errors are 3–17
# ulps of M.  Logits up to M = 26.2 keep exactly the absolute 1e-4 of earlier versions (every tiny test
# model and every preset but flan-t5-base).
TOLERANCE = 1e-4  # the absolute floor: the whole bar for unit-scale logits (M <= LOGITS_SCALE)
RELATIVE_TOLERANCE = 2.0 ** -18  # beyond: 64 float32 ulps of the largest reference logit
LOGITS_SCALE = 1e-4 / RELATIVE_TOLERANCE  # 26.2144: where the two meet
RULE = "max abs logits diff <= 1e-4 * max(1, M / 26.2144), M = max |reference logit| (2^-18 = 64 ulps of M)"


def logits_tolerance(source) -> float:
    """The fp32 bar for logits of magnitude ``source``: a number M (max |reference logit|), or a ``Manifest``
    (the magnitude its export verification measured; manifests of earlier versions: 1e-4).  Every fp32
    check uses it: export, passes, and (the default of) ``elx compare``, with M measured on its own
    reference logits."""
    recorded = 0.0
    if isinstance(source, Manifest):
        record = source.data.get("verification", {}).get("tolerance", {})
        source, recorded = record.get("logits_magnitude"), float(record.get("atol") or 0.0) if "fp32_noise" in record else 0.0
    magnitude = 0.0 if source is None or not np.isfinite(source) else float(source)
    return max(TOLERANCE * max(1.0, magnitude / LOGITS_SCALE), recorded)


def tolerance_record(magnitude: float, report: dict | None = None) -> dict:
    """What the manifest records: the rule, its constants, the measured magnitude and the bar it gives; with an
    export's ``report`` (``verify_export``), fp32's own error per case and each case's bar, and ``atol`` the
    largest of them (the bar of passes and of ``elx compare``)."""
    record = {"rule": RULE, "absolute": TOLERANCE, "relative": RELATIVE_TOLERANCE, "logits_magnitude": magnitude,
              "atol": logits_tolerance(magnitude)}
    if report is not None and "fp32_noise" in report:
        cases = [{**{k: e[k] for k in ("batch", "beams", "source", "past", "step")}, "atol": e["tolerance"],
                  "graphs_vs_fp32": e["max_abs_logits_diff"], "fp32_vs_fp64": e["torch_fp32_vs_fp64"],
                  "graphs_vs_fp64": e["graphs_vs_fp64"]} for e in report["shapes"]]
        record["fp32_noise"] = {**report["fp32_noise"], "cases": cases}
        record["atol"] = max(record["atol"], report["tolerance"])
        encoder = report["fp32_noise"].get("max_torch_fp32_vs_fp64_encoder")
        if encoder is not None and np.isfinite(encoder):
            record["encoder_atol"] = encoder_bar(record["atol"], encoder)
    return record


def encoder_bar(logits_bar: float, encoder_noise: float | None) -> float:
    """An encoder output's bar: ``NOISE_MULTIPLE`` times PyTorch fp32's own encoder error against fp64 on the same
    cases, never below the logits' bar (``logits_bar``); the logits' bar alone where the error is unknown."""
    from elx.exporter.verification.fp32_noise import NOISE_MULTIPLE

    if encoder_noise is None or not np.isfinite(encoder_noise):
        return float(logits_bar)
    return max(float(logits_bar), NOISE_MULTIPLE * float(encoder_noise))


def encoder_tolerance(manifest: Manifest) -> float:
    """The bar for an encoder's output (``elx compare``): the logits' bar, widened to ``NOISE_MULTIPLE`` times
    PyTorch fp32's own encoder error against fp64 on the export's cases where the export measured it
    (``encoder_atol``).  A logits bar alone refused correct encoders: the real whisper-base's 30 s encoder output
    (max |x| 24) is 2.4e-4 from fp64 in PyTorch fp32 itself, the graphs 2.4-2.6e-4 from PyTorch fp32, the logits'
    bar 2.24e-4."""
    record = manifest.data.get("verification", {}).get("tolerance", {})
    return float(record["encoder_atol"]) if "encoder_atol" in record else logits_tolerance(manifest)


def default_shapes(manifest: Manifest) -> tuple:
    return SHAPES if manifest.data.get("is_encoder_decoder", True) else DECODER_ONLY_SHAPES


@dataclass
class Case:
    shape: Shape
    inputs: dict  # encoder inputs by role, batch B
    tokens: np.ndarray  # [rows, step]
    past: dict  # self-cache input name → [rows, ...] host array (the reference's layout)
    history: np.ndarray  # [rows, length] tokens with planted repeats (for in-graph n-gram blocking)
    prefix: np.ndarray  # [rows, past] tokens a prefilled side runs first (its own cache instead of ``past``)

    @property
    def rows(self) -> int:
        return self.shape.batch * self.shape.beams


AUDIO_SCORES_BYTES = 128 << 20  # an audio encoder's attention scores per run in the verification (``RuntimeSide``)
AUDIO_WINDOWS = 2  # the distinct feature windows (Whisper's 30 s) the cases' rows are drawn from (``_pooled_windows``)


# (what make_case reads, shape, seed) -> Case, inside ``cases_kept`` (per thread: a context variable)
_kept_cases: contextvars.ContextVar = contextvars.ContextVar("elx_kept_cases", default=None)


@contextlib.contextmanager
def cases_kept():
    """Inside the block, ``make_case`` computes each case once and hands out copies: an export asks for every case
    ~7 times (each side, each measure; whisper-base's four: 28 calls, 0.5 s of random audio windows)."""
    token = _kept_cases.set(_kept_cases.get() if _kept_cases.get() is not None else {})
    try:
        yield
    finally:
        _kept_cases.reset(token)


def make_case(manifest: Manifest, shape: Shape, seed: int) -> Case:
    """The case of ``shape`` and ``seed`` for ``manifest``'s graphs: a function of the manifest's inputs, tokens,
    padding side, dims and cache entries alone (kept by them inside ``cases_kept``; a copy each call: callers may
    write to what they get)."""
    kept = _kept_cases.get()
    if kept is None:
        return _new_case(manifest, shape, seed)
    key = (json.dumps([manifest.encoder_inputs(), manifest.tokens, manifest.data.get("padding_side"), manifest.dims,
                       manifest.cache_entries], sort_keys=True, default=str), shape, seed)
    if key not in kept:
        kept[key] = _new_case(manifest, shape, seed)
    return copy.deepcopy(kept[key])


def _new_case(manifest: Manifest, shape: Shape, seed: int) -> Case:
    rng = np.random.default_rng(seed)
    inputs = random_inputs(manifest, shape.batch, shape.source, rng)
    if "input_features" in inputs:
        inputs["input_features"] = _pooled_windows(manifest, shape, seed, rng)
    rows = shape.batch * shape.beams
    vocab = manifest.dims["vocab_size"]
    tokens = rng.integers(3, vocab, size=(rows, shape.step), dtype=np.int64)
    past = {}
    for entry in manifest.cache_entries:
        dims = [rows if d == "rows" else (shape.past if i == entry["seq_axis"] else d)
                for i, d in enumerate(entry["shape"])]
        past[entry["input"]] = rng.standard_normal(dims).astype(np.float32)
    history = rng.integers(3, min(vocab, 6), size=(rows, shape.past + shape.step + 10), dtype=np.int64)
    history[:, 0] = 0  # a three-token alphabet: repeated n-grams everywhere
    prefix = np.random.default_rng([seed, 1]).integers(3, vocab, size=(rows, shape.past), dtype=np.int64)
    return Case(shape, inputs, tokens, past, history, prefix)


def _inputs_digest(inputs: dict) -> str:
    """A digest of inputs by role: their names, dtypes and bytes (the key of a memo of their encoder output)."""
    digest = hashlib.blake2b(digest_size=16)
    for role in sorted(inputs):
        array = np.ascontiguousarray(inputs[role])
        digest.update(role.encode() + str(array.dtype).encode() + array.tobytes())
    return digest.hexdigest()


class _AudioRows:
    """A ``Model``'s encoder stages on one audio row, run once per distinct row: the verification's cases draw their
    rows from ``AUDIO_WINDOWS`` windows (``_pooled_windows``), and its runtime side encodes audio a row at a time
    (``AUDIO_SCORES_BYTES``), so a window's second run is the same graphs on the same bytes at the same shape, which
    ONNX Runtime's CPU kernels compute identically (whisper-base's graphs side: 8 rows encoded, 11.1 s; 3, 5.2-5.7
    s).  Everything after the encoder (joining the rows in order, the decoder steps) runs for every row of every
    case.  Other inputs (text, several rows) run as they come.  Holds the model weakly: the side's sessions go with
    its last reference, no cycle."""

    def __init__(self, model: Model):
        import weakref

        self.model, self.rows = weakref.ref(model), {}

    def __call__(self, inputs: dict):
        model = self.model()
        features = inputs.get("input_features")
        if features is None or np.shape(features)[0] != 1:
            return type(model)._encode(model, inputs)
        key = _inputs_digest(inputs)
        if key not in self.rows:
            self.rows[key] = type(model)._encode(model, inputs)
        state = self.rows[key]
        return replace(state, feeds=dict(state.feeds), kept=dict(state.kept))  # its arrays, never written to


class RuntimeSide:
    """An export folder's graphs through the runtime's own ``Model`` on ONNX Runtime (CPU)."""

    def __init__(self, manifest: Manifest, no_repeat_ngram_size: int = 0, prefill: bool = False,
                 packed: bool = False, packed_graphs: Collection[str] = ()):
        # unpacked weights: the graphs' sessions share the one mapped weights.data instead of a copy each
        # (``runners/backends/ort.py``: ``session_options``); the verification's peak at 1B+ was two copies.
        # ``packed``: the prepacked sessions the runtime runs (no arena), a copy of the weights each: int8's record,
        # where ONNX Runtime's MatMulNBits computes otherwise unpacked (fp32 activations) than packed (int8
        # activations at accuracy level 4: on the real SmolLM2-135M, 1.68 against 0.97 max abs logits difference),
        # one in memory at a time (beside HF's model: the int8 export's memory bound).  ``packed_graphs``: those
        # graphs prepacked over the shared mapping (int8's per-layer variants, their fp32 weights kept unpacked)
        backend = (OrtBackend(manifest, arena=False, one_session=True) if packed
                   else OrtBackend(manifest, prepack=False, packed_graphs=packed_graphs))
        # an audio encoder a few rows at a time (``Model.encode``): three 30 s rows' attention scores at once were
        # whisper-base's export peak, 1653-1703 MiB against its 1578 MiB bound; 1118 MiB this way
        self.model = Model(manifest, backend, audio_scores_bytes=AUDIO_SCORES_BYTES).for_run(no_repeat_ngram_size)
        self.prefill = prefill
        self.model._encode = _AudioRows(self.model)

    def run(self, case: Case, past: dict) -> tuple[np.ndarray, np.ndarray | None]:
        state = self.model.encode(case.inputs)
        if self.model.plan.first_scores is not None:
            return self._run_prompt_then_token(case, past, state), None
        history = case.history if self.model.needs_history else None
        cache = DecoderCache(past, case.rows)
        if self.prefill:
            cache = self.model.empty_cache(case.rows)
            if case.prefix.shape[1]:
                _, cache = self.model.step(case.prefix, state, cache, history)
        scores, _ = self.model.step(case.tokens, state, cache, history)
        return scores, state.kept.get("encoder:last_hidden_state")


    def _run_prompt_then_token(self, case: Case, past: dict, state) -> np.ndarray:
        """Decoder-only: the prompt's step (per row), then one token over [prompt ; ``past``]; both steps' scores.
        With ``prefill`` the generated part is the case's prefix tokens, run one step each (the side fills its
        own cache, whatever its layout), instead of ``past``."""
        model, beams = self.model, case.shape.beams
        prompt = np.repeat(case.inputs["input_ids"], beams, axis=0)
        first, cache = model.step(prompt, state, model.empty_cache(case.rows))
        if self.prefill:
            for t in range(case.prefix.shape[1]):
                _, cache = model.step(np.ascontiguousarray(case.prefix[:, t: t + 1]), state, cache)
        else:
            cache = model.append_to_cache(cache, past)
        scores, _ = model.step(case.tokens, state, cache)
        return np.concatenate([scores, first])


class DecoderOnlyTorchSide:
    """HF's own forward of a decoder-only model: the prompt, then one token per row over a per-row cache
    [the prompt's keys/values repeated per beam ; ``past``], with HF's masks and position ids."""

    def __init__(self, model, manifest: Manifest):
        self.model, self.layers = model, manifest.dims["num_decoder_layers"]

    def run(self, case: Case, past: dict) -> tuple[np.ndarray, None]:
        import torch
        from transformers.cache_utils import DynamicCache

        from elx.runners.inputs.prompt import prompt_positions, sequence_positions

        beams, generated = case.shape.beams, case.shape.past
        ids, mask = case.inputs["input_ids"], case.inputs["attention_mask"]
        width = ids.shape[1]
        with torch.no_grad():
            first = self.model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                               position_ids=torch.from_numpy(prompt_positions(mask)), use_cache=True)
            pairs = []
            for i, layer in enumerate(first.past_key_values.layers):
                pairs.append(tuple(torch.cat([t.repeat_interleave(beams, 0),
                                              torch.from_numpy(past[f"past_key_values.{i}.{kind}"])], dim=2)
                                   for t, kind in ((layer.keys, "key"), (layer.values, "value"))))
            rows_mask = np.repeat(mask, beams, axis=0)
            full_mask = np.concatenate([rows_mask, np.ones((case.rows, generated + 1), dtype=np.int64)], axis=1)
            positions = sequence_positions(rows_mask, width + generated + 1)[:, -1:]
            out = self.model(input_ids=torch.from_numpy(case.tokens), attention_mask=torch.from_numpy(full_mask),
                             position_ids=torch.from_numpy(positions), past_key_values=DynamicCache(pairs),
                             use_cache=True)
        first_scores = first.logits[:, -1, :].repeat_interleave(beams, 0)
        return np.concatenate([out.logits[:, -1, :].numpy(), first_scores.numpy()]), None

    def run_together(self, items: list) -> list:
        """``run(case, past)`` for every (case, past) of ``items`` in two forwards for all of them: the prompts
        left-padded to the widest (their own padding kept), then one token per row over [prompt ; a gap ; ``past``],
        the gap and the padding masked, each row at the position ``run`` gives it.  Masked keys get a weight of
        exactly 0, so each row computes what ``run`` computes, in another blocking of the same sums: the results
        differ from ``run``'s by the arithmetic's rounding (fp32: ~3e-6 of the largest logit on TinyLlama-1.1B
        dims, float64: ~1e-15).  ``torch_references`` runs both of the export's references so: each forward streams
        every layer's weights once (TinyLlama-1.1B: 4.4 GB, 8.8 GB in float64), and five cases of two forwards each
        read them ten times (measured there, one thread: fp32 18.9 -> 8.9 s, float64 23.3 -> 11.8 s).  Each row's
        logits are compared with the graphs' for that case alone, whose own rows are not padded: the comparison is
        of two evaluations of the same function, as before, and each case's bar comes from the fp32 and float64
        references computed the same way."""
        import torch
        from transformers.cache_utils import DynamicCache

        from elx.runners.inputs.prompt import prompt_positions, sequence_positions

        cases = [case for case, _ in items]
        width = max(case.inputs["input_ids"].shape[1] for case in cases)
        gap_to = max(case.shape.past for case in cases)
        ids, masks, token_masks, positions = [], [], [], []
        for case in cases:
            prompt_ids, mask = case.inputs["input_ids"], case.inputs["attention_mask"]
            pad = width - prompt_ids.shape[1]
            # the padding id of the case's own padded rows (any id: it is masked), else its first token's
            ids.append(np.pad(prompt_ids, ((0, 0), (pad, 0)), mode="edge"))
            masks.append(np.pad(mask, ((0, 0), (pad, 0))))
            rows_mask = np.repeat(mask, case.shape.beams, axis=0)
            generated = case.shape.past
            token_masks.append(np.concatenate([np.pad(rows_mask, ((0, 0), (pad, 0))),
                                               np.zeros((case.rows, gap_to - generated), dtype=np.int64),
                                               np.ones((case.rows, generated + 1), dtype=np.int64)], axis=1))
            positions.append(sequence_positions(rows_mask, rows_mask.shape[1] + generated + 1)[:, -1:])
        ids, masks = np.concatenate(ids), np.concatenate(masks)
        # the LM head on the last position only, as HF's generate asks for it (on the real SmolLM2-135M a fifth of
        # the prompt forward's arithmetic was the head on positions nobody reads)
        keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(self.model.forward).parameters else {}
        with torch.no_grad():
            first = self.model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(masks),
                               position_ids=torch.from_numpy(prompt_positions(masks)), use_cache=True, **keep)
            pairs = []
            for i, layer in enumerate(first.past_key_values.layers):
                pair = []
                for kind, prompt in (("key", layer.keys), ("value", layer.values)):
                    rows, start = [], 0
                    for case, past in items:
                        mine = prompt[start: start + case.shape.batch].repeat_interleave(case.shape.beams, 0)
                        start += case.shape.batch
                        own = torch.from_numpy(past[f"past_key_values.{i}.{kind}"]).to(mine.dtype)
                        gap = own.new_zeros((*own.shape[:2], gap_to - own.shape[2], *own.shape[3:]))
                        rows.append(torch.cat([mine, gap, own], dim=2))
                    pair.append(torch.cat(rows))
                pairs.append(tuple(pair))
            tokens = np.concatenate([case.tokens for case in cases])
            out = self.model(input_ids=torch.from_numpy(tokens),
                             attention_mask=torch.from_numpy(np.concatenate(token_masks)),
                             position_ids=torch.from_numpy(np.concatenate(positions)),
                             past_key_values=DynamicCache(pairs), use_cache=True)
        last, firsts = out.logits[:, -1, :].numpy(), first.logits[:, -1, :]
        results, row, item = [], 0, 0
        for case in cases:
            first_scores = firsts[item: item + case.shape.batch].repeat_interleave(case.shape.beams, 0).numpy()
            results.append((np.concatenate([last[row: row + case.rows], first_scores]), None))
            row, item = row + case.rows, item + case.shape.batch
        return results


class TorchSide:
    """HF's own forward in PyTorch with per-row self-attention caches."""

    def __init__(self, model, manifest: Manifest, prefill: bool = False):
        self.model, self.layers, self.prefill = model, manifest.dims["num_decoder_layers"], prefill
        self.encoded = {}  # (item digest, attention kernel) -> encoder output (``_encoded``)
        self.crossed = {}  # the same key -> its cross-attention keys and values per layer (``_cross``)

    def run(self, case: Case, past: dict) -> tuple[np.ndarray, np.ndarray]:
        import torch

        beams = case.shape.beams
        inputs = {role: torch.from_numpy(a) for role, a in case.inputs.items()}
        mask = inputs.get("attention_mask")
        mask = None if mask is None else mask.repeat_interleave(beams, 0)
        with torch.no_grad():
            if "input_features" not in inputs:
                return self._text_scores(case, past, inputs, mask)
            # audio: the encoder once per item, one item at a time, its output repeated per beam, as HF's generate
            # does (the encoder runs before the inputs are expanded for beams).  Running it on batch × beams
            # rows at once was 2.6x the work of Whisper's four 30 s cases, and their float64 attention
            # matrices held together were the export's memory peak
            batch = next(iter(inputs.values())).shape[0]
            items = [self._encoded({role: a[i:i + 1] for role, a in inputs.items()}) for i in range(batch)]
            encoder = torch.cat([output for _, output in items])
            # and the decoder on an item's rows (rows do not interact), never across items.  Long encoder outputs
            # (two rows' cross keys/values past ``CROSS_CACHE_BYTES``: audio) read the item's cross keys/values,
            # projected once (``_cross``), as views: an item's beams in one forward, nothing copied per row (a
            # row per forward was 21 forwards for whisper-base's four cases, each reading the 51865-row head: its
            # fp32 and fp64 decoder work 3.0 + 7.6 s, now 8 forwards).  Short ones (text) project them in the
            # item's one forward, which an extra forward per item would cost more than (bart-large's fp64
            # reference: 6.5 -> 13.0 s), a few rows at a time (``rows_per_forward``: on all batch x beams rows at
            # once, every layer's cross keys and values were held together).  Each row's logits are those of the
            # same forward on more rows
            shared = rows_per_forward(encoder, self.layers, 2) < 2
            chunk = beams if shared else rows_per_forward(encoder, self.layers, beams)
            scores = [self._rows_scores(case, past, items[r // beams], n, mask, slice(r, r + n), shared)
                      for r, n in _row_chunks(batch, beams, chunk)]
        return torch.cat(scores).numpy(), encoder.numpy()

    def _text_scores(self, case: Case, past: dict, inputs: dict, mask):
        """A text case: its items through the encoder in one forward, its rows through the decoder in as few as
        ``rows_per_forward`` allows (all of them: text sources are short), as HF's generate runs them (the encoder
        on the batch, the decoder on batch × beams rows, each item's padding its own and masked).  Each row computes
        what it computes alone, in another blocking of the same sums.  An item at a time was two forwards per item,
        each streaming a stack's weights (bart-large: 8 items, the fp64 reference converting every layer per
        forward)."""
        import torch

        encoder = self.model.get_encoder()(**inputs).last_hidden_state
        rows = encoder.repeat_interleave(case.shape.beams, 0)
        chunk = rows_per_forward(encoder[:1], self.layers, case.rows)
        scores = [self._rows_scores(case, past, (None, rows[r: r + chunk]), min(chunk, case.rows - r), mask,
                                    slice(r, r + chunk), shared=False) for r in range(0, case.rows, chunk)]
        return torch.cat(scores).numpy(), encoder.numpy()

    def _encoded(self, item: dict) -> tuple:
        """The encoder's output for one item and its key, computed once per evaluation: an audio case's rows repeat
        windows that other cases encoded (``_pooled_windows``).  Kept by the item's bytes, dtype and attention
        kernel, until ``forget`` (``RecordedSide``: after each evaluation)."""
        key = (_inputs_digest({role: a.numpy() for role, a in item.items()}),
               getattr(self.model.config, "_attn_implementation", None))
        if key not in self.encoded:
            self.encoded[key] = self.model.get_encoder()(**item).last_hidden_state
        return key, self.encoded[key]

    def _cross(self, key, encoder) -> list:
        """The decoder's cross-attention keys and values of one item's encoder output (one row), per layer, as HF's
        own decoder computes and caches them (its first step on one row, an empty cross cache), once per
        evaluation and encoder output.  Every row of every case drawn from that output reads them instead of
        projecting its own copy: an item's beams are rows of the same encoder output, and Whisper's cases draw
        their rows from ``AUDIO_WINDOWS`` windows (21 rows, then 3 windows: the cross projections of 1500 frames
        were most of whisper-base's PyTorch decoder work, fp32 4.4 of 7.8 s, fp64 10.4 of 18.2 s; then 2.5 and
        6.6 s).  Held per evaluation: a window's each (whisper-base: 37 MB in fp32)."""
        import torch
        from transformers.cache_utils import DynamicCache, EncoderDecoderCache

        if key not in self.crossed:
            start = torch.zeros((1, 1), dtype=torch.int64)
            cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
            # the decoder stack alone: its head's logits are not needed (whisper-base's head is 51865 x 512)
            self.model.get_decoder()(input_ids=start, encoder_hidden_states=encoder, past_key_values=cache,
                                     use_cache=True)
            self.crossed[key] = [(layer.keys, layer.values) for layer in cache.cross_attention_cache.layers]
        return self.crossed[key]

    def forget(self) -> None:
        """Drop the encoder outputs and cross keys/values kept for this evaluation."""
        self.encoded, self.crossed = {}, {}

    def _rows_scores(self, case: Case, past: dict, item_encoded: tuple, n: int, mask, item: slice,
                     shared: bool = True):
        """The last position's logits of ``n`` rows of one item (``item``: their slice of the case's rows,
        ``item_encoded`` the item's (key, encoder output)); ``shared``: their cross keys and values are the item's
        (``_cross``), seen by each row, else HF's decoder projects them for each row."""
        import torch
        from transformers.cache_utils import DynamicCache, EncoderDecoderCache

        key, encoder = item_encoded
        rows = encoder if encoder.shape[0] == n else encoder.expand(n, -1, -1)  # the rows' own, or one item's
        mask = None if mask is None else mask[item]
        if self.prefill:
            from elx.exporter.verification.hf_decoding import hf_decoder_logits

            tokens = torch.from_numpy(np.concatenate([case.prefix, case.tokens], axis=1)[item])
            return hf_decoder_logits(self.model, rows, mask, tokens, use_cache=False)[:, -1, :]
        pairs = [(torch.from_numpy(past[f"past_key_values.{i}.decoder.key"][item]),
                  torch.from_numpy(past[f"past_key_values.{i}.decoder.value"][item])) for i in range(self.layers)]
        cross = _viewed_cache(self._cross(key, encoder), n) if shared else DynamicCache()  # empty: HF projects them
        cache = EncoderDecoderCache(DynamicCache(pairs), cross)
        out = self.model(encoder_outputs=(rows,), attention_mask=mask,
                         decoder_input_ids=torch.from_numpy(case.tokens[item]), past_key_values=cache, use_cache=True)
        return out.logits[:, -1, :]


def _viewed_cache(pairs: list, rows: int):
    """A ``DynamicCache`` holding each layer's one-row (keys, values) as views over ``rows`` rows: nothing copied
    (filled through ``DynamicCache(pairs)``, every row's would be concatenated into a new tensor each forward:
    whisper-base's 12 tensors of 1500 frames, 73 ms of a 217 ms float64 forward).  The attention reads the views."""
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache([(k[..., :0, :], v[..., :0, :]) for k, v in pairs])  # its layers, initialized and empty
    for layer, (k, v) in zip(cache.layers, pairs):
        layer.keys, layer.values = k.expand(rows, *k.shape[1:]), v.expand(rows, *v.shape[1:])
    return cache


CROSS_CACHE_BYTES = 64 << 20  # the cross-attention keys and values one reference forward may hold


def rows_per_forward(encoder, layers: int, beams: int) -> int:
    """How many rows of an item one reference forward takes: as many of its beams as keep the decoder's cross
    keys and values (2 per layer, each rows × frames × d_model) within ``CROSS_CACHE_BYTES``, at least one.  The
    item's own are held once (``TorchSide._cross``) and each row reads them as a view, but the attention works on
    rows × frames of them: whisper-base's export with all four beams in one forward peaked 150 MiB higher (1465
    against 1312 MiB; its bound 1578) in the same time."""
    per_row = 2 * layers * encoder.shape[1] * encoder.shape[2] * encoder.element_size()
    return max(1, min(beams, CROSS_CACHE_BYTES // max(1, per_row)))


def _row_chunks(batch: int, beams: int, chunk: int) -> list[tuple[int, int]]:
    """(first row, rows) of each forward: an item's beams in chunks of ``chunk``, item after item."""
    return [(item * beams + first, min(chunk, beams - first)) for item in range(batch) for first in range(0, beams, chunk)]


class RecordedSide:
    """A side's results on the cases ``measure`` draws for ``shapes`` × ``seeds`` (with each case's own random
    past), computed at once, so that the side (its ONNX Runtime sessions: one copy of the weights per graph) is
    released before a candidate loads.  Holding both sides held four copies of a decoder-only model's weights
    (prefill and step, before and after): 27 GB at SmolLM2-1.7B, past this machine's 23 GB."""

    spread = None  # PyTorch fp32's side (``torch_references``): its error per case, the largest over its evaluations
    draws = None  # fp32's side: how many of its rounding draws ``spread`` is the largest over, and why
    later = None  # fp32's side: the draws not yet run (``LaterDraws``), where they may be needed

    def __init__(self, side, manifest: Manifest, shapes, seeds, report=None, together: bool = False, threads=None):
        """``together``: every case in one call of ``side.run_together`` (the float64 reference, ``torch_references``);
        ``threads()``, if given, says how many threads PyTorch takes for the next case (``export.ReferenceThreads``)."""
        self._results = {}
        forget = getattr(side, "forget", None)  # an evaluation's kept encoder outputs (``TorchSide._encoded``)
        if forget is not None:
            forget()
        try:
            self._record(side, manifest, shapes, seeds, report, together, threads)
        finally:
            if forget is not None:
                forget()

    def _record(self, side, manifest: Manifest, shapes, seeds, report, together: bool, threads) -> None:
        import torch

        total = len(seeds) * len(shapes)
        cases = (make_case(manifest, shape, seed) for seed in seeds for shape in shapes)  # made as they run
        if together:
            cases = list(cases)
            if threads is not None:
                torch.set_num_threads(threads())
            results = side.run_together([(case, dict(case.past)) for case in cases])
            for case, result in zip(cases, results):
                self._results[self._key(case, case.past)] = result
                if report is not None:
                    report(len(self._results), total)
            return_free_pages()
            return
        for case in cases:
            if threads is not None:
                torch.set_num_threads(threads())
            self._results[self._key(case, case.past)] = side.run(case, dict(case.past))
            return_free_pages()  # the case's tensors, before the next case allocates its own
            if report is not None:  # report(cases done, cases in all)
                report(len(self._results), total)

    @staticmethod
    def _key(case: Case, past: dict) -> tuple:
        digest = hashlib.blake2b(digest_size=16)
        for array in (case.tokens, case.prefix, *case.inputs.values(), *past.values()):
            digest.update(np.ascontiguousarray(array).tobytes())
        return tuple(case.shape.as_dict().items()), digest.hexdigest()

    def run(self, case: Case, past: dict):
        key = self._key(case, past)
        if key not in self._results:
            raise ElxError("internal error: a verification case the recorded reference did not run; report this")
        return self._results[key]


def _pooled_windows(manifest: Manifest, shape: Shape, seed: int, rng) -> np.ndarray:
    """A case's audio features: its rows drawn from ``AUDIO_WINDOWS`` random windows that every case of ``seed``
    shares, in turn from a random one (items i and i + 1 always differ; a case of two items has both).  A Whisper
    encoder's rows never interact (no padding, no mask) and its 30 s window is most of a case's work: PyTorch's
    references and the graphs' side encode each distinct window once per evaluation (``TorchSide._encoded``,
    ``_AudioRows``).  whisper-base on two cores, a window: PyTorch fp32 1.2 s, fp64 2.5 s, the graphs 1.3 s, and
    its cross keys/values 0.6 s (8 windows, one per row of the four cases, were 31 s; 3 windows 15 s; 2 windows
    10 s).  A row put in another item's place is still seen: every case but the 3-item one has its items distinct,
    and that one's neighbours differ (w, w', w: an item's beams interleaved as ``repeat`` instead of
    ``repeat_interleave`` moves 4 of its 6 rows onto the other window)."""
    pool = random_inputs(manifest, AUDIO_WINDOWS, shape.source, np.random.default_rng([seed, 2]))["input_features"]
    picks = (int(rng.integers(AUDIO_WINDOWS)) + np.arange(shape.batch)) % AUDIO_WINDOWS
    return np.ascontiguousarray(pool[picks])


def _max_abs_finite(a: np.ndarray) -> float:
    finite = a[np.isfinite(a)]
    return float(np.abs(finite).max()) if finite.size else 0.0


def _max_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    if a.shape != b.shape:
        return float("inf")
    both_blocked = np.isneginf(a) & np.isneginf(b)
    if not np.array_equal(np.isneginf(a), np.isneginf(b)):
        return float("inf")  # different tokens blocked
    a, b = np.where(both_blocked, 0.0, a.astype(np.float64)), np.where(both_blocked, 0.0, b.astype(np.float64))
    return float(np.abs(a - b).max())


def _real_positions(encoder: np.ndarray, case: Case) -> np.ndarray:
    """The encoder output with padded positions zeroed: no consumer reads them (attention masks them), and a
    pass may leave them as it likes (``--pass unpad`` writes zeros there)."""
    mask = case.inputs.get("attention_mask")
    if mask is None or encoder.shape[:2] != mask.shape:
        return encoder
    return np.where(mask[:, :, None] != 0, encoder, 0)


def measure(reference, candidate, manifest: Manifest, shapes=SHAPES, seed: int = 0, past_from=None,
            expect=None, bars=None, floor: float = 0.0, encoder_floor: float | None = None) -> dict:
    """Run both sides on the same cases; the report records the max abs logits (and encoder) difference.

    ``past_from(past) -> past`` maps the reference's random past to the candidate's cache layout;
    ``expect(scores, case) -> scores`` maps the reference's scores to what the candidate returns.
    Each case's bar is the magnitude rule (``logits_tolerance`` of the largest reference logit), at least
    ``floor``, and at least ``bars[i]`` for the i-th shape (the export's per-case bars from fp32's own error:
    ``exporter/verification/fp32_noise.py``); ``within`` says whether every case is within its bar.  With
    ``encoder_floor`` (a number), the encoder output is judged too: within ``encoder_tolerance``, the largest of
    that floor and the logits' bars (``judge_encoder``); without it, its difference is only recorded."""
    worst, worst_encoder, per_shape, scale, magnitude = 0.0, None, [], 0.0, 0.0
    for shape in shapes:
        case = make_case(manifest, shape, seed)
        past = dict(case.past)
        candidate_past = past_from(past) if past_from else past  # may rewrite ``past`` consistently, in place
        ref, ref_encoder = reference.run(case, past)
        got, got_encoder = candidate.run(case, candidate_past)
        entry = {**shape.as_dict()}
        magnitude = max(magnitude, _max_abs_finite(ref))  # the reference's logits (before ``expect``)
        if expect is not None:
            ref = expect(ref, case)
            entry["banned"] = int(np.isneginf(ref).sum())  # how much blocking the check really saw
        diff = _max_abs_diff(got, ref)
        entry["max_abs_logits_diff"] = diff
        scale = max(scale, _max_abs_finite(ref))
        if ref_encoder is not None and got_encoder is not None:
            got_encoder, ref_encoder = _real_positions(got_encoder, case), _real_positions(ref_encoder, case)
            entry["max_abs_encoder_diff"] = _max_abs_diff(got_encoder, ref_encoder)
            worst_encoder = max(worst_encoder or 0.0, entry["max_abs_encoder_diff"])
        worst = max(worst, diff) if not np.isnan(diff) else float("nan")
        per_shape.append(entry)
    rule = max(logits_tolerance(magnitude), floor)
    for i, entry in enumerate(per_shape):
        entry["tolerance"] = max(rule, bars[i]) if bars is not None else rule
    within = all(e["max_abs_logits_diff"] <= e["tolerance"] for e in per_shape)  # NaN is never within
    report = {"max_abs_logits_diff": worst, "max_abs_reference": scale, "logits_magnitude": magnitude,
              "tolerance": max(e["tolerance"] for e in per_shape), "within": within, "shapes": per_shape}
    if worst_encoder is not None:
        report["max_abs_encoder_diff"] = worst_encoder
        if encoder_floor is not None:
            judge_encoder(report, max(encoder_floor, report["tolerance"]))
    return report


def judge_encoder(report: dict, bar: float) -> None:
    """The report's encoder output held to ``bar`` (``encoder_tolerance``, ``encoder_within``; NaN is never
    within); ``within`` becomes false where it is not."""
    report["encoder_tolerance"] = float(bar)
    report["encoder_within"] = bool(report["max_abs_encoder_diff"] <= bar)
    report["within"] = bool(report["within"] and report["encoder_within"])


def closeness(report: dict) -> float:
    """How near its bar a report's worst case is: max over cases of diff / bar (inf for NaN)."""
    ratios = [e["max_abs_logits_diff"] / e["tolerance"] if "tolerance" in e else
              e["max_abs_logits_diff"] / report["tolerance"] for e in report["shapes"]]
    return float("inf") if any(np.isnan(r) for r in ratios) else max(ratios, default=0.0)


def _side_progress(report, side: str):
    return None if report is None else (lambda done, total: report(side, done, total))


BATCHED_AGREEMENT = 1e-3  # |fp32 - fp64| / max |fp64 logit| beyond which a batched fp64 reference is not trusted


def _agrees_with(fp64: RecordedSide, fp32: RecordedSide, manifest: Manifest, shapes, seed: int) -> bool:
    """Whether the float64 reference is within ``BATCHED_AGREEMENT`` (relative to its largest logit) of fp32's on
    every case: fp32's own error is 1e-7 to 3e-5 of that (SmolLM2-135M real: 2.9e-5); a float64 forward that computed
    something else errs by O(1).  (A batch that changed what a row computes in both precisions alike would leave the
    two close and both far from the graphs, which compute each case alone: the export would be refused, not passed;
    ``tests/test_verification_memory.py`` holds every decoder-only family's batched rows to its cases alone.)"""
    for shape in shapes:
        case = make_case(manifest, shape, seed)
        high, low = fp64.run(case, case.past)[0], fp32.run(case, case.past)[0]
        if not _max_abs_diff(high, low) <= BATCHED_AGREEMENT * max(_max_abs_finite(high), 1.0):
            return False
    return True


def torch_references(model, manifest: Manifest, shapes=None, seed: int = 0, report=None, threads=None,
                     draws: str = "all") -> tuple:
    """HF's PyTorch forward on the verification's cases, in fp32 and in fp64 (the model converted to float64 in
    place and back, ``exporter/verification/fp32_noise.py``): the two recorded sides ``verify_export`` holds the
    graphs to.  They need the manifest's description of the graphs, not the graphs: an export computes them while
    a second process still traces a template (``exporter/capture/stitched.py``: ``Capture.while_waiting``).

    ``draws``: "all" measures fp32's other rounding draws now (``fp32_spread``); "needed" leaves them to
    ``verify_export``, which runs them only where the graphs are outside a bar of the first draw
    (``LaterDraws``)."""
    from elx.exporter.verification.fp32_noise import Float64Side, in_float64, per_layer_threads

    if draws not in DRAWS:
        raise ElxError(f"unknown fp32 draws {draws!r}; use one of {', '.join(DRAWS)}")
    shapes = shapes or default_shapes(manifest)
    torch_side = (TorchSide if manifest.data.get("is_encoder_decoder", True) else DecoderOnlyTorchSide)(model, manifest)
    # decoder-only cases all in two forwards (``DecoderOnlyTorchSide.run_together``): their activations are small.
    # An encoder-decoder case holds its encoder output and cross keys/values (Whisper: 37 MB a tensor in float64),
    # so those run one after another
    together = isinstance(torch_side, DecoderOnlyTorchSide)
    with per_layer_threads(model, threads if together else None):
        fp32 = RecordedSide(torch_side, manifest, shapes, [seed], _side_progress(report, "PyTorch fp32"),
                            together=together, threads=threads)
    with in_float64(model, threads):
        fp64 = RecordedSide(Float64Side(torch_side), manifest, shapes, [seed], _side_progress(report, "PyTorch fp64"),
                            together=together, threads=threads)
    if together and not _agrees_with(fp64, fp32, manifest, shapes, seed):
        # a float64 reference that is not fp32's function must not widen the bars it sets: its cases again, one at
        # a time
        with in_float64(model, threads):
            fp64 = RecordedSide(Float64Side(torch_side), manifest, shapes, [seed], threads=threads)
    later = LaterDraws(type(torch_side), manifest, shapes, seed, together)
    if not later.relevant(fp64, fp32):
        fp32.draws = {"run": 1, "why": "not relevant: fp32's error is below 1/8 of the magnitude rule on every case"}
    elif draws == "all":
        later.run(model, fp64, fp32, threads, report)
    else:
        fp32.later = later
    return fp32, fp64


class LaterDraws:
    """fp32's other rounding draws (``fp32_spread``), measured once the graphs have run and only where they can
    change the verdict.  They only widen bars: each case's e is the largest error over the draws, so a case within
    the bar of the first draw is within the bar of all of them, and graphs within every first-draw bar pass
    whatever the other draws find.  Where a case is outside its first-draw bar, the draws run (on the model again:
    the export freed it before the graphs' sessions loaded) and the case is judged by the bars of all of them:
    the same verdict, always, as measuring every draw first.  They were half of TinyLlama-1.1B's export (draws of
    9.4 + 3.9 + 11.3 s beside fp32 6.0 s, fp64 10.9 s and the graphs 10.8 s, one run on this 2-core VM), and on its
    random weights they widened no bar.  The bars recorded are the ones the graphs were judged by; an export
    whose passes follow measures all draws first (``export.py``: a pass's bar is the export's largest)."""

    def __init__(self, side_type, manifest: Manifest, shapes, seed: int, together: bool):
        self.side_type, self.manifest, self.shapes, self.seed, self.together = side_type, manifest, shapes, seed, together

    def relevant(self, fp64, fp32) -> bool:
        """Whether any draw could set a bar: fp32's first error reaches ``SPREAD_RELEVANT`` of the magnitude rule on
        some case (the draws measured differ by up to 4.5x on one case; tiny models: 0.005-0.05 of it)."""
        from elx.exporter.verification.fp32_noise import NOISE_MULTIPLE, SPREAD_RELEVANT

        first = measure(fp64, fp32, self.manifest, self.shapes, self.seed)
        worst = max((e["max_abs_logits_diff"] for e in first["shapes"]), default=0.0)
        return bool(NOISE_MULTIPLE * worst >= SPREAD_RELEVANT * first["tolerance"])  # NaN: not relevant, as before

    def run(self, model, fp64, fp32, threads=None, report=None) -> None:
        """The draws on ``model`` (the one the references ran, or the same weights loaded again): ``fp32.spread``."""
        side = self.side_type(model, self.manifest)
        fp32.spread, count = fp32_spread(model, side, fp64, fp32, self.manifest, self.shapes, self.seed,
                                         self.together, threads, report)
        fp32.draws = {"run": count, "why": "all of PyTorch's fp32 evaluations"}
        fp32.later = None


DRAWS = ("needed", "all")  # the export's ``fp32_draws``: fp32's rounding draws where the verdict needs them, or all


def fp32_spread(model, torch_side, fp64, fp32, manifest: Manifest, shapes, seed: int, together: bool,
                threads=None, report=None) -> tuple[list[float], int]:
    """Per case, the largest error against ``fp64`` of PyTorch's fp32 forward over the evaluations that differ from
    the reference only in rounding: the attention kernel (sdpa and eager, where the model takes both) and, for a
    decoder-only model, the cases batched and alone (other GEMM shapes); and how many evaluations that was.  One
    fp32 evaluation is one draw of its rounding: on the real SmolLM2-135M's amplifying case (batch 2 x beams 3)
    eight such evaluations erred from 8.3e-5 to 3.7e-4 on one machine (9.0e-4 on another), and the one the export
    happened to run set a bar that refused correct graphs (``exporter/verification/fp32_noise.py``).  Run where
    ``LaterDraws.relevant`` (the tests' tiny Llama, GPT-2 and T5: not).  ``report(side, done, total)``, if given,
    once per evaluation (the export's line per side: a 1B+ model's draws take as long as its fp32 and fp64
    references together)."""
    from elx.exporter.verification.fp32_noise import attention_as, other_attention, per_layer_threads

    first = measure(fp64, fp32, manifest, shapes, seed)
    worst = [e["max_abs_logits_diff"] for e in first["shapes"]]
    evaluations = [(None, False)] if together else []
    alternative = other_attention(model)
    if alternative is not None:
        evaluations += [(alternative, True), (alternative, False)] if together else [(alternative, False)]
    for k, (attention, batched) in enumerate(evaluations, 1):
        with attention_as(model, attention), per_layer_threads(model, threads if batched else None):
            side = RecordedSide(torch_side, manifest, shapes, [seed], together=batched, threads=threads)
        if report is not None:
            how = f"{attention + ' attention' if attention else 'its attention'}, {'batched' if batched else 'case by case'}"
            report(f"PyTorch fp32 rounding draw {k + 1} of {len(evaluations) + 1} ({how})", len(shapes), len(shapes))
        found = measure(fp64, side, manifest, shapes, seed)["shapes"]
        worst = [max(a, b["max_abs_logits_diff"]) for a, b in zip(worst, found)]
    return worst, len(evaluations) + 1


def verify_export(model, manifest: Manifest, shapes=None, seed: int = 0, release_model=None, report=None,
                  references=None, threads=None, reload_model=None) -> dict:
    """The exported graphs (through the runtime) against HF's PyTorch forward, each case held to the bar its own
    fp32 error sets (``exporter/verification/fp32_noise.py``): PyTorch fp32 and fp64 run the same cases first
    (``torch_references``; or ``references``, the pair it returned earlier for the same manifest, shapes and
    seed), then the graphs.  The report adds ``fp32_noise``: per case, PyTorch fp32 vs fp64 and the graphs vs
    fp64.  ``release_model()``, if given, runs between the two (the export frees HF's model there, so that it and
    the graphs' sessions are never in memory together); ``report(side, done, total)``, if given, after each case
    a side runs (the export's progress).

    ``reload_model()``, if given, returns the same model again: fp32's other rounding draws then run only where a
    case of the graphs is outside its first-draw bar (``LaterDraws``: the same verdict), on the reloaded model;
    without it they run before the model is released."""
    shapes = shapes or default_shapes(manifest)
    fp32, fp64 = references or torch_references(model, manifest, shapes, seed, report, threads,
                                                draws="needed" if reload_model is not None else "all")
    if fp32.later is not None and reload_model is None:  # no way back to the model once it is released
        fp32.later.run(model, fp64, fp32, threads, report)
    if release_model is not None:
        model = None
        release_model()
    graphs = RecordedSide(RuntimeSide(manifest), manifest, shapes, [seed],
                          _side_progress(report, "graphs"))  # sessions released
    verdict = _judged(fp32, fp64, graphs, manifest, shapes, seed)
    if fp32.later is not None:
        if verdict["within"]:
            fp32.draws = {"run": 1, "skipped": True,
                          "why": "the graphs are within the first draw's bar on every case; the other draws can only "
                                 "widen bars (LaterDraws)"}
            fp32.later = None
        else:
            model = reload_model()
            try:
                fp32.later.run(model, fp64, fp32, None, report)
            finally:
                free_weights(model)
                model = None
            verdict = _judged(fp32, fp64, graphs, manifest, shapes, seed)
    verdict["fp32_noise"]["draws"] = dict(fp32.draws or {"run": 1})
    return verdict


def _judged(fp32, fp64, graphs, manifest: Manifest, shapes, seed: int) -> dict:
    """The graphs against PyTorch fp32, each case held to ``max(magnitude rule, NOISE_MULTIPLE · e)``, e the largest
    error against fp64 over the fp32 draws measured so far."""
    from elx.exporter.verification.fp32_noise import NOISE_MULTIPLE, NOISE_RULE, case_bars

    noise = measure(fp64, fp32, manifest, shapes, seed)
    for entry, worst in zip(noise["shapes"], fp32.spread or ()):  # several draws of fp32's rounding
        entry["max_abs_logits_diff"] = max(entry["max_abs_logits_diff"], worst)
    noise["max_abs_logits_diff"] = max((e["max_abs_logits_diff"] for e in noise["shapes"]), default=0.0)
    against_fp64 = measure(fp64, graphs, manifest, shapes, seed)
    report = measure(fp32, graphs, manifest, shapes, seed, bars=case_bars(noise, noise["tolerance"]))
    for entry, e, g in zip(report["shapes"], noise["shapes"], against_fp64["shapes"]):
        entry["torch_fp32_vs_fp64"], entry["graphs_vs_fp64"] = e["max_abs_logits_diff"], g["max_abs_logits_diff"]
    report["fp32_noise"] = {"rule": NOISE_RULE, "multiple": NOISE_MULTIPLE,
                            "max_torch_fp32_vs_fp64": noise["max_abs_logits_diff"],
                            "max_graphs_vs_fp64": against_fp64["max_abs_logits_diff"]}
    if noise.get("max_abs_encoder_diff") is not None:  # the encoder's own (``tolerance_record``: ``encoder_atol``)
        report["fp32_noise"]["max_torch_fp32_vs_fp64_encoder"] = noise["max_abs_encoder_diff"]
    if report.get("max_abs_encoder_diff") is not None:  # the encoder judged by its own fp32 error, as the logits
        judge_encoder(report, encoder_bar(report["tolerance"], noise.get("max_abs_encoder_diff")))
    return report


def verify_rewrite(before: Manifest, after: Manifest, shapes=None, seed: int = 0, past_from=None, expect=None,
                   no_repeat_ngram_size: int = 0, reference: RuntimeSide | None = None, sides=None,
                   with_encoder: bool = True) -> dict:
    """The graphs after a pass against the graphs before it (``reference`` reuses loaded sessions; ``sides``, a
    ``CandidateSides``, loads ``after``'s once for all the seeds it is verified at).  The bar is at least the
    export's own (``logits_tolerance(before)``: on a deep model, widened by fp32's measured error); the encoder
    output's at least the export's encoder bar (``encoder_tolerance(before)``; ``with_encoder=False``: recorded,
    not judged, for graphs in another precision).

    Without a loaded ``reference`` (and no ``past_from``, which rewrites each case's past as it runs), ``before``'s
    results are recorded and its sessions released before ``after``'s load (``RecordedSide``): the two sets of
    sessions side by side were the peak of an export with passes (the real SmolLM2-135M with
    ``--pass fused-attention,fused-norm``: above the export's memory bound)."""
    shapes = shapes or default_shapes(before)
    if reference is None:
        reference = RuntimeSide(before)
        if past_from is None:
            reference = RecordedSide(reference, before, shapes, [seed])
    side = sides(after) if sides is not None else RuntimeSide(after, no_repeat_ngram_size)
    return measure(reference, side, before, shapes, seed, past_from, expect, floor=logits_tolerance(before),
                   encoder_floor=encoder_tolerance(before) if with_encoder else None)


class CandidateSides:
    """The runtime side of the candidate being verified, loaded once for every seed it is verified at (a side per
    seed loaded a 1.7B candidate's two sessions three times: 5 minutes a layer probe); the previous candidate's
    sessions are released before the next one loads, and all of them by ``release`` (or leaving a ``with``)."""

    def __init__(self, **options):
        self.options, self._manifest, self._side = options, None, None

    def __call__(self, manifest: Manifest) -> RuntimeSide:
        if self._manifest is not manifest:
            self.release()
            self._side, self._manifest = RuntimeSide(manifest, **self.options), manifest
        return self._side

    def release(self) -> None:
        self._side = self._manifest = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def worst_report(reports: list) -> dict:
    """One report from several runs (e.g. at several seeds): the numbers (and tolerance) of the one nearest its
    tolerance, every shape listed.  NaN is worst."""
    worst = max(reports, key=closeness)
    merged = {**worst, "within": all(r.get("within", True) for r in reports),
              "shapes": [s for r in reports for s in r["shapes"]]}
    judged = [r for r in reports if "encoder_tolerance" in r]
    if judged:  # the encoder's numbers from the run nearest its encoder bar (NaN nearest)
        nearest = max(judged, key=lambda r: r["max_abs_encoder_diff"] / r["encoder_tolerance"]
                      if np.isfinite(r["max_abs_encoder_diff"]) else np.inf)
        merged.update({k: nearest[k] for k in ("max_abs_encoder_diff", "encoder_tolerance", "encoder_within")})
    return merged


def skipped_draws_hint(manifest: Manifest) -> str:
    """For a refusal measured against ``manifest``'s bars: what to do where its export skipped fp32's other rounding
    draws (``LaterDraws``: its bars are the first draw's, which the other draws could have widened); else ""."""
    draws = manifest.data.get("verification", {}).get("tolerance", {}).get("fp32_noise", {}).get("draws", {})
    if not draws.get("skipped"):
        return ""
    return ("; this folder's bars are fp32's first rounding draw's (its export needed no other): export again with "
            "--fp32-draws all, or with this pass, for bars from all of them")


def require_within_tolerance(report: dict, what: str) -> None:
    """Every case of the report within its bar (``measure``); the message names the case nearest its bar."""
    within = report.get("within", report["max_abs_logits_diff"] <= report["tolerance"])
    if within and report["max_abs_logits_diff"] <= report["tolerance"]:  # the second test also catches NaN
        return
    if not report.get("encoder_within", True) and report["max_abs_logits_diff"] <= report["tolerance"] and \
            all(e["max_abs_logits_diff"] <= e.get("tolerance", report["tolerance"]) for e in report["shapes"]):
        noise = report.get("fp32_noise", {}).get("max_torch_fp32_vs_fp64_encoder")
        because = f"; PyTorch's own fp32 encoder error is {noise:.3g}" if noise is not None else ""
        raise ElxError(f"{what}: the encoder output's max abs diff {report['max_abs_encoder_diff']:.3g} exceeds "
                       f"{report['encoder_tolerance']:.3g} (its fp32 tolerance{because}) although the logits are "
                       "within theirs; nothing was written (report this model and pass)")
    shapes = [e for e in report["shapes"] if "tolerance" in e] or [dict(report)]
    worst = max(shapes, key=lambda e: e["max_abs_logits_diff"] / e["tolerance"] if e["tolerance"] > 0 and
                np.isfinite(e["max_abs_logits_diff"]) else np.inf)
    noise = worst.get("torch_fp32_vs_fp64")
    because = (f"; PyTorch's own fp32 error on that case is {noise:.3g}" if noise is not None else "")
    raise ElxError(f"{what}: max abs logits diff {worst['max_abs_logits_diff']:.3g} exceeds {worst['tolerance']:.3g} "
                   f"(the fp32 tolerance at max |logit| {report['logits_magnitude']:.3g}{because}); nothing was "
                   "written (report this model and pass)")
