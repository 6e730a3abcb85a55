"""``--pass slim``: K-cache only self-attention (Graef & Wasielewski, seed 002, §1, §4; "option 2").

Math, in the paper's notation.  X ∈ R^{n×d} are the decoder states of one row, h heads of width
d_k, d = h·d_k.  Per layer

    K = X·W_K + b_K          V = X·W_V + b_V          W_K, W_V ∈ R^{d×d}
    o_i = softmax_i · V_i   (softmax_i = softmax(s·q_i·K_iᵀ + position bias + mask) ∈ R^{t×n})

With W_K square and invertible, X = (K − b_K)·W_K⁻¹, hence V_i = (K − b_K)·W_KV,i + b_V,i with
W_KV,i = W_K⁻¹·W_V,i ∈ R^{d×d_k}.  Because every row of softmax_i sums to 1 (§4),

    o_i = (softmax_i · K)·W_KV,i + c_i          c_i = b_V,i − b_K·W_KV,i

which is the paper's option 2: first the probabilities times the cached FULL-WIDTH K (all d
columns, every head's keys), then the small [d, d_k] matrix.  V never exists, so the values
leave the cache: half the self-attention cache.  W_KV is computed from the initializers in
float64 with ``np.linalg.solve(W_K, W_V)`` (never an explicit inverse) and stored as float32.
It is never stored in fp16: an fp16 engine must keep the ·W_KV product (and its input P·K) in
fp32, because W_KV amplifies rounding of K by up to cond(W_K) (the record's ``fp16_weights``
error shows what fp16 W_KV would cost).

Cache layout (decision): the key cache keeps the exported layout ``past_key_values.{i}.decoder.key``
[rows, h, P, d_k] — the full-width K split into heads, column c of head j being column j·d_k + c
of K.  QKᵀ, the T5 relative position bias, the K concat and the runners' reordering stay
exactly as exported, and Shape ops that read a removed value input read the key input (same
shape).  P_i·K (full width) is formed without copying the cache: the probabilities of all heads
are stacked and multiplied with every head's keys in one broadcast MatMul (the cache is read
once), then each head's W_KV,i multiplies all rows at once (W_KV is read once per step):

    P [R, h, t, S] → [R, 1, h·t, S];  · K [R, h, S, d_k] → [R, h_j, h_i·t, d_k]
    → [h_i, R, t, h_j, d_k] → [h_i, R·t, d] (= P_i·K per row);  · W_KV [h, d, d_k] (+ c [h, 1, d_k])
    → [h, R, t, d_k] → [R, h, t, d_k], which replaces MatMul(P, V).

(On this CPU, transposing K to [R, S, d] instead costs 2-5× more; a per-row ·W_KV 4.5× more.)

Pattern (by structure; the manifest names only the cache inputs/outputs), per layer:
    x ─MatMul(W_K)[+b_K]─Reshape─Transpose(0,2,1,3)─┐
    past K ──────────────────────────────────────── Concat ─→ present K (QKᵀ reads it)
    x ─MatMul(W_V)[+b_V]─Reshape─Transpose(0,2,1,3)─┐
    past V ──────────────────────────────────────── Concat ─→ present V ─→ MatMul(P, ·)
K and V must project the same x through identical head splits; past V may also feed Shape ops.

Rewrite: MatMul(P, present V) becomes the chain above on present K; past/present V leave the
graph (the V projection is cleaned up), the manifest (decoder inputs/outputs, ``cache.self``),
and therefore the runners.

Verification: per layer cond(W_K) (refused above ``COND_LIMIT``, singular or non-square
W_K refused) and the K→V reconstruction error on random states (fp32; fp16 K cache with fp32
W_KV; fp16 W_KV), then the rewritten folder against the original through the runner's backend
at several shapes, with pasts generated from random states X (K = X·W_K + b_K, V = X·W_V + b_V:
independent random K and V are not representable by a K-only cache), each shape at three seeds.
Nothing is written when the max abs logits diff exceeds half the fp32 tolerance
(``culprits.verify_limit``: generation on other inputs measured up to 1.9× the verified max).
``--pass slim=skip-bad`` keeps K and V for the layers that fail (listed in the record) instead of
refusing.

Accuracy, measured (``tools/measure_slim.py``, random-init presets): the fp32 K→V error is about
3e-8·cond(W_K) of max |V| (the baseline's own fp32 V: ~7e-7) — K's fp32 rounding and the fp32
·W_KV product amplified by W_K's conditioning.  t5-small dims (d = 512): cond 400-3200, logits
diff 5.5e-5, all 6 layers slimmed.  t5-base dims (d = 768): cond 950-25000; the layers with cond
≥ 8.7e3 break 1e-4 (3 of 12 are skipped with ``skip-bad``).  So cond is recorded, the measured
logits diff decides.  An fp16 K cache (W_KV fp32) rebuilds V with 1-25% relative error where an
fp16 V cache has 0.04%: an fp16 engine must keep this path (K included) in fp32.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx_graphsurgeon as gs

from elx.runners.errors import ElxError
from elx.runners.manifest import Manifest

from elx.exporter.verification.verify import CandidateSides, RuntimeSide, verify_rewrite
from elx.exporter.passes import catalog
from elx.exporter.passes.culprits import verified_rewrite
from elx.exporter.passes.rewrite import Builder, adopt, constant_value, load_graph, pass_file, producer, refuse_twice, save_graph
from elx.exporter.passes.slim_math import COND_LIMIT, FP16_NOTE, Analysis, Projection, Unfit, analyse

SPEC = catalog.SLIM  # name, order, argument, conflicts, refusals (decoder-only: rotary MHA models only)
NAME, parse_argument = SPEC.name, SPEC.parse


# -- graph structure ---------------------------------------------------------------------------------

def projection(tensor) -> Projection:
    """``tensor`` = head-split(x·W (+ b)) with constant W; the head split is Reshape → Transpose(0,2,1,3)."""
    tensor, chain = head_split(tensor)
    return Projection(*linear(tensor), chain)


def head_split(tensor) -> tuple:
    """``tensor`` = Transpose(0,2,1,3)(Reshape(y)): (y, [the Reshape, the Transpose])."""
    chain = []
    node = producer(tensor)
    while node is not None and node.op in ("Reshape", "Transpose"):
        chain.insert(0, node)
        tensor, node = node.inputs[0], producer(node.inputs[0])
    ops = [(n.op, list(n.attrs.get("perm", []))) for n in chain]
    if ops != [("Reshape", []), ("Transpose", [0, 2, 1, 3])]:
        raise Unfit(f"unexpected head split {[op for op, _ in ops]} before the cache concat")
    return tensor, chain


def linear(tensor) -> tuple:
    """``tensor`` = x·W (+ b): a MatMul with a constant 2-D W, then maybe an Add of a constant 1-D b.
    Returns (x, W, b as float64 or None)."""
    bias = None
    node = producer(tensor)
    if node is not None and node.op == "Add":
        for i in (0, 1):
            value = constant_value(node.inputs[i])
            if value is not None and value.ndim == 1:
                bias, tensor, node = value.astype(np.float64), node.inputs[1 - i], producer(node.inputs[1 - i])
                break
    weight = None if node is None or node.op != "MatMul" else constant_value(node.inputs[1])
    if weight is None or weight.ndim != 2:
        raise Unfit(f"{tensor.name} is not a projection x·W (+ b) with a constant 2-D W")
    if bias is not None and bias.shape[0] != weight.shape[1]:
        raise Unfit(f"bias of {tensor.name} has {bias.shape[0]} entries for {weight.shape[1]} outputs")
    return node.inputs[0], weight, bias


def same_head_split(k: Projection, v: Projection) -> bool:
    for a, b in zip(k.chain, v.chain):
        if a.op != b.op or a.attrs != b.attrs:
            return False
        if a.op == "Reshape" and a.inputs[1] is not b.inputs[1]:
            va, vb = constant_value(a.inputs[1]), constant_value(b.inputs[1])
            if va is None or vb is None or not np.array_equal(va, vb):
                return False
    return True


def values_matmul(value, what: str) -> gs.Node:
    """The single ``MatMul(P, value)`` that consumes ``value`` (besides graph outputs and Shape reads)."""
    users = [n for n in value.outputs if n.op != "Shape"]
    if len(users) != 1 or users[0].op != "MatMul" or users[0].inputs[1] is not value:
        raise Unfit(f"{what} feeds {[n.op for n in users]}, expected one probabilities·V MatMul")
    softmax = producer(users[0].inputs[0])  # rows of P must sum to 1 for the bias identity
    if softmax is None or softmax.op != "Softmax" or softmax.attrs.get("axis", -1) not in (-1, 3):
        raise Unfit(f"the probabilities multiplying {what} are not a Softmax over the keys")
    return users[0]


def read_shapes_from(graph_tensors: dict, removed: str, replacement: str, keep: gs.Node | None = None) -> None:
    """Shape ops reading ``removed`` read ``replacement`` (same shape); any other reader is a problem."""
    for node in list(graph_tensors[removed].outputs):
        if node is keep:
            continue
        if node.op != "Shape":
            raise Unfit(f"{removed} feeds a {node.op}, not only its concat and Shape ops")
    for node in list(graph_tensors[removed].outputs):
        if node.op == "Shape":
            node.inputs[0] = graph_tensors[replacement]


def values_from_keys(build: Builder, probs, keys, w_kv: np.ndarray, c: np.ndarray | None, hint: str):
    """(P_i·K_full)·W_KV,i + c_i for all heads: P [R, h, T, S], K [R, h, S, d_k] → [R, h, T, d_k].

    The cache is read once (one broadcast MatMul over the stacked probabilities) and so is W_KV
    (one [R·T, d]·[d, d_k] product per head, not one per row).
    """
    heads, d_model, d_kv = w_kv.shape
    op, const = build.op, build.const
    p = op("Reshape", [probs, const("stack_heads", np.array([0, 1, -1, 0], np.int64))], f"{hint}_P_stacked")
    pk = op("MatMul", [p, keys], f"{hint}_PK_pairs")  # [R, h_j, h_i·T, d_k]
    pk = op("Reshape", [pk, const("split_heads", np.array([0, 0, heads, -1, d_kv], np.int64))], f"{hint}_PK5")
    pk = op("Transpose", [pk], f"{hint}_PK_by_query_head", perm=[2, 0, 3, 1, 4])  # [h_i, R, T, h_j, d_k]
    pk = op("Reshape", [pk, const("full_width", np.array([heads, -1, d_model], np.int64))], f"{hint}_PK_full")
    out = op("MatMul", [pk, const(f"{hint}_W_KV", w_kv)], f"{hint}_values")  # [h, R·T, d_k]
    if c is not None:
        out = op("Add", [out, const(f"{hint}_c", c)], f"{hint}_values_bias")
    sizes = op("Shape", [probs], f"{hint}_P_shape")  # [R, h, T, S]
    split = op("Concat", [op("Gather", [sizes, const("h_R_T", np.array([1, 0, 2], np.int64))], f"{hint}_h_R_T"),
                          const("d_k", np.array([d_kv], np.int64))], f"{hint}_by_head_shape", axis=0)
    out = op("Reshape", [out, split], f"{hint}_values_by_head")  # [h, R, T, d_k]
    return op("Transpose", [out], f"{hint}_values_by_row", perm=[1, 0, 2, 3])  # [R, h, T, d_k]


def replace_with(node: gs.Node, tensor) -> None:
    """``node``'s output keeps its name but becomes ``tensor`` (an Identity; ORT folds it away)."""
    node.op, node.inputs, node.attrs = "Identity", [tensor], {}


# -- the self-attention layers ------------------------------------------------------------------------

@dataclass
class SelfLayer:
    index: int
    key_input: str
    key_output: str
    value_input: str
    value_output: str
    k: Projection | None = None
    v: Projection | None = None
    pv: gs.Node | None = None
    analysis: Analysis | None = None


def self_layers(manifest: Manifest) -> list[SelfLayer]:
    """Key/value cache entry pairs from the manifest's ``cache.self``."""
    entries = {e["input"]: e for e in manifest.cache_entries}
    layers = []
    for name, entry in entries.items():
        if not name.endswith(".key"):
            continue
        value = entries.get(name[: -len("key")] + "value")
        if value is None:
            continue
        parts = name.split(".")
        index = int(parts[1]) if len(parts) > 2 and parts[1].isdigit() else len(layers)
        layers.append(SelfLayer(index, name, entry["output"], value["input"], value["output"]))
    return layers


def match(graph: gs.Graph, layer: SelfLayer) -> None:
    tensors = graph.tensors()
    for name in (layer.key_input, layer.key_output, layer.value_input, layer.value_output):
        if name not in tensors:
            raise Unfit(f"{name} is not in the decoder graph")
    concats = {}
    for kind, past, present in (("k", layer.key_input, layer.key_output), ("v", layer.value_input, layer.value_output)):
        node = producer(tensors[present])
        if node is None or node.op != "Concat" or len(node.inputs) != 2 or node.inputs[0] is not tensors[past]:
            raise Unfit(f"{present} is not Concat({past}, new)")
        concats[kind] = node
        setattr(layer, kind, projection(node.inputs[1]))
    if layer.k.x is not layer.v.x:
        raise Unfit("K and V project different inputs")
    if not same_head_split(layer.k, layer.v):
        raise Unfit("K and V are split into heads differently")
    if {concats["k"].attrs.get("axis"), concats["v"].attrs.get("axis")} - {2, -2}:
        raise Unfit("K and V are not concatenated along the sequence axis of [rows, h, P, d_k]")
    layer.pv = values_matmul(tensors[layer.value_output], layer.value_output)
    read_shapes_from(tensors, layer.value_input, layer.key_input, keep=concats["v"])


def rewrite(graph: gs.Graph, layers: list[SelfLayer]) -> None:
    tensors = graph.tensors()
    build = Builder(graph, NAME)
    for layer in layers:
        a = layer.analysis
        out = values_from_keys(build, layer.pv.inputs[0], tensors[layer.key_output], a.w_kv, a.c,
                               f"layer{layer.index}")
        replace_with(layer.pv, out)
    drop_values(graph, {layer.value_input for layer in layers}, {layer.value_output for layer in layers})


def drop_values(graph: gs.Graph, removed_in: set, removed_out: set) -> None:
    """The value inputs/outputs leave the graph, and with them every node only they fed."""
    graph.inputs = [t for t in graph.inputs if t.name not in removed_in]
    graph.outputs = [t for t in graph.outputs if t.name not in removed_out]
    graph.cleanup(remove_unused_graph_inputs=False)
    left = sorted(n for n in graph.tensors() if n in removed_in | removed_out)
    if left:
        raise ElxError(f"pass slim could not remove every use of {left[0]}; report this model")


def consistent_past(layers: list[SelfLayer], heads: int, d_kv: int, seed: int = 1):
    """``past_from`` for ``verify_rewrite``: pasts from random states X, so V = X·W_V + b_V matches
    K = X·W_K + b_K.  Overwrites the slimmed layers' K and V in the original's past (in place) and
    returns the K-only past of the rewritten graph."""

    def split(y: np.ndarray) -> np.ndarray:  # [R, P, h·d_k] → [R, h, P, d_k]
        rows, p, _ = y.shape
        return np.ascontiguousarray(y.reshape(rows, p, heads, d_kv).transpose(0, 2, 1, 3).astype(np.float32))

    def past_from(past: dict) -> dict:
        rng = np.random.default_rng(seed)
        for layer in layers:
            rows, _, p, _ = past[layer.key_input].shape
            x = rng.standard_normal((rows, p, layer.k.w.shape[0]))
            for name, proj in ((layer.key_input, layer.k), (layer.value_input, layer.v)):
                y = x @ proj.w.astype(np.float64)
                past[name] = split(y if proj.b is None else y + proj.b)
        removed = {layer.value_input for layer in layers}
        return {name: value for name, value in past.items() if name not in removed}

    return past_from


# -- apply ----------------------------------------------------------------------------------------------

def _analyse_layers(graph: gs.Graph, layers: list[SelfLayer], heads: int, d_kv: int) -> dict:
    """Match and analyse every layer; returns {index: reason} for those that cannot be rewritten."""
    bad = {}
    for layer in layers:
        try:
            match(graph, layer)
        except Unfit as why:
            bad[layer.index] = str(why)
            continue
        layer.analysis = analyse(layer.k, layer.v, heads, d_kv)
        if layer.analysis.problem:
            bad[layer.index] = layer.analysis.problem
    return bad


def _candidate(manifest: Manifest, graph_file: str, layers: list[SelfLayer]) -> Manifest:
    """A copy of ``manifest`` describing the decoder with ``layers`` slimmed, saved as ``graph_file``."""
    graph = load_graph(manifest, manifest.step)
    fresh = {layer.index: layer for layer in self_layers(manifest)}
    matched = []
    for layer in layers:
        again = fresh[layer.index]
        match(graph, again)  # bind to this graph's tensors (same structure as analysed)
        again.analysis = layer.analysis
        matched.append(again)
    rewrite(graph, matched)
    after = manifest.copy()
    step = after.graphs[after.step]
    step["external_data"] = save_graph(graph, after.folder, graph_file)
    step["file"] = graph_file
    gone_in = {layer.value_input for layer in layers}
    gone_out = {layer.value_output for layer in layers}
    step["inputs"] = {n: s for n, s in step["inputs"].items() if n not in gone_in}
    step["outputs"] = {n: s for n, s in step["outputs"].items() if n not in gone_out}
    after.data["cache"]["self"] = [e for e in after.cache_entries if e["input"] not in gone_in]
    return after


def apply(folder: Path, manifest: Manifest, argument: str | None) -> dict:
    """slim on an encoder-decoder export.  Decoder-only (RoPE) exports: ``slim_rope.apply`` (the catalog names it
    for that kind), keys cached before RoPE."""
    refuse_twice(manifest, NAME)
    skip_bad = parse_argument(argument)
    layers = self_layers(manifest)
    if not layers:
        raise ElxError("pass slim: this export's self-attention cache holds no key/value pairs "
                       "(slim already applied?); export again from the model")
    heads, d_kv = manifest.dims["num_heads"], manifest.dims["d_kv"]
    bad = _analyse_layers(load_graph(manifest, manifest.step), layers, heads, d_kv)
    step_file, reference = manifest.graphs[manifest.step]["file"], RuntimeSide(manifest.copy())
    with CandidateSides() as sides:
        after, done, report = verified_rewrite(
            folder, manifest, NAME, "decoder self-attention", layers, bad, skip_bad,
            candidate=lambda todo, suffix: _candidate(manifest, pass_file(step_file, suffix), todo),
            verify=lambda candidate, todo, seed, probe=False: verify_rewrite(
                manifest, candidate, seed=seed, reference=reference, sides=sides,
                past_from=consistent_past(todo, heads, d_kv, seed + 1)),
            estimate=True)
    adopt(folder, manifest, after)
    return record(NAME, argument, layers, done, bad, report,
                  cache="keys only: past_key_values.{i}.decoder.key [rows, h, P, d_kv] (full-width K split "
                        "into heads); values recomputed as (P_i·K)·W_KV,i + c_i")


def record(name: str, argument, layers, done, bad: dict, report: dict, cache: str) -> dict:
    per_layer, done_indices = {}, {layer.index for layer in done}
    for layer in layers:
        stats = dict(layer.analysis.stats) if layer.analysis else {}
        stats["slimmed"] = layer.index in done_indices
        per_layer[str(layer.index)] = stats
    return {"name": name, "argument": argument, "layers": [layer.index for layer in done],
            "skipped": {str(i): reason for i, reason in sorted(bad.items())}, "per_layer": per_layer,
            "cache": cache, "w_kv_dtype": "float32", "fp16": FP16_NOTE, "cond_limit": COND_LIMIT, **report}
