"""``--pass el-self`` on decoder-only exports (GPT-2): the prompt's X at batch B shared by all beams,
the generated tokens' X per beam (Yan et al., seed 000, §3.2 and App. B; ``el_self.py`` has the
encoder-decoder form and the helpers both use).

Math, in the paper's notation.  A decoder-only export keeps, per layer, the prompt's keys and
values once per item (K_p, V_p ∈ R^{P×h·d_k}, batch B, ``exporter/capture/shared_prompt.py``) and the
generated tokens' per beam (K_g, V_g ∈ R^{G×h·d_k}).  Both are projections of the layer's
attention input X (the output of ``ln_1``, [t, D] per row): GPT-2's fused ``c_attn`` computes
[Q | K | V] = X·W + b in one Conv1D, so W_K, b_K (W_V, b_V) are the second (third) column block
of W, b (``qkv.py`` finds the split).  For query row q (head i, scale c = d_k^-1/2), with
the prompt's padding mask m_p and G' = G + t generated keys,

    s_p,i = c·q_i·K_p,iᵀ + m_p        s_g,i = c·q_i·K_g,iᵀ        A_i = softmax([s_p,i ; s_g,i])
    o_i   = A_i[:P]·V_p,i + A_i[P:]·V_g,i

EL-attention substitutes K = X·W_K + 1·b_K and V = X·W_V + 1·b_V:

    c·q_i·K_iᵀ = c·(q_i·W_K,iᵀ)·Xᵀ + c·(q_i·b_K,iᵀ)·1ᵀ

The second term is one number per query row and head, the same for every key of both parts (same
q_i, same b_K,i: both parts come from one c_attn; same c), so it shifts the whole concatenated row
[s_p,i ; s_g,i] by a constant and softmax(z + a·1) = softmax(z): b_K drops out.  The graph is
checked for exactly this before anything is rewritten: each part reaches the Concat only through
scalar scales (equal products in both parts) and additive terms (masks), the prompt part also
through Reshape/Transpose that move whole rows (last axis kept), the prompt queries are the same
queries regrouped, and the Concat (last axis) feeds the Softmax (last axis).  For the values,
with A_p = A[:P], A_g = A[P:] the two complementary Slices of that one Softmax (checked in the
graph) and the rows of A summing to 1,

    o_i = (A_p·X_p)·W_V,i + (A_g·X_g)·W_V,i + (A_p·1 + A_g·1)·b_V,i
        = (A_p·X_p)·W_V,i + (A_g·X_g)·W_V,i + b_V,i

so b_V,i is added once, to the generated part, and the two parts must be summed by one Add
(checked).  The cache per layer: the prompt's X_p [B, P, D] (``prompt_hidden.{i}``, per-input
state, read by every beam of the item) and the generated X_g [rows, G, D] (``past_hidden.{i}``,
per beam), instead of K and V [·, h, ·, d_k] each: D/(2·h·d_k) of both (1/2 for GPT-2, h·d_k = D).
The prefill graph outputs X_p (``present_hidden.{i}``, an Identity of ``ln_1``'s output) instead
of the prompt's K and V; it still computes them for its own attention.

With a per-beam prompt cache (``--prompt-cache per-beam``) the step graph is plain attention over
[prompt ; generated] per row: the encoder-decoder rewrite applies as it is, and the cache entry
is filled from the prefill's X_p at the first step (``init``), one copy per beam.

Rewrite (``el_self.expanded_scores`` / ``values_from_states``, rows R = B for the prompt part,
whose query axis holds the k·t queries of an item's beams):
    MatMul(q_items, K_pᵀ) → (q_items·W_K,iᵀ)·X_pᵀ        MatMul(A_p', V_p) → (A_p'·X_p)·W_V,i
    MatMul(q, K_gᵀ)       → (q·W_K,iᵀ)·X_gᵀ              MatMul(A_g, V_g)  → (A_g·X_g)·W_V,i + b_V,i
with X_g = Concat(past_hidden, x; axis 1) → present_hidden.  Masks, scale, Concat, Softmax, the
Slices, the regrouping Reshape/Transposes and the head merge stay as exported.

Verification: as for every pass (``exporter/verification/verify.py``): the prefill and one step after a random
generated past, at several (batch, beams, prompt width, past) shapes with left-padded prompts,
through the runner; the generated past comes from random states X shaped by ``ln_1``'s γ, β
(K = X·W_K + b_K and V = X·W_V + b_V for the original); ≤ 1e-4 or nothing is written.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx_graphsurgeon as gs

from elx.runners.errors import ElxError
from elx.runners.manifest import Manifest

from elx.exporter.passes import el_self
from elx.exporter.passes.el_self import NAME, SelfLayer, _Consts, _become, _reader, _redirect_shape_reads
from elx.exporter.passes.qkv import head_projection
from elx.exporter.passes.rewrite import Builder, constant_value, load_graph, pass_file, producer, save_graph
from elx.exporter.passes.slim_math import Unfit

NAMES = ("past_hidden.{}", "present_hidden.{}")  # the generated part's X cache (step input, step output)
PROMPT = "prompt_hidden.{}"  # the step's input of the prompt's X, batch B
PREFILL = "present_hidden.{}"  # the prefill's output of the prompt's X
REGROUP = ("Reshape", "Transpose")


@dataclass
class PromptLayer(SelfLayer):
    """A decoder-only layer: the generated part (``SelfLayer``), the prompt's K/V inputs and their prefill sources."""

    prompt_key: str | None = None  # step input [B, h, P, d_k] (beam-shared prompt); None: per-beam
    prompt_value: str | None = None
    source_key: str = ""  # the prefill output holding the prompt's keys / values
    source_value: str = ""
    qk_prompt: gs.Node | None = None  # MatMul(q_items, K_pᵀ)
    pv_prompt: gs.Node | None = None  # MatMul(A_p', V_p)

    @property
    def prompt(self) -> str:
        return PROMPT.format(self.index)

    @property
    def prefill_output(self) -> str:
        return PREFILL.format(self.index)


def layers_of(manifest: Manifest) -> list[PromptLayer]:
    """The cache's key/value pairs, each with its prompt part: a beam-shared step input fed from a stage
    (``prompt_key_values.{i}.key|value``) or the cache entry's ``init`` (per-beam)."""
    inputs = manifest.graphs[manifest.step]["inputs"]
    shared = {}
    for name, spec in inputs.items():
        source = spec.get("from", "")
        parts = name.split(".")
        if source.partition(":")[0] in manifest.stages and len(parts) == 3 and parts[1].isdigit() \
                and parts[2] in ("key", "value"):
            shared[(int(parts[1]), parts[2])] = (name, source.partition(":")[2])
    inits = {e["input"]: e.get("init", "") for e in manifest.cache_entries}
    layers = []
    for pair in el_self.self_layers(manifest):
        layer = PromptLayer(pair.index, pair.key_input, pair.key_output, pair.value_input, pair.value_output,
                            names=NAMES)
        if (pair.index, "key") in shared and (pair.index, "value") in shared:
            (layer.prompt_key, layer.source_key), (layer.prompt_value, layer.source_value) = (
                shared[(pair.index, "key")], shared[(pair.index, "value")])
        elif inits.get(pair.key_input) and inits.get(pair.value_input):
            layer.source_key, layer.source_value = (inits[n].partition(":")[2] for n in (pair.key_input,
                                                                                         pair.value_input))
        else:
            raise ElxError(f"pass {NAME}: decoder-only layer {pair.index} has no prompt keys/values from a stage "
                           "(neither prompt_key_values inputs nor a cache init); export again from the model")
        layers.append(layer)
    return layers


def prefill_stage(manifest: Manifest) -> str:
    stages = {source.partition(":")[0] for source in _prompt_sources(manifest)}
    if len(stages) != 1:
        raise ElxError(f"pass {NAME}: the prompt's keys/values come from {sorted(stages)}, expected one prefill stage; "
                       "export again from the model")
    return stages.pop()


def _prompt_sources(manifest: Manifest) -> list[str]:
    sources = [spec["from"] for spec in manifest.graphs[manifest.step]["inputs"].values()
               if spec["from"].partition(":")[0] in manifest.stages and spec["from"].endswith((".key", ".value"))]
    return sources + [e["init"] for e in manifest.cache_entries if e.get("init")]


# -- matching the beam-shared step graph -------------------------------------------------------------

def _regrouped_from(tensor, target) -> bool:
    """Whether ``tensor`` is ``target`` regrouped by Reshape/Transpose only."""
    while tensor is not target:
        node = producer(tensor)
        if node is None or node.op not in REGROUP:
            return False
        tensor = node.inputs[0]
    return True


def _keeps_rows(node: gs.Node) -> bool:
    """A Reshape (sizes checked by verification) or a Transpose that keeps the last (key) axis last."""
    perm = list(node.attrs.get("perm", []))
    return node.op == "Reshape" or (node.op == "Transpose" and perm and perm[-1] == len(perm) - 1)


def _slice(node: gs.Node) -> dict:
    """A Slice over the last axis with step 1: its data, start and end tensors."""
    if node.op != "Slice" or len(node.inputs) < 4:
        raise Unfit(f"the attention probabilities feed a {node.op}, expected Slices of the key axis")
    axes = constant_value(node.inputs[3])
    steps = constant_value(node.inputs[4]) if len(node.inputs) > 4 else np.array([1])
    if axes is None or list(np.reshape(axes, -1)) not in ([3], [-1]) or steps is None or list(np.reshape(steps, -1)) != [1]:
        raise Unfit("the attention probabilities are sliced along another axis or with a step")
    return {"data": node.inputs[0], "start": node.inputs[1], "end": node.inputs[2]}


def _width_of(tensor, prompt_keys) -> bool:
    """Whether ``tensor`` is the prompt's width P: Shape(·)[2:3] of a [B, h, P, d_k] tensor whose P is the
    same (symbolic) size as ``prompt_keys``' (the export reads it off any layer's prompt keys or values)."""
    node = producer(tensor)
    if node is None or node.op != "Shape" or node.attrs.get("start") != 2 or node.attrs.get("end") != 3:
        return False
    shape, width = node.inputs[0].shape, prompt_keys.shape[2] if prompt_keys.shape else None
    return bool(shape) and len(shape) == 4 and width is not None and shape[2] == width


def match_shared(graph: gs.Graph, layer: PromptLayer, d_model: int, heads: int, d_kv: int) -> None:
    """Bind a beam-shared-prompt layer (see the module doc for what is checked and why)."""
    tensors = el_self.match_projections(graph, layer, d_model, heads, d_kv)
    for name in (layer.prompt_key, layer.prompt_value):
        if name not in tensors:
            raise Unfit(f"{name} is not in the decoder graph")
    layer.qk = el_self.scores_matmul(tensors[layer.key_output], layer.key_output)
    layer.qk_prompt = el_self.scores_matmul(tensors[layer.prompt_key], layer.prompt_key)
    if not _regrouped_from(layer.qk_prompt.inputs[0], layer.qk.inputs[0]):
        raise Unfit("the prompt's scores are not computed from the same queries regrouped")
    gen_scale, gen_scores, concat = el_self.scaled_scores(layer.qk.outputs[0])
    prompt_scale, prompt_scores, prompt_concat = el_self.scaled_scores(layer.qk_prompt.outputs[0], REGROUP)
    regroups = [n for n in _path(layer.qk_prompt.outputs[0], prompt_scores) if n.op in REGROUP]
    if not all(_keeps_rows(n) for n in regroups):
        raise Unfit("the prompt's scores are transposed across the key axis before the softmax")
    if concat is not prompt_concat or concat.op != "Concat" or concat.attrs.get("axis") not in (-1, 3) \
            or len(concat.inputs) != 2 or concat.inputs[0] is not prompt_scores or concat.inputs[1] is not gen_scores:
        raise Unfit("the prompt's and the generated scores are not concatenated [prompt ; generated] along the keys")
    if gen_scale != prompt_scale:
        raise Unfit(f"the prompt's scores are scaled by {prompt_scale}, the generated by {gen_scale}: q·b_K would "
                    "not cancel")
    softmax = _reader(concat.outputs[0], "the concatenated scores")
    if not el_self.is_key_softmax(softmax):
        raise Unfit(f"the concatenated scores reach a {softmax.op}, expected a Softmax over the keys")
    layer.pv = _reader(tensors[layer.value_output], layer.value_output)
    layer.pv_prompt = _reader(tensors[layer.prompt_value], layer.prompt_value)
    for node, values in ((layer.pv, layer.value_output), (layer.pv_prompt, layer.prompt_value)):
        if node.op != "MatMul" or node.inputs[1] is not tensors[values]:
            raise Unfit(f"{values} is not multiplied by attention probabilities")
    _check_value_parts(layer, softmax.outputs[0], tensors[layer.prompt_key])


def _path(start, end) -> list:
    """The nodes from ``start`` down to ``end`` along single non-Shape consumers."""
    nodes, current = [], start
    while current is not end:
        node = _reader(current, "the scores")
        nodes.append(node)
        current = node.outputs[0]
    return nodes


def _check_value_parts(layer: PromptLayer, probs, prompt_keys) -> None:
    """A_p and A_g are the complementary Slices [0, P) and [P, end) of one softmax, and o_p + o_g is one Add."""
    gen = producer(layer.pv.inputs[0])
    prompt = producer(layer.pv_prompt.inputs[0])
    while prompt is not None and prompt.op in REGROUP:
        prompt = producer(prompt.inputs[0])
    if gen is None or prompt is None:
        raise Unfit("the value products do not read slices of the probabilities")
    gen_slice, prompt_slice = _slice(gen), _slice(prompt)
    start, end = constant_value(prompt_slice["start"]), constant_value(gen_slice["end"])
    if gen_slice["data"] is not probs or prompt_slice["data"] is not probs:
        raise Unfit("the value products read slices of different probabilities")
    if start is None or np.reshape(start, -1).tolist() != [0] or gen_slice["start"] is not prompt_slice["end"] \
            or not _width_of(prompt_slice["end"], prompt_keys) or end is None or int(np.reshape(end, -1)[0]) < 2 ** 31:
        raise Unfit("the value products do not read the probabilities' [0, P) and [P, end) parts")
    add = _reader(layer.pv.outputs[0], "the generated values")
    current = layer.pv_prompt.outputs[0]
    node = _reader(current, "the prompt's values")
    while node.op in REGROUP:
        current, node = node.outputs[0], _reader(node.outputs[0], "the prompt's values")
    if add.op != "Add" or node is not add or set(map(id, add.inputs)) != {id(current), id(layer.pv.outputs[0])}:
        raise Unfit("the prompt's and the generated values are not summed by one Add")


# -- rewriting ----------------------------------------------------------------------------------------

def rewrite_prompt_part(graph: gs.Graph, layers: list[PromptLayer], d_model: int, heads: int, d_kv: int,
                        wide: frozenset = frozenset()) -> None:
    """The beam-shared prompt's products read X_p (``prompt_hidden.{i}`` [B, P, D]) instead of K_p, V_p."""
    build = Builder(graph, f"{NAME}/prompt")
    consts = _Consts(build, d_model, heads, d_kv)
    tensors = graph.tensors()
    swap = {}
    for layer in layers:
        tag = f"prompt{layer.index}"
        x_p = gs.Variable(layer.prompt, dtype=np.float32, shape=["batch", "prompt_sequence", d_model])
        w_k_t, w_v = el_self.head_weights(layer, d_model, heads, d_kv)
        _become(layer.qk_prompt, el_self.expanded_scores(build, consts, layer.qk_prompt.inputs[0], x_p, w_k_t, tag, wide))
        _become(layer.pv_prompt, el_self.values_from_states(build, consts, layer.pv_prompt.inputs[0], x_p, w_v, None,
                                                            tag, wide))
        for name in (layer.prompt_key, layer.prompt_value):
            _redirect_shape_reads(build, consts, tensors[name], x_p)
        swap[layer.prompt_key], swap[layer.prompt_value] = x_p, None
    graph.inputs = [swap.get(t.name, t) for t in graph.inputs if swap.get(t.name, t) is not None]


def rewrite_prefill(graph: gs.Graph, layers: list[PromptLayer]) -> None:
    """The prefill outputs each layer's X_p (the input of its K/V projection) instead of the prompt's K and V."""
    tensors = graph.tensors()
    swap = {}
    for layer in layers:
        for name in (layer.source_key, layer.source_value):
            if name not in tensors:
                raise Unfit(f"{name} is not in the prefill graph")
        k, v = head_projection(tensors[layer.source_key]), head_projection(tensors[layer.source_value])
        if k.x is not v.x:
            raise Unfit(f"the prefill's {layer.source_key} and {layer.source_value} project different inputs")
        out = gs.Variable(layer.prefill_output, dtype=np.float32, shape=["batch", "prompt_sequence", k.w.shape[0]])
        graph.nodes.append(gs.Node("Identity", f"{NAME}/prefill{layer.index}_X", inputs=[k.x], outputs=[out]))
        swap[layer.source_key], swap[layer.source_value] = out, None
    graph.outputs = [swap.get(t.name, t) for t in graph.outputs if swap.get(t.name, t) is not None]


# -- the candidate manifest -------------------------------------------------------------------------

def candidate(manifest: Manifest, wide: frozenset = frozenset()) -> tuple[Manifest, list[PromptLayer]]:
    """A copy of ``manifest`` whose prefill outputs X_p and whose step caches X (both graphs saved as new files)."""
    dims = manifest.dims
    d_model, heads, d_kv = dims["d_model"], dims["num_heads"], dims["d_kv"]
    layers = layers_of(manifest)
    shared = layers[0].prompt_key is not None
    stage = prefill_stage(manifest)
    step, prefill = load_graph(manifest, manifest.step), load_graph(manifest, stage)
    for layer in layers:
        try:
            (match_shared if shared else el_self.match)(step, layer, d_model, heads, d_kv)
        except Unfit as why:
            raise ElxError(f"pass {NAME}: self-attention layer {layer.index}: {why}; nothing was written")
    try:
        rewrite_prefill(prefill, layers)
    except Unfit as why:
        raise ElxError(f"pass {NAME}: the {stage} graph: {why}; nothing was written")
    if shared:
        rewrite_prompt_part(step, layers, d_model, heads, d_kv, wide)
    el_self.rewrite(step, layers, d_model, heads, d_kv, wide)
    after = manifest.copy()
    for name, graph in ((manifest.step, step), (stage, prefill)):
        spec = after.graphs[name]
        spec["file"] = pass_file(spec["file"], NAME)
        spec["external_data"] = save_graph(graph, after.folder, spec["file"])
    _describe(after, stage, layers, d_model, shared)
    return after, layers


def _describe(after: Manifest, stage: str, layers: list[PromptLayer], d_model: int, shared: bool) -> None:
    swap = el_self._swap
    prompt_shape = ["batch", "prompt_sequence", d_model]
    past_shape, present_shape = ["rows", "past_sequence", d_model], ["rows", "past_sequence + 1", d_model]
    prefill = after.graphs[stage]
    prefill["outputs"] = _swap_names(prefill["outputs"], {layer.source_key: (layer.source_value, {
        layer.prefill_output: {"dtype": "float32", "shape": prompt_shape}}) for layer in layers})
    step = after.graphs[after.step]
    inputs = step["inputs"]
    if shared:
        inputs = _swap_names(inputs, {layer.prompt_key: (layer.prompt_value, {layer.prompt: {
            "dtype": "float32", "shape": prompt_shape, "from": f"{stage}:{layer.prefill_output}"}}) for layer in layers})
    step["inputs"] = swap(inputs, layers, {layer.key_input: {layer.past: {
        "dtype": "float32", "shape": past_shape, "from": f"cache:{layer.present}"}} for layer in layers})
    step["outputs"] = swap(step["outputs"], layers, {layer.key_output: {layer.present: {
        "dtype": "float32", "shape": present_shape}} for layer in layers})
    entries = {e["input"]: e for e in after.cache_entries}
    new = {}
    for layer in layers:
        entry = {"input": layer.past, "output": layer.present, "dtype": "float32", "shape": past_shape, "seq_axis": 1}
        if not shared:
            entry["init"] = f"{stage}:{layer.prefill_output}"
        new[layer.key_input] = {layer.past: entry}
    after.data["cache"]["self"] = list(swap(entries, layers, new).values())
    prompt = after.data["cache"].setdefault("prompt", {})
    if shared:
        prompt["holds"] = (f"{PROMPT.format('{i}')}: the prompt's attention inputs X [batch, prompt_sequence, "
                           f"{d_model}] per layer, read by every beam ({NAME})")
    else:
        prompt["holds"] = (f"{stage}:{PREFILL.format('{i}')}: the prompt's attention inputs X [batch, prompt_sequence, "
                           f"{d_model}] per layer, copied per beam into {NAMES[0].format('{i}')} ({NAME})")


def _swap_names(entries: dict, new: dict) -> dict:
    """``entries`` with each key of ``new`` replaced by ``new[key][1]`` and ``new[key][0]`` dropped."""
    dropped = {value for value, _ in new.values()}
    out = {}
    for name, spec in entries.items():
        if name in new:
            out.update(new[name][1])
        elif name not in dropped:
            out[name] = spec
    return out


def apply(folder: Path, manifest: Manifest, argument: str | None) -> dict:
    """el-self on a decoder-only export: the prompt's X_p once per input and the generated tokens' X per beam."""
    record = el_self.run(folder, manifest, argument, candidate)
    heads, d_kv = manifest.dims["num_heads"], manifest.dims["d_kv"]
    record["prompt"] = manifest.data["cache"]["prompt"]["holds"] + f" instead of K and V [·, {heads}, ·, {d_kv}]"
    record["prompt_cache_ratio"] = record["self_cache_ratio"]
    return record
