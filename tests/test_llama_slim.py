"""``--pass slim`` on RoPE decoder-only exports (seed 002 §3, option 1: keys cached before RoPE, no values).

conftest's Qwen2 (MHA, non-zero q/k/v biases, θ = 1e6) in both prompt-cache forms; Llama (GQA) for the
refusals.  ``ELX_LONG_TESTS=1`` adds Phi-3 (fused qkv_proj, partial rotary).
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from elx.exporter.verification.compare import compare
from elx.runners.errors import ElxError
from elx.runners.generate import Generator
from elx.runners.inputs.random_inputs import random_inputs
from elx.runners.manifest import Manifest

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def slimmed(qwen2_exports, tmp_path_factory):
    """{form: (baseline export, slim export)} for Qwen2's two prompt-cache forms."""
    from elx.exporter.export import apply_passes

    root = tmp_path_factory.mktemp("slim")
    return {form: (qwen2_exports[form], apply_passes(qwen2_exports[form], root / form, "slim"))
            for form in ("shared", "per-beam")}


@pytest.mark.parametrize("form", ["shared", "per-beam"])
def test_manifest_keys_only(slimmed, form):
    """No value anywhere: the prefill outputs keys only, the step takes no values, the cache holds keys; the
    shared form reads the prompt's position ids (to rotate the prompt's keys); every layer slimmed and verified."""
    manifest = Manifest.load(slimmed[form][1])
    record = manifest.data["passes"][-1]
    assert record["name"] == "slim" and record["layers"] == [0, 1] and record["skipped"] == {}
    assert record["max_abs_logits_diff"] <= 5e-5 and "before RoPE" in record["cache"]
    assert all(np.isfinite(s["cond_W_K"]) and s["has_bias"] == {"k": True, "v": True}
               for s in record["per_layer"].values())  # Qwen2's b_K and b_V
    names = [*manifest.graphs["prefill"]["outputs"], *manifest.graphs["decoder"]["inputs"],
             *manifest.graphs["decoder"]["outputs"], *(e["input"] for e in manifest.cache_entries)]
    assert not [n for n in names if n.endswith(".value")]
    assert [e["input"] for e in manifest.cache_entries] == ["past_key_values.0.key", "past_key_values.1.key"]
    step = manifest.graphs["decoder"]["inputs"]
    if form == "shared":
        assert step["prompt_position_ids"]["from"] == "prompt:position_ids"
        assert step["prompt_key_values.0.key"]["from"] == "prefill:present.0.key"
    else:
        assert "prompt_position_ids" not in step and manifest.cache_entries[0]["init"] == "prefill:present.0.key"


@pytest.mark.parametrize("form", ["shared", "per-beam"])
def test_identical_to_hf(slimmed, form):
    report = compare(slimmed[form][1], batch_size=3, input_length=11, seed=4, num_beams=4, num_return_sequences=2,
                     no_repeat_ngram_size=2, max_new_tokens=10)
    assert report.all_identical and max(max(r.step_logits_diff) for r in report.rows) <= 1e-4
    report = compare(slimmed[form][1], batch_size=2, input_length=40, seed=5, max_new_tokens=12)
    assert report.all_identical and max(max(r.step_logits_diff) for r in report.rows) <= 1e-4


@pytest.mark.parametrize("form", ["shared", "per-beam"])
def test_half_the_live_cache(slimmed, form):
    """Live bytes during a beam search: the prompt part (per-input state, or the per-beam cache's first P
    positions) and the generated part are half the baseline's; the tokens are the same."""
    runs = {}
    for which, folder in zip(("baseline", "slim"), slimmed[form]):
        generator = Generator.from_folder(folder)
        inputs = random_inputs(generator.manifest, 3, 10, np.random.default_rng(0))
        runs[which] = generator.generate(inputs, num_beams=3, max_new_tokens=6, min_new_tokens=6, track_memory=True)
    np.testing.assert_array_equal(runs["baseline"].sequences, runs["slim"].sequences)
    mask, positions = 3 * 10 * 8, 3 * 10 * 8  # the prompt's mask (and, slim shared: its position ids), int64
    for base, slim in zip(runs["baseline"].memory, runs["slim"].memory):
        assert 2 * slim["cache_bytes"] == base["cache_bytes"]
        if form == "shared":
            assert 2 * (slim["state_bytes"] - mask - positions) == base["state_bytes"] - mask > 0
        else:
            assert slim["state_bytes"] == base["state_bytes"] == 0


def test_verification_sees_the_key_positions(qwen2_exports, tmp_path, monkeypatch):
    """The check can fail: rotating the cached keys one position off (p − G + 1 … p + 1) is refused, nothing
    written."""
    from elx.exporter.export import apply_passes
    import elx.exporter.passes.slim_rope as slim_rope

    original = slim_rope.generated_positions

    def shifted(build, position_ids, keys):
        return build.op("Add", [original(build, position_ids, keys), build.const("one", np.array(1, np.int64))])

    monkeypatch.setattr(slim_rope, "generated_positions", shifted)
    with pytest.raises(ElxError, match="nothing was written") as info:
        apply_passes(qwen2_exports["shared"], tmp_path / "bad", "slim")
    assert "\n" not in str(info.value)
    assert not (tmp_path / "bad").exists()


def test_a_candidates_graphs_die_before_the_next_candidate(qwen2_exports, tmp_path, monkeypatch):
    """At SmolLM2-1.7B the single-layer probes of ``slim=skip-bad`` grew the pass by 0.5 GB each (23.3 GB after 24
    probes: each layer object kept its probe's graphs).  Here every candidate is rejected (a limit of 0), so the
    pass makes the all-layers candidate and a probe per layer; when each starts, no earlier one's graph lives."""
    import gc
    import weakref

    import elx.exporter.passes.culprits as culprits
    import elx.exporter.passes.slim_rope as slim_rope
    from elx.exporter.export import apply_passes

    made, alive_at_start = [], []
    load, make = slim_rope.load_graph, slim_rope.candidate

    def tracked_load(manifest, name):
        graph = load(manifest, name)
        made.append(weakref.ref(graph.nodes[-1]))  # nodes and tensors link each other: one alive keeps the graph's
        return graph

    def tracked_candidate(manifest, layers, suffix):
        gc.collect()
        alive_at_start.append(sum(ref() is not None for ref in made))
        return make(manifest, layers, suffix)

    monkeypatch.setattr(slim_rope, "load_graph", tracked_load)
    monkeypatch.setattr(slim_rope, "candidate", tracked_candidate)
    monkeypatch.setattr(culprits, "verify_limit", lambda report: 0.0)
    monkeypatch.setattr(culprits, "static_scores", lambda layers: None)  # the probes: a candidate per layer
    with pytest.raises(ElxError, match="no decoder self-attention layer is accurate enough"):
        apply_passes(qwen2_exports["shared"], tmp_path / "none", "slim=skip-bad")
    layers = Manifest.load(qwen2_exports["shared"]).dims["num_decoder_layers"]
    assert len(alive_at_start) == 1 + layers  # all layers, then each alone (all beyond the limit: none left)
    assert alive_at_start == [1] * len(alive_at_start)  # only the pass's own analysis graph, loaded first


@pytest.mark.parametrize("family,passes,expected", [("llama", "slim", "GQA/MQA"),
                                                     ("qwen2", "el-self", "RoPE rotates each cached key")],
                         ids=["slim-gqa", "el-self-rope"])
def test_refusals(exported, model_folders, tmp_path, capsys, family, passes, expected):
    """GQA (Llama: 2 key/value heads for 4 query heads) refuses slim, RoPE models refuse el-self: one line, at
    export before any work (exit 2) and on an existing export, nothing written."""
    from elx.cli import main
    from elx.exporter.export import apply_passes

    out = tmp_path / "out"
    assert main(["export", "--model", str(model_folders[family]), "--pass", passes, "--output", str(out),
                 "--quiet"]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("elx: error: pass ") and expected in line and "does not apply to" in line
    with pytest.raises(ElxError) as info:
        apply_passes(exported(family), out, passes)
    assert expected in str(info.value) and "\n" not in str(info.value)
    assert not out.exists()


@pytest.mark.skipif(not os.environ.get("ELX_LONG_TESTS"), reason="exports Phi-3 (minutes); set ELX_LONG_TESTS=1")
def test_phi3_fused_partial_rotary(tmp_path):
    """Phi-3: K and V are slices of one fused qkv_proj, RoPE rotates half of each head."""
    from elx.exporter.export import apply_passes, export_model
    from tests.conftest import make_model_folder

    for form in ("shared", "per-beam"):
        export = export_model(str(make_model_folder(tmp_path, "phi3")), tmp_path / f"phi3-{form}", quiet=True,
                              prompt_cache=form)
        slim = apply_passes(export, tmp_path / f"phi3-{form}-slim", "slim")
        assert Manifest.load(slim).data["passes"][-1]["layers"] == [0, 1]
        report = compare(slim, batch_size=3, input_length=9, seed=1, num_beams=3, max_new_tokens=8)
        assert report.all_identical and max(max(r.step_logits_diff) for r in report.rows) <= 1e-4
