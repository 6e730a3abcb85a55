"""int8, per layer: which layers stay fp32, decided by measuring each one's teacher-forced error (issue 28).

Before the folder is converted (``exporter/precision/int8.py``), each layer is quantized *alone*: the fp32
export converted with only that layer's weight MatMuls on int8 weights (``convert_folder(only=layer)``),
then measured against PyTorch fp32 on the seeded random cases the int8 record uses
(``int8_check.random_inputs_error``: teacher-forced max abs logits difference, each side filling
its own cache).  A layer is what ``int8.layer_of`` reads from the module path the ONNX exporter records on each
node, or from the weight's name (``layers.3``, ``decoder.block.1``, GPT-2's ``h.0``), plus the LM head
(``lm_head``); MatMuls that name no layer (nodes a pass wrote) follow the rule without a measurement.

**Out of line**: a layer whose error alone exceeds ``OUT_OF_LINE`` times the median layer's.  Quantizing
any layer changes the logits by roughly the same amount when its weights and activations are of the same
kind; one that changes them several times more (an outlier channel the per-tensor activation scale cannot
resolve, a saturating product) costs more agreement than the bytes it saves, and stays fp32.  The manifest
records every layer's error, the median, the factor and the layers kept (``int8.layers``).

**Cost.**  ONNX Runtime's quantizer runs once, on every layer (``convert_folder``); each layer's graph is then
the fp32 graph with that layer's MatMuls replaced by the nodes the quantizer wrote for them (DynamicQuantizeLinear
of the activation, MatMulInteger on the stored int8 weight, the scale products; found by walking back from each
MatMul's output to tensors the fp32 graph has) and their initializers: the same weights, scales and nodes a
conversion of that layer alone writes, so the same error bit for bit (``tests/test_int8_layers.py`` holds it to
``convert_folder(only=layer)``).  Graphs without the layer are read from the fp32 folder as they are.  Per layer:
one graph copy and save, one check.  t5-small dims (13 layers, one thread, a loaded machine, one run each):
153.1 s with a conversion per layer, 62.9 s so (the full conversion included; the same errors).  The export
keeps that full conversion when no layer is out of line (``measure_and_convert``).  The prepared fp32 weights are
written once, always as external data, and each variant is a graph referring to them (a graph under 2 GB saved
whole made every variant a 645 MB copy, serialized and written per layer: 13 of SmolLM2-135M's ~20 s a layer).
PyTorch's side runs once (``RecordedSide``) for all layers.  A layer then costs two ONNX Runtime sessions (their
fp32 weights mapped, not prepacked: ``runners/backends/ort_mapped.py``; its int8 weights prepacked, below) and the
graphs' five cases (real SmolLM2-135M, 2026-11-30: 113 s for 31 layers, 101-111 s unpacked).

**On the kernels the runtime runs.**  ONNX Runtime's ``MatMulNBits`` (accuracy level 4) quantizes activations to
int8 only in its prepacked kernel; unpacked it multiplies dequantized weights in fp32.  Measured unpacked, the rule
saw the weights' rounding alone: on the real SmolLM2-135M (2026-11-30) layers.11 was 4.8x the median (0.596 /
0.124) and stayed fp32; measured packed, every layer's error is 1.1-4.0x its unpacked one, the median 0.298 and none
is out of line.  So a variant's sessions prepack (``packed_graphs``) while its fp32 weights are also listed as graph
inputs (``fp32_weights_as_inputs``: an overridable initializer is neither folded nor prepacked), read from the
shared mapping: the int8 MatMuls run as the runtime runs them, and the fp32 weights are not copied per session
(prepacked, they were: 2x the model beside HF's, 2137 MiB peak).  The fp32 parts then skip ONNX Runtime's fusions
through constant weights, a difference of fp32's order (the whole int8 export's cases: 1.713 so, 1.676 packed
whole, 0.968 unpacked).  Graphs without the layer run unpacked.  Still the slowest
step of any export; a cheaper measurement (one session per graph, the layer's weights swapped) is not done.
Real SmolLM2-135M (31 layers, 2026-11-29): 190 s, then 91 s once the LM head was found once per graph
(``int8.lm_heads``) instead of by a walk of the graph per MatMul; of a layer's ~2.8 s, ~2 s is ONNX Runtime running
the cases.

**Memory.**  The int8 graphs' own tensors go to the same file as the prepared fp32 weights (equal bytes once: the
prefill's and the step's int8 weights are the same), and both graphs are read without their weights, each tensor
copied on its own (``PreparedWeights.move``): a variant's sessions map one file, and the pairs hold graph structure
only.  Loaded whole, the two pairs of the real SmolLM2-135M held 536 MiB for the whole measurement (a removed
tensor's bytes stay in its message); so, 61 MiB (``docs/measurements/export_speed_2026-11-29.md``, fifth session).
"""
from __future__ import annotations

import re
import shutil
import statistics
import tempfile
from pathlib import Path

import onnx

from elx.runners.manifest import Manifest

OUT_OF_LINE = 4.0
RULE = (f"a layer stays fp32 when its teacher-forced max abs logits difference, quantized alone, exceeds "
        f"{OUT_OF_LINE:g} x the median layer's")


def measured_layers(manifest: Manifest) -> list[str]:
    """The layers the rule would quantize in the fp32 export ``manifest`` describes, in graph order."""
    from elx.exporter.precision.int8 import _scores_output, prepare

    return _in_graph_order((prepare(onnx.load(str(manifest.graph_path(name)))), _scores_output(manifest, name))
                           for name in [*manifest.stages, manifest.step])


def pair_layers(pairs: dict) -> list[str]:
    """``measured_layers`` of graphs already loaded (``GraphPair``s, in graph order)."""
    return _in_graph_order((pair.fp32, pair.logits) for pair in pairs.values())


def _in_graph_order(graphs) -> list[str]:
    """The layers of each (prepared model, scores output), first graph first, each layer once."""
    from elx.exporter.precision.int8 import layers_of

    found = []
    for model, logits in graphs:
        found += [layer for layer in sorted(layers_of(model, logits)) if layer not in found]
    return found


class PreparedWeights:
    """The prepared fp32 graphs' weights in one file of the work folder, each distinct tensor once: the variants
    of every graph point at it, so the ONNX Runtime sessions of one layer's check map one copy of the model
    (``runners/backends/ort_mapped.py`` maps each data file once).  A file per graph held the prefill's and the
    step's copies of the same weights at once: the real SmolLM2-135M's int8 export peaked at 2750 MiB there."""

    def __init__(self, work: Path, file: str = "fp32.weights.data"):
        from elx.exporter.capture.shared_weights import ByteStore

        self.file = file
        self.handle = open(Path(work) / file, "w+b")
        self.store = ByteStore(self.handle)

    def move(self, model: onnx.ModelProto, folder: Path | None = None) -> None:
        """Every initializer of ``model`` holding ``MIN_BYTES`` or more of raw data, or stored outside the graph (read
        from ``folder``, one tensor at a time), moved to the file (in place)."""
        from onnx.external_data_helper import uses_external_data

        from elx.exporter.capture.shared_weights import _Reader, store_tensor

        reader = _Reader(Path(folder)) if folder is not None else None
        try:
            for tensor in model.graph.initializer:
                if uses_external_data(tensor) and reader is None:
                    raise ValueError(f"{tensor.name} is stored outside the graph; no folder was given to read it")
                store_tensor(tensor, reader, self.store, self.file)
        finally:
            if reader is not None:
                reader.close()
        self.handle.flush()

    def close(self) -> None:
        self.handle.close()


class GraphPair:
    """One graph of the export: fp32 (prepared as the conversion prepares it) and converted with every layer on
    int8; ``variant(layer)`` is the fp32 graph with only ``layer``'s MatMuls on int8, or None without them."""

    def __init__(self, manifest: Manifest, name: str, converted: Manifest, work: Path | None = None,
                 store: "PreparedWeights | None" = None):
        from elx.exporter.memory import return_free_pages
        from elx.exporter.precision.fp16 import boundaries
        from elx.exporter.precision.int8 import _scores_output, prepare

        # with a work folder, both graphs are read without their weights: each tensor is copied to the work folder's
        # file one at a time (``PreparedWeights.move``); loaded whole, the two graphs of the real SmolLM2-135M held
        # 536 MiB through the whole measurement (their protos keep a removed tensor's bytes)
        lazy = work is not None
        source = Path(manifest.graph_path(name)).parent
        self.fp32 = prepare(onnx.load(str(manifest.graph_path(name)), load_external_data=not lazy), source)
        self.int8 = onnx.load(str(converted.graph_path(name)), load_external_data=not lazy)
        self.logits = _scores_output(manifest, name)
        self.exact = boundaries(manifest)[name].exact_outputs
        graph = self.fp32.graph
        self.known = ({o for n in graph.node for o in n.output} | {i.name for i in graph.input}
                      | {t.name for t in graph.initializer})
        self.producers = {o: (i, n) for i, n in enumerate(self.int8.graph.node) for o in n.output}
        # only the tensors the conversion wrote are taken from the int8 graph (``variant``): the fp32 ones it shares
        # with the fp32 graph (the embeddings, norms, the layers kept fp32) dropped, not held twice per graph
        initializers = self.int8.graph.initializer
        for index in reversed(range(len(initializers))):
            if initializers[index].name in self.known:
                del initializers[index]
        self.work = None
        if lazy:  # the prepared weights written once; each variant refers to them (see the module doc)
            self.work = Path(work)
            # always external (``save_model`` keeps a graph under 2 GB whole: each variant was then a copy of the
            # weights, serialized and written per layer, 13 s a layer on SmolLM2-135M), and in one file for every
            # graph, equal tensors once (``PreparedWeights``): the int8 graph's own tensors too
            own = store is None
            store = store or PreparedWeights(self.work, f"{name}.fp32.weights.data")
            store.move(self.fp32, source)
            store.move(self.int8, Path(converted.graph_path(name)).parent)
            if own:
                store.close()
            # a fresh proto: a cleared field's bytes stay in the message's arena until the message goes
            self.fp32 = onnx.load_model_from_string(self.fp32.SerializeToString())
            self.int8 = onnx.load_model_from_string(self.int8.SerializeToString())
        self.int8_weights = {t.name: t for t in self.int8.graph.initializer}
        return_free_pages()

    def _written_for(self, output: str) -> list[tuple[int, onnx.NodeProto]]:
        """The converted graph's nodes computing ``output`` from tensors the fp32 graph has (index, node)."""
        found, stack = {}, [output]
        while stack:
            tensor = stack.pop()
            if tensor not in self.producers or (tensor in self.known and tensor != output):
                continue
            index, node = self.producers[tensor]
            if index not in found:
                found[index] = node
                stack.extend(node.input)
        return sorted(found.items(), key=lambda item: item[0])

    def variant(self, layer: str) -> onnx.ModelProto | None:
        from elx.exporter.precision.int8 import choose

        chosen, _ = choose(self.fp32, self.exact, self.logits, only=layer)
        if not chosen:
            return None
        chosen = set(chosen)
        model = onnx.ModelProto()
        model.CopyFrom(self.fp32)
        nodes, placed, weights = [], set(), set()
        for node in self.fp32.graph.node:
            if node.name not in chosen:
                nodes.append(node)
                continue
            weights.add(node.input[1])
            for index, written in self._written_for(node.output[0]):
                if index not in placed:  # a quantized activation shared by several MatMuls: placed once
                    placed.add(index)
                    nodes.append(written)
        graph = model.graph
        del graph.node[:]
        graph.node.extend(nodes)
        used = {name for n in nodes for name in n.input}
        kept = [t for t in graph.initializer if t.name not in weights or t.name in used]
        added = [self.int8_weights[name] for name in sorted(used - self.known) if name in self.int8_weights]
        del graph.initializer[:]
        graph.initializer.extend(kept + added)
        domains = {o.domain for o in model.opset_import}
        model.opset_import.extend(o for o in self.int8.opset_import if o.domain not in domains)
        return model


def fp32_weights_as_inputs(model: onnx.ModelProto) -> int:
    """List every fp32 weight of a MatMul/Gemm in ``model`` as a graph input too (in place; returns how many): an
    initializer that is also an input may be overridden, so ONNX Runtime neither folds nor prepacks it, while the
    int8 weights stay constant and are packed as the runtime packs them (``measure_and_convert``)."""
    from onnx import helper

    graph = model.graph
    floats = {t.name: t for t in graph.initializer if t.data_type == onnx.TensorProto.FLOAT}
    names = sorted({n.input[1] for n in graph.node if n.op_type in ("MatMul", "Gemm", "FusedMatMul")
                    and len(n.input) > 1 and n.input[1] in floats} - {i.name for i in graph.input})
    graph.input.extend(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, list(floats[name].dims))
                       for name in names)
    return len(names)


def variant_folder(manifest: Manifest, pairs: dict, layer: str, target: Path,
                   weights_as_inputs: bool = False) -> tuple[Manifest, list[str]]:
    """A folder whose graphs run ``layer`` alone on int8 weights, and the graphs that changed; graphs without it
    are the fp32 files.  A pair made with a ``work`` folder writes its variant there as a graph alone, its fp32
    weights referring to the prepared weights written once (``GraphPair``): a layer costs its own int8 weights, not
    a copy of the model.  ``weights_as_inputs``: the variants' fp32 weights listed as inputs
    (``fp32_weights_as_inputs``)."""
    target.mkdir(parents=True, exist_ok=True)
    after = Manifest(manifest.copy().data, target)
    changed = []
    for name, pair in pairs.items():
        spec = after.graphs[name]
        model = pair.variant(layer)
        if model is None:
            spec["file"] = str(manifest.graph_path(name).resolve())  # read where it is
            continue
        changed.append(name)
        if weights_as_inputs:
            fp32_weights_as_inputs(model)
        if pair.work is not None:
            path = pair.work / f"{name}.{target.name}.layer.onnx"  # beside the weights its references name
            onnx.save_model(model, str(path))
            spec["file"], spec["external_data"] = str(path), []
            continue
        from elx.exporter.capture.onnx_export import save_model

        spec["file"] = f"{name}.layer.onnx"
        spec["external_data"] = save_model(model, target / spec["file"])
    return after, changed


def measure_layers(torch_model, manifest: Manifest, progress=None) -> dict:
    """Every layer's error quantized alone, and the layers out of line (see the module doc)."""
    with tempfile.TemporaryDirectory(prefix="elx-int8-every-layer-") as work:
        return measure_and_convert(torch_model, manifest, Path(work), progress)[0]


def measure_and_convert(torch_model, manifest: Manifest, target: Path, progress=None) -> tuple[dict, Manifest]:
    """``measure_layers``, and the conversion of every layer it starts from, written to ``target`` (the int8
    export itself when no layer turns out of line: ``int8_export.finish``); ``progress(layer, done, total)``
    after each layer's measurement."""
    from elx.exporter.precision.decoder_only import torch_side
    from elx.exporter.precision.int8 import convert_folder
    from elx.exporter.precision.int8_check import random_inputs_error

    from elx.exporter.verification.verify import RecordedSide, default_shapes

    # PyTorch's side once for every layer: its results on the seeded cases, recorded (it was re-run per layer)
    reference = RecordedSide(torch_side(torch_model, manifest), manifest, default_shapes(manifest), [0])
    errors = {}
    converted = convert_folder(manifest, target)
    with tempfile.TemporaryDirectory(prefix="elx-int8-layers-") as work:
        shared = Path(work) / "weights"
        shared.mkdir()
        store = PreparedWeights(shared)
        try:
            pairs = {name: GraphPair(manifest, name, converted, shared, store)
                     for name in [*manifest.stages, manifest.step]}
        finally:
            store.close()
        layers = pair_layers(pairs)
        for done, layer in enumerate(layers, 1):
            folder = Path(work) / re.sub(r"[^A-Za-z0-9_.-]", "_", layer)
            # on the int8 kernels the runtime runs (prepacked), the fp32 weights unpacked over the shared mapping
            variant, changed = variant_folder(manifest, pairs, layer, folder, weights_as_inputs=True)
            errors[layer] = random_inputs_error(torch_model, variant, reference,
                                                packed_graphs=changed)["max_abs_logits_diff"]
            shutil.rmtree(folder, ignore_errors=True)
            for path in shared.glob(f"*.{folder.name}.layer.onnx"):
                path.unlink()
            if progress is not None:
                progress(layer, done, len(layers))
    median = statistics.median(errors.values()) if errors else 0.0
    kept = [layer for layer, error in errors.items() if not error <= OUT_OF_LINE * median]  # NaN: kept
    return ({"rule": RULE, "factor": OUT_OF_LINE, "median_max_abs_logits_diff": median,
             "max_abs_logits_diff": errors, "kept_fp32": kept}, converted)
