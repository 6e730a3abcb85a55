"""``elx export --precision fp16``: the verified fp32 export, converted by the fp16 rule, checked, recorded.

Order: export and passes run and verify in fp32 exactly as for an fp32 export (1e-4); then the
folder's graphs are rewritten by ``exporter/precision/fp16.py``'s rule (``convert_folder``), with the
self-attention cache and the per-input state (stage outputs: cross K/V, or the encoder output
that EL reads) stored in fp16 at the graph boundary, logits and user inputs fp32, slim's K-only
entries fp32.  The manifest records every IO dtype (graph inputs/outputs, ``cache.self``), the
``precision`` and, under ``fp16``, the rule's per-graph counts and which boundary tensors are fp16.

Checks (``exporter/precision/fp16_check.py``: tolerance D·u relative to max |logit|, both the ``runtime``
and the ``fp16_arithmetic`` mode, each side filling its own cache from a prefix; refused beyond it):

* the fp16 baseline (the export before any pass, converted) against PyTorch fp32
  (``verification.fp16_baseline``; without passes the baseline is the export: ``verification.fp16``);
* after each pass, the folder converted to fp16 against the fp16 baseline (the pass's record,
  ``fp16.vs_fp16_baseline``): how much a pass changes fp16 results;
* the final fp16 export against PyTorch fp32 (``verification.fp16``).

Decoder-only exports (GPT-2, OPT, the RoPE families) take the same path: the prompt K/V (the prefill's
outputs: the shared prompt state, or the per-beam cache's initial contents) and the cache in fp16, both
scores (the prefill's first-step logits and the step's) fp32; PyTorch's side of the checks runs the
prompt, a prefix and the token in one forward (``exporter/precision/decoder_only.py``).
"""
from __future__ import annotations

import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import onnx

from elx.runners.errors import ElxError
from elx.runners.manifest import Manifest

from elx.exporter.capture.onnx_export import save_model
from elx.exporter.passes.ngram import log_softmax_blocked
from elx.exporter.passes.rewrite import drop_unused_files, pass_file
from elx.exporter.precision.fp16 import boundaries, exact_entries, to_fp16
from elx.exporter.precision.fp16_check import MODES, arithmetic_twin, fp16_depth, judge
from elx.exporter.progress import WEIGHTS, Progress
from elx.exporter.precision.decoder_only import torch_side
from elx.exporter.verification.verify import RuntimeSide, default_shapes, measure

PRECISIONS = ("fp32", "fp16", "int8")  # int8: exporter/precision/int8.py
SUFFIX = "fp16"


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ElxError(f"unknown precision {precision!r}; choose fp32, fp16 or int8")
    return precision


def refuse_fp16(manifest: Manifest, what: str) -> None:
    """Passes and engine builds start from fp32 graphs."""
    precision = manifest.data.get("precision", "fp32")
    if precision != "fp32":
        raise ElxError(f"{manifest.folder} is an {precision} export; {what} from the fp32 export "
                       f"(elx export --precision {precision} converts after the passes)")


def _set_dtypes(specs: dict, names) -> None:
    for name in names:
        specs[name]["dtype"] = "float16"


def convert_folder(manifest: Manifest, target: Path) -> Manifest:
    """Write the fp16 graphs of the export ``manifest`` describes into ``target``; return their manifest."""
    target.mkdir(parents=True, exist_ok=True)
    after = Manifest(manifest.copy().data, target)
    counts, sides = {}, boundaries(manifest)
    for name, boundary in sides.items():
        spec = after.graphs[name]
        for key in ("file", "tensorrt_file"):
            if not spec.get(key):
                continue
            model = onnx.load(str(Path(manifest.folder) / spec[key]))
            model, counts[name] = to_fp16(model, manifest.family, manifest.dims, boundary)
            file = pass_file(spec[key], SUFFIX)
            extra = save_model(model, target / file)
            spec[key] = file
            if key == "file":
                spec["external_data"] = extra
        _set_dtypes(spec["inputs"], boundary.half_inputs)
        _set_dtypes(spec["outputs"], boundary.half_outputs)
    half_cache = sides[manifest.step].half_inputs
    for entry in after.data["cache"]["self"]:
        if entry["input"] in half_cache:
            entry["dtype"] = "float16"
    after.data["precision"] = "fp16"
    after.data["fp16"] = {
        "rule": "exporter/precision/fp16.py", "check": "exporter/precision/fp16_check.py", "graphs": counts,
        "fp16_io": {name: sorted(b.half_inputs | b.half_outputs) for name, b in sides.items()},
        "fp32_exact": sorted(exact_entries(manifest)),
        "logits": "float32 (HF's searches run in fp32)"}
    return after


def compare(reference: dict, candidate: Manifest, work: Path, what: str, reference_depth: int = 0) -> dict:
    """``candidate`` (fp16) against ``reference`` (mode → side) in both modes, judged by D·u.

    ``work``: where the candidate's ``fp16_arithmetic`` twins are written."""
    report = {}
    for mode in MODES:
        graphs = candidate if mode == "runtime" else arithmetic_twin(candidate, work)
        depth = max(reference_depth, fp16_depth(candidate))
        result = measure(reference[mode], RuntimeSide(graphs, prefill=True), candidate, default_shapes(candidate))
        report[mode] = judge(result, depth, f"{what} ({mode.replace('_', ' ')})")
        blocked = candidate.graphs[candidate.step].get("blocked")
        if blocked:  # the ngram pass: log-softmaxed, blocked scores as well
            n = blocked["ngram_size"]
            result = measure(reference[mode], RuntimeSide(graphs, n, prefill=True), candidate,
                             default_shapes(candidate), expect=log_softmax_blocked(n))
            report[mode]["blocked"] = judge(result, depth, f"{what}, blocked scores ({mode.replace('_', ' ')})")
    return report


@contextmanager
def fp16_checks(precision: str, torch_model, manifest: Manifest, progress: Progress | None = None):
    """``Fp16Export`` for an fp16 export (its temporary files removed afterwards), None for fp32.
    Each conversion and check is a stage of ``progress`` (``exporter/progress.py``)."""
    if precision != "fp16":
        yield None
        return
    work = Path(tempfile.mkdtemp(prefix="elx-fp16-"))
    try:
        yield Fp16Export(torch_model, manifest, work, progress or Progress("elx export", progress="none"))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _summary(report: dict) -> str:
    parts = [f"{mode.replace('_', ' ')} {r['relative_diff']:.2e}" for mode, r in report.items()]
    return (f"relative max abs logits diff {', '.join(parts)} "
            f"(tolerance D·u = {report['fp16_arithmetic']['relative_tolerance']:.2e})")


class Fp16Export:
    """The fp16 side of one export: the fp16 baseline, the per-pass checks, the final conversion."""

    def __init__(self, torch_model, manifest: Manifest, work: Path, progress: Progress):
        self.work, self.progress = work, progress
        with progress.stage("fp16 baseline vs PyTorch", WEIGHTS["fp16"]) as stage:
            reference = torch_side(torch_model, manifest)
            self.torch = {mode: reference for mode in MODES}
            self.baseline = convert_folder(manifest, self.work / "baseline")
            self.baseline_report = compare(self.torch, self.baseline, self.work / "baseline-twin",
                                           "fp16 baseline vs PyTorch")
            stage.detail = _summary(self.baseline_report)
        self.passes, self.reference = 0, None

    def check_pass(self, manifest: Manifest, record: dict) -> None:
        """After a pass (verified in fp32): its folder in fp16 against the fp16 baseline, into the record."""
        self.passes += 1
        work = self.work / f"pass{self.passes}"
        with self.progress.stage(f"pass {record['name']} in fp16 vs the fp16 baseline", WEIGHTS["fp16"]) as stage:
            candidate = convert_folder(manifest, work / "graphs")
            if self.reference is None:
                twin = arithmetic_twin(self.baseline, self.work / "baseline-twin")
                self.reference = {"runtime": RuntimeSide(self.baseline, prefill=True),
                                  "fp16_arithmetic": RuntimeSide(twin, prefill=True)}
            report = compare(self.reference, candidate, work / "twin",
                             f"pass {record['name']} in fp16 vs the fp16 baseline", fp16_depth(self.baseline))
            record["fp16"] = {"vs_fp16_baseline": report}
            stage.detail = _summary(report)
        shutil.rmtree(work, ignore_errors=True)

    def finish(self, folder: Path, manifest: Manifest) -> dict:
        """Convert ``folder`` in place (``manifest`` updated, fp32 graph files removed) and check it."""
        with self.progress.stage("fp16 conversion" + (" and check vs PyTorch" if self.passes else ""),
                                 WEIGHTS["fp16"]) as stage:
            before = manifest.copy()
            after = convert_folder(manifest, Path(folder))
            manifest.data.clear()
            manifest.data.update(after.data)
            drop_unused_files(Path(folder), before, manifest)
            if self.passes:
                final = compare(self.torch, manifest, self.work / "final-twin", "fp16 export vs PyTorch")
                stage.detail = _summary(final)
            else:  # the baseline is the export: same graphs, same check
                final = self.baseline_report
                stage.detail = "the fp16 baseline (checked above)"
        verification = manifest.data["verification"]
        verification["fp16"] = final
        if self.passes:
            verification["fp16_baseline"] = self.baseline_report
        return final
