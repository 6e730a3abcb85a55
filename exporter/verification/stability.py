"""Is HF's own answer for a row stable?  The one rule that tells a bug from a fragile row, used by
``elx compare`` (``exporter/verification/compare.py``) and the differential test (``tests/differential.py``, which runs
``compare_loaded``).

On peaked models HF's answer can hinge on a near-tie: it moves when its logits move by an export's own
rounding error, or between HF's own configurations, or between a padded batch and the input alone.  A row
where elx differs from HF ``generate`` then proves nothing either way.  A differing row counts as a
failure only where HF's answer is **stable**, which takes all three:

1. **HF agrees with itself**: HF ``generate`` gives the row in eager fp32, sdpa fp32 and fp64
   (``HF_VARIANTS``; fp64 with sdpa attention where the family has it: eager fp64 is NaN on the
   Llama family's left-padded rows in transformers 5.24), as in its default attention (the run compared).
2. **Alone = batched**: HF gives the row's tokens for its input run alone (unpadded, a batch of one).
   Decoder-only models: compared up to the shorter row, since HF's ``max_length`` counts a batch's padding.
3. **It survives the export's error**: elx's search fed HF's float64 logits (``exporter/verification/hf_reference.py``)
   gives HF's float64 answer, and still gives it with every logit perturbed by seeded uniform noise in
   [-ε, ε] (``SEEDS`` seeds), where ε is the comparison's measured teacher-forced max abs logits
   difference (elx against PyTorch, capped at the tolerance: an export beyond it fails on its numerics).

A row that misses one of them is **fragile**: reported, not counted.  Where elx's search on HF's
float64 logits gives another answer than HF's float64 ``generate`` (a search bug), the row counts.

**Margin** (rows that differ, where ε > 0): the largest amplitude on the ladder ε·2^j (j = -``LADDER``
… ``LADDER``) under which all ``SEEDS`` seeded perturbations keep the row's answer, found from j = 0 up
while it survives and down while it does not.  A margin ≥ ε is rule 3; a margin of ``2^LADDER``·ε is
reported as "at least", one below ε·2^-``LADDER`` as "below".  It says how far HF's answer is from moving:
a failure with a margin of 16ε is a real difference, a fragile row with a margin of ε/8 a near-tie.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import numpy as np

from elx.exporter.families.catalog import hf_attention_applies
from elx.exporter.verification.hf_reference import cached_search_applies, hf_generate, search_backend

HF_VARIANTS = ("eager-fp32", "sdpa-fp32", "fp64")  # HF configurations whose agreement rule 1 asks for
SEEDS = 3  # seeded perturbations per amplitude
LADDER = 4  # the margin is searched over ε·2^j, |j| <= LADDER


def hf_variant(model, name: str):
    """A copy of ``model`` in one of ``HF_VARIANTS``: attention implementation eager/sdpa in fp32, or fp64 (sdpa
    where the family has it, else eager: in transformers 5.24 eager fp64 gives NaN logits for the left-padded rows
    of the Llama-family decoder-only models, so HF's fp64 answer always differed there and every such row was
    excused as fragile, a real elx error on it included; sdpa fp64 is finite there)."""
    attention, _, precision = name.rpartition("-")
    variant = copy.deepcopy(model)
    if precision == "fp64":
        attention = attention or ("sdpa" if hf_attention_applies(model, "sdpa") else "eager")
        variant = variant.double()
    else:
        variant = variant.float()
    variant.set_attn_implementation(attention)
    if variant.config._attn_implementation != attention:  # pragma: no cover - a model that cannot switch
        raise RuntimeError(f"{type(model).__name__} did not switch to {attention} attention")
    return variant.eval()


class HfVariants:
    """HF ``generate`` in each of ``HF_VARIANTS`` (copies of one model, built on first use and kept)."""

    def __init__(self, model):
        self.model = model
        self._models = {}

    def get(self, name: str):
        if name not in self._models:
            self._models[name] = hf_variant(self.model, name)
        return self._models[name]

    def generate(self, inputs: dict, options: dict) -> dict:
        """Each variant HF can run the model in (FSMT's own attention has no sdpa form)."""
        return {name: hf_generate(self.get(name), inputs, options) for name in HF_VARIANTS
                if name == "fp64" or hf_attention_applies(self.model, name.rpartition("-")[0])}


def same_row(a, b, fill: int) -> bool:
    """Equal tokens, where one row may be longer only by ``fill`` padding (the batch's width depends on other rows)."""
    a, b = np.asarray(a), np.asarray(b)
    n = min(len(a), len(b))
    if not np.array_equal(a[:n], b[:n]):
        return False
    return bool(np.all(a[n:] == fill) and np.all(b[n:] == fill))


@dataclass
class RowStability:
    """Why a differing row's HF answer is stable or fragile (the module docstring's rules)."""

    variant_tokens: dict  # HF_VARIANTS name -> that configuration's tokens for the row
    variants_agree: bool
    alone_tokens: list
    alone_agrees: bool
    epsilon: float  # the perturbation amplitude of rule 3
    search_agrees: bool | None = None  # elx's search on HF's float64 logits = HF fp64 generate (None: not run)
    survives: bool | None = None  # rule 3 (None: ε = 0, nothing to perturb)
    margin: float | None = None  # the largest surviving amplitude on the ladder (0.0: none survived)
    margin_bound: str = ""  # ">=": the ladder's top survived; "<": its bottom did not
    reasons: list = field(default_factory=list)  # what makes it fragile, one phrase each

    @property
    def stable(self) -> bool:
        return self.search_agrees is False or not self.reasons

    def margin_text(self) -> str:
        if self.margin is None:
            return "margin not measured (ε = 0)"
        if self.margin_bound == "<":
            return f"margin < {self.epsilon * 2.0 ** -LADDER:.1e} ({_in_eps(2.0 ** -LADDER)})"
        bound = ">= " if self.margin_bound == ">=" else ""
        return f"margin {bound}{self.margin:.1e} ({_in_eps(self.margin / self.epsilon)})"


def _in_eps(ratio: float) -> str:
    if ratio >= 1:
        return f"{ratio:g}ε"
    return f"ε/{1 / ratio:g}"


def epsilon_of(max_logits_diff: float, atol: float) -> float:
    """Rule 3's amplitude: the measured teacher-forced error, at most the tolerance (NaN: the tolerance)."""
    return atol if math.isnan(max_logits_diff) else min(max_logits_diff, atol)


def _alone(inputs: dict, item: int) -> tuple[dict, int]:
    """Item ``item``'s inputs on their own, without padding, and how many padding positions it had."""
    mask = inputs.get("attention_mask")
    if mask is None or "input_ids" not in inputs:
        return {role: value[item: item + 1] for role, value in inputs.items()}, 0
    keep = np.asarray(mask[item]) == 1
    return ({"input_ids": inputs["input_ids"][item][keep][None, :],
             "attention_mask": np.ones((1, int(keep.sum())), dtype=np.asarray(mask).dtype)},
            int((~keep).sum()))


def _without_fill(row, fill: int) -> np.ndarray:
    row = np.asarray(row)
    end = len(row)
    while end and row[end - 1] == fill:
        end -= 1
    return row[:end]


def _alone_same(batched, alone, fill: int, padding: int, left_padded: bool) -> bool:
    """The row of the batch and the row of the input alone hold the same tokens (padding aside)."""
    if not left_padded:
        return same_row(batched, alone, fill)
    batched, alone = _without_fill(np.asarray(batched)[padding:], fill), _without_fill(alone, fill)
    n = min(len(batched), len(alone))  # HF's max_length counts the batch's left padding
    return bool(np.array_equal(batched[:n], alone[:n]))


def check_rows(generator, variants: HfVariants, inputs: dict, hf: np.ndarray, hf_options: dict, settings,
               rows: list, epsilon: float) -> dict:
    """``RowStability`` of each row in ``rows`` (rows of HF's output ``hf`` on ``inputs`` where elx differs)."""
    rules = generator.rules
    fill = rules.output_fill(settings)
    per_item = rules.rows_per_input(settings)
    outputs = variants.generate(inputs, hf_options)
    out = {}
    alone_runs = {}
    for r in rows:
        item = r // per_item
        if item not in alone_runs:
            single, padding = _alone(inputs, item)
            alone_runs[item] = (hf_generate(variants.model, single, hf_options), padding)
        alone, padding = alone_runs[item]
        tokens = {name: seqs[r].tolist() if r < seqs.shape[0] else [] for name, seqs in outputs.items()}
        alone_row = alone[r - item * per_item].tolist()
        stability = RowStability(tokens, all(same_row(hf[r], t, fill) for t in tokens.values()), alone_row,
                                 _alone_same(hf[r], alone_row, fill, padding, rules.padding_side == "left"),
                                 epsilon)
        if not stability.variants_agree:
            disagree = [name for name, t in tokens.items() if not same_row(hf[r], t, fill)]
            stability.reasons.append(f"HF's own {', '.join(disagree)} differ")
        if not stability.alone_agrees:
            stability.reasons.append("HF gives the input alone other tokens")
        out[r] = stability
    _perturb(generator, variants, inputs, hf_options, settings, out, epsilon, fill)
    return out


def _perturb(generator, variants, inputs, hf_options, settings, found: dict, epsilon: float, fill: int) -> None:
    """Rule 3 and the margin: elx's search on HF's float64 logits, unperturbed (against HF's float64 ``generate``
    computing the same logits: on HF's cache for decoder-only models, ``HfDecoderOnlyCachedBackend``; without a
    cache for encoder-decoder ones), then on the ladder."""
    from elx.runners.generate import Generator

    model = variants.get("fp64")
    cached = cached_search_applies(generator.manifest)
    hf64 = hf_generate(model, inputs, dict(hf_options, use_cache=cached))

    def run(amplitude: float, seed: int) -> np.ndarray:
        backend = search_backend(model, generator.manifest, (amplitude, seed) if amplitude else None, cached=cached)
        return Generator(backend).generate(inputs, settings=settings).sequences

    reference = run(0.0, 0)
    for r, stability in found.items():
        stability.search_agrees = r < reference.shape[0] and same_row(reference[r], hf64[r], fill)
    if epsilon <= 0:
        return

    def surviving(j: int, candidates: set) -> set:
        for seed in range(SEEDS):
            if not candidates:
                break
            out = run(epsilon * 2.0 ** j, seed)
            candidates = {r for r in candidates if r < out.shape[0] and same_row(reference[r], out[r], fill)}
        return candidates

    at_eps = surviving(0, set(found))
    for r, stability in found.items():
        stability.survives = r in at_eps
        if not stability.survives:
            stability.reasons.append(f"HF's float64 answer moves under logits perturbations of ±ε = {epsilon:.1e}")
    _climb(found, at_eps, epsilon, surviving, up=True)
    _climb(found, set(found) - at_eps, epsilon, surviving, up=False)


def _climb(found: dict, rows: set, epsilon: float, surviving, up: bool) -> None:
    """Margins of ``rows``: up the ladder from ε while they survive, or down from ε/2 until they do."""
    pending = set(rows)
    for r in pending:
        found[r].margin = epsilon if up else 0.0
    for step in range(1, LADDER + 1):
        if not pending:
            return
        j = step if up else -step
        kept = surviving(j, pending)
        for r in kept:
            found[r].margin = epsilon * 2.0 ** j
        pending = kept if up else pending - kept
    for r in pending:
        found[r].margin_bound = ">=" if up else "<"
