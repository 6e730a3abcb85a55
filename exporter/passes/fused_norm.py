"""``--pass fused-norm``: each RMSNorm as one ONNX Runtime kernel, the residual Add before it inside the kernel.

**Math.** RMSNorm (Llama family, T5) is y = g · x / sqrt(mean(x²) + ε) over the hidden axis.  Traced, it is seven
nodes (``Pow(x, 2)``, ``ReduceMean``, ``Add(ε)``, ``Sqrt``, ``Reciprocal``, ``Mul(x, ·)``, ``Mul(g, ·)``), and the
residual sum x = a + b that feeds it one more: at one token a step those are ~8 kernel launches of a few hundred
floats each, 61 times in SmolLM2-135M's step graph.  ONNX Runtime computes the same in one kernel:
``SimplifiedLayerNormalization(x, g)`` (ε as an attribute, the mean of squares accumulated in fp32 as traced), and
``com.microsoft.SkipSimplifiedLayerNormalization(a, b, g)`` where x = a + b is a residual sum of two same-shape
tensors: its fourth output is a + b itself, read by whatever read the Add (the next residual).  ONNX Runtime's own
graph optimizer does not fuse the traced form (it looks for ``Div``; the export writes ``Reciprocal`` and ``Mul``).

**Pattern** (from each ``Pow`` whose exponent is the constant 2): each node above read by the next alone, the
``ReduceMean`` over the last axis only, ε a scalar constant, the first ``Mul`` reading the same x as the ``Pow``.
The skip form where x is an ``Add`` of two non-constant tensors whose shapes the graph declares equal (rank 2 or 3,
the kernel's rule); otherwise the plain form.  Every graph of the export is rewritten (prefill, step, encoder,
decoder); a graph without RMSNorm stays as it is, and an export with none at all is refused in one line.

**Exactness.** The kernel computes the same sum of squares, ε, square root and products in fp32, in its own order:
the rewritten graphs are verified against the traced ones on the export's random cases like every pass, within the
export's fp32 tolerance (recorded).  fp32 graphs only: an fp16 export's RMSNorms run in fp32 between two Casts (HF's
``to(float32)``), a form not matched (refused: no RMSNorm found).  TensorRT has no such layer (engine builds refuse
the export); ONNX Runtime's CPU and CUDA providers have both kernels.

**Measured** (real SmolLM2-135M-Instruct, ``docs/measurements/real_smollm2_2026-11-30.md``): 61 norms in each of the
prefill and step graphs (60 with their residual Add); with ``--pass fused-attention`` (its cache in place) the step
graph 806 -> 383 nodes after ONNX Runtime's fusions, and greedy batch 1 (128 new tokens) 4.12 -> 3.78 s, 1.09x
(eight alternating rounds in one process); the rewritten graphs 2.7e-4 from the traced ones on the verification's
cases (tolerance 1.45e-3).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from elx.runners.errors import ElxError
from elx.runners.manifest import Manifest

from elx.exporter.passes import catalog
from elx.exporter.passes.rewrite import commit, constant_value, load_graph, pass_file, producer, refuse_twice, \
    save_graph, scalar_value

SPEC = catalog.FUSED_NORM
NAME, parse_argument = SPEC.name, SPEC.parse
DOMAIN = "com.microsoft"


def _next(tensor, op: str) -> gs.Node | None:
    """The one node reading ``tensor``, where it is an ``op``."""
    readers = tensor.outputs
    return readers[0] if len(readers) == 1 and readers[0].op == op else None


def _last_axis_only(mean: gs.Node, rank: int | None) -> bool:
    axes = mean.attrs.get("axes")
    if axes is None and len(mean.inputs) > 1:
        axes = constant_value(mean.inputs[1])
    if axes is None or int(mean.attrs.get("keepdims", 1)) != 1:
        return False
    axes = [int(a) for a in np.asarray(axes).reshape(-1)]
    return len(axes) == 1 and (axes[0] == -1 or (rank is not None and axes[0] == rank - 1))


def find_norm(power: gs.Node):
    """The RMSNorm starting at ``power`` (see the module doc): (x, ε, g, y, its nodes), else None."""
    if scalar_value(power.inputs[1]) != 2.0:
        return None
    x = power.inputs[0]
    mean = _next(power.outputs[0], "ReduceMean")
    shape = getattr(x, "shape", None)
    if mean is None or not _last_axis_only(mean, len(shape) if shape is not None else None):
        return None
    add = _next(mean.outputs[0], "Add")
    if add is None:
        return None
    epsilon = next((scalar_value(t) for t in add.inputs if scalar_value(t) is not None), None)
    root = _next(add.outputs[0], "Sqrt")
    inverse = _next(root.outputs[0], "Reciprocal") if root is not None else None
    scaled = _next(inverse.outputs[0], "Mul") if inverse is not None else None
    if epsilon is None or scaled is None or x not in scaled.inputs:
        return None
    weighted = _next(scaled.outputs[0], "Mul")
    if weighted is None:
        return None
    gain = next(t for t in weighted.inputs if t is not scaled.outputs[0])
    gain_value = constant_value(gain)
    if gain_value is None or gain_value.ndim != 1:
        return None
    return x, epsilon, gain, weighted.outputs[0], [power, mean, add, root, inverse, scaled, weighted]


def _residual(x):
    """(a, b, the Add) where ``x`` = a + b of two non-constant tensors the graph declares of one shape (rank 2 or
    3), else None."""
    add = producer(x)
    if add is None or add.op != "Add" or len(add.inputs) != 2:
        return None
    a, b = add.inputs
    shapes = [getattr(t, "shape", None) for t in (a, b)]
    if any(constant_value(t) is not None for t in (a, b)) or shapes[0] is None or shapes[0] != shapes[1] or \
            len(shapes[0]) not in (2, 3):
        return None
    return a, b, add


def rewrite_graph(graph: gs.Graph) -> dict:
    """Every RMSNorm of ``graph`` as one kernel; returns counts {norms, with_residual}."""
    norms = skips = 0
    for power in [node for node in graph.nodes if node.op == "Pow"]:
        found = find_norm(power)
        if found is None:
            continue
        x, epsilon, gain, y, nodes = found
        for node in nodes:
            node.inputs.clear()
            node.outputs.clear()
        norms += 1
        residual = _residual(x)
        if residual is not None:
            a, b, add = residual
            add.inputs.clear()
            add.outputs.clear()
            graph.nodes.append(gs.Node("SkipSimplifiedLayerNormalization", f"{NAME}/skip_norm_{norms}", domain=DOMAIN,
                                       attrs={"epsilon": epsilon}, inputs=[a, b, gain],
                                       outputs=[y, gs.Variable.empty(), gs.Variable.empty(), x]))
            skips += 1
        else:
            graph.nodes.append(gs.Node("SimplifiedLayerNormalization", f"{NAME}/norm_{norms}",
                                       attrs={"epsilon": epsilon, "axis": -1, "stash_type": 1},
                                       inputs=[x, gain], outputs=[y]))
    if skips and not any(d.domain == DOMAIN for d in (graph.import_domains or [])):
        graph.import_domains = list(graph.import_domains or []) + [onnx.helper.make_opsetid(DOMAIN, 1)]
    return {"norms": norms, "with_residual": skips}


def apply(folder: Path, manifest: Manifest, argument: str | None) -> dict:
    parse_argument(argument)
    refuse_twice(manifest, NAME)
    before = manifest.copy()
    graphs = {}
    for name in [*manifest.stages, manifest.step]:
        graph = load_graph(manifest, name)
        counts = rewrite_graph(graph)
        if counts["norms"]:
            entry = manifest.graphs[name]
            file = pass_file(entry["file"], NAME)
            entry["external_data"] = save_graph(graph, folder, file)
            entry["file"] = file
            graphs[name] = counts
    if not graphs:
        raise ElxError(f"pass {NAME}: no RMSNorm in fp32 form (Pow, ReduceMean, Add, Sqrt, Reciprocal, Mul, Mul) in "
                       f"any graph of this {manifest.family} export; nothing was written (drop the pass for this model)")
    report = commit(folder, before, manifest, f"pass {NAME}")
    return {"name": NAME, "graphs": graphs, **report}
