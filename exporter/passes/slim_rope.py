"""``--pass slim`` on decoder-only exports with rotary positions: a K-only cache holding the keys before RoPE
(Graef & Wasielewski, seed 002, §3 "Support for RoPE", option 1; §4 for the K/V biases).

Math, in the paper's notation.  Per layer and head i, X ∈ R^{n×d} the attention inputs of n positions,
h heads of width d_k with h·d_k = d (MHA), query position m, key positions n:

    K = X·W_K + b_K        V = X·W_V + b_V        W_K, W_V ∈ R^{d×d}
    s_i = c·(R_m·q_i)·(R_n·K_n,i)ᵀ + M        o_i = softmax(s_i)·V_i

where R_n rotates each head's rotary dims by angles n·θ (RoPE, HF's rotate-half layout, partial
rotary and YaRN's attention factor included).  RoPE acts on Q and K, never on V.  Option 1 keeps
K *before* RoPE in the cache, K_raw = X·W_K + b_K, and rotates the keys after reading them, each
with its own position n.  With W_K invertible, X = (K_raw − b_K)·W_K⁻¹, so V is an affine function
of K_raw:

    V_i = K_raw·W_KV,i + (b_V,i − b_K·W_KV,i),        W_KV,i = W_K⁻¹·W_V,i ∈ R^{d×d_k}

Qwen2's b_K stays in the cached K_raw (§4 drops b_K only where no RoPE sits between the projection
and the dot product: R_n·b_K depends on n); subtracting b_K·W_KV is the exact affine relation.
Because the attention probabilities P of a query sum to 1,

    o_i = P_i·V_i = (P_i·K_raw)·W_KV,i + c_i,        c_i = b_V,i − b_K·W_KV,i

computed in §2's cheaper order (P times the full-width K_raw, then the small W_KV,i; ``slim.values_from_keys``).
The beam-shared prompt (``exporter/capture/shared_prompt.py``) splits P into A_p (the prompt's keys, batch B)
and A_g (the generated keys, per beam), complementary slices of one softmax (A_p·1 + A_g·1 = 1):

    o_i = (A_p·K_raw,p)·W_KV,i + (A_g·K_raw,g)·W_KV,i + c_i        (c_i added once, to the generated part)

No V is stored: the prefill outputs the prompt's K_raw (``present.{i}.key``, now before RoPE) and no
values; the cache holds the generated tokens' K_raw: half the self-attention state of the prompt and of
the generated tokens.  GQA/MQA are refused: there W_K is [d, h_kv·d_k] with h_kv·d_k < d, K does not
determine X, and V is no function of K (the paper: MHA models only).

Key positions, as HF gives them (``runners/inputs/prompt.py``):

* generated keys (both prompt-cache forms): the step's position p and its G + 1 generated keys sit at
  p − G, …, p (generated tokens take consecutive positions);
* the shared prompt's keys: the prompt's position ids, a new step input (``prompt:position_ids``, batch B);
* the per-beam form's one cache [rows, h, S, d_k] (prompt and generated keys): cumsum(attention_mask) − 1,
  HF's rule (a padding key gets some position; its probability is 0).

The rotation is the graph's own: the nodes between K's head split and the cache concat (R_n) are
cloned onto the cached keys, and the nodes computing cos/sin from ``position_ids`` onto the key
positions, so each key gets exactly the function HF applied, at its own position.  Each step then
rotates all S keys it reads (a few elementwise ops on [rows, h, S, d_k]) instead of the new one only.

Verification (``culprits.verified_rewrite``): per layer cond(W_K) and the K→V reconstruction error
(``slim_math.analyse``), then the rewritten folder against the original through the runner at the
decoder-only shapes, each side running the prompt and then the case's prefix tokens one step at a
time (``RuntimeSide(prefill=True)``: each fills its own cache from real states), at three seeds,
within half the 1e-4 tolerance; ``slim=skip-bad`` keeps K and V (rotated) for the layers that fail.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx_graphsurgeon as gs

from elx.runners.errors import ElxError
from elx.runners.manifest import Manifest

from elx.exporter.verification.verify import CandidateSides, RecordedSide, RuntimeSide, default_shapes, measure
from elx.exporter.passes import slim
from elx.exporter.passes.catalog import GQA
from elx.exporter.passes.culprits import VERIFY_SEEDS, verified_rewrite
from elx.exporter.passes.el_self_decoder_only import PromptLayer, _check_value_parts, _reader, layers_of, prefill_stage
from elx.exporter.passes.qkv import head_projection
from elx.exporter.passes.rewrite import Builder, adopt, load_graph, pass_file, producer, refuse_twice, save_graph
from elx.exporter.passes.slim_math import Unfit, analyse

NAME = slim.NAME
PROMPT_POSITIONS = "prompt_position_ids"  # the shared form's step input of the prompt's position ids
POSITION_IDS = "position_ids"  # the step's (and the prefill's) position input
MASK = "attention_mask"  # the per-beam step's mask over every position so far


@dataclass
class Rotation:
    """RoPE between K's head split and the cache: ``raw`` (K before it), ``rotated`` (what the graph caches),
    the ``nodes`` in between (topological order) and their ``positional`` inputs (cos/sin of ``position_ids``)."""

    raw: gs.Variable
    rotated: gs.Variable
    nodes: list
    positional: list


@dataclass
class RopeLayer:
    """A decoder-only layer (the cache and prompt names of ``el_self_decoder_only.layers_of``) and what slim binds."""

    names: PromptLayer
    analysis: object = None
    parts: dict = field(default_factory=dict)  # the bound graph pieces (rebound per candidate graph)

    @property
    def index(self) -> int:
        return self.names.index


# -- structure: ancestors, the rotation, the positions ---------------------------------------------------------

def _ancestors(tensor) -> set:
    """ids of the nodes ``tensor`` is computed from."""
    seen, stack = set(), [tensor]
    while stack:
        node = producer(stack.pop())
        if node is not None and id(node) not in seen:
            seen.add(id(node))
            stack.extend(node.inputs)
    return seen


def _descendants(tensor) -> set:
    seen, stack = set(), [tensor]
    while stack:
        for node in stack.pop().outputs:
            if id(node) not in seen:
                seen.add(id(node))
                stack.extend(node.outputs)
    return seen


def _from_positions(tensor, positions) -> bool:
    """Whether ``tensor`` is computed from ``positions`` and constants only (cos/sin of the position ids)."""
    found, seen, stack = False, set(), [tensor]
    while stack:
        current = stack.pop()
        if current is positions:
            found = True
            continue
        if isinstance(current, gs.Constant):
            continue
        node = producer(current)
        if node is None:
            return False  # another graph input
        if id(node) not in seen:
            seen.add(id(node))
            stack.extend(node.inputs)
    return found


_NORMS = ("ReduceMean", "ReduceL2", "LayerNormalization", "RMSNormalization", "SimplifiedLayerNormalization",
          "Sqrt", "Reciprocal")


def _visited(tensor, limit: int = 64) -> list:
    """The tensors above ``tensor`` (its nearest ``limit`` ancestors' outputs, breadth first)."""
    out, queue, seen = [], [tensor], set()
    while queue and len(out) < limit:
        current = queue.pop(0)
        node = producer(current)
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        out.append(current)
        queue.extend(t for t in node.inputs if not isinstance(t, gs.Constant))
    return out


def find_rotation(graph: gs.Graph, rotated, x) -> Rotation:
    """The RoPE nodes turning K = head-split(x·W_K + b_K) into ``rotated`` (see the module doc)."""
    positions = graph.tensors().get(POSITION_IDS)
    raw, queue, seen = None, [rotated], set()
    while queue and raw is None:  # the nearest head-split projection of x above ``rotated``
        tensor = queue.pop(0)
        if tensor is not rotated:
            try:
                if head_projection(tensor).x is x:
                    raw = tensor
                    break
            except Unfit:
                pass
        node = producer(tensor)
        if node is not None and id(node) not in seen:
            seen.add(id(node))
            queue.extend(t for t in node.inputs if not isinstance(t, gs.Constant))
    if raw is None:
        found = {producer(t).op for t in _visited(rotated) if producer(t) is not None}
        norms = [op for op in _NORMS if op in found]
        if norms:  # Qwen3's k_norm (the catalog refuses the family at once; this names it for any other)
            raise Unfit(f"K is normalized per head (a {norms[0]} between K's projection and the cache) before RoPE, so "
                        "the cached K is no affine function of the layer's input and V is no function of the cached K")
        raise Unfit(f"{rotated.name} is not computed from a head-split projection of the layer's input")
    if raw is rotated:
        raise Unfit("no rotary embedding between K's projection and the cache")
    inside = _ancestors(rotated) & _descendants(raw)
    nodes = [n for n in graph.nodes if id(n) in inside]
    made = {id(out) for n in nodes for out in n.outputs}
    positional = []
    for node in nodes:
        for tensor in node.inputs:
            if tensor is raw or id(tensor) in made or isinstance(tensor, gs.Constant):
                continue
            if positions is None or not _from_positions(tensor, positions):
                raise Unfit(f"the rotation of K reads {tensor.name}, which is neither a constant nor computed from "
                            f"{POSITION_IDS}")
            if all(t is not tensor for t in positional):
                positional.append(tensor)
    if not positional:
        raise Unfit("the rotation of K does not depend on the positions")
    return Rotation(raw, rotated, nodes, positional)


def _position_nodes(graph: gs.Graph, positional: list) -> list:
    """The nodes computing ``positional`` (cos/sin) from ``position_ids``, topological order."""
    positions = graph.tensors()[POSITION_IDS]
    inside = set()
    for tensor in positional:
        inside |= _ancestors(tensor)
    inside &= _descendants(positions)
    return [n for n in graph.nodes if id(n) in inside]


class Rotator:
    """Clones a graph's RoPE onto other keys at other positions (cos/sin computed once per positions tensor)."""

    def __init__(self, graph: gs.Graph, build: Builder):
        self.graph, self.build = graph, build
        self._cos_sin = {}  # positions tensor name → {original tensor name: clone}

    def _clone(self, nodes: list, mapping: dict, tag: str) -> dict:
        for node in nodes:
            inputs = [mapping.get(t.name, t) for t in node.inputs]
            outputs = [gs.Variable(self.build._name(f"{tag}_{out.name}"), dtype=out.dtype) for out in node.outputs]
            self.graph.nodes.append(gs.Node(node.op, self.build._name(f"{tag}_{node.op}"), attrs=dict(node.attrs),
                                            inputs=inputs, outputs=outputs))
            mapping.update({old.name: new for old, new in zip(node.outputs, outputs)})
        return mapping

    def rotate(self, rotation: Rotation, keys, positions, pos_nodes: list, tag: str):
        """R_n·``keys`` [N, h, S, d_k] with key positions ``positions`` [N, S] (int64)."""
        if positions.name not in self._cos_sin:
            self._cos_sin[positions.name] = self._clone(pos_nodes, {POSITION_IDS: positions}, f"pos{len(self._cos_sin)}")
        mapping = dict(self._cos_sin[positions.name])
        mapping[rotation.raw.name] = keys
        return self._clone(rotation.nodes, mapping, tag)[rotation.rotated.name]


def generated_positions(build: Builder, position_ids, keys):
    """p − G, …, p for the step's positions p [rows, 1] and the G + 1 keys [rows, h, G + 1, d_k]: [rows, G + 1]."""
    op, const = build.op, build.const
    count = op("Shape", [keys], "key_count", start=2, end=3)  # [1]
    last = op("Sub", [count, const("one", np.array([1], np.int64))], "last_key")
    offsets = op("Range", [const("zero", np.array(0, np.int64)), op("Squeeze", [count], "count_scalar"),
                           const("step", np.array(1, np.int64))], "key_offsets")  # [G + 1]
    first = op("Sub", [position_ids, last], "first_position")  # [rows, 1]
    return op("Add", [first, op("Unsqueeze", [offsets, const("axis0", np.array([0], np.int64))], "offsets_row")],
              "key_positions")


def mask_positions(build: Builder, mask):
    """cumsum(mask) − 1 over the keys [rows, S] (HF's positions; padding keys get some position)."""
    total = build.op("CumSum", [mask, build.const("axis1", np.array(1, np.int64))], "mask_cumsum")
    return build.op("Sub", [total, build.const("one", np.array(1, np.int64))], "mask_positions")


# -- matching ---------------------------------------------------------------------------------------------------

def _concat(tensors: dict, past: str, present: str) -> gs.Node:
    node = producer(tensors[present])
    if node is None or node.op != "Concat" or len(node.inputs) != 2 or node.inputs[0] is not tensors[past] \
            or node.attrs.get("axis") not in (2, -2):
        raise Unfit(f"{present} is not Concat({past}, new) along the sequence axis of [rows, h, P, d_k]")
    return node


def match_step(graph: gs.Graph, layer: RopeLayer, shared: bool) -> None:
    """Bind the step graph's pieces of ``layer`` (see the module doc for what is checked)."""
    names, tensors = layer.names, graph.tensors()
    for name in (names.key_input, names.key_output, names.value_input, names.value_output,
                 *((names.prompt_key, names.prompt_value) if shared else ())):
        if name not in tensors:
            raise Unfit(f"{name} is not in the decoder graph")
    concat_k = _concat(tensors, names.key_input, names.key_output)
    concat_v = _concat(tensors, names.value_input, names.value_output)
    v = head_projection(concat_v.inputs[1])
    rotation = find_rotation(graph, concat_k.inputs[1], v.x)
    k = head_projection(rotation.raw)
    pv = _reader(tensors[names.value_output], names.value_output)
    if pv.op != "MatMul" or pv.inputs[1] is not tensors[names.value_output]:
        raise Unfit(f"{names.value_output} is not multiplied by attention probabilities")
    parts = dict(k=k, v=v, rotation=rotation, concat_k=concat_k, concat_v=concat_v, pv=pv)
    if shared:
        names.pv = pv
        names.pv_prompt = _reader(tensors[names.prompt_value], names.prompt_value)
        if names.pv_prompt.op != "MatMul" or names.pv_prompt.inputs[1] is not tensors[names.prompt_value]:
            raise Unfit(f"{names.prompt_value} is not multiplied by attention probabilities")
        softmax = producer(producer(pv.inputs[0]).inputs[0]) if producer(pv.inputs[0]) is not None else None
        if softmax is None or softmax.op != "Softmax" or softmax.attrs.get("axis", -1) not in (-1, 3):
            raise Unfit("the generated keys' probabilities are not a slice of a Softmax over the keys")
        _check_value_parts(names, softmax.outputs[0], tensors[names.prompt_key])  # A_p, A_g complementary, one Add
        parts["pv_prompt"] = names.pv_prompt
    else:
        softmax = producer(pv.inputs[0])
        if softmax is None or softmax.op != "Softmax" or softmax.attrs.get("axis", -1) not in (-1, 3):
            raise Unfit(f"the probabilities multiplying {names.value_output} are not a Softmax over the keys")
    layer.parts = parts


def match_prefill(graph: gs.Graph, layer: RopeLayer) -> dict:
    names, tensors = layer.names, graph.tensors()
    for name in (names.source_key, names.source_value):
        if name not in tensors:
            raise Unfit(f"{name} is not in the prefill graph")
    v = head_projection(tensors[names.source_value])
    return dict(rotation=find_rotation(graph, tensors[names.source_key], v.x))


# -- rewriting ----------------------------------------------------------------------------------------------------

def _swap_input(node: gs.Node, tensor, replacement) -> None:
    for i, t in enumerate(list(node.inputs)):
        if t is tensor:
            node.inputs[i] = replacement


def _readers(tensor) -> list:
    """The non-Shape readers of ``tensor`` (taken before nodes reading it are added)."""
    return [node for node in tensor.outputs if node.op != "Shape"]


def _read_from(readers: list, tensor, replacement) -> None:
    """``readers`` read ``replacement`` instead of ``tensor``."""
    for node in readers:
        _swap_input(node, tensor, replacement)


def _shapes_from(tensor, replacement, keep=()) -> None:
    """Shape readers of ``tensor`` read ``replacement`` (same shape); any other reader (but ``keep``) is a problem."""
    for node in list(tensor.outputs):
        if any(node is k for k in keep):
            continue
        if node.op != "Shape":
            raise Unfit(f"{tensor.name} feeds a {node.op}, not only its concat/product and Shape ops")
        _swap_input(node, tensor, replacement)


def rewrite_step(graph: gs.Graph, layers: list[RopeLayer], shared: bool) -> None:
    build = Builder(graph, f"{NAME}/rope")
    rotate = Rotator(graph, build)
    tensors = graph.tensors()
    pos_nodes = _position_nodes(graph, [t for layer in layers for t in layer.parts["rotation"].positional])
    prompt_positions = None
    if shared:
        prompt_positions = gs.Variable(PROMPT_POSITIONS, dtype=np.int64, shape=["batch", "prompt_sequence"])
        graph.inputs.append(prompt_positions)
        key_positions = generated_positions(build, tensors[POSITION_IDS],
                                            tensors[layers[0].names.key_output])
    else:
        key_positions = mask_positions(build, tensors[MASK])
    removed_in, removed_out = set(), set()
    for layer in layers:
        names, parts, a, tag = layer.names, layer.parts, layer.analysis, f"layer{layer.index}"
        rotation = parts["rotation"]
        present_k = tensors[names.key_output]
        parts["concat_k"].inputs[1] = rotation.raw  # the cache keeps K before RoPE
        readers = _readers(present_k)
        _read_from(readers, present_k, rotate.rotate(rotation, present_k, key_positions, pos_nodes, f"{tag}_keys"))
        slim.replace_with(parts["pv"], slim.values_from_keys(build, parts["pv"].inputs[0], present_k, a.w_kv, a.c, tag))
        _shapes_from(tensors[names.value_input], tensors[names.key_input], keep=(parts["concat_v"],))
        _shapes_from(tensors[names.value_output], present_k)
        removed_in.add(names.value_input)
        removed_out.add(names.value_output)
        if shared:
            prompt_k, prompt_v = tensors[names.prompt_key], tensors[names.prompt_value]
            readers = _readers(prompt_k)
            _read_from(readers, prompt_k, rotate.rotate(rotation, prompt_k, prompt_positions, pos_nodes,
                                                        f"{tag}_prompt_keys"))
            slim.replace_with(parts["pv_prompt"], slim.values_from_keys(build, parts["pv_prompt"].inputs[0], prompt_k,
                                                                        a.w_kv, None, f"{tag}_prompt"))
            _shapes_from(prompt_v, prompt_k)
            removed_in.add(names.prompt_value)
    slim.drop_values(graph, removed_in, removed_out)


def rewrite_prefill(graph: gs.Graph, layers: list[RopeLayer]) -> None:
    """The prefill outputs each layer's K before RoPE as ``present.{i}.key`` and no values."""
    out_names = {}
    for layer in layers:
        rotation = layer.parts["prefill"]["rotation"]
        name = layer.names.source_key
        rotation.rotated.name = f"{name}/rotated"  # the prefill's own attention keeps reading the rotated keys
        raw = gs.Variable(name, dtype=np.float32, shape=rotation.rotated.shape)
        graph.nodes.append(gs.Node("Identity", f"{NAME}/prefill{layer.index}_raw_keys", inputs=[rotation.raw],
                                   outputs=[raw]))
        out_names[f"{name}/rotated"] = raw
        out_names[layer.names.source_value] = None
    graph.outputs = [out_names.get(t.name, t) for t in graph.outputs if out_names.get(t.name, t) is not None]
    graph.cleanup(remove_unused_graph_inputs=False)


# -- the candidate manifest -----------------------------------------------------------------------------------

def candidate(manifest: Manifest, layers: list[RopeLayer], suffix: str) -> Manifest:
    """A copy of ``manifest`` with ``layers`` slimmed in the step and prefill graphs (saved as new files).

    The graphs are bound to copies of ``layers`` (binding the callers' objects kept every probe's graphs alive
    until the pass ended: +0.5 GB a probe at SmolLM2-1.7B, 23.3 GB after 24 probes)."""
    layers = [RopeLayer(copy.copy(layer.names), layer.analysis) for layer in layers]
    shared = layers[0].names.prompt_key is not None
    stage = prefill_stage(manifest)
    step, prefill = load_graph(manifest, manifest.step), load_graph(manifest, stage)
    try:
        for layer in layers:
            match_step(step, layer, shared)
            layer.parts["prefill"] = match_prefill(prefill, layer)
        rewrite_step(step, layers, shared)
        rewrite_prefill(prefill, layers)
    except Unfit as why:
        raise ElxError(f"pass {NAME}: {why}; nothing was written")
    after = manifest.copy()
    for name, graph in ((manifest.step, step), (stage, prefill)):
        spec = after.graphs[name]
        spec["file"] = pass_file(spec["file"], suffix)
        spec["external_data"] = save_graph(graph, after.folder, spec["file"])
    _describe(after, stage, layers, shared)
    return after


def _describe(after: Manifest, stage: str, layers: list[RopeLayer], shared: bool) -> None:
    gone_in = {layer.names.value_input for layer in layers}
    gone_out = {layer.names.value_output for layer in layers}
    step = after.graphs[after.step]
    if shared:
        gone_in |= {layer.names.prompt_value for layer in layers}
        step["inputs"][PROMPT_POSITIONS] = {"dtype": "int64", "shape": ["batch", "prompt_sequence"],
                                            "from": "prompt:position_ids"}
    step["inputs"] = {n: s for n, s in step["inputs"].items() if n not in gone_in}
    step["outputs"] = {n: s for n, s in step["outputs"].items() if n not in gone_out}
    prefill = after.graphs[stage]
    prefill["outputs"] = {n: s for n, s in prefill["outputs"].items()
                          if n not in {layer.names.source_value for layer in layers}}
    after.data["cache"]["self"] = [e for e in after.cache_entries if e["input"] not in gone_in]
    prompt = after.data["cache"].setdefault("prompt", {})
    prompt["holds"] = (f"{stage}:present.{{i}}.key: the prompt's keys before RoPE per layer (no values), "
                       + ("read by every beam (slim)" if shared else "copied per beam into the cache (slim)"))


# -- apply --------------------------------------------------------------------------------------------------------

def probe_shapes(shapes) -> tuple:
    """The cases a single-layer probe of ``slim=skip-bad`` runs (``culprits._errors_alone``: a probe only ranks the
    layers; every candidate that may be kept is verified on all cases at every seed): those whose side runs the
    prompt and at most one cached token before the case's step, each step reading the prompt's keys, where a layer's
    recomputed values show.  A prefilled side runs the prompt and each prefix token one forward at a time: the five
    decoder-only cases are 25 forwards, these two 5; at SmolLM2-1.7B each forward reads the 6.8 GB of weights, and a
    probe of all five took ~40 s of the pass's ~1400 s (24 probes)."""
    chosen = tuple(shape for shape in shapes if shape.past <= 1)
    return chosen or tuple(shapes)



def refuse_grouped(manifest: Manifest) -> None:
    dims = manifest.dims
    heads, kv = dims["num_heads"], dims.get("num_kv_heads") or dims["num_heads"]
    if kv != heads:
        raise ElxError(f"pass {NAME} does not apply to this {manifest.family} export: "
                       f"{GQA.format(kv=kv, heads=heads)}; drop it from --pass (slim attention is for MHA models)")


def apply(folder: Path, manifest: Manifest, argument: str | None) -> dict:
    refuse_twice(manifest, NAME)
    skip_bad = slim.parse_argument(argument)
    refuse_grouped(manifest)
    layers = [RopeLayer(names) for names in layers_of(manifest)]
    if not layers:
        raise ElxError(f"pass {NAME}: this export's self-attention cache holds no key/value pairs (slim already "
                       "applied?); export again from the model")
    dims = manifest.dims
    heads, d_kv = dims["num_heads"], dims["d_kv"]
    shared = layers[0].names.prompt_key is not None
    graph, bad = load_graph(manifest, manifest.step), {}
    for layer in layers:
        try:
            match_step(graph, layer, shared)
        except Unfit as why:
            bad[layer.index] = str(why)
            continue
        layer.analysis = analyse(layer.parts["k"], layer.parts["v"], heads, d_kv)
        if layer.analysis.problem:
            bad[layer.index] = layer.analysis.problem
    shapes = default_shapes(manifest)
    # the graphs before the rewrite, run once on every case the verification draws; their sessions go before
    # any candidate's load (both at once did not fit in memory at SmolLM2-1.7B)
    reference = RecordedSide(RuntimeSide(manifest.copy(), prefill=True), manifest, shapes, VERIFY_SEEDS)
    with CandidateSides(prefill=True) as sides:
        after, done, report = verified_rewrite(
            folder, manifest, NAME, "decoder self-attention", layers, bad, skip_bad,
            candidate=lambda todo, suffix: candidate(manifest, todo, suffix),
            verify=lambda after, todo, seed, probe=False: measure(reference, sides(after), manifest,
                                                                  probe_shapes(shapes) if probe else shapes, seed),
            estimate=True)
    adopt(folder, manifest, after)
    record = slim.record(NAME, argument, layers, done, bad, report,
                         cache="keys only, before RoPE: past_key_values.{i}.key [rows, h, P, d_kv] (and the prompt's "
                               "keys, before RoPE); each step rotates the keys it reads; values recomputed as "
                               "(P_i·K)·W_KV,i + c_i")
    record["rope"] = "option 1 (seed 002 §3): K cached before RoPE, rotated after reading"
    return record
