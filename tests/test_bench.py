"""``elx bench --quick``: the smoke run end to end (no timing assertions), and the IOBinding backend."""
from __future__ import annotations

import json

import numpy as np
import pytest


def test_bench_quick(tmp_path):
    from elx.cli import main

    assert main(["bench", "--quick", "--work", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "t5-tiny" / "results" / "bench.json").read_text())
    systems = {s["system"]: s for s in report["systems"]}
    assert set(systems) == {"HF generate (PyTorch)", "elx baseline", "elx el"}
    assert all(s["tokens_equal_hf"] for s in systems.values())
    base, el = systems["elx baseline"], systems["elx el"]
    dims = report["dims"]
    # live tensors: el holds one [B, N, D] encoder output, the baseline 2·L cross K/V [B, h, N, d_kv]
    assert base["state_bytes"] > el["state_bytes"] > 0
    float_bytes = base["state_bytes"] - 2 * 32 * 8, el["state_bytes"] - 2 * 32 * 8  # minus the int64 mask
    assert float_bytes[0] / float_bytes[1] == pytest.approx(2 * dims["num_decoder_layers"] * dims["num_heads"]
                                                           * dims["d_kv"] / dims["d_model"])
    assert base["cache_bytes"] == el["cache_bytes"]
    assert report["flops_per_generate"] > 0 and report["matmul_peak_gflops"] > 0
    assert (tmp_path / "t5-tiny" / "results" / "bench.md").read_text().count("| elx") == 2


@pytest.mark.parametrize("passes", [None, "el", "ngram=2"])
def test_iobinding_backend_matches_plain_backend(exported, passes):
    """The IOBinding path (device-resident state/cache, Gather-graph reorder) runs on the CPU EP here."""
    from runners.generate import Generator
    from runners.inputs import random_inputs
    from runners.manifest import Manifest

    folder = exported("bart", passes)
    manifest = Manifest.load(folder)
    io, plain = Generator.from_folder(folder, backend="ort-io"), Generator.from_folder(folder)
    assert type(io.model.backend).__name__ == "OrtIoBackend"
    inputs = random_inputs(manifest, 3, 9, np.random.default_rng(0))
    for options in (dict(max_new_tokens=8, no_repeat_ngram_size=2),
                    dict(num_beams=4, num_return_sequences=2, max_new_tokens=8, no_repeat_ngram_size=2)):
        a = io.generate(inputs, track_memory=True, **options)
        b = plain.generate(inputs, track_memory=True, **options)
        np.testing.assert_array_equal(a.sequences, b.sequences)
        assert a.memory == b.memory


def test_cuda_backend_needs_onnxruntime_gpu(exported):
    import onnxruntime as ort

    from runners.errors import ElxError
    from runners.manifest import Manifest
    from runners.ort_io_backend import OrtIoBackend

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("onnxruntime-gpu is installed here")
    with pytest.raises(ElxError, match="onnxruntime-gpu"):
        OrtIoBackend(Manifest.load(exported("t5")), device="cuda")
