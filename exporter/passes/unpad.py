"""``--pass unpad``: the position-wise layers of a padded batch run on its real tokens only.

A batch of B inputs padded to N positions holds T = Σ_b n_b real tokens (n_b: row b's mask sum).  In
a Transformer layer every product with a weight matrix acts on each position alone: for the
projections Q = X·W_Q, K, V, the output projection and the feed-forward network FFN(x) = φ(x·W_1)·W_2
(gated: (φ(x·W_1) ⊙ x·W_3)·W_2), row (b, n) of the output depends on row (b, n) of the input only.
The rows of padded positions are computed and then never read: attention masks them as keys
(their softmax weight is exactly 0), and their queries' outputs are masked again by every
later consumer (cross-attention in the decoder, the prompt cache's mask in a decoder-only model).
At the bench's batches (row lengths drawn in [N/2, N]) about a quarter of the positions are padding,
and these products are most of an encoder's arithmetic.  CTranslate2 removes the padding from its
encoder's position-wise layers the same way.

Rewrite (a graph with an ``attention_mask`` input [B, N]: the encoder, a decoder-only prefill):

    real    = NonZero(Reshape(mask, [-1]))                     [T]     the real positions, row-major
    row     = where(mask ≠ 0, CumSum_exclusive(mask ≠ 0), T)    [B·N]   each position's row in [Y; 0]
    pack(X) = Gather(Reshape(X, [-1, d]), real)                [T, d]
    unpack(Y) = Reshape(Gather(Concat(Y, 0_{1 × d'}), row), [B, N, d'])

(a real position with k real positions before it is packed row k; every padded position reads the zero
row T).  The unpack is one copy of each output row; a scatter into a zeroed [B·N, d'] buffer, the first
form of this pass, wrote every row three times (zeros, the copy ScatterND makes, the scattered rows):
measured on this 2-core VM at B = 32, N = 256, three quarters real, 7.9 ms against 4.0 ms for d' = 512
and 31.4 ms against 13.6 ms for d' = 2048 (ONNX Runtime CPU, 2 threads, medians of 41).

A *region* is a connected set of position-wise nodes on row tensors ([B, N, ·]): products with a
constant 2-D weight, element-wise nodes (activations, gates, biases, residual additions between row
tensors, scalings by constants that broadcast along the last axis), reductions over the last axis
(an RMS norm's mean of squares) and layer / RMS norms over it.  Only regions holding a product are
rewritten; nodes reading the same outside tensor are one region (it is packed once).  Each region's entries (row tensors made outside it: the embeddings, attention's output) are
packed once and each tensor leaving it (the projections attention reads, the graph's output) is
unpacked: in an encoder layer the residual stream, both norms, the feed-forward network and every
projection run on T rows, and only attention's own products run in the padded layout, with one pack
(its output) and one unpack per projection it reads.  The packed tensors carry the shape [1, T, f]
(symbolic T): ONNX Runtime's fusions (a residual add into the layer norm after it) read shapes, and
fuse the packed graph as they fused the padded one (BART's encoder, fused differently while the
recorded shapes were stale, was 7e-7 apart; now 0.0).

Measured (t5-small dims, int8, ONNX Runtime CPU, 2 threads): the first form of this pass packed the
products only (norms and residual additions padded: 3 packs and 5 unpacks per encoder layer, and
ScatterND unpacks); its encoder graph at batch 4 (13% padding) was no faster than the baseline's
(236.8 against 232.7 ms), with the Gather unpack 219.6 ms.

Exactness: each output row of a matrix product is the same dot products of the same row, and a norm or an
element-wise node computes a row from that row alone, by the same kernel once fused alike, so the real
rows are what the unpadded graph computes (checked: the verification's logits difference, recorded);
padded rows hold zeros instead of values that no consumer reads.  The verification compares the
encoder output at real positions only (``exporter/verification/verify.py``).  With ``--precision int8`` the
activation's per-tensor quantization scale is then taken over the real rows only.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from elx.runners.errors import ElxError
from elx.runners.manifest import Manifest

from elx.exporter.passes import catalog
from elx.exporter.passes.rewrite import Builder, commit, constant_shape, constant_value, load_graph, pass_file, \
    refuse_twice, save_graph

SPEC = catalog.UNPAD
NAME, parse_argument = SPEC.name, SPEC.parse
MASK_ROLE = "input:attention_mask"
PACKED_ROWS = "unpad_real_tokens"  # T, the symbolic dim of packed tensors
MASK_INPUT = "attention_mask"  # added to a graph that reads the positions without their mask (cross K/V)

# element-wise ops a region may hold: unary, or binary between row tensors and constants that broadcast along
# the last axis
UNARY = {"Relu", "Gelu", "Erf", "Tanh", "Sigmoid", "Softplus", "Exp", "Neg", "Sqrt", "Reciprocal", "Identity", "Cast",
         "HardSigmoid", "Softsign", "Elu", "LeakyRelu", "Selu", "Mish", "Abs"}
BINARY = {"Mul", "Add", "Sub", "Div", "Pow"}
REDUCTIONS = {"ReduceMean", "ReduceSum", "ReduceMax"}  # over the last axis, keeping it: an [.., 1] row tensor
NORMS = {"LayerNormalization", "SimplifiedLayerNormalization", "RMSNormalization"}  # over the last axis


def _static_shape(tensor) -> list | None:
    shape = getattr(tensor, "shape", None)
    return None if shape is None else list(shape)


def _weight(node: gs.Node) -> tuple | None:
    """The shape of the constant 2-D weight of ``MatMul(x, W)``, or None.  Shapes only, here and below: reading
    every weight's values to find the regions held a second copy of the model (TinyLlama-1.1B's unpad: 16.9 GB)."""
    if node.op != "MatMul" or len(node.inputs) != 2:
        return None
    shape = constant_shape(node.inputs[1])
    return shape if shape is not None and len(shape) == 2 else None


def _per_feature(shape: tuple) -> bool:
    """A constant that broadcasts along the last axis only (a scalar, [f], [1, f], [1, 1, f])."""
    return len(shape) <= 3 and all(s == 1 for s in shape[:-1])


def _last_axis(node: gs.Node) -> bool:
    """A reduction or norm over the last axis (of a rank-3 row tensor) alone, keeping the axis."""
    if node.op in NORMS:
        return node.attrs.get("axis", -1) in (-1, 2)
    if node.attrs.get("keepdims", 1) != 1:
        return False
    axes = node.attrs.get("axes")
    if axes is None and len(node.inputs) > 1:
        axes = constant_value(node.inputs[1])
    return axes is not None and [int(a) for a in np.ravel(axes)] in ([-1], [2])


class Region:
    """Position-wise nodes connected through the tensors they pass on: they run on the packed rows."""

    def __init__(self):
        self.nodes, self.tensors = [], set()

    def add(self, node: gs.Node) -> None:
        self.nodes.append(node)
        self.tensors.update(t.name for t in node.outputs)

    def entries(self) -> list:
        """Row tensors made outside the region (or graph inputs) that its nodes read: packed once each."""
        seen, out = set(), []
        for node in self.nodes:
            for t in node.inputs:
                if constant_shape(t) is None and t.name not in self.tensors and t.name not in seen:
                    seen.add(t.name)
                    out.append(t)
        return out

    def outputs(self, graph_outputs: set) -> list:
        """Tensors made here that a node outside the region (or the graph's output) reads."""
        inside = {id(n) for n in self.nodes}
        out = []
        for node in self.nodes:
            for t in node.outputs:
                if t.name in graph_outputs or any(id(c) not in inside for c in t.outputs):
                    out.append(t)
        return out


def _position_wise(node: gs.Node, is_rows) -> bool:
    """``node`` acts on each position alone: its variable inputs are row tensors ([B, N, ·]), its constants
    broadcast along the last axis, and it mixes no two positions."""
    if not node.outputs or any(t.outputs for t in node.outputs[1:]):
        return False  # one output read (a norm's optional mean and inverse deviation are not)
    variable = [t for t in node.inputs if t.name and constant_shape(t) is None]
    if not variable or not all(is_rows(t) for t in variable):
        return False
    if node.op == "MatMul":
        return _weight(node) is not None and is_rows(node.inputs[0])
    if node.op in NORMS:
        return len(variable) == 1 and variable[0] is node.inputs[0] and _last_axis(node)
    if node.op in REDUCTIONS:
        return len(variable) == 1 and variable[0] is node.inputs[0] and _last_axis(node)
    if node.op not in UNARY | BINARY:
        return False
    return all(_per_feature(constant_shape(t)) for t in node.inputs if t.name and constant_shape(t) is not None)


def find_regions(graph: gs.Graph, dims: tuple) -> list[Region]:
    """The regions of ``graph``: the connected sets of position-wise nodes on [B, N, ·] row tensors (``dims`` =
    the mask's two symbolic dims) that hold at least one product with a constant weight.  A tensor is a row
    tensor when its known shape is [B, N, f], or when a position-wise node of a region makes it."""
    made = set()  # outputs of position-wise nodes: row tensors whatever their recorded shape

    def is_rows(tensor) -> bool:
        shape = _static_shape(tensor)
        return tensor.name in made or bool(shape) and len(shape) == 3 and tuple(shape[:2]) == dims

    position_wise = []
    graph.toposort()  # producers before consumers: a node's row inputs are known when it is reached
    for node in graph.nodes:
        if _position_wise(node, is_rows):
            position_wise.append(node)
            made.update(t.name for t in node.outputs)
    # connected components: two position-wise nodes are joined when one reads what the other makes, or both read
    # the same tensor made outside (the embeddings a norm and a residual add read; cross K/V's input)
    parent = {id(n): id(n) for n in position_wise}

    def root(key):
        while parent[key] != key:
            parent[key] = parent[parent[key]]
            key = parent[key]
        return key

    by_output = {t.name: n for n in position_wise for t in n.outputs}
    first_reader = {}  # readers of one entry share its packed copy: one region
    for node in position_wise:
        for t in node.inputs:
            if t.name in by_output:
                parent[root(id(node))] = root(id(by_output[t.name]))
            elif t.name and constant_shape(t) is None:
                parent[root(id(node))] = root(id(first_reader.setdefault(t.name, node)))
    groups: dict = {}
    for node in position_wise:
        groups.setdefault(root(id(node)), []).append(node)
    regions = []
    for nodes in groups.values():
        if any(n.op == "MatMul" for n in nodes):  # packing pays for itself through the products only
            region = Region()
            for node in nodes:
                region.add(node)
            regions.append(region)
    return regions


class _Packing:
    """The real positions of the graph's mask, and each position's row among the packed rows, computed once."""

    def __init__(self, build: Builder, mask):
        op, const = build.op, build.const
        flat = op("Reshape", [mask, const("flat", np.array([-1], np.int64))], "mask_flat")
        nonzero = op("NonZero", [flat], "real")  # [1, T]
        self.rows = op("Reshape", [nonzero, const("rows", np.array([-1], np.int64))], "real_list")  # [T]
        is_real = op("Cast", [flat], "is_real", to=onnx.TensorProto.BOOL)
        before = op("CumSum", [op("Cast", [is_real], "real_count", to=onnx.TensorProto.INT64),
                               const("axis0", np.array(0, np.int64))], "real_before", exclusive=1)
        zero_row = op("Size", [self.rows], "zero_row")  # T: the row after the packed ones
        self.inverse = op("Where", [is_real, before, zero_row], "position_rows")  # [B·N]
        self.mask_shape = op("Shape", [mask], "mask_shape")  # [B, N]
        self.build = build

    def pack(self, x, width: int):
        op, const = self.build.op, self.build.const
        flat = op("Reshape", [x, const("flat_rows", np.array([-1, width], np.int64))], "rows")
        packed = op("Gather", [flat, self.rows], "packed", axis=0)
        # [1, T, d]: the products keep the rank they had ([B, N, d]), so that ONNX Runtime fuses (or not) each
        # product and its bias exactly as before (a 2-D input became a Gemm with the bias inside: other rounding)
        out = op("Unsqueeze", [packed, const("axis0", np.array([0], np.int64))], "packed_3d")
        out.dtype, out.shape = x.dtype, [1, PACKED_ROWS, width]  # as ONNX Runtime's fusions read shapes
        return out

    def unpack(self, y, width: int):
        op, const = self.build.op, self.build.const
        flat = op("Reshape", [y, const("flat_rows", np.array([-1, width], np.int64))], "packed_rows")
        dtype = getattr(y, "dtype", None)
        zero = (const("zero", np.zeros((1, width), dtype)) if dtype is not None and np.dtype(dtype).kind == "f"
                else op("CastLike", [const("zero", np.zeros((1, width), np.float32)), flat], "zero"))
        rows = op("Concat", [flat, zero], "packed_and_zero", axis=0)  # [T + 1, d']
        gathered = op("Gather", [rows, self.inverse], "unpacked", axis=0)  # [B·N, d']
        shape = op("Concat", [self.mask_shape, const("width", np.array([width], np.int64))], "padded_shape", axis=0)
        return op("Reshape", [gathered, shape], "padded")


def _width(tensor) -> int:
    shape = _static_shape(tensor)
    if shape and isinstance(shape[-1], (int, np.integer)) and shape[-1] > 0:
        return int(shape[-1])
    producer = tensor.inputs[0] if tensor.inputs else None
    weight = _weight(producer) if producer is not None else None
    if weight is not None:
        return int(weight[1])
    if producer is not None and producer.op in REDUCTIONS:
        return 1
    if producer is not None and producer.op in UNARY | BINARY | NORMS:  # the broadcast width of its row inputs
        widths = [_width(t) for t in producer.inputs if t.name and constant_shape(t) is None]
        if widths:
            return max(widths)
    for consumer in tensor.outputs:  # the rows a product with a constant weight reads (a built graph's attention
        # output, whose shape ONNX's inference leaves open past the grouped-query reshapes)
        weight = _weight(consumer) if consumer.inputs and consumer.inputs[0] is tensor else None
        if weight is not None:
            return int(weight[0])
    raise ElxError(f"pass unpad: the width of {tensor.name} is unknown; report this model")


def rewrite_graph(graph: gs.Graph, mask_name: str) -> dict:
    """Pack the entries and unpack the outputs of every region of ``graph``; returns what was rewritten."""
    mask = next((t for t in graph.inputs if t.name == mask_name), None)
    if mask is None or _static_shape(mask) is None or len(mask.shape) != 2:
        raise ElxError(f"pass unpad needs a [batch, sequence] {mask_name} input; this graph has none")
    regions = find_regions(graph, tuple(mask.shape))
    if not regions:
        raise ElxError("pass unpad found no products with constant weights on [batch, sequence, d] activations; "
                       "report this model")
    build = Builder(graph, "unpad")
    packing = _Packing(build, mask)
    graph_outputs = {t.name for t in graph.outputs}
    products = packed_entries = unpacked = 0
    for region in regions:
        outputs = region.outputs(graph_outputs)  # before rewiring: consumers outside the region
        for entry in region.entries():
            packed = packing.pack(entry, _width(entry))
            for node in region.nodes:
                node.inputs = [packed if t is entry else t for t in node.inputs]
            packed_entries += 1
        for tensor in outputs:
            consumers = [c for c in tensor.outputs if c not in region.nodes]
            padded = packing.unpack(tensor, _width(tensor))
            for consumer in consumers:
                consumer.inputs = [padded if t is tensor else t for t in consumer.inputs]
            if tensor.name in graph_outputs:
                graph.outputs = [padded if t is tensor else t for t in graph.outputs]
                padded.name, tensor.name = tensor.name, tensor.name + "/packed"
                padded.dtype, padded.shape = tensor.dtype, tensor.shape  # the graph's output as it was declared
            unpacked += 1
        products += sum(n.op == "MatMul" for n in region.nodes)
        for node in region.nodes:  # the shapes recorded for the padded layout: now [1, T, f]
            for t in node.outputs:
                shape = _static_shape(t)
                if shape and len(shape) == 3 and tuple(shape[:2]) == tuple(mask.shape):
                    t.shape = [1, PACKED_ROWS, shape[2]]
    return {"regions": len(regions), "products": products, "packs": packed_entries, "unpacks": unpacked}


def graphs_with_mask(manifest: Manifest) -> list[tuple[str, str | None]]:
    """(graph, its mask input) of every stage graph fed the input's attention mask, and (graph, None) of every
    other stage graph reading a [batch, sequence, d] activation of those positions (cross K/V from the encoder
    output): it is given the mask as a new input."""
    found, dims = [], set()
    for name in manifest.stages:
        for input_name, spec in manifest.graphs[name]["inputs"].items():
            if spec.get("from") == MASK_ROLE:
                found.append((name, input_name))
                dims.add(tuple(spec["shape"]))
    for name in manifest.stages:
        specs = manifest.graphs[name]["inputs"].values()
        if all(name != f[0] for f in found) and any(tuple(s["shape"][:2]) in dims and len(s["shape"]) == 3
                                                    for s in specs):
            found.append((name, None))
    return found


def _mask_input(graph: gs.Graph, manifest: Manifest, name: str) -> str:
    """Add the input's attention mask to a stage graph that has none (its name in the encoder's graphs)."""
    spec = next(s for g in manifest.stages for s in manifest.graphs[g]["inputs"].values() if s.get("from") == MASK_ROLE)
    graph.inputs.append(gs.Variable(MASK_INPUT, dtype=np.int64, shape=list(spec["shape"])))
    manifest.graphs[name]["inputs"][MASK_INPUT] = dict(spec)
    return MASK_INPUT


def apply(folder: Path, manifest: Manifest, argument: str | None) -> dict:
    refuse_twice(manifest, NAME)
    parse_argument(argument)
    targets = graphs_with_mask(manifest)
    if not targets:
        raise ElxError("pass unpad needs a graph fed the input's attention mask (an encoder or a decoder-only "
                       "prefill); this export has none (Whisper's encoder reads fixed-length features)")
    before = manifest.copy()
    rewritten = {}
    for name, mask_name in targets:
        graph = load_graph(manifest, name)
        rewritten[name] = rewrite_graph(graph, mask_name or _mask_input(graph, manifest, name))
        file = pass_file(manifest.graphs[name]["file"], NAME)
        manifest.graphs[name]["external_data"] = save_graph(graph, folder, file)
        manifest.graphs[name]["file"] = file
    report = commit(folder, before, manifest, what="pass unpad")
    return {"name": NAME, "graphs": rewritten, **report}
