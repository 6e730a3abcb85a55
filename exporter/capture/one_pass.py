"""Trace a wrapper to ATen IR in one pass of ``torch.export`` instead of two.

**Why.**  ``torch.onnx.export(..., dynamo=True)`` captures the program with ``torch.export.export`` (the training
IR: the model's Python run once over fake tensors with symbolic shapes), then decomposes it for ONNX with
``ExportedProgram.run_decompositions(table)``, which traces that whole program a second time (``aot_export`` over
fake tensors, symbolic shapes again).  The second trace is most of the cost of a graph: the tiny T5 decoder on the
AMD EPYC VM, stage by stage, capture 7.1 s and decompositions 10.6 s of 20.8 s; one trace straight to ATen IR with
the same table 13.3 s (``/work/notes/s7/single_pass.py``).  A graph's trace is most of a small model's export and
of every template's.

**How.**  Inside ``torch.onnx.export``, ``torch.export.export`` is replaced by ``torch.export._trace._export`` with
``pre_dispatch=False`` and the table torch.onnx would have decomposed with
(``_decomp.create_onnx_friendly_decomposition_table`` of the ops its registry implements), split as
``run_decompositions`` splits it: the CompositeImplicitAutograd ops to keep or decompose are overridden for the
trace (``_override_composite_implicit_decomp``), the rest goes to ``aot_export`` as its decompositions.  torch.onnx's
own decomposition step then returns that program as it is; everything else of ``torch.onnx.export`` (type
promotion, assertions removed, the translation, input and output names, dynamic axes, onnxscript's optimizer) runs
as before.

**The graph.**  The same operators as the two-pass trace's; intermediate value names and a few symbolic-size
computations differ, and a tied weight is named by its first name (``embed_tokens``) instead of its last
(``lm_head``).  The export's verification (logits against PyTorch, ``exporter/verification/``) holds it like any
graph, and the stitcher traces its templates the same way.

**Private API.**  torch is pinned (``torch==2.13.0``).  Where a piece this needs is missing, or the one pass
raises, the graph is traced the standard way (two passes), as with ``ELX_ONE_PASS_TRACE=0``.
"""
from __future__ import annotations

import contextlib
import functools
import os

ENV = "ELX_ONE_PASS_TRACE"


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def _pieces():
    """torch's private pieces, or None where this torch lacks one."""
    try:
        import torch.export as torch_export
        from torch.export import _trace
        from torch.export.exported_program import (_override_composite_implicit_decomp,
                                                   _split_decomp_table_to_cia_and_python_decomp)
        from torch.onnx._internal.exporter import _decomp, _fx_passes, _registration
    except ImportError:
        return None
    needed = (getattr(_trace, "_export", None), getattr(_trace, "_export_to_aten_ir", None),
              getattr(_fx_passes, "decompose_with_registry", None),
              getattr(_decomp, "create_onnx_friendly_decomposition_table", None),
              getattr(_decomp, "get_onnx_implemented_overloads", None))
    if not all(callable(x) for x in needed):
        return None
    return torch_export, _trace, _override_composite_implicit_decomp, _split_decomp_table_to_cia_and_python_decomp, \
        _decomp, _fx_passes, _registration


@functools.lru_cache(maxsize=1)
def _onnx_table() -> tuple:
    """torch.onnx's decomposition table (what ``_fx_passes.decompose_with_registry`` builds), as items."""
    _, _, _, _, _decomp, _, _registration = _pieces()
    registry = _registration.ONNXRegistry.from_torchlib()
    implemented = set(_decomp.get_onnx_implemented_overloads(registry))
    return tuple(_decomp.create_onnx_friendly_decomposition_table(implemented).items())


@contextlib.contextmanager
def aten_in_one_trace():
    """Within this, ``torch.onnx.export(..., dynamo=True)`` traces its program once, straight to ATen IR.

    Yields a list that gets one entry per program traced so (to tell the caller the one pass ran)."""
    pieces = _pieces() if enabled() else None
    traced: list = []
    if pieces is None:
        yield traced
        return
    torch_export, _trace, override_cia, split_table, _, _fx_passes, _ = pieces
    standard_export, standard_decompose = torch_export.export, _fx_passes.decompose_with_registry
    standard_to_aten = _trace._export_to_aten_ir
    decomposed: set[int] = set()

    def export(mod, args, kwargs=None, *, dynamic_shapes=None, strict=False, preserve_module_call_signature=(),
               prefer_deferred_runtime_asserts_over_guards=False):
        if strict:  # torch.onnx's second strategy (dynamo), tried where the first failed: as torch.onnx runs it
            return standard_export(mod, args, kwargs, dynamic_shapes=dynamic_shapes, strict=strict,
                                   preserve_module_call_signature=preserve_module_call_signature,
                                   prefer_deferred_runtime_asserts_over_guards=prefer_deferred_runtime_asserts_over_guards)
        cia, python_table = split_table(dict(_onnx_table()))
        _trace._export_to_aten_ir = functools.partial(standard_to_aten, decomp_table=python_table)
        try:
            with override_cia(cia):
                program = _trace._export(mod, args, kwargs, dynamic_shapes, strict=strict,
                                         preserve_module_call_signature=preserve_module_call_signature,
                                         pre_dispatch=False,
                                         prefer_deferred_runtime_asserts_over_guards=prefer_deferred_runtime_asserts_over_guards)
        finally:
            _trace._export_to_aten_ir = standard_to_aten
        decomposed.add(id(program))
        traced.append(True)
        return program

    def decompose(program, registry):
        return program if id(program) in decomposed else standard_decompose(program, registry)

    torch_export.export, _fx_passes.decompose_with_registry = export, decompose
    try:
        yield traced
    finally:
        torch_export.export, _fx_passes.decompose_with_registry = standard_export, standard_decompose
        traced.clear()
