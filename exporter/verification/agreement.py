"""Token agreement of an export with HF ``generate`` in PyTorch fp32, over seeded batches (``elx compare`` per seed).

An fp16 export is not expected to return HF's fp32 tokens everywhere: where two candidates' scores
are closer than fp16's rounding, the choice can flip and the rest of the sequence follows.  This
module measures how often and how early, for ``tools/measure_fp16.py`` and the tests:

* ``rows_identical`` / ``rows``: returned sequences equal to HF's token for token (the agreement rate);
* ``first_divergence``: per differing row, the generated step (0 = first generated token) where it first
  differs, with mean, median and min; ``max_step_logits_diff``: the largest teacher-forced logits difference.

``arithmetic="fp16"`` measures the export's fp16-arithmetic twin (``exporter/precision/fp16_check.py``:
every fp16 MatMul rounds its inputs and result as a GPU does) instead of the graphs as the CPU EP runs them.
"""
from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from elx.runners.manifest import Manifest

from elx.exporter.verification.compare import compare
from elx.exporter.precision.fp16_check import arithmetic_twin


def twin_folder(folder, work: Path) -> Path:
    """A folder whose manifest runs ``folder``'s fp16-arithmetic twins (written inside it, named relative to it)."""
    work = Path(work).absolute()
    twin = arithmetic_twin(Manifest.load(folder), work / "graphs")
    for spec in twin.graphs.values():
        spec["file"] = str(Path(spec["file"]).relative_to(work))
    twin.folder = work
    twin.data["has_tokenizer"] = False
    twin.save(work)
    return Path(work)


def _stats(values: list) -> dict:
    if not values:
        return {"mean": None, "median": None, "min": None}
    return {"mean": statistics.fmean(values), "median": statistics.median(values), "min": min(values)}


def token_agreement(folder, seeds=range(4), batch_size: int = 4, input_length: int = 32, arithmetic: str = "runtime",
                    inputs: dict | None = None, **options) -> dict:
    """Agreement of ``folder``'s tokens with HF fp32's over ``seeds`` (one batch of random inputs each), or on
    the one batch ``inputs`` (encoder inputs by role, e.g. log-mel features of real speech)."""
    seeds = [None] if inputs is not None else list(seeds)
    with tempfile.TemporaryDirectory(prefix="elx-agreement-") as work:
        target = twin_folder(folder, Path(work)) if arithmetic == "fp16" else folder
        rows, identical, divergence, worst = 0, 0, [], 0.0
        for seed in seeds:
            report = compare(target, batch_size=batch_size, input_length=input_length, seed=seed or 0, inputs=inputs,
                             **options)
            for row in report.rows:
                rows += 1
                identical += row.identical
                if not row.identical and row.first_divergence is not None:
                    divergence.append(row.first_divergence)
                worst = max([worst, *row.step_logits_diff])
    return {"rows": rows, "rows_identical": identical, "agreement": identical / rows if rows else None,
            "first_divergence": {"steps": divergence, **_stats(divergence)}, "max_step_logits_diff": worst,
            "arithmetic": arithmetic, "seeds": seeds, "batch_size": batch_size, "input_length": input_length,
            "options": options}
