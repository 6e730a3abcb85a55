"""fp16 engines: the export's fp32 graphs rewritten by the one fp16 rule, checked on ONNX Runtime first.

The rule (what is fp16, what stays fp32, and why) is ``exporter/precision/fp16.py``, shared with
``elx export --precision fp16``.  TensorRT for RTX builds only strongly typed networks (every layer
computes in the type of its tensors; there is no "allow fp16" builder flag), and elx builds NVIDIA
TensorRT's networks the same way, so an fp16 engine is an fp32 graph with the rule's parts rewritten
to fp16.  Engines keep every graph input and output fp32 (the engines' IO match the manifest): only
the rule's weight MatMuls change, with slim's keys exact (``Boundary.exact_outputs``).

Verification (``verify``): the converted graphs' fp16-arithmetic twins against the fp32 graphs on
ONNX Runtime (CPU), max abs step output difference relative to the largest |output|; refused above
D·u (``exporter/precision/fp16_check.py`` states and derives it) or on any inf/nan the fp32 graphs do not
have.  The per-reason counts and the measured error go into the manifest's ``engines.fp16``.
"""
from __future__ import annotations

from pathlib import Path

import onnx

from elx.runners.manifest import Manifest

from elx.exporter.capture.onnx_export import save_model
from elx.exporter.precision.fp16 import Boundary, boundaries, to_fp16
from elx.exporter.precision.fp16_check import arithmetic_twin, fp16_depth, judge
from elx.exporter.tensorrt.verify import with_files
from elx.exporter.verification.verify import verify_rewrite


def convert(manifest: Manifest, sources: dict[str, Path], folder: Path) -> tuple[dict[str, Path], dict]:
    """fp16 versions of the ONNX files ``sources`` (graph → path) in ``folder``, with counts per graph."""
    out, counts, sides = {}, {}, boundaries(manifest)
    for graph, source in sources.items():
        model = onnx.load(str(source))
        model, counts[graph] = to_fp16(model, manifest.family, manifest.dims,
                                       Boundary(exact_outputs=sides[graph].exact_outputs))
        folder.mkdir(parents=True, exist_ok=True)
        out[graph] = folder / f"{Path(source).stem}.fp16.onnx"
        save_model(model, out[graph])
    return out, counts


def verify(manifest: Manifest, converted: dict[str, Path]) -> dict:
    """fp16 graphs (``converted``: graph → ORT-runnable file) against the export's fp32 ones."""
    fp16 = with_files(manifest, converted)
    twin = arithmetic_twin(fp16, Path(next(iter(converted.values()))).parent / "emulated")
    measured = verify_rewrite(manifest, twin, with_encoder=False)  # fp16: judged by ``judge``'s own rule
    report = judge(measured, fp16_depth(fp16), "fp16 engines (checked on ONNX Runtime)")
    return {"max_abs_logits_diff": report["max_abs_logits_diff"], "max_abs_logits": report["max_abs_reference"],
            "relative_diff": report["relative_diff"], "relative_tolerance": report["relative_tolerance"],
            "fp16_depth": report["fp16_depth"], "arithmetic": "fp16 MatMuls emulated on ONNX Runtime's CPU EP"}
