"""The TensorRT backend on a GPU: engines built here run and match ONNX Runtime (skipped without a GPU).

Needs TensorRT for RTX (or NVIDIA TensorRT), PyTorch with CUDA and a GPU the runtime supports (TensorRT
for RTX 1.7: compute capability 7.5, 8.0, 8.6, 8.9, 12.0, 12.1; Hopper is not among them).
"""
from __future__ import annotations

import importlib.util
import shutil

import numpy as np
import pytest

from elx.runners.errors import ElxError
from elx.runners.manifest import Manifest
from elx.runners.backends.ort import OrtBackend


def _gpu_skip_reason() -> str | None:
    if importlib.util.find_spec("tensorrt_rtx") is None and importlib.util.find_spec("tensorrt") is None:
        return "no TensorRT runtime installed (pip install 'elx[tensorrt]')"
    try:
        import torch
    except ImportError:
        return "PyTorch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    if importlib.util.find_spec("tensorrt") is None:
        from elx.exporter.tensorrt.build import RTX_TARGETS

        major, minor = torch.cuda.get_device_capability()
        if f"{major}.{minor}" not in RTX_TARGETS:
            return f"TensorRT for RTX does not run on compute capability {major}.{minor}"
    return None


REASON = _gpu_skip_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=REASON or "")]
LIMITS = dict(max_batch_size=2, max_beams=3, max_input_length=16, max_new_tokens=6)


def _engines(exported, tmp_path, family, passes=None, **options):
    import torch

    from elx.exporter.tensorrt.build import build_engine

    folder = tmp_path / "export"
    shutil.copytree(exported(family, passes), folder)
    major, minor = torch.cuda.get_device_capability()
    runtime = "tensorrt" if importlib.util.find_spec("tensorrt") is not None else "tensorrt-rtx"
    capabilities = None if runtime == "tensorrt" else [f"{major}.{minor}"]
    build_engine(folder, runtime=runtime, compute_capabilities=capabilities, quiet=True, **LIMITS, **options)
    return Manifest.load(folder)


def _backend(manifest):
    from elx.runners.backends.tensorrt import TensorRTBackend

    return TensorRTBackend(manifest, device="cuda")


def _step_feeds(manifest, rows: int, past: int, rng):
    tokens = rng.integers(3, manifest.dims["vocab_size"], size=(rows, 1), dtype=np.int64)
    cache = {}
    for entry in manifest.cache_entries:
        dims = [rows if d == "rows" else (past if i == entry["seq_axis"] else d) for i, d in enumerate(entry["shape"])]
        cache[entry["input"]] = rng.standard_normal(dims).astype(np.float32)
    return tokens, cache


def _run_step(backend, manifest, inputs, tokens, cache, history=None):
    """Stages then one step through the backend seam; returns (host logits, device presents)."""
    available = {f"input:{role}": a for role, a in inputs.items()}
    for stage in manifest.stages:
        graph = manifest.graphs[stage]
        feeds = {n: available[s["from"]] for n, s in graph["inputs"].items()}
        names = list(graph["outputs"])
        for name, value in zip(names, backend.run(stage, feeds, names)):
            available[f"{stage}:{name}"] = value
    step = manifest.graphs[manifest.step]
    feeds = {}
    for name, spec in step["inputs"].items():
        source = spec["from"]
        if source == "step:input_ids":
            feeds[name] = tokens
        elif source == "step:history":
            feeds[name] = history
        elif source.startswith("cache:"):
            feeds[name] = cache[name]
        else:
            feeds[name] = available[source]
    outputs = [step.get("logits", "logits")] + [e["output"] for e in manifest.cache_entries]
    logits, *presents = backend.run(manifest.step, feeds, outputs, host_outputs=outputs[:1])
    return logits, presents


@pytest.mark.parametrize("family,passes", [("t5", None), ("bart", "el")])
def test_engines_match_onnx_runtime(exported, tmp_path, family, passes):
    from elx.runners.backends.base import DecoderCache
    from elx.runners.inputs.random_inputs import random_inputs

    manifest = _engines(exported, tmp_path, family, passes)
    backend, ort = _backend(manifest), OrtBackend(manifest)
    rng = np.random.default_rng(0)
    inputs = random_inputs(manifest, 2, 11, rng)
    tokens, cache = _step_feeds(manifest, 6, 4, rng)
    logits, presents = _run_step(backend, manifest, inputs, tokens, cache)
    expected, expected_cache = ort.step(tokens, ort.encode(inputs), DecoderCache(cache, 6))
    assert isinstance(logits, np.ndarray) and np.abs(logits - expected).max() <= 1e-4
    for entry, value in zip(manifest.cache_entries, presents):
        assert np.abs(backend.to_host(value) - expected_cache.arrays[entry["input"]]).max() <= 1e-4
    # rows reordered on the device equal rows reordered on the host
    rows = np.array([5, 0, 0, 2])
    moved = backend.take(presents[0], rows)
    assert np.array_equal(backend.to_host(moved), np.take(backend.to_host(presents[0]), rows, axis=0))
    assert backend.nbytes(moved) == moved.numel() * 4


def test_first_step_with_an_empty_cache_and_shapes_outside_the_profile(exported, tmp_path):
    from elx.runners.backends.base import DecoderCache
    from elx.runners.inputs.random_inputs import random_inputs

    manifest = _engines(exported, tmp_path, "t5", "el")
    backend, ort = _backend(manifest), OrtBackend(manifest)
    rng = np.random.default_rng(1)
    inputs = random_inputs(manifest, 1, 5, rng)
    tokens, cache = _step_feeds(manifest, 3, 0, rng)  # past length 0: the first step
    logits, _ = _run_step(backend, manifest, inputs, tokens, cache)
    expected, _ = ort.step(tokens, ort.encode(inputs), DecoderCache(cache, 3))
    assert np.abs(logits - expected).max() <= 1e-4
    too_long = random_inputs(manifest, 1, 17, rng)
    with pytest.raises(ElxError, match="axis 'encoder_sequence' is 17, outside the engine's built range 1..16"):
        _run_step(backend, manifest, too_long, tokens, cache)
    tokens, cache = _step_feeds(manifest, 3, 10, rng)
    with pytest.raises(ElxError, match="axis 'past_sequence' is 10, outside the engine's built range 0..9"):
        _run_step(backend, manifest, inputs, tokens, cache)


def test_ngram_plugin_in_the_engine_blocks_like_onnx_runtime(exported, tmp_path):
    from elx.runners.backends.base import DecoderCache
    from elx.runners.inputs.random_inputs import random_inputs

    manifest = _engines(exported, tmp_path, "bart", "ngram=2", ngram="engine")
    backend, ort = _backend(manifest), OrtBackend(manifest)
    from elx.runners.model import Model

    assert backend.ngram_blocking == "engine" and Model(manifest, backend).needs_history
    rng = np.random.default_rng(2)
    inputs = random_inputs(manifest, 2, 9, rng)
    tokens, cache = _step_feeds(manifest, 4, 3, rng)
    history = rng.integers(3, 6, size=(4, 9), dtype=np.int64)
    logits, _ = _run_step(backend, manifest, inputs, tokens, cache, history)
    expected, _ = ort.step(tokens, ort.encode(inputs), DecoderCache(cache, 4), history=history)
    assert np.array_equal(np.isneginf(logits), np.isneginf(expected)) and np.isneginf(expected).any()
    finite = np.isfinite(expected)
    assert np.abs(logits[finite] - expected[finite]).max() <= 1e-4
