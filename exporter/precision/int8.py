"""int8: which MatMuls run on int8 weights, and how the folder's graphs are converted (``--precision int8``).

The graphs are exported, rewritten by passes and verified in fp32 first (exactly as an fp32 export); the
finished fp32 graphs are then converted here, and the result is measured against HF fp32
(``exporter/precision/int8_check.py``), not held to a tolerance it cannot meet.

**Rule.**  Every MatMul whose second input is a constant 2-D fp32 weight (attention projections, cross
K/V, feed-forward, and the LM head after its constant ``Transpose`` is folded) is quantized with ONNX
Runtime's dynamic quantization (``onnxruntime.quantization.quantize_dynamic``): the weight is stored in
int8, symmetric, one scale per output channel (a quarter of fp32's bytes, the bytes every decoder step
streams); at run time each activation entering such a MatMul is quantized to uint8 with one scale and zero
point per tensor, computed from that tensor (``DynamicQuantizeLinear``), and the int32 product is scaled
back to fp32 (ONNX Runtime's optimizer fuses each into ``DynamicQuantizeMatMul``, or
``MatMulIntegerToFloat`` where one quantized activation feeds several MatMuls; checked on the optimized
graph).  Everything else stays as an fp32 export computes it: residual stream, layer/RMS norms, softmax
and log-softmax, attention scores and probabilities·V (activation × activation), position bias, masks,
biases, embedding Gathers, the self-attention cache, the per-input state and the logits (graph IO is
unchanged: fp32).  Kept fp32 by exception (as the fp16 rule, ``exporter/precision/fp16.py``, and for the same
reason): slim's W_KV products and the projection producing a slim K-only cache (V is recomputed as
K·W_KV, which amplifies any error of K by up to cond(W_K)).  Also kept fp32: EL's per-head W_K/W_V, 3-D
weights [heads, ·, ·] (the quantizer scales 2-D weights per column; not attempted here), 2·d² weights per
decoder layer.  ``KEEP_LM_HEAD_FP32`` records the LM head decision (below).

**Why dynamic quantization and not ``MatMulNBits`` with 8 bits** (measured here: a 2-core AMD EPYC with
AVX2, no AVX-512 or VNNI, shared with other jobs, so only interleaved ratios mean much; t5-small dims,
random weights, batch 4, 256 input tokens, beam 4, 32 forced new tokens, medians of 5 interleaved rounds
unless said): with 1 thread, fp32 5.23 s, ``MatMulNBits`` bits=8 with ``accuracy_level=4`` (int8
activations per block of 32) 6.30 s, block 128 6.13 s, dynamic quantization (8-bit weights) 3.49 s;
with 2 threads (3 rounds), fp32 5.00 s against ``MatMulNBits`` bits=8 at the default accuracy level
(weight-only, fp32 compute) 22.6 s: neither ``MatMulNBits`` form has a fast 8-bit kernel on this CPU.
Dynamic quantization with this module's settings (7-bit weights, LM head int8), 1 thread: 2.90 s against
fp32 4.56 s.  A weight-only QDQ graph (``DequantizeLinear`` → fp32 MatMul) was not measured: it computes
in fp32.  So the activation entering a quantized MatMul is quantized too (per tensor), as CTranslate2's
int8 quantizes its activations (per row); what that changes is measured and recorded, not assumed.

**Kernels: per model kind** (``kernel_for``, recorded as ``int8.kernel``).  The figures above are t5-small's,
and they hold for encoder-decoder exports: ``dynamic``.  Decoder-only exports take ``nbits``: ``MatMulNBits``
with 8-bit symmetric weights per block of 32 along K and ``accuracy_level=4`` (activations quantized to int8 per
block of 32 at run time).  Measured on the real SmolLM2-135M-Instruct (``docs/measurements/
real_smollm2_2026-11-27.md``, "MatMulNBits"): greedy batch 1 as fast (1.74-1.83 s against 1.84-1.89 s, 128
tokens), and HF fp32's greedy tokens for 46 steps against 1, beam 4 rows equal to HF's 2/4 against 0/4 (real
weights' massive activations: one scale per tensor cannot resolve them, one per block of 32 can); beam 4 batch 4
is 1.3x slower than dynamic quantization there.  Everything else below (what stays fp32, the per-layer rule) is
the same for both kernels; ``REDUCE_RANGE`` is dynamic quantization's alone.  ``nbits`` graphs are converted one
weight at a time, the graph read without its weights (``exporter/precision/int8_nbits.py``: what ONNX Runtime's
``MatMulNBitsQuantizer`` writes, byte for byte, without a whole graph's fp32 and int8 weights in memory at once).

**Saturation.**  On x86 CPUs without VNNI, MLAS's u8s8 kernel adds pairs of u8·s8 products in int16
(``vpmaddubsw``), which saturates when both products are large; ``REDUCE_RANGE`` (7-bit weights) rules
that out at the cost of one bit of weight precision.  Measured (t5-small dims, random weights,
teacher-forced max abs logits difference against PyTorch fp32 on random inputs, max |logit| 9.14): 0.650
with 8-bit weights, 0.201 with 7-bit; beam 4 on the recorded draw: 6/8 and 7/8 sequences identical to HF.

**LM head and layers out of line.**  Measured as above: 0.201 with the LM head in int8, 0.196 with it in fp32,
and the same sequences identical to HF (greedy 8/8, beam 4 7/8): its error is not out of line, so by default
it is quantized (``KEEP_LM_HEAD_FP32 = False``).  Every export now measures it, and each layer, alone
(``exporter/precision/int8_layers.py``): a layer (the LM head included) whose error quantized alone is out of
line with the others' stays fp32; the manifest's ``int8.layers`` records the measurement, ``int8.lm_head``
what the LM head is.

**Decoder-only exports** (GPT-2, OPT, the Llama families) take the same rule on both graphs (prefill and
step); GPT-2's ``Conv1D`` exports as ``Gemm``, rewritten first as a weight MatMul and a bias add
(``precision.gemms_to_matmuls``) so that it is quantized too.
"""
from __future__ import annotations

import logging
import re
import tempfile
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from elx.runners.manifest import Manifest

from elx.exporter.memory import return_free_pages
from elx.exporter.capture.onnx_export import save_model
from elx.exporter.passes.rewrite import pass_file
from elx.exporter.precision.fp16 import _exact_projections, boundaries, gemms_to_matmuls
from elx.exporter.precision.int8_nbits import save as save_nbits

SUFFIX = "int8"
KEEP_LM_HEAD_FP32 = False  # measured: see the module doc
REDUCE_RANGE = True
# The kernel per model kind (module doc, "Kernels"): decoder-only exports run ONNX Runtime's MatMulNBits with
# 8-bit weights per block of NBITS_BLOCK and activations quantized per block; encoder-decoder exports keep
# dynamic quantization (per-tensor activations), faster there.
KERNELS = ("dynamic", "nbits")
NBITS_BLOCK = 32
NBITS_ACCURACY = 4  # MatMulNBits' accuracy_level: activations quantized to int8 per block at run time


METHODS = {
    "dynamic": "onnxruntime.quantization.quantize_dynamic: int8 weights, symmetric, per output channel; uint8 "
               "activations, per tensor, quantized at run time",
    "nbits": f"onnxruntime MatMulNBits (bits=8, block_size={NBITS_BLOCK}, symmetric, accuracy_level=4): int8 weights "
             f"per block of {NBITS_BLOCK} along K; int8 activations per block, quantized at run time"}


def kernel_for(manifest: Manifest) -> str:
    """``nbits`` for decoder-only exports, ``dynamic`` for encoder-decoder ones (measured: the module doc)."""
    return "dynamic" if manifest.data.get("is_encoder_decoder", True) else "nbits"


def fold_weight_transposes(model: onnx.ModelProto, folder: Path | None = None) -> int:
    """Replace each ``Transpose`` of an initializer (a tied LM head: ``MatMul(x, Transpose(E))``) by the transposed
    initializer, so that the MatMul reads a constant weight; returns how many were folded (initializers stored
    outside the graph are read from ``folder``)."""
    from elx.exporter.capture.shared_weights import values

    graph = model.graph
    weights = {t.name: t for t in graph.initializer}
    kept, folded = [], 0
    for node in graph.node:
        source = weights.get(node.input[0]) if node.op_type == "Transpose" else None
        if source is None or source.data_type != TensorProto.FLOAT:
            kept.append(node)
            continue
        perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
        value = np.ascontiguousarray(np.transpose(values(source, folder), perm))
        graph.initializer.append(numpy_helper.from_array(value, node.output[0]))
        folded += 1
    del graph.node[:]
    graph.node.extend(kept)
    used = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
    unused = [t for t in graph.initializer if t.name not in used]
    for tensor in unused:
        graph.initializer.remove(tensor)
    return folded


def fold_weight_concats(model: onnx.ModelProto, folder: Path | None = None) -> int:
    """Replace each ``Concat`` of 2-D fp32 initializers (``--pass fused-attention``'s packed q/k/v weights, which ONNX
    Runtime would fold at load) by the concatenated initializer, so that the MatMul reading it is a weight MatMul
    the rule quantizes; returns how many were folded (weights stored outside the graph are read from ``folder``)."""
    from elx.exporter.capture.shared_weights import values

    graph = model.graph
    weights = {t.name: t for t in graph.initializer}
    kept, folded = [], 0
    for node in graph.node:
        sources = [weights.get(name) for name in node.input] if node.op_type == "Concat" else [None]
        if any(s is None or s.data_type != TensorProto.FLOAT or len(s.dims) != 2 for s in sources):
            kept.append(node)
            continue
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        value = np.concatenate([values(s, folder) for s in sources], axis=axis)
        graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(value), node.output[0]))
        folded += 1
    if folded:
        del graph.node[:]
        graph.node.extend(kept)
        used = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
        for tensor in [t for t in graph.initializer if t.name not in used]:
            graph.initializer.remove(tensor)
    return folded


def lm_heads(model: onnx.ModelProto, logits: str | None) -> set[str]:
    """The outputs of the MatMuls whose result reaches the logits through no other MatMul (only a bias add or a
    scale, at most four of them): walked back once from ``logits`` (one pass over the graph, not one per MatMul:
    asked per MatMul it was 12 of the int8 per-layer measurement's 37 s on SmolLM2-135M)."""
    if logits is None:
        return set()
    producers = {o: n for n in model.graph.node for o in n.output}
    heads, frontier = set(), {logits}
    for _ in range(5):
        found = [producers[name] for name in frontier if name in producers]
        heads |= {n.output[0] for n in found if n.op_type == "MatMul"}
        frontier = {i for n in found if n.op_type in ("Add", "Mul", "Identity") for i in n.input}
    return heads


LAYER = re.compile(r"((?:encoder|decoder)\.)?(?:layers|layer|h|block|blocks)\.\d+(?![0-9])")
LM_HEAD = "lm_head"


def layer_of(node: onnx.NodeProto) -> str | None:
    """The layer a weight MatMul belongs to: read from the module path the ONNX exporter records on the node
    (``namespace``: ``.../model.model.layers.3.self_attn.q_proj: ...`` → ``layers.3``; T5's
    ``decoder.block.1.layer.0...`` → ``decoder.block.1``), else from the weight's name (its parameter name when
    the export kept it); None when neither names a layer (e.g. nodes a pass wrote)."""
    namespace = next((p.value for p in node.metadata_props if p.key == "namespace"), "")
    for text in (namespace, node.input[1]):
        found = LAYER.search(text)
        if found:
            return found.group(0)
    return None


def choose(model: onnx.ModelProto, exact_outputs=frozenset(), logits: str | None = None,
           keep_lm_head: bool = KEEP_LM_HEAD_FP32, keep_layers=frozenset(), only=None) -> tuple[list[str], dict]:
    """The names of the MatMuls the rule quantizes, and the count per decision (for the manifest).

    ``keep_layers``: layers (``layer_of``, or ``LM_HEAD``) kept fp32 by the per-layer measurement;
    ``only``: quantize that one layer and nothing else (the measurement's own conversions)."""
    graph = model.graph
    weights = {t.name: t for t in graph.initializer}
    exact = _exact_projections(graph, exact_outputs, weights)
    chosen, counts = [], Counter()
    heads = lm_heads(model, logits)
    for index, node in enumerate(graph.node):
        if node.op_type != "MatMul":
            continue
        weight = weights.get(node.input[1])
        if weight is None or weight.data_type != TensorProto.FLOAT:
            counts["fp32: activation x activation"] += 1
        elif len(weight.dims) != 2:
            counts["fp32: per-head (3-D) weight"] += 1
        elif "W_KV" in node.input[1]:
            counts["fp32: slim W_KV product"] += 1
        elif index in exact:
            counts["fp32: slim key projection"] += 1
        else:
            head = node.output[0] in heads
            layer = LM_HEAD if head else layer_of(node)
            if only is not None:
                if layer == only:
                    chosen.append(node.name)
            elif head and keep_lm_head:
                counts["fp32: LM head"] += 1
            elif layer in keep_layers:
                counts["fp32: layer out of line (measured)"] += 1
            else:
                counts["int8: LM head" if head else "int8: weight MatMul"] += 1
                chosen.append(node.name)
    return chosen, dict(sorted(counts.items()))


def layers_of(model: onnx.ModelProto, logits: str | None) -> set[str]:
    """The layers (``layer_of``, ``LM_HEAD``) of the MatMuls the rule would quantize in ``model``; unrecognised
    weight names are not measured one by one (they follow the rule)."""
    names = {n.name: n for n in model.graph.node}
    chosen, _ = choose(model, logits=logits)
    heads = lm_heads(model, logits)
    return {LM_HEAD if names[c].output[0] in heads else layer_of(names[c]) for c in chosen} - {None}


def _name_nodes(model: onnx.ModelProto) -> None:
    """ONNX Runtime's quantizer picks nodes by name: give every unnamed (or twice-named) node a unique one."""
    seen = set()
    for i, node in enumerate(model.graph.node):
        if not node.name or node.name in seen:
            node.name = f"{node.op_type.lower()}_int8_{i}"
        seen.add(node.name)


@contextmanager
def _quiet():
    """The quantizer logs a suggestion to pre-process on the root logger for every graph: not the user's concern."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)


def prepare(model: onnx.ModelProto, folder: Path | None = None) -> onnx.ModelProto:
    """Fold constant weight transposes and concatenations and rewrite constant-weight Gemms (in place): every weight MatMul reads
    its weight directly; nodes named uniquely (the quantizer picks them by name).  A graph loaded without its
    weights reads the few it transposes from ``folder``."""
    fold_weight_transposes(model, folder)
    fold_weight_concats(model, folder)
    gemms_to_matmuls(model, folder)  # GPT-2's Conv1D: a Gemm on a constant weight
    _name_nodes(model)
    return model


def to_int8(model: onnx.ModelProto, exact_outputs=frozenset(), logits: str | None = None,
            keep_lm_head: bool = KEEP_LM_HEAD_FP32, reduce_range: bool = REDUCE_RANGE, keep_layers=frozenset(),
            only=None, kernel: str = "dynamic", folder: Path | None = None) -> tuple[onnx.ModelProto, dict]:
    """``model`` (fp32) with the rule's MatMuls quantized; and the count per decision (``keep_layers``, ``only``:
    see ``choose``; ``kernel``: one of ``KERNELS``).  ``dynamic`` takes a model with its weights loaded; ``nbits``
    also one loaded without them, reading each from ``folder`` when it converts it (``int8_nbits.py``)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from elx.exporter.precision.int8_nbits import to_nbits

    prepare(model, folder)
    chosen, counts = choose(model, exact_outputs, logits, keep_lm_head, keep_layers, only)
    if not chosen:
        return model, counts
    if kernel == "nbits":
        return to_nbits(model, chosen, folder, NBITS_BLOCK, NBITS_ACCURACY), counts
    with tempfile.TemporaryDirectory(prefix="elx-int8-") as work:
        source, target = Path(work) / "fp32.onnx", Path(work) / "int8.onnx"
        save_model(model, source)
        with _quiet():
            quantize_dynamic(source, target, per_channel=True, reduce_range=reduce_range, weight_type=QuantType.QInt8,
                             nodes_to_quantize=chosen, use_external_data_format=True,
                             extra_options={"MatMulConstBOnly": True})
        quantized = onnx.load(str(target))  # its external data read in: the folder stores it (shared_weights.py)
    return quantized, counts


def _scores_output(manifest: Manifest, name: str) -> str | None:
    """The output of graph ``name`` holding scores: the step's logits, or a decoder-only prefill's first-step
    scores (``first_step_scores``); None for other stages."""
    if name == manifest.step:
        return manifest.graphs[name].get("logits", "logits")
    graph, _, output = (manifest.data.get("first_step_scores") or "").partition(":")
    return output if graph == name else None


def convert_folder(manifest: Manifest, target: Path, keep_lm_head: bool = KEEP_LM_HEAD_FP32,
                   reduce_range: bool = REDUCE_RANGE, keep_layers=frozenset(), only=None) -> Manifest:
    """Write the int8 graphs of the (fp32) export ``manifest`` describes into ``target``; return their manifest.
    Graph IO is unchanged (fp32): only weights and the MatMuls reading them change (``keep_layers``, ``only``:
    see ``choose``)."""
    target.mkdir(parents=True, exist_ok=True)
    after = Manifest(manifest.copy().data, target)
    counts, sides, kernel = {}, boundaries(manifest), kernel_for(manifest)
    for name in [*manifest.stages, manifest.step]:
        spec = after.graphs[name]
        logits = _scores_output(manifest, name)
        # nbits: the graph without its weights, each read when converted and written when saved (int8_nbits.py)
        lazy = kernel == "nbits"
        model = onnx.load(str(Path(manifest.folder) / spec["file"]), load_external_data=not lazy)
        model, counts[name] = to_int8(model, sides[name].exact_outputs, logits, keep_lm_head, reduce_range,
                                      keep_layers, only, kernel, Path(manifest.folder))
        file = pass_file(spec["file"], SUFFIX)
        if lazy:
            spec["external_data"] = save_nbits(model, Path(manifest.folder), target / file)
        else:
            spec["external_data"] = save_model(model, target / file)
        spec["file"] = file
        del model  # before the next graph is read: one graph's fp32 and int8 weights at a time
        return_free_pages()
        spec.pop("tensorrt_file", None)  # the TensorRT twin of a pass graph: engines are built from fp32/fp16 graphs
    after.data["precision"] = "int8"
    after.data["int8"] = {
        "rule": "exporter/precision/int8.py", "check": "exporter/precision/int8_check.py", "graphs": counts,
        "kernel": kernel, "method": METHODS[kernel],
        "reduce_range": reduce_range if kernel == "dynamic" else False, "lm_head": "fp32" if keep_lm_head else "int8",
        "logits": "float32 (HF's searches run in fp32)", "io": "float32 (caches and per-input state as fp32 exports)"}
    return after
