"""How fp16 graphs are checked: the tolerance, and fp16 arithmetic made explicit for ONNX Runtime's CPU EP.

**What the CPU EP computes.**  It has no fp16 MatMul kernel: it inserts casts and runs the MatMul
in fp32, and its optimizer then drops those casts together with the rule's own Cast-to-fp16 of the
activation and the Cast-to-fp32 of the result (``InsertedPrecisionFreeCast``).  An fp16 graph on the
CPU EP therefore computes with fp16-rounded weights and fp16-stored boundary tensors, but fp32
activations: less rounding than a GPU does.  So every fp16 check is measured twice:

* ``runtime``: the graphs as ONNX Runtime runs them here (what ``elx generate`` computes on a CPU);
* ``fp16_arithmetic``: twins (``emulate``) in which every fp16 MatMul is written out as Cast the
  fp16 activation and weight to fp32 → fp32 MatMul → Cast the result to fp16, explicit casts that
  ONNX Runtime keeps: fp16 inputs, fp16 weights, fp32 accumulation, fp16 result, the arithmetic of a
  GPU fp16 GEMM (up to summation order).  This is the stricter number and the one a GPU should see.

**Tolerance** (both modes; refused above it).  Unit roundoff of fp16: u = 2^-11 (11-bit significand,
round to nearest).  One fp16 MatMul stage rounds its input, its weights and its result, each with a
relative error uniform in [-u, u] (standard deviation u/√3); with fp32 accumulation and unstructured
signs, the three add in quadrature to a relative error of about u of the stage's output
(√(2/3)·u from the products, u/√3 from the result).  Between stages everything is fp32 (residuals,
norms, softmax), so the error of the logits is the accumulation of the stages along the deepest
path: about u·√D when the D stages' errors are independent, at most about u·D when they add up
coherently.  The check allows the coherent case:

    max |logits_fp16 − logits_reference|  ≤  D · u · max |logits_reference|

with D = the number of fp16 MatMuls on the longest path from the inputs to the logits, counted on
the converted graphs (``fp16_depth``: through encoder, cross K/V and decoder; a self-attention cache
input counts at the depth of the output it is fed back from).  The expected error is about √D times
smaller; a result beyond D·u is more than rounding (overflow, a broken rewrite, an amplifying
path such as a slim key in fp16) and is refused.  The fp32 checks (1e-4) are untouched.
"""
from __future__ import annotations

from pathlib import Path

import onnx
from onnx import TensorProto, helper

from elx.runners.errors import ElxError
from elx.runners.manifest import Manifest

from elx.exporter.capture.onnx_export import save_model
from elx.exporter.precision.fp16 import half_weight_names
from elx.exporter.tensorrt.verify import with_files

UNIT_ROUNDOFF = 2.0 ** -11
MODES = ("runtime", "fp16_arithmetic")


def emulate(model: onnx.ModelProto) -> onnx.ModelProto:
    """Rewrite in place: each MatMul on an fp16 weight becomes explicit fp32 compute between fp16 roundings."""
    graph = model.graph
    half = half_weight_names(model)
    nodes, widened = [], set()
    for node in graph.node:
        if node.op_type != "MatMul" or node.input[1] not in half:
            nodes.append(node)
            continue
        a, w, out = node.input[0], node.input[1], node.output[0]
        for name in (a, w):
            if name not in widened:  # one Cast per tensor, however many MatMuls read it
                widened.add(name)
                nodes.append(helper.make_node("Cast", [name], [f"{name}/emu32"], f"{name}/emu_widen",
                                              to=TensorProto.FLOAT))
        nodes += [helper.make_node("MatMul", [f"{a}/emu32", f"{w}/emu32"], [f"{out}/emu32"], node.name),
                  helper.make_node("Cast", [f"{out}/emu32"], [out], f"{out}/emu_round", to=TensorProto.FLOAT16)]
    del graph.node[:]
    graph.node.extend(nodes)
    return model


def arithmetic_twin(manifest: Manifest, work: Path) -> Manifest:
    """``manifest`` with its graphs replaced by their ``emulate`` twins, written into ``work``."""
    work.mkdir(parents=True, exist_ok=True)
    files = {}
    for name in [*manifest.stages, manifest.step]:
        model = emulate(onnx.load(str(manifest.graph_path(name))))
        files[name] = work / f"{name}.emulated.onnx"
        save_model(model, files[name])
    return with_files(manifest, files)


def _longest(model: onnx.ModelProto, start: dict) -> dict:
    half = half_weight_names(model)
    depth = dict(start)
    for node in model.graph.node:
        if node.op_type in ("Shape", "Size"):  # sizes carry no rounding error
            continue
        base = max((depth.get(name, 0) for name in node.input if name), default=0)
        step = 1 if node.op_type == "MatMul" and node.input[1] in half else 0
        for name in node.output:
            depth[name] = base + step
    return {o.name: depth.get(o.name, 0) for o in model.graph.output}


def fp16_depth(manifest: Manifest) -> int:
    """D: fp16 MatMuls on the longest path from the user inputs to the step's scores (see the module doc)."""
    at_source: dict[str, int] = {}
    out = {}
    for name in [*manifest.stages, manifest.step]:
        spec = manifest.graphs[name]
        model = onnx.load(str(manifest.graph_path(name)), load_external_data=False)
        start = {inp: at_source.get(s["from"], 0) for inp, s in spec["inputs"].items()}
        out = _longest(model, start)
        if name == manifest.step:  # a cached entry was made by the same graph one step earlier
            for inp, s in spec["inputs"].items():
                if s["from"].startswith("cache:"):
                    start[inp] = out.get(s["from"].partition(":")[2], 0)
            out = _longest(model, start)
        at_source.update({f"{name}:{o}": d for o, d in out.items()})
    spec = manifest.graphs[manifest.step]
    scores = [spec.get("logits", "logits"), (spec.get("blocked") or {}).get("output")]
    return max(out.get(s, 0) for s in scores if s)


def judge(report: dict, depth: int, what: str) -> dict:
    """Add the relative error and the tolerance D·u to a ``measure`` report; refuse beyond it."""
    diff, scale = report["max_abs_logits_diff"], report["max_abs_reference"]
    tolerance = depth * UNIT_ROUNDOFF
    relative = diff / max(scale, 1e-30)
    report.update(relative_diff=relative, relative_tolerance=tolerance, fp16_depth=depth,
                  unit_roundoff=UNIT_ROUNDOFF)
    report.pop("tolerance", None)  # the fp32 absolute tolerance does not apply here
    if not relative <= tolerance:  # also catches NaN
        raise ElxError(f"{what}: fp16 changes the logits by {diff:.3g} (relative {relative:.3g} > D·u = "
                       f"{depth}·2^-11 = {tolerance:.3g}); nothing was written (use --precision fp32)")
    return report
