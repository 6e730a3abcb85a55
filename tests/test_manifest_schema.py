"""Damaged or hand-edited export folders (issue 23, class 4): every manifest field the runners read is checked once,
at load, against ``runners/manifest_schema.py``; the refusal is one line naming the field by its JSON path and
saying what to do.  Pinned cases from the issue's probes, then a hypothesis test that damages a real manifest at
random (a field removed or replaced by any JSON value) and asserts ``ElxError`` or a normal run, nothing else.

``ELX_LONG_TESTS=1`` draws more damaged manifests.
"""
from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elx.cli import main
from elx.runners.errors import ElxError
from elx.runners.generate import Generator
from elx.runners.manifest_schema import check, json_path

LONG = os.environ.get("ELX_LONG_TESTS") == "1"


def refused(capsys, *args) -> str:
    code = main([str(a) for a in args])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("elx: error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def t5_manifest(exported) -> dict:
    return json.loads((exported("t5") / "manifest.json").read_text())


@pytest.fixture()
def t5_copy(tmp_path, exported) -> Path:
    folder = tmp_path / "copy"
    shutil.copytree(exported("t5"), folder)
    return folder


def write(folder: Path, data) -> None:
    (folder / "manifest.json").write_text(data if isinstance(data, str) else json.dumps(data))


def damage(data: dict, path: tuple, value=...) -> dict:
    """A copy of ``data`` with the field at ``path`` removed (``value`` omitted) or replaced."""
    data = copy.deepcopy(data)
    parent = data
    for key in path[:-1]:
        parent = parent[key]
    if value is ...:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return data


# -- pinned: the damaged folders ----------------------------------------------------------------

@pytest.mark.parametrize("path,value,expected", [
    (("graphs", "encoder", "outputs"), ..., "graphs.encoder.outputs is missing"),
    (("graphs", "decoder", "outputs"), ..., "graphs.decoder.outputs is missing"),
    (("graphs", "encoder", "inputs", "input_ids", "shape"), ..., "graphs.encoder.inputs.input_ids.shape is missing"),
    (("graphs", "decoder", "inputs", "input_ids", "dtype"), ..., "graphs.decoder.inputs.input_ids.dtype is missing"),
    (("graphs", "decoder", "outputs", "logits", "dtype"), ..., "graphs.decoder.outputs.logits.dtype is missing"),
    (("cache", "self", 0, "seq_axis"), ..., "cache.self[0].seq_axis is missing"),
    (("cache", "self", 0, "seq_axis"), "2", "cache.self[0].seq_axis is a str ('2')"),
    (("cache", "self", 0, "seq_axis"), 9, "cache.self[0].seq_axis is 9, not an axis of its shape"),
    (("cache", "self", 0, "dtype"), "int9", "cache.self[0].dtype is a str ('int9')"),
    (("cache", "self", 0, "input"), "nope", "cache.self[0].input is a str ('nope'), not an input of graph 'decoder'"),
    (("tokens", "pad_token_id"), "0", "tokens.pad_token_id is a str ('0')"),
    (("tokens", "eos_token_id"), ["x"], "tokens.eos_token_id[0] is a str ('x')"),
    (("tokens", "decoder_start_token_id"), 0.5, "tokens.decoder_start_token_id is a float (0.5)"),
    (("tokens", "pad_token_id"), 10 ** 30, "tokens.pad_token_id is 1000"),
    (("tokens", "decoder_start_token_id"), 99999, "not an id in the vocabulary (dims.vocab_size is 128)"),
    (("tokens", "eos_token_id"), [-5], "tokens.eos_token_id[0] is -5"),
    (("dims", "max_position_embeddings"), -3, "dims.max_position_embeddings is -3"),
    (("generation_defaults", "suppress_tokens"), "x", "generation_defaults.suppress_tokens is a str"),
    (("graphs", "decoder", "logits"), "nope", "graphs.decoder.logits is a str ('nope'), not an output of graph"),
    (("graphs", "cross_kv", "inputs", "encoder_hidden_states", "from"), "encoder:nope", "not an output of stage"),
    (("graphs", "decoder", "external_data"), "x.bin", "graphs.decoder.external_data is a str"),
    (("source",), "x", "source is a str ('x')"),
    (("is_encoder_decoder",), "false", "is_encoder_decoder is a str ('false')"),
    (("stages", 0), "nope", "stages[0] is a str ('nope'), not a graph named in graphs"),
])
def test_damaged_field_is_named(capsys, t5_copy, t5_manifest, path, value, expected):
    write(t5_copy, damage(t5_manifest, path, value))
    line = refused(capsys, "generate", t5_copy, "--input-ids", "5 6 7", "--max-new-tokens", "2")
    assert expected in line and "manifest.json" in line and "re-run 'elx export'" in line


def test_version_written_as_a_string_is_not_called_version_1(capsys, t5_copy, t5_manifest):
    write(t5_copy, damage(t5_manifest, ("version",), "1"))
    line = refused(capsys, "generate", t5_copy, "--input-ids", "5 6 7")
    assert "version is a str ('1'), not the integer 1" in line and "reads 1" not in line
    write(t5_copy, damage(t5_manifest, ("version",), 2))
    assert "has manifest version 2; this elx reads version 1" in refused(capsys, "generate", t5_copy, "--input-ids", "5")


def test_deeply_nested_manifest(capsys, t5_copy, t5_manifest):
    text = json.dumps(t5_manifest)
    write(t5_copy, text[:-1] + ', "notes": ' + "[" * 100_000 + "]" * 100_000 + "}")
    assert "nested too deeply" in refused(capsys, "generate", t5_copy, "--input-ids", "5 6 7")
    write(t5_copy, text[:-1] + ', "x": ' + "1" * 5000 + "}")  # more digits than Python converts
    assert "corrupted" in refused(capsys, "generate", t5_copy, "--input-ids", "5 6 7")


@pytest.mark.parametrize("first,second,graph", [("encoder.onnx", "decoder.onnx", "graphs.encoder"),
                                                ("encoder.onnx", "cross_kv.onnx", "graphs.encoder")])
def test_swapped_graph_files(capsys, t5_copy, first, second, graph):
    (t5_copy / first).rename(t5_copy / "swap")
    (t5_copy / second).rename(t5_copy / first)
    (t5_copy / "swap").rename(t5_copy / second)
    line = refused(capsys, "generate", t5_copy, "--input-ids", "5 6 7")
    assert f"the graph file of {graph} does not match the manifest's inputs" in line and "swapped" in line


def test_a_graph_file_of_another_type(t5_copy, t5_manifest):
    edited = damage(t5_manifest, ("graphs", "encoder", "inputs", "input_ids", "dtype"), "int32")
    write(t5_copy, edited)
    with pytest.raises(ElxError, match=r"input_ids of type int64 in the file"):
        Generator.from_folder(t5_copy)


def test_unknown_fields_stay_allowed(t5_copy, t5_manifest):
    """Newer sections (another elx's generation config, engines notes) do not make a folder unreadable."""
    data = damage(t5_manifest, ("new_section",), {"anything": [1, {"x": None}]})
    data["graphs"]["decoder"]["note"] = "hand-written"
    data["tokens"]["sep_token_id"] = None
    write(t5_copy, data)
    out = Generator.from_folder(t5_copy).generate(input_ids=[[5, 6, 7]], max_new_tokens=2)
    assert out.sequences.shape == (1, 3)


def test_json_paths():
    assert json_path(("cache", "self", 0, "seq_axis")) == "cache.self[0].seq_axis"
    assert json_path(("graphs", "decoder", "inputs", "past.0.key", "from")) == "graphs.decoder.inputs['past.0.key'].from"
    assert json_path(()) == "the manifest"


# -- drawn: a real manifest damaged at random ------------------------------------------------------------

def _paths(value, prefix=()):
    """Every field of a parsed manifest, as paths (objects' keys and lists' indices), parents first."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield (*prefix, key)
            yield from _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value[:3]):
            yield (*prefix, index)
            yield from _paths(item, (*prefix, index))


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8)
                     | st.sampled_from([0, 1, -1, 2 ** 63, "rows", "input:input_ids", "encoder:last_hidden_state"]),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                  max_size=3), max_leaves=6)


@settings(max_examples=400 if LONG else 40, deadline=None, derandomize=not LONG,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_randomly_damaged_manifest_is_refused_or_runs(data, t5_manifest, exported, tmp_path_factory):
    """Any single field removed or replaced: ``Manifest.load`` and a generate raise ``ElxError`` or succeed."""
    paths = [p for p in _paths(t5_manifest) if p[0] not in ("verification",)]
    path = data.draw(st.sampled_from(paths), label="path")
    value = data.draw(st.just(...) | _JSON, label="value")
    damaged = damage(t5_manifest, path, value)
    try:
        check(damaged, "manifest.json")
    except ElxError as err:
        assert "\n" not in str(err) and ("manifest" in str(err))
        return
    folder = tmp_path_factory.mktemp("damaged")
    for graph in Path(exported("t5")).glob("*.onnx"):
        (folder / graph.name).symlink_to(graph)
    write(folder, damaged)
    try:
        Generator.from_folder(folder).generate(input_ids=np.array([[5, 6, 7], [8, 9, 0]]), num_beams=2,
                                               max_new_tokens=2)
    except ElxError:
        pass
