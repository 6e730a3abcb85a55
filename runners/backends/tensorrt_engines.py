"""The manifest's ``engines`` section: what ``elx build-engine`` built, and the checks a runner makes against it.

Written by ``exporter/tensorrt/build.py``, read by ``runners/backends/tensorrt.py``; plain data, no
TensorRT import, so every check here also runs on machines without a GPU.  The section::

    "engines": {
      "format": 1, "build_id": "...", "folder": "engines",
      "runtime": "tensorrt_rtx", "runtime_version": "1.7.1.116",
      "precision": "fp32" | "fp16", "tf32": false, "compute_capabilities": ["8.0", ...],
      "limits": {"max_batch_size": 8, "max_beams": 4, "max_input_length": 512, "max_new_tokens": 128},
      "axes": {"batch": [1, 8, 8], "rows": [1, 32, 32], "encoder_sequence": [1, 256, 512],
               "decoder_sequence": [1, 1, 4], "past_sequence": [0, 66, 131], "history_length": [1, 66, 132]},
      "graphs": {"<graph>": {"file": "engines/<graph>.plan", "source": "<onnx file built>", "source_bytes": N,
                              "bytes": N, "build_seconds": s,
                              "inputs": {"<name>": {"dtype": "int64", "axes": ["batch", "encoder_sequence"],
                                                    "profiles": [[[min...], [opt...], [max...]]]}},
                              "outputs": {"<name>": {"dtype": "float32", "shape": [-1, 128]}}}},
      "ngram": {"size": 3, "blocking": "engine" | "host", ...},      (only for --pass ngram exports)
      "fp16": {...}                                                   (only for precision fp16)
    }

``axes`` holds [min, opt, max] per named axis; ``axes`` of an input name each dimension (an int for a
fixed one) and ``profiles`` its [min, opt, max] shapes per optimization profile.  ``engines/build.json``
repeats ``build_id``: a manifest and an engines folder from different builds are refused.
"""
from __future__ import annotations

import json
from pathlib import Path

from elx.runners.errors import ElxError

SECTION = "engines"
FORMAT = 1
BUILD_FILE = "build.json"

# what to change when a shape falls outside the built range
_REBUILD_HINT = {
    "batch": "--max-batch-size",
    "rows": "--max-batch-size or --max-beams",
    "encoder_sequence": "--max-input-length",
    "past_sequence": "--max-new-tokens",
    "history_length": "--max-new-tokens",
    "decoder_sequence": "a shorter decoder prompt",
}


def section(manifest) -> dict:
    """The manifest's engines section, checked against the folder; one-line errors for what is off."""
    data = manifest.data.get(SECTION)
    folder = Path(manifest.folder) if manifest.folder is not None else None
    where = folder or "this export"
    if not data:
        raise ElxError(f"{where} has no TensorRT engines; run elx build-engine {where} first")
    if data.get("format") != FORMAT:
        raise ElxError(f"{where}: engines section format {data.get('format')!r} is not {FORMAT}; run elx build-engine again")
    if folder is None:
        return data
    stamp = folder / data["folder"] / BUILD_FILE
    try:
        built = json.loads(stamp.read_text()).get("build_id")
    except (OSError, ValueError):
        built = None
    if built != data["build_id"]:
        raise ElxError(f"{folder / data['folder']} does not match manifest.json (another or an interrupted build); "
                       f"run elx build-engine {folder} again")
    for name in [*manifest.stages, manifest.step]:
        graph = data["graphs"].get(name)
        if graph is None:
            raise ElxError(f"{folder}: no engine for graph {name!r}; run elx build-engine {folder} again")
        if not (folder / graph["file"]).is_file():
            raise ElxError(f"{folder / graph['file']} is missing; run elx build-engine {folder} again")
        spec = manifest.graphs[name]
        sources = {spec["file"], spec.get("tensorrt_file")}
        source = folder / graph["source"]
        if graph["source"] not in sources or not source.is_file() or source.stat().st_size != graph["source_bytes"]:
            raise ElxError(f"the engine for {name!r} was built from another {graph['source']} (the graphs changed "
                           f"since); run elx build-engine {folder} again")
    return data


def _axis_error(graph: str, name: str, axis, index: int, value: int, low: int, high: int) -> ElxError:
    label = repr(axis) if isinstance(axis, str) else f"{index}"
    hint = _REBUILD_HINT.get(axis)
    fix = f"; rebuild the engines with a larger {hint}" if hint and value > high else ""
    if isinstance(axis, str) and axis == "decoder_sequence" and value > high:
        fix = "; the engines take at most that many decoder tokens per step"
    return ElxError(f"{graph} input {name!r} axis {label} is {value}, outside the engine's built range "
                    f"{low}..{high}{fix}")


def check_shapes(graph: str, spec: dict, shapes: dict) -> int:
    """The first optimization profile that holds every input shape; else a one-line error naming the axis."""
    missing = [n for n in spec["inputs"] if n not in shapes]
    if missing:
        raise ElxError(f"{graph} needs input(s) {', '.join(missing)}")
    first_error = None
    count = len(next(iter(spec["inputs"].values()))["profiles"]) if spec["inputs"] else 1
    for index in range(count):
        error = None
        for name, tensor in spec["inputs"].items():
            shape = tuple(int(d) for d in shapes[name])
            low, _, high = tensor["profiles"][index]
            if len(shape) != len(low):
                raise ElxError(f"{graph} input {name!r} has rank {len(shape)}, the engine takes rank {len(low)}")
            for i, (value, lo, hi, axis) in enumerate(zip(shape, low, high, tensor["axes"])):
                if not lo <= value <= hi:
                    error = _axis_error(graph, name, axis, i, value, lo, hi)
                    break
            if error:
                break
        if error is None:
            return index
        first_error = first_error or error
    raise first_error
