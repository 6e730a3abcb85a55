"""The Python API under misuse (issue 23, class 5): every public function checks its arguments first
(``runners/arguments.py``) and raises ``elx.ElxError`` naming the argument, never a ``TypeError`` or
``ValueError`` from deep inside, and never runs on silently converted values (float token ids truncated, an
attention mask of 7s).

Pinned cases from the issue first, then hypothesis properties: arguments of wrong types and shapes drawn for
``Generator.generate``, ``Generator.from_folder``, ``generate_file``, ``export`` and ``build_engine``; each call
raises ``ElxError`` or returns a correct result (what the same call with plain Python values returns).
``ELX_LONG_TESTS=1`` draws ten times as many examples.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import elx
from elx import ElxError

LONG = os.environ.get("ELX_LONG_TESTS") == "1"
IDS = [[5, 6, 7], [8, 9, 10]]


def examples(n: int):
    return settings(max_examples=n * (10 if LONG else 1), deadline=None, derandomize=not LONG, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def t5(exported) -> Path:
    return exported("t5")


@pytest.fixture(scope="module")
def generator(t5):
    return elx.Generator.from_folder(t5)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "in.jsonl"
    path.write_text("".join(json.dumps({"id": i, "input_ids": ids}) + "\n" for i, ids in enumerate(IDS)))
    return path


def refused(call, *names: str) -> str:
    with pytest.raises(ElxError) as info:
        call()
    message = str(info.value)
    assert all(name in message for name in names), message
    return message


# -- pinned: the examples --------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,names", [
    (dict(input_ids="5 6 7"), ["input_ids", "a str"]),
    (dict(input_ids=5), ["input_ids", "an int"]),
    (dict(input_ids=[5, 6, 7]), ["input_ids row 0", "an int"]),
    (dict(input_ids=[[[5, 6, 7]]]), ["input_ids row 0", "a list"]),
    (dict(input_ids=[[5.7, 6.2, 7.9]]), ["input_ids row 0", "a float (5.7)"]),
    (dict(input_ids=np.array([[5.7, 6.2]])), ["input_ids", "float64"]),
    (dict(input_ids=[None, [5, 6]]), ["input_ids row 0 is None"]),
    (dict(input_ids=[[True, False]]), ["input_ids row 0", "a bool"]),
    (dict(input_ids=[[5, 6, 7], [8, 9]], attention_mask=[[1, 1, 1], [1, 1]]), ["input_ids rows", "different lengths"]),
    (dict(input_ids=[[5, 6, 7]], attention_mask=[[7, 7, 7]]), ["attention_mask holds 7"]),
    (dict(input_ids=[[5, 6, 7]], attention_mask=[[1, -3, 1]]), ["attention_mask holds -3"]),
    (dict(input_ids=[[5, 6, 7]], attention_mask=[[1, 1]]), ["attention_mask has shape [1, 2]"]),
    (dict(input_ids=[[5, 6, 7]], attention_mask=[[0, 0, 0]]), ["attention_mask row 0 masks every token"]),
    (dict(attention_mask=[[1, 1]]), ["attention_mask goes with input_ids"]),
    (dict(text=5), ["text", "an int"]),
    (dict(text=b"w5 w6"), ["text", "bytes"]),
    (dict(inputs={"input_ids": IDS, "foo": 1}), ["inputs has 'foo'"]),
    (dict(input_ids=IDS, num_beams=2.5), ["num_beams"]),
    (dict(input_ids=IDS, num_beams="4"), ["num_beams"]),
    (dict(input_ids=IDS, num_beams=True), ["num_beams"]),
    (dict(input_ids=IDS, max_new_tokens=-1), ["max_new_tokens"]),
    (dict(input_ids=IDS, num_beams=2, early_stopping=1), ["early_stopping"]),
    (dict(input_ids=IDS, eos_token_id="x"), ["eos_token_id"]),
    (dict(input_ids=IDS, eos_token_id=10 ** 30), ["eos_token_id", "outside this model's token ids"]),
    (dict(input_ids=IDS, pad_token_id=128), ["pad_token_id is 128", "0 to 127"]),
    (dict(input_ids=IDS, decoder_start_token_id=99999), ["decoder_start_token_id is 99999"]),
    (dict(input_ids=IDS, forced_bos_token_id=1000), ["forced_bos_token_id"]),
    (dict(input_ids=IDS, suppress_tokens="x"), ["suppress_tokens"]),
    (dict(input_ids=IDS, begin_suppress_tokens=5), ["begin_suppress_tokens"]),
    (dict(input_ids=IDS, track_memory="yes"), ["track_memory"]),
    (dict(input_ids=IDS, settings={"num_beams": 2}), ["settings"]),
])
def test_generate_misuse(generator, kwargs, names):
    refused(lambda: generator.generate(**kwargs), *names)


@pytest.mark.parametrize("kwargs,names", [
    (dict(folder=None), ["folder must be a path", "None"]),
    (dict(folder=5), ["folder must be a path", "an int"]),
    (dict(threads="2"), ["threads must be an integer", "a str ('2')"]),
    (dict(threads=True), ["threads"]),
    (dict(threads=0), ["threads must be >= 1"]),
    (dict(backend=3), ["backend must be a string"]),
    (dict(device_id="0"), ["device_id"]),
])
def test_from_folder_misuse(t5, kwargs, names):
    refused(lambda: elx.Generator.from_folder(**{"folder": t5, **kwargs}), *names)


@pytest.mark.parametrize("kwargs,names", [
    (dict(batch_size="8"), ["batch_size (--batch-size) must be an integer", "a str ('8')"]),
    (dict(batch_size=None), ["batch_size"]),
    (dict(window=0), ["window (--sort-window) must be >= 1"]),
    (dict(resume="no"), ["resume must be True or False"]),
    (dict(threads="2"), ["threads"]),
    (dict(generator="x"), ["generator must be an elx.Generator"]),
    (dict(num_beams="4"), ["num_beams"]),
    (dict(pad_token_id=500), ["pad_token_id is 500"]),
    (dict(output_file=None), ["output_file must be a path"]),
])
def test_generate_file_misuse(t5, data_file, tmp_path, kwargs, names):
    args = {"folder": t5, "input_file": data_file, "output_file": tmp_path / "out.jsonl", "progress": "none",
            "max_new_tokens": 2, **kwargs}
    refused(lambda: elx.generate_file(**args), *names)
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("kwargs,names", [
    (dict(passes=3), ["passes must be a string or None", "an int"]),
    (dict(model=None), ["model must be a model folder, a hub id or a preset name"]),
    (dict(precision="int9"), ["precision 'int9'"]),
    (dict(precision=16), ["precision must be a string"]),
    (dict(seed="1"), ["seed must be an integer"]),
    (dict(seed=-1), ["seed must be between 0 and"]),
    (dict(random_init="yes"), ["random_init must be True or False"]),
    (dict(prompt_cache=3), ["prompt_cache"]),
])
def test_export_misuse(tmp_path, kwargs, names):
    args = {"model": "t5-tiny", "output": tmp_path / "out", "random_init": True, **kwargs}
    refused(lambda: elx.export(args.pop("model"), args.pop("output"), **args), *names)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kwargs,names", [
    (dict(folder=None), ["folder must be a path"]),
    (dict(max_batch_size="8"), ["max_batch_size (--max-batch-size) must be an integer"]),
    (dict(max_beams=0), ["max_beams (--max-beams) must be >= 1"]),
    (dict(compute_capabilities=8.0), ["compute_capabilities"]),
    (dict(quiet="x"), ["quiet"]),
])
def test_build_engine_misuse(t5, kwargs, names):
    refused(lambda: elx.build_engine(**{"folder": t5, **kwargs}), *names)


def test_accepted_forms_give_the_plain_result(generator):
    """numpy ids of any integer width, tuples, numpy scalars, a bool mask: what plain lists of ints give."""
    plain = generator.generate(input_ids=IDS, attention_mask=[[1, 1, 1], [1, 1, 0]], num_beams=2, max_new_tokens=3)
    for ids, mask in [(np.array(IDS, np.int32), np.array([[1, 1, 1], [1, 1, 0]], bool)),
                      (tuple(map(tuple, IDS)), ((1, 1, 1), (1, 1, 0))),
                      ([[np.int64(t) for t in row] for row in IDS], np.array([[1, 1, 1], [1, 1, 0]], np.uint8))]:
        out = generator.generate(input_ids=ids, attention_mask=mask, num_beams=np.int64(2), max_new_tokens=3)
        assert np.array_equal(out.sequences, plain.sequences)
        assert np.array_equal(out.sequences_scores, plain.sequences_scores)


# -- drawn: wrong types and shapes ---------------------------------------------------------------------------

_SCALARS = (st.none() | st.booleans() | st.integers(-(2 ** 70), 2 ** 70) | st.floats() | st.text(max_size=5)
            | st.binary(max_size=3) | st.sampled_from([0, 1, 2, 3, -1, 5, 127, 128, 2 ** 63, "2", "ort", "cpu",
                                                       "never", 2.0, np.int64(2), np.float32(1.5), np.bool_(True)]))
_ARRAYS = hnp.arrays(st.sampled_from([np.int64, np.int32, np.uint8, np.uint64, np.float32, np.float64, np.bool_]),
                     hnp.array_shapes(min_dims=0, max_dims=3, max_side=3))
_ROWS = st.lists(st.lists(st.integers(0, 127), min_size=1, max_size=4), min_size=1, max_size=3)
WRONG = st.recursive(_SCALARS | _ARRAYS | _ROWS, lambda inner: st.lists(inner, max_size=3) | st.tuples(inner, inner)
                     | st.dictionaries(st.text(max_size=3), inner, max_size=2), max_leaves=8)

_GENERATION_OPTIONS = ("num_beams", "max_new_tokens", "min_new_tokens", "max_length", "min_length", "length_penalty",
                       "early_stopping", "num_return_sequences", "no_repeat_ngram_size", "eos_token_id",
                       "pad_token_id", "decoder_start_token_id", "forced_bos_token_id", "forced_eos_token_id",
                       "suppress_tokens", "begin_suppress_tokens")


def _plain(value):
    """``value`` with numpy scalars and arrays as Python ints, floats, bools and lists."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _is_rows_of_ints(value) -> bool:
    return (isinstance(value, list) and len(value) > 0
            and all(isinstance(r, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in r)
                    for r in value))


def _same(a, b) -> bool:
    return np.array_equal(a.sequences, b.sequences) and (
        a.sequences_scores is None and b.sequences_scores is None
        or np.array_equal(a.sequences_scores, b.sequences_scores))


@examples(60)
@given(data=st.data())
def test_generate_takes_wrong_arguments_as_elx_errors(data, generator):
    """One argument of ``generate`` drawn from any type and shape; ``ElxError``, or the plain call's result."""
    target = data.draw(st.sampled_from(["input_ids", "attention_mask", "text", "inputs", "options"]), label="target")
    value = data.draw(WRONG, label="value")
    kwargs = {"input_ids": IDS, "max_new_tokens": 3}
    if target == "options":
        kwargs[data.draw(st.sampled_from(_GENERATION_OPTIONS), label="option")] = value
    elif target == "inputs":
        kwargs = {"inputs": value, "max_new_tokens": 3}
    elif target == "text":
        kwargs = {"text": value, "max_new_tokens": 3}
    else:
        kwargs[target] = value
    try:
        out = generator.generate(**kwargs)
    except ElxError as err:
        assert "\n" not in str(err)
        return
    plain = {name: _plain(v) for name, v in kwargs.items()}
    if target == "input_ids":
        assert _is_rows_of_ints(plain["input_ids"]), f"accepted input_ids {value!r}"
    if target == "attention_mask" and value is not None:
        mask = np.asarray(plain["attention_mask"])
        assert mask.shape == (2, 3) and set(np.unique(mask)) <= {0, 1}, f"accepted attention_mask {value!r}"
        plain["attention_mask"] = mask.astype(np.int64).tolist()
    assert _same(out, generator.generate(**plain))


@examples(25)
@given(name=st.sampled_from(["folder", "backend", "device", "threads", "device_id"]), value=WRONG)
def test_from_folder_takes_wrong_arguments_as_elx_errors(t5, name, value):
    try:
        loaded = elx.Generator.from_folder(**{"folder": t5, name: value})
    except ElxError as err:
        assert "\n" not in str(err)
        return
    assert loaded.generate(input_ids=IDS, max_new_tokens=2).sequences.shape[0] == 2


_FILE_ARGUMENTS = ("batch_size", "max_tokens_per_batch", "sort", "window", "pipeline", "resume", "force", "skip_bad",
                   "progress", "threads", "backend", "device", "ray_actors", "ray_ship", "num_beams", "eos_token_id")


@examples(25)
@given(name=st.sampled_from(_FILE_ARGUMENTS), value=WRONG)
def test_generate_file_takes_wrong_arguments_as_elx_errors(t5, data_file, tmp_path_factory, name, value):
    out = tmp_path_factory.mktemp("file") / "out.jsonl"
    args = {"progress": "none", "max_new_tokens": 2, name: value}
    try:
        summary = elx.generate_file(t5, data_file, out, **args)
    except ElxError as err:
        assert "\n" not in str(err)
        return
    assert summary.written == len(IDS) and len(out.read_text().splitlines()) == len(IDS)


@examples(25)
@given(name=st.sampled_from(["model", "output", "passes", "random_init", "seed", "force", "quiet", "precision",
                             "prompt_cache", "fp32_draws"]), value=WRONG)
def test_export_takes_wrong_arguments_as_elx_errors(tmp_path_factory, name, value):
    """A model no export can find, so that arguments that pass their checks end in ``ElxError`` quickly."""
    args = {"model": str(tmp_path_factory.mktemp("none") / "no-model"),
            "output": tmp_path_factory.mktemp("out") / "x", name: value}
    with pytest.raises(ElxError):
        elx.export(args.pop("model"), args.pop("output"), **args)


@examples(15)
@given(name=st.sampled_from(["folder", "precision", "max_batch_size", "max_beams", "max_input_length",
                             "max_new_tokens", "runtime", "compute_capabilities", "ngram", "quiet"]), value=WRONG)
def test_build_engine_takes_wrong_arguments_as_elx_errors(tmp_path_factory, name, value):
    """A folder that is no export, so that arguments that pass their checks end in ``ElxError`` quickly."""
    args = {"folder": tmp_path_factory.mktemp("not-an-export"), name: value}
    with pytest.raises(ElxError):
        elx.build_engine(**args)
