"""``--pass slim-cross``: K-only cross-attention caches (seed 002, §6), values recomputed from keys.

Math as in ``slim`` (see its docstring), applied to cross-attention: with H ∈ R^{N×d} the
encoder output of one input sequence, K = H·W_K + b_K and V = H·W_V + b_V, so for square,
invertible W_K

    o_i = softmax_i · V_i = (softmax_i · K)·W_KV,i + c_i,    W_KV,i = W_K⁻¹·W_V,i,  c_i = b_V,i − b_K·W_KV,i

(rows of softmax_i sum to 1; padded source positions carry ~0 probability).  The ``cross_kv``
graph then emits only the keys ``present.{i}.encoder.key`` [B, h, N, d_k] (batch B, shared by the
beams), the decoder takes only ``past_key_values.{i}.encoder.key`` and computes, per layer,

    P [B, h, beam·t, N] → [B, 1, h·beam·t, N];  · K [B, h, N, d_k] → [B, h_j, h_i·beam·t, d_k]
    → [h_i, B·beam·t, d] = P_i·K (full width);  · W_KV [h, d, d_k] (+ c) → [B, h, beam·t, d_k]

which replaces ``MatMul(P, V)``: the cross-attention state per input sequence halves.  W_KV is
computed in float64 (``np.linalg.solve``) and stored float32, never fp16 (see ``slim``).

Pattern (by structure): in ``cross_kv``, each key/value output is
``encoder_hidden_states ─MatMul(W)[+b]─Reshape─Transpose(0,2,1,3)``, both of one layer from the
same input with the same head split; in the decoder the value input feeds exactly one
``MatMul(P, V)`` and possibly Shape ops (those read the key input instead, same shape).

Verification: cond(W_K) and the K→V reconstruction error per layer, then the rewritten folder
against the original on random inputs at several shapes (the cross K/V come from the real
``cross_kv`` graph, so they are consistent), each shape at three seeds; refused beyond half the
fp32 tolerance (``culprits.verify_limit``) in max abs logits diff, for a
singular, ill-conditioned or non-square W_K, unless ``--pass slim-cross=skip-bad`` (those layers
keep their values; the record lists them).  ``el`` removes the cross cache altogether, so the
two passes refuse to combine.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import onnx_graphsurgeon as gs

from elx.runners.errors import ElxError
from elx.runners.manifest import Manifest

from elx.exporter.verification.verify import CandidateSides, RuntimeSide, verify_rewrite
from elx.exporter.passes import catalog
from elx.exporter.passes.culprits import verified_rewrite
from elx.exporter.passes.rewrite import Builder, adopt, load_graph, pass_file, refuse_twice, save_graph
from elx.exporter.passes.slim import projection, read_shapes_from, record, replace_with, same_head_split, values_from_keys, values_matmul
from elx.exporter.passes.slim_math import Analysis, Projection, Unfit, analyse

SPEC = catalog.SLIM_CROSS  # name, order, argument, conflicts, refusals (el declares its conflict)
NAME, parse_argument = SPEC.name, SPEC.parse
STAGE = "cross_kv"
WHERE = "decoder cross-attention"


@dataclass
class CrossLayer:
    index: int
    key_input: str  # decoder inputs
    value_input: str
    key_source: str  # cross_kv outputs
    value_source: str
    k: Projection | None = None
    v: Projection | None = None
    pv: gs.Node | None = None
    analysis: Analysis | None = None


def cross_layers(manifest: Manifest) -> list[CrossLayer]:
    inputs = manifest.graphs[manifest.step]["inputs"]
    cross = {n: s["from"].partition(":")[2] for n, s in inputs.items() if s["from"].startswith(f"{STAGE}:")}
    layers = []
    for key in (n for n in cross if n.endswith(".key")):
        value = key[: -len("key")] + "value"
        if value not in cross:
            continue
        parts = key.split(".")
        index = int(parts[1]) if len(parts) > 2 and parts[1].isdigit() else len(layers)
        layers.append(CrossLayer(index, key, value, cross[key], cross[value]))
    return sorted(layers, key=lambda layer: layer.index)


def match(decoder: gs.Graph, cross: gs.Graph, layer: CrossLayer) -> None:
    produced = {t.name: t for t in cross.outputs}
    for name in (layer.key_source, layer.value_source):
        if name not in produced:
            raise Unfit(f"{name} is not an output of the {STAGE} graph")
    layer.k, layer.v = projection(produced[layer.key_source]), projection(produced[layer.value_source])
    if layer.k.x is not layer.v.x:
        raise Unfit("K and V project different inputs")
    if not same_head_split(layer.k, layer.v):
        raise Unfit("K and V are split into heads differently")
    tensors = decoder.tensors()
    for name in (layer.key_input, layer.value_input):
        if name not in tensors:
            raise Unfit(f"{name} is not in the decoder graph")
    layer.pv = values_matmul(tensors[layer.value_input], layer.value_input)
    read_shapes_from(tensors, layer.value_input, layer.key_input, keep=layer.pv)


def _analyse_layers(manifest: Manifest, layers: list[CrossLayer]) -> dict:
    decoder, cross = load_graph(manifest, manifest.step), load_graph(manifest, STAGE)
    heads, d_kv = manifest.dims["num_heads"], manifest.dims["d_kv"]
    bad = {}
    for layer in layers:
        try:
            match(decoder, cross, layer)
        except Unfit as why:
            bad[layer.index] = str(why)
            continue
        layer.analysis = analyse(layer.k, layer.v, heads, d_kv)
        if layer.analysis.problem:
            bad[layer.index] = layer.analysis.problem
    return bad


def _candidate(manifest: Manifest, layers: list[CrossLayer], suffix: str) -> Manifest:
    """A copy of ``manifest`` whose decoder and cross_kv graphs have ``layers`` K-only (new files)."""
    decoder, cross = load_graph(manifest, manifest.step), load_graph(manifest, STAGE)
    fresh = {layer.index: layer for layer in cross_layers(manifest)}
    build = Builder(decoder, NAME)
    tensors = decoder.tensors()
    for layer in layers:
        again = fresh[layer.index]
        match(decoder, cross, again)
        a = layer.analysis
        out = values_from_keys(build, again.pv.inputs[0], tensors[again.key_input], a.w_kv, a.c,
                               f"cross{layer.index}")
        replace_with(again.pv, out)
    gone_in = {layer.value_input for layer in layers}
    gone_out = {layer.value_source for layer in layers}
    decoder.inputs = [t for t in decoder.inputs if t.name not in gone_in]
    cross.outputs = [t for t in cross.outputs if t.name not in gone_out]
    decoder.cleanup(remove_unused_graph_inputs=False)
    if any(name in decoder.tensors() for name in gone_in):
        raise ElxError(f"pass {NAME} could not remove every use of the cross values; report this model")

    after = manifest.copy()
    for name, graph in ((after.step, decoder), (STAGE, cross)):
        spec = after.graphs[name]
        file = pass_file(spec["file"], suffix)
        spec["external_data"] = save_graph(graph, after.folder, file)
        spec["file"] = file
    step = after.graphs[after.step]
    step["inputs"] = {n: s for n, s in step["inputs"].items() if n not in gone_in}
    stage = after.graphs[STAGE]
    stage["outputs"] = {n: s for n, s in stage["outputs"].items() if n not in gone_out}
    after.data["cache"]["cross"]["values"] = (
        "recomputed from keys (slim-cross): (P_i·K)·W_KV,i + c_i; keys [batch, h, N, d_kv]")
    return after


def apply(folder: Path, manifest: Manifest, argument: str | None) -> dict:
    refuse_twice(manifest, NAME)
    skip_bad = parse_argument(argument)
    if "el" in manifest.pass_names():
        raise ElxError("pass slim-cross shrinks the cross-attention cache that el removes; use one of them")
    if STAGE not in manifest.graphs or STAGE not in manifest.stages:
        raise ElxError(f"pass slim-cross needs the {STAGE} graph (cross-attention keys and values); "
                       "this export has none")
    layers = cross_layers(manifest)
    if not layers:
        raise ElxError("pass slim-cross: the decoder reads no cross-attention values (already applied?); "
                       "export again from the model")
    bad, reference = _analyse_layers(manifest, layers), RuntimeSide(manifest.copy())
    with CandidateSides() as sides:
        after, done, report = verified_rewrite(
            folder, manifest, NAME, WHERE, layers, bad, skip_bad,
            candidate=lambda todo, suffix: _candidate(manifest, todo, suffix),
            verify=lambda candidate, todo, seed, probe=False: verify_rewrite(manifest, candidate, seed=seed,
                                                                             reference=reference, sides=sides),
            estimate=True)
    adopt(folder, manifest, after)
    return record(NAME, argument, layers, done, bad, report,
                  cache="cross keys only: past_key_values.{i}.encoder.key [batch, h, N, d_kv] from cross_kv; "
                        "values recomputed in the decoder as (P_i·K)·W_KV,i + c_i")
