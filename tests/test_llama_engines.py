"""TensorRT for RTX engines for Llama-family exports, built on this CPU (``elx build-engine``; skips without
``tensorrt_rtx``): the tiny Llama (GQA, the prompt shared by the beams) and Qwen2 with ``--pass slim`` in HF's
per-beam layout (the prompt in the cache: a longer past, the step's attention mask over past + 1 positions)."""
from __future__ import annotations

import pytest

from elx.exporter.tensorrt.profiles import Limits, axis_ranges
from elx.runners.manifest import Manifest
from tests.test_tensorrt_build import LIMITS, _build, _check_engines, _copy, needs_rtx

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@needs_rtx
def test_llama_engines(exported, tmp_path):
    folder = _copy(exported("llama"), tmp_path, "llama")
    _build(folder)
    engines = _check_engines(folder)
    assert engines["axes"]["prompt_sequence"] == [1, 8, 16] and sorted(engines["graphs"]) == ["decoder", "prefill"]
    assert engines["graphs"]["decoder"]["inputs"]["prompt_key_values.0.key"]["shape"] == [-1, 2, -1, 8]


@needs_rtx
def test_slim_per_beam_engines(qwen2_exports, tmp_path):
    from elx.exporter.export import apply_passes

    folder = apply_passes(qwen2_exports["per-beam"], tmp_path / "slim", "slim")
    _build(folder)
    manifest = Manifest.load(folder)
    engines = manifest.data["engines"]
    past = 16 + 6 + 3  # the prompt and the generated tokens share the per-beam cache
    assert engines["axes"]["past_sequence"] == [0, 13, past] and engines["axes"]["past_sequence + 1"] == [1, 14, past + 1]
    step = engines["graphs"]["decoder"]["inputs"]
    assert step["attention_mask"]["profiles"] == [[[1, 1], [6, 14], [6, past + 1]]]
    assert sorted(step) == ["attention_mask", "input_ids", "past_key_values.0.key", "past_key_values.1.key",
                            "position_ids"]


def test_decoder_only_axes(exported, qwen2_exports):
    """The prompt axis, and a per-beam cache's longer past (no TensorRT needed)."""
    limits = Limits(**LIMITS)
    shared = axis_ranges(Manifest.load(exported("llama")), limits)
    per_beam = axis_ranges(Manifest.load(qwen2_exports["per-beam"]), limits)
    assert shared["prompt_sequence"] == per_beam["prompt_sequence"] == [1, 8, 16]
    assert shared["past_sequence"] == [0, 5, 9] and per_beam["past_sequence"] == [0, 13, 25]
