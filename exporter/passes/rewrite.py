"""Shared machinery of the graph passes: load/save graphs, walk them by structure, add nodes, and
commit a rewrite only after it has been verified against the graphs it replaces."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx.external_data_helper import load_external_data_for_tensor, uses_external_data

from elx.runners.errors import ElxError
from elx.runners.manifest import Manifest

from elx.exporter.capture.onnx_export import save_model
from elx.exporter.capture.shared_weights import external_files, subgraphs
from elx.exporter.verification.verify import require_within_tolerance, skipped_draws_hint, verify_rewrite

SHAPE_OPS = ("Reshape", "Transpose", "Squeeze", "Unsqueeze", "Identity")


class _StoredValues(gs.ir.tensor.LazyValues):
    """A weight left in its external-data file (``weights.data``) until a pass reads its values.

    Passes rewrite structure and read a few weights (W_K and W_V for slim); loading every weight of a
    graph for that held the whole model once per loaded graph (a 1.7B model's slim candidates: two
    graphs of 6.8 GB each, and as much again to serialize them).  A weight never read is exported as
    the same external reference (onnx-graphsurgeon reuses a ``LazyValues``' TensorProto), so the
    rewritten graph points at the bytes already on disk; a weight read is held as an array from then on
    and saved with the new graph's data."""

    def __init__(self, tensor, folder: Path):
        super().__init__(tensor)
        self.folder = folder

    def load(self):
        copy = onnx.TensorProto()
        copy.CopyFrom(self.tensor)
        load_external_data_for_tensor(copy, str(self.folder))
        return np.array(onnx.numpy_helper.to_array(copy))


def load_graph(manifest: Manifest, name: str) -> gs.Graph:
    """The graph ``name`` of ``manifest`` with its weights left on disk until read (``_StoredValues``), and its nodes'
    metadata kept aside (``node_metadata``: onnx-graphsurgeon drops it; ``save_graph`` writes it back)."""
    path = manifest.graph_path(name)
    model = onnx.load(str(path), load_external_data=False)
    metadata = {node.name: list(node.metadata_props) for node in model.graph.node if node.name and node.metadata_props}
    graph = gs.import_onnx(model)
    graph.node_metadata = metadata
    for each in (graph, *graph.subgraphs(recursive=True)):
        for tensor in each.tensors().values():
            values = getattr(tensor, "_values", None)
            if type(values) is gs.ir.tensor.LazyValues and uses_external_data(values.tensor):
                tensor._values = _StoredValues(values.tensor, path.parent)
    return graph


def save_graph(graph: gs.Graph, folder: Path, file: str) -> list[str]:
    """Save ``graph`` as ``folder/file``; returns every data file it reads: the new weights' own file
    (if any) and the files of the weights it still points at (``load_graph``), so that dropping the
    replaced graphs' files never drops bytes this one reads."""
    graph.cleanup(remove_unused_graph_inputs=False).toposort()
    model = gs.export_onnx(graph)
    model.ir_version = min(model.ir_version, 10)  # readable by older runtimes and polygraphy
    restore_metadata(model, getattr(graph, "node_metadata", {}))
    for each in (model.graph, *subgraphs(model.graph)):
        for tensor in each.initializer:  # a weight read in (now bytes in the graph) keeps its import's flag
            if tensor.data_location == onnx.TensorProto.EXTERNAL and tensor.HasField("raw_data"):
                tensor.data_location = onnx.TensorProto.DEFAULT
                del tensor.external_data[:]
    written = save_model(model, Path(folder) / file)
    return written + [f for f in external_files(model) if f not in written]


def node_metadata(graph: gs.Graph) -> dict:
    """Node name → its metadata entries (the exporter's module path, ``pkg.torch.onnx.name_scopes``, that int8's
    per-layer rule reads to tell which layer a MatMul belongs to: ``exporter/precision/int8.py`` ``layer_of``)."""
    if not hasattr(graph, "node_metadata"):
        graph.node_metadata = {}
    return graph.node_metadata


def inherit_metadata(graph: gs.Graph, node_name: str, source: gs.Node) -> None:
    """Node ``node_name`` (a pass's new node) belongs where ``source`` does (e.g. a packed projection: its layer)."""
    metadata = node_metadata(graph)
    if source.name in metadata:
        metadata[node_name] = metadata[source.name]


def restore_metadata(model: onnx.ModelProto, metadata: dict) -> None:
    for node in model.graph.node:
        if node.name in metadata and not node.metadata_props:
            node.metadata_props.extend(metadata[node.name])


def producer(tensor) -> gs.Node | None:
    return tensor.inputs[0] if tensor.inputs else None


def only_consumer(tensor, what: str) -> gs.Node:
    if len(tensor.outputs) != 1:
        raise ElxError(f"unexpected graph structure: {what} has {len(tensor.outputs)} consumers, expected 1")
    return tensor.outputs[0]


def through_shape_ops_down(tensor) -> tuple[gs.Node, list]:
    """Follow single consumers through shape-only ops; return the first other node and the path."""
    path = []
    node = only_consumer(tensor, tensor.name)
    while node.op in SHAPE_OPS:
        path.append(node)
        node = only_consumer(node.outputs[0], node.outputs[0].name)
    return node, path


def through_shape_ops_up(tensor):
    """Walk producers through shape-only ops; return the first tensor not produced by one."""
    node = producer(tensor)
    while node is not None and node.op in SHAPE_OPS:
        tensor = node.inputs[0]
        node = producer(tensor)
    return tensor


def constant_shape(tensor) -> tuple | None:
    """A constant's shape, without reading its values (a weight left on disk stays there: ``_StoredValues``); None
    where ``tensor`` is not a constant (exactly where ``constant_value`` gives None)."""
    if isinstance(tensor, gs.Constant):
        return tuple(tensor.shape)
    node = producer(tensor)
    if node is not None and node.op == "Constant":
        return tuple(node.attrs["value"].shape)
    return None


def constant_value(tensor) -> np.ndarray | None:
    if isinstance(tensor, gs.Constant):
        return np.asarray(tensor.values)
    node = producer(tensor)
    if node is not None and node.op == "Constant":
        return np.asarray(node.attrs["value"].values)
    return None


def scalar_value(tensor) -> float | None:
    """A one-element constant's value as a float, else None."""
    value = constant_value(tensor)
    return float(np.asarray(value).reshape(())) if value is not None and value.size == 1 else None


def linear_before(tensor) -> tuple[np.ndarray, np.ndarray | None]:
    """``tensor`` = x·W (+ b) with constant W [in, out] and b [out]: return (W, b), else fail."""
    bias = None
    node = producer(tensor)
    if node is not None and node.op == "Add":
        for i in (0, 1):
            value = constant_value(node.inputs[i])
            if value is not None and value.ndim == 1:
                bias, tensor, node = value, node.inputs[1 - i], producer(node.inputs[1 - i])
                break
    if node is None or node.op != "MatMul" or constant_value(node.inputs[1]) is None:
        raise ElxError(f"unexpected graph structure: {tensor.name} is not a linear projection with constant weights")
    return constant_value(node.inputs[1]), bias


class Builder:
    """Adds nodes to a gs graph with fresh, readable names under one prefix."""

    def __init__(self, graph: gs.Graph, prefix: str):
        self.graph, self.prefix, self.count = graph, prefix, 0

    def _name(self, hint: str) -> str:
        self.count += 1
        return f"{self.prefix}/{hint}_{self.count}"

    def const(self, hint: str, value) -> gs.Constant:
        return gs.Constant(self._name(hint), np.ascontiguousarray(value))

    def op(self, op: str, inputs: list, hint: str | None = None, dtype=None, **attrs) -> gs.Variable:
        name = self._name(hint or op.lower())
        out = gs.Variable(name + ":0", dtype=dtype)
        self.graph.nodes.append(gs.Node(op, name, attrs=attrs, inputs=list(inputs), outputs=[out]))
        return out


def refuse_twice(manifest: Manifest, name: str) -> None:
    if name in manifest.pass_names():
        raise ElxError(f"pass {name!r} was already applied to this export; export again from the model to re-apply")


def pass_file(current: str, name: str) -> str:
    """The file a pass writes a rewritten graph to: ``decoder.onnx`` → ``decoder.<name>.onnx``."""
    return f"{current[: -len('.onnx')]}.{name}.onnx"


def drop_unused_files(folder: Path, before: Manifest, after: Manifest) -> None:
    """Delete the graph files ``before`` names that ``after`` no longer does."""
    for file in set(before.graph_files()) - set(after.graph_files()):
        (Path(folder) / file).unlink(missing_ok=True)


def adopt(folder: Path, manifest: Manifest, after: Manifest) -> None:
    """``manifest`` (updated in place, as passes do) becomes ``after``; files only it used go."""
    before = manifest.copy()
    for key, value in after.data.items():  # unchanged entries (e.g. the ``passes`` list) keep their identity
        if manifest.data.get(key) != value:
            manifest.data[key] = value
    drop_unused_files(folder, before, manifest)


def commit(folder: Path, before: Manifest, after: Manifest, what: str, **verify_options) -> dict:
    """Verify ``after`` against ``before`` (``elx.exporter.verification.verify.verify_rewrite``); on success drop files only
    ``before`` used.  Raises (nothing committed) beyond the tolerance."""
    report = verify_rewrite(before, after, **verify_options)
    try:
        require_within_tolerance(report, what)
    except ElxError as refusal:
        hint = skipped_draws_hint(before)
        if not hint:
            raise
        raise ElxError(f"{refusal}{hint}") from None
    drop_unused_files(folder, before, after)
    return report
