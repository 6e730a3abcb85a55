"""Trace the wrappers with the default torch exporter (dynamo) and save ONNX graphs.

Graphs are fp32, opset 18 (the dynamo exporter's floor; the brief asks ≥ 17), with dynamic
batch, row and sequence axes.  ``save_model`` writes one graph on its own (a graph whose weights
exceed 2 GB with external data, ``<file>.data`` next to it); when the folder is complete,
``exporter/capture/shared_weights.py`` moves every graph's weights into the folder's one ``weights.data``,
each stored once.  Example sizes are all > 1 because torch.export specializes dimensions whose
example size is 0 or 1.
"""
from __future__ import annotations

import contextlib
import io
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path

import onnx
import torch
from torch.export import Dim

from elx.exporter.capture.attention import elx_attention
from elx.exporter.families.catalog import Family
from elx.exporter.capture.last_position import select_before_head
from elx.exporter.capture.wrappers import CrossKVGraph, DecoderGraph, EncoderGraph

OPSET = 18
EXTERNAL_DATA_BYTES = 1_800_000_000  # protobuf's hard limit is 2 GiB; stay clear of it
EXAMPLE = dict(batch=2, beams=3, source=7, past=3, step=2)


def finished(model: onnx.ModelProto) -> onnx.ModelProto:
    """A captured graph as the folder keeps it: a tied head's ``MatMul(x, Transpose(E))`` as ``Gemm(x, E,
    transB=1)`` (``exporter/capture/tied_head.py``: ONNX Runtime would fold a copy of ``E`` at each session load)."""
    from elx.exporter.capture.tied_head import gemm_for_tied_head

    gemm_for_tied_head(model)
    return model


def save_model(model: onnx.ModelProto, path: Path) -> list[str]:
    """Save ``model``; large ones get external data. Returns the extra files written."""
    path = Path(path)
    size = sum(t.ByteSize() for t in model.graph.initializer)
    if size < EXTERNAL_DATA_BYTES:
        onnx.save_model(model, str(path))
        return []
    data = path.name + ".data"
    if (path.parent / data).exists():
        (path.parent / data).unlink()
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=data,
                    size_threshold=1024)
    return [data]


@dataclass
class GraphSpec:
    """What one graph is traced from: the wrapper module, example inputs, their dynamic axes and the names.

    An export function builds it for any model of the family (``make_spec(model)``): for the user's model
    (the names and the record of the graph) and for the few-layer template ``exporter/capture`` traces."""

    module: object
    args: list
    dynamic_shapes: object
    input_names: list
    output_names: list


def trace(spec: GraphSpec) -> onnx.ModelProto:
    """Trace ``spec`` with the dynamo exporter, optimize it (onnxscript) and pick the last position before the
    LM head: the graph as every export writes it, its weights inside."""
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    program = _onnx_program(spec)
    # optimize=True runs onnxscript's optimizer once inside the export; a second ``program.optimize()`` changed no
    # byte of any graph (checked by serializing before and after: the real SmolLM2's templates and every family of
    # tests/conftest.py's BUILDERS) and cost 0.1-0.2 s a graph
    model = program.model_proto
    del program
    forget_rewriter_state()
    select_before_head(model)  # exporter/capture/last_position.py: the last position is picked before the LM head
    return model


@contextlib.contextmanager
def _without_stack_traces():
    """FX does not record the Python stack of each node it traces (torch.onnx writes it into every ONNX node as
    ``pkg.torch.onnx.stack_trace``).  Formatting a stack per node was a third of a small graph's trace (tiny T5
    decoder, two traces each way on the AMD EPYC VM: 20.6 -> 13.4 s; tiny Llama prefill 12.7 -> 10.6 s) and the
    stacks a third of the graph's bytes, paths of this machine's files among them.  The module path of each node
    (``namespace``, ``pkg.torch.onnx.name_scopes``: what the stitcher and int8's per-layer rule read) stays."""
    import torch.fx.config as fx_config

    before = getattr(fx_config, "do_not_emit_stack_traces", None)
    if before is None:  # a torch without the setting
        yield
        return
    fx_config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        fx_config.do_not_emit_stack_traces = before


def _onnx_program(spec: GraphSpec):
    module = spec.module
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), _without_stack_traces(), \
            elx_attention(module.hf_model, module.family):
        warnings.simplefilter("ignore")
        return torch.onnx.export(module, tuple(spec.args), dynamo=True, opset_version=OPSET,
                                 input_names=spec.input_names, output_names=spec.output_names,
                                 dynamic_shapes=spec.dynamic_shapes, verbose=False, optimize=True)


def forget_rewriter_state() -> None:
    """Drop the graph onnxscript's rewrite rules keep after optimizing one.

    Its rules are module-level objects whose pattern matcher keeps the last graph it matched (``_graph``,
    ``_match``), and through it the traced program's initializers: the PyTorch model's own tensors.  An export
    kept them alive after the model was released (measured: the real SmolLM2's 513 MiB weights file stayed
    mapped through the verification)."""
    import sys

    for name, module in list(sys.modules.items()):
        if not name.startswith("onnxscript.rewriter") or module is None:
            continue
        for value in list(vars(module).values()):
            rules = getattr(value, "rules", None)
            for rule in (rules if isinstance(rules, (list, tuple)) else [value]):
                matcher = getattr(rule, "_matcher", None)
                for attribute in ("_graph", "_tracer", "_current_node", "_match"):
                    if matcher is not None and hasattr(matcher, attribute):
                        setattr(matcher, attribute, None)


def export_graph(make_spec, model, path: Path, capture=None) -> list[str]:
    """Write the graph ``make_spec(model)`` describes to ``path``; returns the data files it reads.

    ``capture`` (``exporter/capture``'s ``Capture``) traces a few-layer template and stitches the model's
    layers from it; without one (or where it does not apply) the whole model is traced."""
    if capture is not None:
        return capture.export(make_spec, path)
    return save_model(finished(trace(make_spec(model))), path)


def _export(module, args, dynamic_shapes, input_names, output_names, path: Path) -> list[str]:
    """Trace ``module`` whole and save it (``export_graph`` without a capture)."""
    return save_model(finished(trace(GraphSpec(module, list(args), dynamic_shapes, input_names, output_names))), path)


def _example_encoder_inputs(model, family: Family, batch: int, source: int) -> list[torch.Tensor]:
    out = []
    for spec in family.encoder_inputs(model.config):
        if spec.role == "input_ids":
            out.append(torch.randint(3, min(model.config.vocab_size, 1000), (batch, source)))
        elif spec.role == "attention_mask":
            mask = torch.ones(batch, source, dtype=torch.int64)
            mask[1:, source - 2:] = 0
            out.append(mask)
        else:
            out.append(torch.randn(batch, *spec.shape[1:]))
    return out


def _encoder_spec(model, family: Family) -> GraphSpec:
    specs = family.encoder_inputs(model.config)
    batch, source = Dim("batch"), Dim("encoder_sequence")
    dyn = []
    for spec in specs:
        dyn.append({i: (batch if d == "batch" else source) for i, d in enumerate(spec.shape) if isinstance(d, str)})
    args = _example_encoder_inputs(model, family, EXAMPLE["batch"], EXAMPLE["source"])
    return GraphSpec(EncoderGraph(model, family), args, {"inputs": tuple(dyn)}, [s.name for s in specs],
                     ["last_hidden_state"])


def export_encoder(model, family: Family, path: Path, capture=None) -> dict:
    specs = family.encoder_inputs(model.config)
    extra = export_graph(lambda m: _encoder_spec(m, family), model, path, capture)
    d_model = family.dims(model.config)["d_model"]
    source_axis = "encoder_sequence" if family.uses_encoder_mask else "encoder_frames"
    return {
        "file": path.name, "external_data": extra,
        "inputs": {s.name: {"dtype": s.dtype, "shape": list(s.shape), "from": f"input:{s.role}"} for s in specs},
        "outputs": {"last_hidden_state": {"dtype": "float32", "shape": ["batch", source_axis, d_model]}},
    }


def cross_names(layers: int) -> list[str]:
    return [f"present.{i}.encoder.{kind}" for i in range(layers) for kind in ("key", "value")]


def _cross_kv_spec(model, family: Family) -> GraphSpec:
    dims = family.dims(model.config)
    hidden = torch.randn(EXAMPLE["batch"], EXAMPLE["source"], dims["d_model"])
    dyn = {"encoder_hidden_states": {0: Dim("batch"), 1: Dim("encoder_sequence")}}
    return GraphSpec(CrossKVGraph(model, family), [hidden], dyn, ["encoder_hidden_states"],
                     cross_names(dims["num_decoder_layers"]))


def export_cross_kv(model, family: Family, path: Path, capture=None) -> dict:
    dims = family.dims(model.config)
    names = cross_names(dims["num_decoder_layers"])
    extra = export_graph(lambda m: _cross_kv_spec(m, family), model, path, capture)
    shape = ["batch", dims["num_heads"], "encoder_sequence", dims["d_kv"]]
    return {
        "file": path.name, "external_data": extra,
        "inputs": {"encoder_hidden_states": {"dtype": "float32", "shape": ["batch", "encoder_sequence", dims["d_model"]],
                                             "from": "encoder:last_hidden_state"}},
        "outputs": {n: {"dtype": "float32", "shape": shape} for n in names},
    }


def decoder_spec(model, family: Family) -> tuple[GraphSpec, dict, list]:
    """The step graph's spec, its inputs' manifest entries and its self-attention cache entries."""
    dims = family.dims(model.config)
    layers, heads, d_kv = dims["num_decoder_layers"], dims["num_heads"], dims["d_kv"]
    b, beams, n, p, t = (EXAMPLE[k] for k in ("batch", "beams", "source", "past", "step"))
    rows = b * beams
    batch, source, row_dim = Dim("batch"), Dim("encoder_sequence"), Dim("rows")
    past_dim, step_dim = Dim("past_sequence"), Dim("decoder_sequence")

    names, args, dyn, inputs = ["input_ids"], [torch.randint(3, 100, (rows, t))], [{0: row_dim, 1: step_dim}], {}
    inputs["input_ids"] = {"dtype": "int64", "shape": ["rows", "decoder_sequence"], "from": "step:input_ids"}
    if family.uses_encoder_mask:
        mask = torch.ones(b, n, dtype=torch.int64)
        mask[1:, n - 2:] = 0
        names.append("encoder_attention_mask"); args.append(mask); dyn.append({0: batch, 1: source})
        inputs["encoder_attention_mask"] = {"dtype": "int64", "shape": ["batch", "encoder_sequence"],
                                            "from": "input:attention_mask"}
    self_shape = ["rows", heads, "past_sequence", d_kv]
    cache = []
    for i in range(layers):
        for kind in ("key", "value"):
            name = f"past_key_values.{i}.decoder.{kind}"
            names.append(name); args.append(torch.randn(rows, heads, p, d_kv)); dyn.append({0: row_dim, 2: past_dim})
            inputs[name] = {"dtype": "float32", "shape": self_shape, "from": f"cache:present.{i}.decoder.{kind}"}
            cache.append({"input": name, "output": f"present.{i}.decoder.{kind}", "dtype": "float32",
                          "shape": self_shape, "seq_axis": 2})
    cross_shape = ["batch", heads, "encoder_sequence", d_kv]
    for i in range(layers):
        for kind in ("key", "value"):
            name = f"past_key_values.{i}.encoder.{kind}"
            names.append(name); args.append(torch.randn(b, heads, n, d_kv)); dyn.append({0: batch, 2: source})
            inputs[name] = {"dtype": "float32", "shape": cross_shape, "from": f"cross_kv:present.{i}.encoder.{kind}"}
    outputs = ["logits"] + [e["output"] for e in cache]
    spec = GraphSpec(DecoderGraph(model, family), args, {"input_ids": dyn[0], "rest": tuple(dyn[1:])}, names,
                     outputs)
    return spec, inputs, cache


def describe_decoder(model, family: Family, path: Path) -> tuple[dict, list[dict]]:
    """The decoder graph's manifest entry (its data files still unknown) and its cache entries, before it is traced."""
    dims = family.dims(model.config)
    heads, d_kv = dims["num_heads"], dims["d_kv"]
    _, inputs, cache = decoder_spec(model, family)
    present_shape = ["rows", heads, "past_sequence + decoder_sequence", d_kv]
    graph = {
        "file": path.name, "external_data": [], "inputs": inputs, "logits": "logits",
        "outputs": {"logits": {"dtype": "float32", "shape": ["rows", dims["vocab_size"]]},
                    **{e["output"]: {"dtype": "float32", "shape": present_shape} for e in cache}},
    }
    return graph, cache


def export_decoder(model, family: Family, path: Path, capture=None) -> tuple[dict, list[dict]]:
    graph, cache = describe_decoder(model, family, path)
    graph["external_data"] = export_graph(lambda m: decoder_spec(m, family)[0], model, path, capture)
    return graph, cache
