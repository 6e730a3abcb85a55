"""The per-layer int8 rule's graphs (``exporter/precision/int8_layers.py``): each layer's graph cut from one
conversion of every layer is the graph a conversion of that layer alone writes, so its error is the same bit for
bit, on an encoder-decoder export (cross K/V: one quantized encoder output shared by every layer's projections)
and a decoder-only one (prefill and step)."""
from __future__ import annotations

from collections import Counter

import onnx
import pytest

from elx.runners.manifest import Manifest

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _ops(model: onnx.ModelProto) -> Counter:
    return Counter(n.op_type for n in model.graph.node)


@pytest.mark.parametrize("family", ["t5", "llama"])
def test_a_layer_cut_from_the_full_conversion_is_that_layer_converted_alone(exported, model_folders, tmp_path,
                                                                           family, monkeypatch):
    """Each layer's variant (cut from one full conversion) is that layer converted alone, bit for bit: written
    as a whole folder, and as the export writes it, a graph whose fp32 weights refer to the prepared weights
    written once (external data forced here, as a real model's size would)."""
    from elx.exporter.precision.decoder_only import torch_side
    from elx.exporter.precision.int8 import convert_folder
    from elx.exporter.precision.int8_check import random_inputs_error
    from elx.exporter.precision.int8_layers import (GraphPair, PreparedWeights, measured_layers, pair_layers,
                                                    variant_folder)
    from elx.exporter.source.load import resolve_model

    manifest = Manifest.load(exported(family))
    torch_model = resolve_model(str(model_folders[family])).model
    reference = torch_side(torch_model, manifest)
    converted = convert_folder(manifest, tmp_path / "every-layer")
    pairs = {name: GraphPair(manifest, name, converted) for name in [*manifest.stages, manifest.step]}
    # no monkeypatching of the 2 GB rule: a graph under it is what every real export below 2 GB has (a patched
    # threshold here once hid that the prepared weights were saved inside the graph, copied by every variant)
    (tmp_path / "shared").mkdir()
    (tmp_path / "apart").mkdir()
    store = PreparedWeights(tmp_path / "shared")
    shared = {name: GraphPair(manifest, name, converted, tmp_path / "shared", store) for name in pairs}
    store.close()
    apart = {name: GraphPair(manifest, name, converted, tmp_path / "apart") for name in pairs}
    sizes = {name: (tmp_path / "apart" / f"{name}.fp32.weights.data").stat().st_size for name in apart}
    one_file = (tmp_path / "shared" / store.file).stat().st_size
    # the graphs' weights in one file, each tensor once: the sessions of a layer's check map one copy of the model
    assert max(sizes.values()) <= one_file < sum(sizes.values()) and min(sizes.values()) > 0, (one_file, sizes)
    weights = {name: one_file for name in pairs}
    layers = pair_layers(pairs)
    assert layers == measured_layers(manifest) and "lm_head" in layers and len(layers) >= 3
    fp32_ops = {name: _ops(pair.fp32) for name, pair in pairs.items()}
    for layer in layers:
        alone = convert_folder(manifest, tmp_path / f"alone-{layer}", only=layer)
        cut = variant_folder(manifest, pairs, layer, tmp_path / f"cut-{layer}")
        changed = 0
        for name in pairs:
            want, got = (onnx.load(str(m.graph_path(name))) for m in (alone, cut))
            assert _ops(got) == _ops(want), (layer, name)
            changed += _ops(got) != fp32_ops[name]
        assert changed >= 1, layer  # the layer's MatMuls are on int8 somewhere
        referring = variant_folder(manifest, shared, layer, tmp_path / f"ref-{layer}")
        for name in pairs:
            path = referring.graph_path(name)
            if path.parent == tmp_path / "shared":  # the variant: its fp32 weights refer to the shared file
                graph = onnx.load(str(path), load_external_data=False).graph
                inline = sum(t.ByteSize() for t in graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL)
                assert not list(path.parent.glob(f"{path.name}.data")) and inline < weights[name] / 2, (inline, name)
                assert any(t.data_location == onnx.TensorProto.EXTERNAL for t in graph.initializer)
        errors = [random_inputs_error(torch_model, m, reference)["max_abs_logits_diff"]
                  for m in (alone, cut, referring)]
        assert errors[0] == errors[1] == errors[2] and errors[0] > 0, (layer, errors)
