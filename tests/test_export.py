"""Export round trip: graphs, manifest contract, and ORT vs PyTorch at several shapes."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch

from elx.exporter.verification.verify import SHAPES, Shape, verify_export
from elx.runners.manifest import Manifest


@pytest.mark.parametrize("family", ["t5", "bart", "whisper"])
def test_manifest_contract(exported, family):
    folder = exported(family)
    manifest = Manifest.load(folder)
    data = json.loads((folder / "manifest.json").read_text())
    assert data["family"] == family
    assert manifest.stages == ["encoder", "cross_kv"] and manifest.step == "decoder"
    layers = manifest.dims["num_decoder_layers"]
    decoder = manifest.graphs["decoder"]["inputs"]
    for i in range(layers):  # Optimum's names
        assert decoder[f"past_key_values.{i}.decoder.key"]["from"] == f"cache:present.{i}.decoder.key"
        assert decoder[f"past_key_values.{i}.encoder.value"]["from"] == f"cross_kv:present.{i}.encoder.value"
    # the cross cache is computed at batch B (once per input), the self cache at rows = B·beams
    assert decoder["past_key_values.0.encoder.key"]["shape"][0] == "batch"
    assert decoder["past_key_values.0.decoder.key"]["shape"][0] == "rows"
    roles = manifest.encoder_inputs()
    if family == "whisper":
        assert set(roles) == {"input_features"}  # no token-id assumption
    else:
        assert set(roles) == {"input_ids", "attention_mask"}
    verification = data["verification"]["export"]
    assert verification["max_abs_logits_diff"] <= 1e-4 and len(verification["shapes"]) == len(SHAPES)
    for name in manifest.stages + [manifest.step]:
        model = onnx.load(str(manifest.graph_path(name)), load_external_data=False)
        assert max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) >= 17
        graph_inputs = {i.name for i in model.graph.input}
        assert graph_inputs == set(manifest.graphs[name]["inputs"])


@pytest.mark.parametrize("family", ["t5", "bart", "whisper"])
def test_ort_matches_pytorch_at_new_shapes(exported, model_folders, family):
    """Shapes the export never saw: batch 1 and 5, beams 1..5, empty and long pasts, steps of 1..3 tokens."""
    from elx.exporter.source.load import resolve_model

    folder = exported(family)
    model = resolve_model(str(model_folders[family])).model
    shapes = (Shape(1, 5, 3, 0), Shape(5, 1, 13, 9), Shape(2, 2, 4, 1, 3))
    report = verify_export(model, Manifest.load(folder), shapes=shapes, seed=7)
    assert report["max_abs_logits_diff"] <= 1e-4
    assert report["max_abs_encoder_diff"] <= 1e-4


def test_self_cache_grows_and_cross_state_is_per_input(exported):
    """Runner-side state: cross K/V at batch B (not per beam), self cache [rows, h, P, d_kv] growing by 1."""
    from elx.runners.generate import Generator
    from elx.runners.inputs.random_inputs import random_inputs

    gen = Generator.from_folder(exported("t5"))
    inputs = random_inputs(gen.manifest, 3, 9, np.random.default_rng(0))
    result = gen.generate(inputs, num_beams=4, max_new_tokens=6, min_new_tokens=6, track_memory=True)
    dims = gen.manifest.dims
    heads, d_kv, layers = dims["num_heads"], dims["d_kv"], dims["num_decoder_layers"]
    state = result.memory[0]["state_bytes"]
    mask_bytes = 3 * 9 * 8
    assert state == 2 * layers * 3 * heads * 9 * d_kv * 4 + mask_bytes  # batch 3, never 12 rows
    for step, entry in enumerate(result.memory):
        assert entry["cache_bytes"] == 2 * layers * 12 * heads * (step + 1) * d_kv * 4


def test_random_init_preset_is_recorded(tmp_path):
    """A hub id with --random-init builds the preset architecture and says so in the manifest."""
    from elx.exporter.source.load import preset_names, resolve_model

    assert {"t5-small", "t5-base", "t5-large", "flan-t5-base", "bart-base", "bart-large"} <= set(preset_names())
    loaded = resolve_model("google-t5/t5-small", random_init=True, seed=3)
    assert loaded.source == {"kind": "random-init", "model": "google-t5/t5-small", "preset": "t5-small",
                             "random_init": True, "seed": 3}
    assert loaded.model.config.d_model == 512 and loaded.model.config.num_layers == 6
    again = resolve_model("t5-small", random_init=True, seed=3).model
    assert torch.equal(loaded.model.shared.weight, again.shared.weight)  # seeded: reproducible for compare


def test_external_data_path(tmp_path, model_folders, monkeypatch):
    """Graphs above the size limit are saved with their own external data through export and passes alike, then
    folded into the folder's one shared weights file (exporter/capture/shared_weights.py), their own data files removed.

    The limit (2 GB in real use) is lowered so that a tiny model takes the same code path."""
    import elx.exporter.capture.onnx_export as onnx_export
    from elx.exporter.verification.compare import compare
    from elx.exporter.capture.shared_weights import WEIGHTS_FILE

    monkeypatch.setattr(onnx_export, "EXTERNAL_DATA_BYTES", 10_000)
    # the same export checks the release of HF's model before the passes (an fp32 export: released; CI's one fp32
    # case of ``test_the_model_is_released_before_the_passes_run``)
    folder, released = _export_watching_the_model(monkeypatch, str(model_folders["t5"]), tmp_path / "ext",
                                                  passes="el", quiet=True)
    assert released == [True]
    manifest = Manifest.load(folder)
    for name in manifest.stages + [manifest.step]:
        assert manifest.graphs[name]["external_data"] == [WEIGHTS_FILE]
        model = onnx.load(str(folder / manifest.graphs[name]["file"]), load_external_data=False)
        external = [t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
        assert external and all(t.ByteSize() < 1024 for t in model.graph.initializer if t not in external)
        assert {e.value for t in external for e in t.external_data if e.key == "location"} == {WEIGHTS_FILE}
    assert sorted(p.name for p in folder.iterdir()) == sorted(set(manifest.graph_files()) | {"manifest.json"})
    assert not list(folder.glob("*.onnx.data"))
    assert compare(folder, batch_size=2, input_length=7, num_beams=2, max_new_tokens=5).all_identical


@pytest.mark.parametrize("precision,freed", [("fp32", True), ("fp16", False)])
def test_the_model_is_released_before_the_passes_run(tmp_path, model_folders, monkeypatch, precision, freed):
    """``elx export --pass slim=skip-bad`` at SmolLM2-1.7B held HF's model (6.8 GB) beside the pass's sessions:
    an fp32 export releases it once verified against it (the passes verify graphs against graphs); fp16
    keeps it (each pass is checked in fp16 against PyTorch)."""
    folder, seen = _export_watching_the_model(monkeypatch, str(model_folders["t5"]), tmp_path / "out", passes="el",
                                              quiet=True, precision=precision)
    assert seen == [freed]
    assert [p["name"] for p in Manifest.load(folder).data["passes"]] == ["el"]


def _export_watching_the_model(monkeypatch, *args, **kwargs):
    """``export_model(*args, **kwargs)``, and for each time the passes start, whether HF's model was gone by then."""
    import weakref

    import elx.exporter.export as export

    refs, seen = [], []
    real_resolve, real_run = export.resolve_model, export.run_passes

    def resolve(*a, **k):
        loaded = real_resolve(*a, **k)
        refs.append(weakref.ref(loaded.model))
        return loaded

    def run(*a, **k):
        seen.append(refs[0]() is None)
        return real_run(*a, **k)

    monkeypatch.setattr(export, "resolve_model", resolve)
    monkeypatch.setattr(export, "run_passes", run)
    return export.export_model(*args, **kwargs), seen
