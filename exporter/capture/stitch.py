"""Stitch a traced few-layer template into the whole model's graph: the last template layer, copied once per
missing layer and bound to that layer's weights.

The template is the model itself with ``TEMPLATE_LAYERS`` layers per stack (``exporter/capture/template.py``),
traced, optimized and rewritten exactly as a whole-model export is (``exporter/capture/onnx_export.py``'s ``trace``).
Its nodes name the module they come from (the dynamo exporter's ``pkg.torch.onnx.name_scopes`` metadata), so
each node is known to belong to layer ``k`` of a stack or to no layer (embeddings, masks, RoPE tables, the
final norm and head).  Layer 0 of a stack may differ from the others (T5's relative position bias lives in its
first block; the exporter computes shared values such as RoPE's cos/sin in the first layer that uses them), so
the layers copied are the template's last, ``L2``, and the one before it, ``L1``, is its witness: the two must be
the same nodes in the same order (operator, attributes, arity), and every input of ``L2`` must relate to the
matching input of ``L1`` in one of these ways, which says what each copy ``c`` reads:

* **internal**: produced by ``L2``'s node ``k`` (``L1``'s too): copy ``c``'s node ``k``;
* **carried**: produced by ``L1``'s node ``k`` (``L1`` reads the same input from layer 0 or the embeddings: the
  residual stream, T5's position bias): copy ``c − 1``'s node ``k``;
* **per-layer input**: a graph input named with the layer index (``past_key_values.2.key`` where ``L1`` reads
  ``past_key_values.1.key``): the same name with ``c``;
* **weight**: an initializer bound to a parameter of layer 2 (``exporter/capture/weights.py``) where ``L1``'s is
  bound to the same parameter of layer 1 with the same transform: a new initializer bound to layer ``c``'s;
* **shared**: anything else, the same tensor for ``L1`` and ``L2`` (masks, RoPE tables, shape constants).

``L2``'s outputs named with the layer index become copy ``c``'s (``present.c.key``); nodes after the layers
that read ``L2``'s outputs (the final norm) read the last copy's.  A template that does not fit this
description (layers that differ, a layer-dependent constant, a value read across layers) raises
``NotStitchable`` and the whole model is traced instead (``exporter/capture/__init__.py``).

Every initializer bound to a parameter is pointed at that parameter of the user's model, written to
``weights.data`` once; other large initializers move there too, small ones stay in the graph.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from typing import Callable

import numpy as np
import onnx

from elx.exporter.capture.weights import Binding, WeightsFile, values_of

SCOPES = "pkg.torch.onnx.name_scopes"


class NotStitchable(Exception):
    """The template cannot be copied layer by layer; the message says why."""


class TooShallow(NotStitchable):
    """The model has no more layers than the template: traced whole, nothing to say."""


@dataclass(frozen=True)
class Stack:
    """One stack of layers as the graph names it: ``scope`` the wrapper's module path of its layers
    (``model.model.layers``), ``source`` the HF model's (``model.layers``: parameter names), the template's
    and the model's layer counts."""

    scope: str
    source: str
    template: int
    layers: int


def relayer(name: str, old: int, new: int) -> str | None:
    """``name`` with its one dotted layer index ``old`` replaced by ``new`` (``present.2.key`` → ``present.7.key``);
    None when ``name`` holds no such index or more than one."""
    pattern = rf"(?<=\.){old}(?=\.|$)"
    if len(re.findall(pattern, name)) != 1:
        return None
    return re.sub(pattern, str(new), name)


def restack(name: str, stack: str, old: int, new: int) -> str | None:
    """A weight's name in layer ``new`` of ``stack`` for its name in layer ``old`` (``decoder.block.2.layer.2.x`` →
    ``decoder.block.7.layer.2.x``: only the stack's index changes); None when ``name`` is not in that layer."""
    prefix = f"{stack}.{old}."
    return f"{stack}.{new}.{name[len(prefix):]}" if name.startswith(prefix) else None


def _scopes(node: onnx.NodeProto) -> list:
    for prop in node.metadata_props:
        if prop.key == SCOPES:
            try:
                value = ast.literal_eval(prop.value)
            except (ValueError, SyntaxError):
                return []
            return value if isinstance(value, list) else []
    return []


def layer_of(node: onnx.NodeProto, index: dict):
    """(stack scope, layer) of ``node``, or None for a node of no layer; ``index``: {"scope.k": (scope, k)}."""
    for entry in _scopes(node):
        hit = index.get(entry)
        if hit is not None:
            return hit
    return None


def _attributes(node: onnx.NodeProto) -> list:
    return sorted(a.SerializeToString(deterministic=True) for a in node.attribute)


def _same_values(a: onnx.TensorProto, b: onnx.TensorProto) -> bool:
    return a.data_type == b.data_type and list(a.dims) == list(b.dims) and np.array_equal(values_of(a), values_of(b))


class _Graph:
    """Lookups over the template graph being stitched."""

    def __init__(self, graph: onnx.GraphProto, index: dict):
        self.graph = graph
        self.nodes = list(graph.node)
        self.layer = [layer_of(n, index) for n in self.nodes]
        self.producer = {out: (i, o) for i, n in enumerate(self.nodes) for o, out in enumerate(n.output) if out}
        self.consumers = {}
        for i, n in enumerate(self.nodes):
            for name in n.input:
                self.consumers.setdefault(name, []).append(i)
        self.inputs = {vi.name: vi for vi in graph.input}
        self.outputs = {vi.name: vi for vi in graph.output}
        self.initializers = {t.name: t for t in graph.initializer}
        self.value_info = {vi.name: vi for vi in graph.value_info}
        self.names = set(self.producer) | set(self.inputs) | set(self.initializers) | {n.name for n in self.nodes}
        self._absorb_unscoped()

    def _absorb_unscoped(self) -> None:
        """A node the optimizer made without a name scope (onnxscript's rewrites: GPT-2's Split of the fused q/k/v)
        belongs to layer ``k`` when it reads a tensor of layer ``k`` (and of no other layer) and layer ``k`` (and no
        other layer) reads it; a chain of such nodes joins node by node.  A node so placed wrongly fails the checks
        of ``stitch_stack`` (layers that differ, a value read across layers): the graph is then traced whole."""
        changed = True
        while changed:
            changed = False
            for i, node in enumerate(self.nodes):
                if self.layer[i] is not None:
                    continue
                sources = {self.layer[self.producer[x][0]] for x in node.input if x in self.producer}
                readers = {self.layer[c] for out in node.output for c in self.consumers.get(out, ())}
                sources.discard(None)
                readers.discard(None)  # another unscoped node of the same chain, absorbed in a later round
                if len(sources) == 1 and readers == sources:
                    self.layer[i] = next(iter(sources))
                    changed = True

    def members(self, scope: str, k: int) -> list[int]:
        return [i for i, hit in enumerate(self.layer) if hit == (scope, k)]


def _plan_inputs(g: _Graph, stack: Stack, l1: list, l2: list, bindings: dict) -> list:
    """The role of each input of each node of ``l2`` (module docstring), checked against ``l1``."""
    a, b = stack.template - 2, stack.template - 1
    pos1, pos2 = {i: j for j, i in enumerate(l1)}, {i: j for j, i in enumerate(l2)}
    layer_prefix = f"{stack.source}.{b}."
    plan = []
    for j, (i1, i2) in enumerate(zip(l1, l2)):
        n1, n2 = g.nodes[i1], g.nodes[i2]
        where = f"layer {b}'s node {n2.name} ({n2.op_type})"
        if len(n1.input) != len(n2.input) or len(n1.output) != len(n2.output):
            raise NotStitchable(f"{where} and layer {a}'s {n1.name} differ in arity")
        roles = []
        for x1, x2 in zip(n1.input, n2.input):
            if x2 == "" or x1 == "":
                if x1 != x2:
                    raise NotStitchable(f"{where}: an optional input is set in one layer only")
                roles.append(("shared", ""))
                continue
            p2, p1 = g.producer.get(x2), g.producer.get(x1)
            if p2 is not None and p2[0] in pos2:
                if p1 is None or pos1.get(p1[0]) != pos2[p2[0]] or p1[1] != p2[1]:
                    raise NotStitchable(f"{where} reads {x2} inside its layer, layer {a} reads {x1}")
                roles.append(("internal", pos2[p2[0]], p2[1]))
            elif p2 is not None and p2[0] in pos1:
                if p1 is not None and (p1[0] in pos1 or p1[0] in pos2):
                    raise NotStitchable(f"{where} reads {x2} from layer {a}, which reads {x1} from its own layer")
                roles.append(("carried", pos1[p2[0]], p2[1]))
            elif x2 in g.inputs:
                if x1 == x2:
                    roles.append(("shared", x2))
                elif relayer(x1, a, b) == x2:
                    roles.append(("input", x2))
                else:
                    raise NotStitchable(f"{where} reads graph input {x2}, layer {a} reads {x1}")
            elif x2 in g.initializers:
                found2, found1 = bindings.get(x2), bindings.get(x1)
                if found2 is not None and found2.source.startswith(layer_prefix):
                    expected = restack(found2.source, stack.source, b, a)
                    if found1 is None or found1.source != expected or (found1.transform, found1.shift) != (
                            found2.transform, found2.shift):
                        raise NotStitchable(f"{where} reads {found2.source} ({found2.transform}); layer {a} reads "
                                            f"{found1.source + ' (' + found1.transform + ')' if found1 else x1}")
                    roles.append(("weight", x2, found2))
                elif x1 == x2 or (found2 is not None and found1 == found2) or (
                        x1 in g.initializers and _same_values(g.initializers[x1], g.initializers[x2])):
                    roles.append(("shared", x2))
                else:
                    raise NotStitchable(f"{where} reads constant {x2}, layer {a} a different one ({x1}): a constant "
                                        "that depends on the layer")
            elif p2 is not None:
                if x1 != x2:
                    raise NotStitchable(f"{where} reads {x2} from outside the layers, layer {a} reads {x1}")
                roles.append(("shared", x2))
            else:
                raise NotStitchable(f"{where} reads {x2}, which nothing produces")
        plan.append(roles)
    return plan


def _plan_outputs(g: _Graph, stack: Stack, l1: list, l2: list) -> tuple[dict, dict]:
    """``L2``'s outputs that are per-layer graph outputs ({(k, o): name}) and those read after the layers or that are
    the graph's own output ({(k, o): name}); ``L1``'s outputs must be read by the layers alone (or be its per-layer
    graph outputs)."""
    a, b = stack.template - 2, stack.template - 1
    members = set(l1) | set(l2)
    per_layer, downstream = {}, {}
    for k, (i1, i2) in enumerate(zip(l1, l2)):
        for o, (y1, y2) in enumerate(zip(g.nodes[i1].output, g.nodes[i2].output)):
            if y2 in g.outputs and y1 not in g.outputs:  # the stack's output is the graph's (BART's encoder)
                downstream[(k, o)] = y2
                continue
            if y2 in g.outputs:
                if relayer(y1, a, b) != y2:
                    raise NotStitchable(f"graph output {y2} of layer {b} has no per-layer name")
                per_layer[(k, o)] = y2
            elif y1 in g.outputs:
                raise NotStitchable(f"graph output {y1} of layer {a} has no counterpart in layer {b}")
            outside1 = [c for c in g.consumers.get(y1, ()) if c not in members]
            if outside1:
                raise NotStitchable(f"{y1} of layer {a} is read after the layers ({g.nodes[outside1[0]].name})")
            if any(c not in members for c in g.consumers.get(y2, ())):
                downstream[(k, o)] = y2
    return per_layer, downstream


def _relayer_metadata(node: onnx.NodeProto, stack: Stack, c: int) -> None:
    b = stack.template - 1
    pattern = re.compile(re.escape(f"{stack.scope}.{b}") + r"(?![0-9])")
    for prop in node.metadata_props:
        prop.value = pattern.sub(f"{stack.scope}.{c}", prop.value)


def _unique(name: str, taken: set) -> str:
    while name in taken:
        name += "_"
    taken.add(name)
    return name


def stitch_stack(model: onnx.ModelProto, stack: Stack, bindings: dict, weights: WeightsFile, tensors: dict,
                 on_layer: Callable[[int], None] | None = None) -> dict:
    """Copy the template's last layer of ``stack`` until the stack has ``stack.layers`` layers (in place).
    ``bindings`` (updated with the copies' initializers): {initializer: Binding}; ``tensors``: the user's model's
    parameters and buffers by name.  Returns {template per-layer name: [names of the copies]} for the graph's
    inputs and outputs (in layer order)."""
    if stack.layers <= stack.template:
        return {}
    if stack.template < 3:
        raise NotStitchable(f"a template of {stack.template} layers has no layer to check the copied one against")
    index = {f"{stack.scope}.{k}": (stack.scope, k) for k in range(stack.template)}
    g = _Graph(model.graph, index)
    a, b = stack.template - 2, stack.template - 1
    l1, l2 = g.members(stack.scope, a), g.members(stack.scope, b)
    if not any(hit is not None and hit[0] == stack.scope for hit in g.layer):
        return {}  # the wrapper holds the stack but the graph runs none of it (T5's step graph: the encoder)
    if not l2 or len(l1) != len(l2):
        raise NotStitchable(f"layers {a} and {b} of {stack.scope} have {len(l1)} and {len(l2)} nodes")
    for i1, i2 in zip(l1, l2):
        n1, n2 = g.nodes[i1], g.nodes[i2]
        if (n1.op_type, n1.domain) != (n2.op_type, n2.domain) or _attributes(n1) != _attributes(n2):
            raise NotStitchable(f"layers {a} and {b} of {stack.scope} differ at {n1.name} / {n2.name}")
    plan = _plan_inputs(g, stack, l1, l2, bindings)
    per_layer_outputs, downstream = _plan_outputs(g, stack, l1, l2)

    taken = set(g.names)
    final = {key: name for key, name in downstream.items() if name in g.outputs}
    for key, name in final.items():  # layer 2 is no longer the last: its tensor gets a name, the last copy's the output's
        _rename_tensor(g, name, _unique(f"{name}__layer{b}", taken))
        downstream[key] = g.nodes[l2[key[0]]].output[key[1]]
    previous = {(k, o): out for k, i in enumerate(l2) for o, out in enumerate(g.nodes[i].output)}
    copies, new_inits, new_value_info, io_names = [], [], [], {}
    for c in range(stack.template, stack.layers):
        outputs = {}
        for k, i in enumerate(l2):
            for o, out in enumerate(g.nodes[i].output):
                if not out:
                    outputs[(k, o)] = ""
                elif (k, o) in final and c == stack.layers - 1:
                    outputs[(k, o)] = final[(k, o)]
                elif (k, o) in per_layer_outputs:
                    outputs[(k, o)] = relayer(out, b, c)
                    io_names.setdefault(out, []).append(outputs[(k, o)])
                    taken.add(outputs[(k, o)])
                else:
                    outputs[(k, o)] = _unique(f"{out}__layer{c}", taken)
                    if out in g.value_info:
                        info = onnx.ValueInfoProto()
                        info.CopyFrom(g.value_info[out])
                        info.name = outputs[(k, o)]
                        new_value_info.append(info)
        for k, (i, roles) in enumerate(zip(l2, plan)):
            node = onnx.NodeProto()
            node.CopyFrom(g.nodes[i])
            node.name = _unique(f"{node.name}__layer{c}", taken)
            for p, role in enumerate(roles):
                kind = role[0]
                if kind == "internal":
                    node.input[p] = outputs[(role[1], role[2])]
                elif kind == "carried":
                    node.input[p] = previous[(role[1], role[2])]
                elif kind == "input":
                    node.input[p] = relayer(role[1], b, c)
                    if node.input[p] not in io_names.get(role[1], ()):
                        io_names.setdefault(role[1], []).append(node.input[p])
                elif kind == "weight":
                    template, binding = g.initializers[role[1]], role[2]
                    source = restack(binding.source, stack.source, b, c)
                    if source not in tensors:
                        raise NotStitchable(f"the model has no {source} (layer {c}'s copy of {binding.source})")
                    tensor = onnx.TensorProto()
                    tensor.name = _unique(f"{role[1]}__layer{c}", taken)
                    tensor.data_type, tensor.dims[:] = template.data_type, template.dims
                    weights.bound(tensor, binding.renamed(source), tensors[source])
                    bindings[tensor.name] = binding.renamed(source)
                    new_inits.append(tensor)
                    node.input[p] = tensor.name
            for o in range(len(node.output)):
                node.output[o] = outputs[(k, o)]
            _relayer_metadata(node, stack, c)
            copies.append(node)
        previous = outputs
        if on_layer is not None:
            on_layer(c)

    last = previous
    renamed = {y2: last[key] for key, y2 in downstream.items()}
    members = set(l2)
    for i, node in enumerate(g.nodes):
        if i in members:
            continue
        for p, name in enumerate(node.input):
            if name in renamed:
                node.input[p] = renamed[name]
    after = max(l2)
    ordered = g.nodes[: after + 1] + copies + g.nodes[after + 1:]
    del model.graph.node[:]
    model.graph.node.extend(_toposorted(ordered, model.graph))
    model.graph.initializer.extend(new_inits)
    model.graph.value_info.extend(new_value_info)
    return io_names


def _rename_tensor(g: _Graph, old: str, new: str) -> None:
    """Rename a tensor the nodes of ``g`` produce and read (and its value info); not a graph input or output."""
    i, o = g.producer.pop(old)
    g.nodes[i].output[o] = new
    g.producer[new] = (i, o)
    for c in g.consumers.pop(old, ()):
        node = g.nodes[c]
        for p, name in enumerate(node.input):
            if name == old:
                node.input[p] = new
        g.consumers.setdefault(new, []).append(c)
    if old in g.value_info:
        g.value_info[old].name = new
        g.value_info[new] = g.value_info.pop(old)


def _toposorted(nodes: list, graph: onnx.GraphProto) -> list:
    """``nodes`` as they are when each node's inputs are produced before it, else in a stable topological order."""
    known = {vi.name for vi in graph.input} | {t.name for t in graph.initializer} | {""}
    produced = set(known)
    ordered = True
    for node in nodes:
        if any(name not in produced for name in node.input):
            ordered = False
            break
        produced.update(node.output)
    if ordered:
        return nodes
    producer = {out: i for i, n in enumerate(nodes) for out in n.output}
    waiting = [sum(1 for name in set(n.input) if name in producer) for n in nodes]
    consumers = {}
    for i, n in enumerate(nodes):
        for name in set(n.input):
            if name in producer:
                consumers.setdefault(producer[name], []).append(i)
    import heapq

    ready = [i for i, w in enumerate(waiting) if w == 0]
    heapq.heapify(ready)
    out = []
    while ready:
        i = heapq.heappop(ready)
        out.append(nodes[i])
        for j in consumers.get(i, ()):
            waiting[j] -= 1
            if waiting[j] == 0:
                heapq.heappush(ready, j)
    if len(out) != len(nodes):
        raise NotStitchable("the stitched graph has a cycle")
    return out


def order_io(model: onnx.ModelProto, io_names: dict, input_names: list, output_names: list) -> None:
    """The graph's inputs and outputs in the user's model's order (``input_names``, ``output_names`` of its spec):
    the template's own, and each per-layer one's copies (``io_names``) with the template's type."""
    graph = model.graph
    for field, wanted in ((graph.input, input_names), (graph.output, output_names)):
        available = {vi.name: vi for vi in field}
        for template, copies in io_names.items():
            if template in available:
                for name in copies:
                    info = onnx.ValueInfoProto()
                    info.CopyFrom(available[template])
                    info.name = name
                    available[name] = info
        missing = [name for name in wanted if name not in available]
        if missing or len(wanted) != len(available):
            extra = sorted(set(available) - set(wanted))
            raise NotStitchable(f"the stitched graph's {'inputs' if field is graph.input else 'outputs'} do not match "
                                f"the model's: missing {missing[:4]}, unexpected {extra[:4]}")
        ordered = [available[name] for name in wanted]
        del field[:]
        field.extend(ordered)


def bind_weights(model: onnx.ModelProto, bindings: dict, weights: WeightsFile, tensors: dict) -> None:
    """Point every bound initializer at the user's model's tensor (``weights.data``); move other large initializers
    there too."""
    for tensor in model.graph.initializer:
        binding: Binding | None = bindings.get(tensor.name)
        if binding is None:
            weights.own(tensor)
        elif tensor.data_location != onnx.TensorProto.EXTERNAL:  # not yet pointed at the model's tensor (a template's
            # own values, or none: a template from the cache, ``template_cache.load_bound``)
            if binding.source not in tensors:
                raise NotStitchable(f"the model has no {binding.source}")
            weights.bound(tensor, binding, tensors[binding.source])
