"""Graph sets for TensorRT checked on ONNX Runtime: a manifest copy pointing at rewritten ONNX files.

The engine builder rewrites graphs before TensorRT sees them (fp16 weights, n-gram blocking moved
to the host).  Each rewrite gets an ORT-runnable twin; ``with_files`` describes the export with the
twins in place, and ``elx.exporter.verification.verify.verify_rewrite`` (the one verification flow of export and
passes) measures it against the export on the same seeded random cases.
"""
from __future__ import annotations

from pathlib import Path

from elx.runners.manifest import Manifest


def with_files(manifest: Manifest, files: dict[str, Path], drop_inputs: dict[str, list[str]] | None = None,
               drop_outputs: dict[str, list[str]] | None = None) -> Manifest:
    """A copy of ``manifest`` whose graphs ``files`` point at other ONNX files (absolute paths)."""
    copy = manifest.copy()
    for graph, path in files.items():
        spec = copy.graphs[graph]
        spec["file"], spec["external_data"] = str(Path(path).absolute()), []
        spec.pop("tensorrt_file", None)
        for name in (drop_inputs or {}).get(graph, []):
            spec["inputs"].pop(name, None)
        for name in (drop_outputs or {}).get(graph, []):
            spec["outputs"].pop(name, None)
    return copy
