"""How an int8 export is verified: what it changes is measured against HF fp32 and recorded, then held to it.

int8 weights (``exporter/precision/int8.py``) change the logits by far more than fp32's 1e-4, and greedy or
beam search then picks another token wherever two candidates are closer than that: no tolerance derived from
rounding says which sequences stay HF's.  So the export measures, and records under ``verification.int8``:

* ``random_inputs``: the teacher-forced max abs logits difference against PyTorch fp32 on the fp32 check's
  seeded random inputs and random decoder tokens (``exporter/verification/verify.py``'s shapes), each side filling its
  own cache from the case's prefix tokens (as the fp16 checks do: a slim export's K-only cache cannot take
  the fp32 check's random past), and max |logit|;
* per search (``greedy``: 1 beam, ``beam4``: 4 beams) on a seeded draw (``DRAW``: random inputs, HF
  ``generate`` in PyTorch fp32 with the model's generation defaults and ``max_new_tokens``), teacher-forced
  along HF's own tokens (``exporter/verification/compare.py``): the max abs logits difference, the top-1 agreement
  (the share of (row, step) pairs where the export's highest-scoring token is HF's) overall and per step,
  and the share of returned sequences identical to HF's.

``exporter/precision/int8_export.py`` (``record``) measures them at export.  ``elx compare`` on an int8 export
(``judge``) reports its run against those figures and fails only where the
export does worse than recorded:

* **on the recorded draw** (same seed, batch size, input length, beams and ``max_new_tokens``): the figures are
  reproducible, so fewer identical sequences or fewer top-1 agreements than recorded fail;
* **on another draw**: sequences and top-1 pairs are counts from a finite draw, so each is held to the recorded
  share with a one-sided binomial test: it fails when a count this low has probability below ``ALPHA`` under
  the recorded share;
* **logits, either draw**: the teacher-forced max abs difference may reach ``LOGITS_MARGIN`` × the largest
  recorded one (``logits_bound``, compare's ``atol``): another draw of inputs, or another thread count moving a
  per-tensor activation scale by one rounding, changes it by a small factor; a corrupted export by orders of
  magnitude.

The fp32 tolerance is never applied to an int8 export.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from elx.runners.manifest import Manifest

DRAW = {"seed": 0, "batch_size": 8, "input_length": 32, "max_new_tokens": 16}
SEARCHES = {"greedy": 1, "beam4": 4}
ALPHA = 0.01
LOGITS_MARGIN = 2.0


def search_name(num_beams: int) -> str:
    """The recorded search a run is judged against: greedy for 1 beam, beam4 for any beam search."""
    return "greedy" if num_beams == 1 else "beam4"


def summarize(report) -> dict:
    """The recorded figures of one ``elx.exporter.verification.compare.CompareReport``."""
    rows = report.rows
    top1 = np.array([s for r in rows for s in r.step_top1], dtype=bool)
    steps = max((len(r.step_top1) for r in rows), default=0)
    per_step = [float(np.mean([r.step_top1[s] for r in rows if len(r.step_top1) > s])) for s in range(steps)]
    diffs = [d for r in rows for d in r.step_logits_diff]
    identical = sum(r.identical for r in rows)
    return {"rows": len(rows), "rows_identical": identical, "identical_share": identical / max(len(rows), 1),
            "top1_pairs": int(top1.size), "top1_agree": int(top1.sum()),
            "top1_agreement": float(top1.mean()) if top1.size else 1.0, "top1_agreement_per_step": per_step,
            "max_abs_logits_diff": max(diffs, default=0.0),
            "first_divergence": [r.first_divergence for r in rows if not r.identical]}


def random_inputs_error(torch_model, manifest: Manifest, reference=None, packed: bool = False,
                        packed_graphs=()) -> dict:
    """The teacher-forced logits error of ``manifest``'s graphs against PyTorch fp32 on the seeded random cases
    (prefix-filled caches; ``reference``: the PyTorch side, when the caller has built it; ``packed``: on the
    prepacked sessions the runtime runs; ``packed_graphs``: those graphs prepacked over the shared mapping,
    ``RuntimeSide``)."""
    from elx.exporter.precision.decoder_only import torch_side
    from elx.exporter.verification.verify import RuntimeSide, default_shapes, measure

    reference = reference or torch_side(torch_model, manifest)
    side = RuntimeSide(manifest, prefill=True, packed=packed, packed_graphs=packed_graphs)
    found = measure(reference, side, manifest, default_shapes(manifest))
    found.pop("tolerance", None)  # the fp32 tolerance does not apply here
    found["relative_diff"] = found["max_abs_logits_diff"] / max(found["max_abs_reference"], 1e-30)
    return found


def logits_bound(manifest: Manifest) -> float:
    """``elx compare``'s default ``atol`` for an int8 export: ``LOGITS_MARGIN`` × the largest recorded teacher-forced
    logits difference (random inputs, and along HF's tokens in each search)."""
    found = manifest.data["verification"]["int8"]
    recorded = [found["random_inputs"]["max_abs_logits_diff"],
                *(s["max_abs_logits_diff"] for s in found["searches"].values())]
    return LOGITS_MARGIN * max(recorded)


def binomial_cdf(k: int, n: int, p: float) -> float:
    """P[X ≤ k] for X ~ Binomial(n, p)."""
    if p >= 1.0:
        return 0.0 if k < n else 1.0
    return sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(0, k + 1))


@dataclass
class Agreement:
    """One compare run against the recorded figures of the same search."""

    search: str
    same_draw: bool
    recorded: dict
    measured: dict
    problems: list = field(default_factory=list)

    def lines(self) -> list[str]:
        r, m = self.recorded, self.measured
        where = "the recorded draw" if self.same_draw else "another draw than the recorded one"
        return [f"int8 agreement on {where} (recorded: {r['rows']} rows, {search_label(self.search)}): "
                f"{m['rows_identical']}/{m['rows']} sequences identical to HF fp32 "
                f"({m['identical_share']:.0%}; recorded {r['identical_share']:.0%}), top-1 agreement "
                f"{m['top1_agreement']:.2%} of {m['top1_pairs']} steps (recorded {r['top1_agreement']:.2%})"]


def search_label(name: str) -> str:
    return {"greedy": "greedy", "beam4": "beam 4"}[name]


def judge(manifest: Manifest, report, draw: dict) -> Agreement:
    """``report`` (a compare run of the int8 export) against the recorded figures (see the module doc).
    ``draw``: the run's seed, batch_size, input_length, max_new_tokens and num_beams (None where the caller
    passed its own inputs)."""
    found = manifest.data["verification"]["int8"]
    name = search_name(draw["num_beams"])
    recorded, measured = found["searches"][name], summarize(report)
    same = all(draw.get(k) == v for k, v in found["draw"].items()) and draw["num_beams"] == recorded["num_beams"]
    problems = []
    for what, count, total, share in (
            ("sequences identical to HF fp32", measured["rows_identical"], measured["rows"],
             recorded["identical_share"]),
            ("top-1 agreement along HF's tokens", measured["top1_agree"], measured["top1_pairs"],
             recorded["top1_agreement"])):
        if same:
            worse = count < round(share * total)
        else:
            worse = total > 0 and binomial_cdf(count, total, share) < ALPHA
        if worse:
            how = ("below the recorded figure on the same draw" if same else
                   f"improbably low under the recorded {share:.2%} (binomial P < {ALPHA})")
            problems.append(f"{what}: {count}/{total}, {how}: the int8 export does worse than it recorded")
    return Agreement(name, same, recorded, measured, problems)
