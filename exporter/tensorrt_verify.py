"""Check a rewritten graph set for TensorRT against the export's own graphs, on ONNX Runtime (CPU).

The engine builder rewrites graphs before TensorRT sees them (fp16 weights, n-gram blocking moved to
the host); like the passes, each rewrite is run against what it replaces on seeded random inputs
(padded sources, random non-empty pasts, token histories with planted repeats) and the measured
difference goes into the manifest.  No PyTorch needed: only the runner's ORT backend.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from runners.backend import DecoderCache
from runners.inputs import random_inputs
from runners.manifest import Manifest
from runners.ort_backend import OrtBackend

# (batch, beams, source length, past length, step length)
SHAPES = ((1, 1, 5, 0, 1), (2, 3, 9, 4, 1), (2, 2, 7, 0, 2))


def with_files(manifest: Manifest, files: dict[str, Path], drop_inputs: dict[str, list[str]] | None = None) -> Manifest:
    """A copy of ``manifest`` whose graphs ``files`` point at other ONNX files (absolute paths)."""
    copy = manifest.copy()
    for graph, path in files.items():
        spec = copy.graphs[graph]
        spec["file"], spec["external_data"] = str(Path(path).absolute()), []
        spec.pop("tensorrt_file", None)
        for name in (drop_inputs or {}).get(graph, []):
            spec["inputs"].pop(name, None)
    return copy


def _histories(rows: int, length: int, vocab: int, rng) -> np.ndarray:
    history = rng.integers(3, min(vocab, 6), size=(rows, length), dtype=np.int64)
    history[:, 0] = 0
    return history


def step_outputs(manifest: Manifest, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per shape of ``SHAPES``: (token history, last-position step output) of ``manifest``'s graphs."""
    backend = OrtBackend(manifest, threads=1)
    results = []
    for batch, beams, source, past_len, step in SHAPES:
        rng = np.random.default_rng(seed)
        inputs = random_inputs(manifest, batch, source, rng)
        rows = batch * beams
        tokens = rng.integers(3, manifest.dims["vocab_size"], size=(rows, step), dtype=np.int64)
        past = {}
        for entry in manifest.cache_entries:
            dims = [rows if d == "rows" else (past_len if i == entry["seq_axis"] else d)
                    for i, d in enumerate(entry["shape"])]
            past[entry["input"]] = rng.standard_normal(dims).astype(np.float32)
        history = _histories(rows, past_len + step + 6, manifest.dims["vocab_size"], rng)
        out, _ = backend.step(tokens, backend.encode(inputs), DecoderCache(past, rows),
                              history=history if backend.needs_history else None)
        results.append((history, np.asarray(out, dtype=np.float32)))
    return results


def max_abs_diff(expected: np.ndarray, got: np.ndarray) -> float:
    """Max abs difference; infinite when the two disagree on which entries are -inf/inf/nan."""
    finite = np.isfinite(expected)
    if not np.array_equal(finite, np.isfinite(got)) or not np.array_equal(expected[~finite], got[~finite]):
        return float("inf")
    return float(np.abs(expected[finite] - got[finite]).max()) if finite.any() else 0.0
