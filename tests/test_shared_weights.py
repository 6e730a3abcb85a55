"""Each weight is stored once per export folder (exporter/capture/shared_weights.py, issue 27 item 6).

* every large initializer of every graph the manifest lists lives in ``weights.data``, and no two
  stored ranges hold the same bytes;
* the file holds nothing else: bytes outside the referenced ranges are alignment zeros, shorter than
  one alignment step (passes that drop or rewrite graphs leave no orphaned weights);
* storing weights once changes no output: generation from the folder is bit-identical to the same
  graphs saved standalone (every tensor inside its own file);
* the folder holds exactly the files its manifest lists (``--force`` replaces it; nothing else is left).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx.external_data_helper import uses_external_data

from elx.exporter.atomic import check_output
from elx.exporter.capture.shared_weights import LINE, MIN_BYTES, PAGE, WEIGHTS_FILE, graph_files
from elx.runners.errors import ElxError
from elx.runners.manifest import Manifest


def stored_ranges(folder: Path) -> tuple[list[tuple[int, int]], int]:
    """(offset, length) of every external tensor of every graph in the folder, and the tensors counted."""
    manifest = Manifest.load(folder)
    ranges, count = [], 0
    for file in graph_files(manifest):
        model = onnx.load(str(folder / file), load_external_data=False)
        for tensor in model.graph.initializer:
            if uses_external_data(tensor):
                info = {e.key: e.value for e in tensor.external_data}
                assert info["location"] == WEIGHTS_FILE, (file, tensor.name, info)
                ranges.append((int(info["offset"]), int(info["length"])))
                count += 1
            else:  # what stays inside a graph is small
                assert len(tensor.raw_data) < MIN_BYTES, (file, tensor.name)
    return ranges, count


def check_stored_once(folder: Path) -> dict:
    """The layout rules of the module docstring; returns the manifest's ``weights`` record."""
    manifest = Manifest.load(folder)
    ranges, count = stored_ranges(folder)
    data = (folder / WEIGHTS_FILE).read_bytes()
    distinct = sorted(set(ranges))
    blobs = [data[o:o + n] for o, n in distinct]
    assert all(o + n <= len(data) for o, n in distinct)
    assert len(set(blobs)) == len(blobs), "two stored ranges hold the same bytes"
    end = 0
    for offset, length in distinct:  # ranges never overlap; the gaps are alignment zeros
        assert offset >= end and offset % (PAGE if length >= PAGE else LINE) == 0
        gap = data[end:offset]
        assert gap == b"\0" * len(gap) and len(gap) < PAGE, (end, offset)
        end = offset + length
    assert end == len(data), "bytes after the last stored tensor"
    record = manifest.data["weights"]
    assert record["bytes"] == len(data) and record["distinct_tensors"] == len(distinct) and record["tensors"] == count
    for spec in manifest.graphs.values():
        assert spec["external_data"] == [WEIGHTS_FILE]
    expected = set(manifest.graph_files()) | {"manifest.json"} | ({"tokenizer"} if (folder / "tokenizer").exists()
                                                                    else set())
    assert {p.name for p in folder.iterdir()} == expected
    return record


def standalone_copy(folder: Path, target: Path) -> Path:
    """The export with every graph saved with its tensors inside it (no shared file)."""
    shutil.copytree(folder, target)
    manifest = Manifest.load(target)
    for file in graph_files(manifest):
        onnx.save_model(onnx.load(str(folder / file)), str(target / file))
    (target / WEIGHTS_FILE).unlink()
    data = json.loads((target / "manifest.json").read_text())
    for spec in data["graphs"].values():
        spec["external_data"] = []
    (target / "manifest.json").write_text(json.dumps(data))
    return target


@pytest.mark.parametrize("family,passes", [("t5", None), ("t5", "el"), ("bart", "ngram=2"), ("gpt2", None)])
def test_each_weight_is_stored_once(exported, family, passes):
    check_stored_once(exported(family, passes))


def test_graphs_of_one_model_share_their_weights(exported):
    """GPT-2's prefill and step graphs hold the same weights: the folder stores them once (was twice)."""
    folder = exported("gpt2")
    record = check_stored_once(folder)
    ranges, _ = stored_ranges(folder)
    per_graph = sum(n for _, n in ranges)  # what each graph would hold on its own
    assert record["bytes"] < 0.6 * per_graph
    # the T5 baseline's encoder and decoder read the one shared embedding
    t5 = Manifest.load(exported("t5"))
    assert t5.data["weights"]["tensors"] > t5.data["weights"]["distinct_tensors"]


@pytest.mark.parametrize("family,passes", [("t5", "el"), ("gpt2", None)])
def test_storing_weights_once_changes_no_output(exported, tmp_path, family, passes):
    from elx.runners.generate import Generator
    from elx.runners.inputs.random_inputs import random_inputs

    folder = exported(family, passes)
    alone = standalone_copy(folder, tmp_path / "standalone")
    assert not (alone / WEIGHTS_FILE).exists()
    results = []
    for path in (folder, alone):
        generator = Generator.from_folder(path)
        inputs = random_inputs(generator.manifest, 3, 9, np.random.default_rng(4))
        results.append(generator.generate(inputs, num_beams=3, max_new_tokens=6, num_return_sequences=2))
    assert np.array_equal(results[0].sequences, results[1].sequences)
    assert np.array_equal(results[0].sequences_scores, results[1].sequences_scores)  # bit for bit


def test_passes_leave_no_orphaned_or_duplicated_weights(exported, tmp_path):
    """A pass on an export whose weights are already shared (bench's cached baseline): the graphs it replaces
    (cross_kv, the decoder) take their weights with them, the rewrite's new ones are stored once."""
    from elx.exporter.export import apply_passes

    base = exported("t5")
    folder = apply_passes(base, tmp_path / "el", "el")
    check_stored_once(folder)
    assert "cross_kv" not in Manifest.load(folder).graphs
    cross_kv = onnx.load(str(Manifest.load(base).graph_path("cross_kv")))
    dropped = {t.raw_data for t in cross_kv.graph.initializer if len(t.raw_data) >= MIN_BYTES}
    data = (folder / WEIGHTS_FILE).read_bytes()
    assert dropped and not any(d in data for d in dropped)  # the cross K/V projections left with their graph


def test_graph_data_files_are_folded_in(exported, tmp_path):
    """A folder whose graphs carry their own ``X.onnx.data`` (graphs above 2 GB, or an older elx) is repacked:
    the per-graph files go, one shared file stays."""
    from elx.exporter.capture.shared_weights import store_weights_once

    folder = standalone_copy(exported("t5"), tmp_path / "own-data")
    manifest = Manifest.load(folder)
    for spec in manifest.graphs.values():
        model = onnx.load(str(folder / spec["file"]))
        onnx.save_model(model, str(folder / spec["file"]), save_as_external_data=True, location=spec["file"] + ".data",
                        size_threshold=0)
        spec["external_data"] = [spec["file"] + ".data"]
    manifest.data["weights"] = store_weights_once(folder, manifest)
    manifest.save(folder)
    check_stored_once(folder)
    assert not list(folder.glob("*.onnx.data"))


def test_force_replaces_a_shared_weights_export_and_nothing_else(exported, tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(exported("t5"), folder)
    assert check_output(folder, force=True) == folder  # weights.data is listed by the manifest: elx's own
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(ElxError, match="notes.txt"):
        check_output(folder, force=True)


def test_a_pass_graph_reads_its_weights_from_the_folder_until_a_pass_reads_them(exported, tmp_path):
    """``load_graph`` leaves weights on disk (a 1.7B model's slim candidates held 6.8 GB per loaded graph):
    a graph saved untouched points at ``weights.data`` and its data files name it; a weight the pass read
    is saved inside the new graph; ONNX Runtime runs both to the same outputs as the original."""
    import onnxruntime as ort
    from elx.exporter.passes.rewrite import load_graph, save_graph

    folder = Path(shutil.copytree(exported("gpt2"), tmp_path / "gpt2"))
    manifest = Manifest.load(folder)
    graph = load_graph(manifest, manifest.step)
    weights = [t for t in graph.tensors().values() if isinstance(getattr(t, "_values", None), onnx_lazy())
               and uses_external_data(t._values.tensor)]
    assert len(weights) >= 10  # nothing read yet: every large weight still an external reference
    read = max(weights, key=lambda t: np.prod(t.shape))
    original = onnx.numpy_helper.to_array(next(t for t in onnx.load(str(manifest.graph_path(manifest.step)))
                                               .graph.initializer if t.name == read.name))
    assert np.array_equal(read.values, original)  # read from weights.data on demand
    files = save_graph(graph, folder, "decoder.read.onnx")
    assert files == [WEIGHTS_FILE]  # no copy of the weights: the new graph reads the folder's file
    saved = onnx.load(str(folder / "decoder.read.onnx"), load_external_data=False)
    inside = {t.name for t in saved.graph.initializer if not uses_external_data(t)}
    outside = {t.name for t in saved.graph.initializer if uses_external_data(t)}
    assert read.name in inside and len(outside) == len(weights) - 1
    feeds = {}
    rng = np.random.default_rng(0)
    session = ort.InferenceSession(str(manifest.graph_path(manifest.step)), providers=["CPUExecutionProvider"])
    for spec in session.get_inputs():
        shape = [2 if not isinstance(d, int) else d for d in spec.shape]
        feeds[spec.name] = (rng.integers(0, 5, shape) if "int" in spec.type else rng.standard_normal(shape)).astype(
            np.int64 if "int" in spec.type else np.float32)
    rewritten = ort.InferenceSession(str(folder / "decoder.read.onnx"), providers=["CPUExecutionProvider"])
    for a, b in zip(session.run(None, feeds), rewritten.run(None, feeds)):
        assert np.array_equal(a, b)


def onnx_lazy():
    import onnx_graphsurgeon as gs
    return gs.ir.tensor.LazyValues


def test_large_strings_equal_only_where_sampled_are_both_stored(tmp_path):
    """Strings over 4 MiB are keyed by samples of their bytes (``bytes_key``); a key match is confirmed byte for
    byte, so two strings that differ only between the samples are both written, and equal ones once."""
    from elx.exporter.capture.shared_weights import SAMPLED_ABOVE, ByteStore, bytes_key

    rng = np.random.default_rng(0)
    a = rng.standard_normal(SAMPLED_ABOVE // 4 * 3, dtype=np.float32)  # 12 MiB
    b = a.copy()
    middle = len(a) // 2 + 4099  # between two sampled slices
    b[middle] += 1.0
    assert bytes_key(memoryview(a).cast("B")) == bytes_key(memoryview(b).cast("B"))  # the samples agree
    with open(tmp_path / "w.data", "w+b") as handle:
        store = ByteStore(handle)
        first, second, again = (store.place(x.tobytes()) for x in (a, b, a.copy()))
    assert first != second and again == first and store.distinct == 2 and store.references == 3
    data = np.fromfile(tmp_path / "w.data", dtype=np.float32)
    assert np.array_equal(data[first // 4: first // 4 + len(a)], a)
    assert np.array_equal(data[second // 4: second // 4 + len(b)], b)


def test_initializer_views_and_transposes_are_the_bytes_of_numpy():
    """``values_of`` (a view of an initializer's bytes) and ``transposed`` (PyTorch's transpose) give what
    ``numpy_helper.to_array`` and NumPy's transpose give, bit for bit."""
    from onnx import numpy_helper

    from elx.exporter.capture.weights import _equal, transposed, values_of

    rng = np.random.default_rng(1)
    for array in (rng.standard_normal((67, 129)).astype(np.float32), rng.integers(-5, 5, (3, 4, 5)),
                  rng.standard_normal(7).astype(np.float16), np.array([np.nan, -0.0], dtype=np.float32)):
        tensor = numpy_helper.from_array(array, "t")
        assert np.array_equal(values_of(tensor), numpy_helper.to_array(tensor), equal_nan=True)
        assert values_of(tensor).dtype == array.dtype
    w = rng.standard_normal((300, 70)).astype(np.float32)
    assert transposed(w).tobytes() == np.ascontiguousarray(w.T).tobytes()
    assert _equal(transposed(w), w, "transpose") and not _equal(transposed(w) + 1e-7, w, "transpose")
    nan = np.array([np.nan, 1.0], dtype=np.float32)
    assert _equal(nan.copy(), nan, "identity")  # a weight's bytes, NaN included
    assert not _equal(np.array([0.0, 1.0], dtype=np.float32), np.array([-0.0, 1.0], dtype=np.float32), "identity")


def _with_new_tensors(folder: Path, graph: str, changed: str, same: bool) -> tuple[str, int]:
    """``graph``'s first large external initializer put inside the graph (its own bytes where ``same``, else other
    bytes), and a new 4 KiB initializer added; returns (that initializer's name, its offset before)."""
    from onnx import numpy_helper
    from onnx.external_data_helper import load_external_data_for_tensor

    path = folder / Manifest.load(folder).graphs[graph]["file"]
    model = onnx.load(str(path), load_external_data=False)
    tensor = next(t for t in model.graph.initializer if uses_external_data(t) and t.name == changed) if changed else \
        next(t for t in model.graph.initializer if uses_external_data(t))
    offset = int({e.key: e.value for e in tensor.external_data}["offset"])
    load_external_data_for_tensor(tensor, str(folder))
    tensor.data_location = onnx.TensorProto.DEFAULT
    del tensor.external_data[:]
    if not same:
        tensor.raw_data = bytes(b ^ 1 for b in tensor.raw_data)
    model.graph.initializer.append(numpy_helper.from_array(
        np.random.default_rng(0).standard_normal(1024).astype(np.float32), "new_4k"))
    onnx.save_model(model, str(path))
    return tensor.name, offset


def _all_values(folder: Path) -> dict:
    """(graph file, initializer name) -> its bytes, wherever they are stored."""
    from elx.exporter.capture.shared_weights import values

    found = {}
    for file in graph_files(Manifest.load(folder)):
        for tensor in onnx.load(str(folder / file), load_external_data=False).graph.initializer:
            found[file, tensor.name] = values(tensor, folder).tobytes()
    return found


@pytest.mark.parametrize("family,graph,same", [("gpt2", "decoder", True), ("t5", "cross_kv", False)])
def test_weights_data_is_brought_to_what_the_graphs_read_in_place(exported, tmp_path, family, graph, same):
    """``_kept_in_place``: after a pass, ``weights.data`` is kept (the same file), the ranges no graph reads any more
    are dropped (the later ones moved down, zeros between), a tensor equal to stored bytes is pointed at them and
    new bytes are appended; the layout rules hold and every graph reads the same values as before.  GPT-2: a pass
    that keeps every weight (unpad) plus a new tensor; T5: a replaced weight (its old bytes read by no graph)."""
    from elx.exporter.capture.shared_weights import store_weights_once

    folder = tmp_path / family
    shutil.copytree(exported(family), folder)
    before, inode = (folder / WEIGHTS_FILE).read_bytes(), (folder / WEIGHTS_FILE).stat().st_ino
    name, offset = _with_new_tensors(folder, graph, "", same=same)
    expected = _all_values(folder)
    manifest = Manifest.load(folder)
    manifest.data["weights"] = store_weights_once(folder, manifest)
    manifest.save(folder)
    check_stored_once(folder)
    assert _all_values(folder) == expected
    after = (folder / WEIGHTS_FILE).read_bytes()
    assert (folder / WEIGHTS_FILE).stat().st_ino == inode  # the file kept, not written anew
    model = onnx.load(str(folder / manifest.graphs[graph]["file"]), load_external_data=False)
    tensor = next(t for t in model.graph.initializer if t.name == name)
    if same:  # nothing dropped: the bytes before untouched, the copy pointed back at them, 4 KiB appended
        assert after[:len(before)] == before and len(before) < len(after) <= len(before) + PAGE + 4096
        assert int({e.key: e.value for e in tensor.external_data}["offset"]) == offset
    else:  # the replaced weight's bytes are gone
        old = before[offset: offset + len(expected[manifest.graphs[graph]["file"], name])]
        assert old not in after and len(after) <= len(before) + 2 * PAGE + 4096
