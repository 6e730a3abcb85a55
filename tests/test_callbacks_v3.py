"""Issue 40 class 2: what the caller's callables return, and option types, held to ``ElxError`` or HF's own behaviour.

``prefix_allowed_tokens_fn`` returning None, strings, numbers, floats (5.7 was used as token 5), bools, sets or ids
outside the vocabulary raised TypeError / ValueError / IndexError from ``runners/search/processors/masks.py``; a
logits processor returning NaN under sampling raised torch's RuntimeError from ``sampling.py``; a stopping criterion
returning None, a string or floats was read as a bool; float ``decoder_input_ids`` were truncated.  Each is now one
``ElxError`` line naming the callable or option, or exactly what transformers 5.24 returns where it accepts the
value.  A hypothesis test draws the return values (wrong types, shapes, NaN, ±inf, valid forms) of the three kinds
of callables in greedy, beam and sampled runs and runs HF ``generate`` beside elx on the same tiny T5.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from elx.runners.errors import ElxError
from tests.conftest import LONG

pytestmark = pytest.mark.usefixtures("one_torch_thread")
VOCAB = 128  # conftest's T5
INPUTS = [[5, 6, 7, 8], [9, 10, 11, 1]]


@pytest.fixture(scope="module")
def t5(exported, model_folders):
    from transformers import AutoModelForSeq2SeqLM

    from elx.runners.generate import Generator

    return Generator.from_folder(exported("t5"), threads=1), AutoModelForSeq2SeqLM.from_pretrained(
        model_folders["t5"]).eval()


# -- the values drawn: each a function of the callable's own arguments (numpy, as elx calls it) ---------------

def _prefix(form: str):
    def fn(item, tokens):
        last = int(tokens[-1])
        return {
            "valid": [t for t in range(VOCAB) if (t + last + item) % 3], "np-int": np.arange(5, 9),
            "nested": [[5, 6], [7, 8]], "range": range(20, 30), "tuple": (5, 6), "none": None, "str": "5",
            "int": 5, "float": [5.7], "whole-float": [5.0, 9.0], "np-float": np.array([6.5]), "bool": [True, False],
            "set": {5, 6}, "empty": [], "outside": [VOCAB + 3], "negative": [-1], "far-negative": [-1000],
            "nan": [float("nan")], "object": [object()],
        }[form]
    return fn


PREFIX_FORMS = ("valid", "np-int", "nested", "range", "tuple", "none", "str", "int", "float", "whole-float",
                "np-float", "bool", "set", "empty", "outside", "negative", "far-negative", "nan", "object")


def _processor(form: str):
    def fn(ids, scores):
        s = np.array(scores, dtype=np.float32)
        if form == "bump":
            return s + (ids[:, -1:] % 4).astype(np.float32)
        if form == "nan-all":
            return s * np.float32("nan")
        if form == "nan-one":
            s[:, 3] = np.nan
            return s
        if form == "posinf-one":
            s[:, 7] = np.inf
            return s
        if form == "neginf-all":
            return np.full_like(s, -np.inf)
        if form == "neginf-but-one":
            out = np.full_like(s, -np.inf)
            out[:, 9] = 0.0
            return out
        return {"int": s.astype(np.int64), "float64": s.astype(np.float64), "wrong-shape": s[:, :5],
                "transposed": s.T, "none": None, "str": "scores", "scalar": 0.0, "list": s.tolist(),
                "bool": s > 0, "row": s[0], "complex": s.astype(np.complex64)}[form]
    return fn


PROCESSOR_FORMS = ("bump", "nan-all", "nan-one", "posinf-one", "neginf-all", "neginf-but-one", "int", "float64",
                   "wrong-shape", "transposed", "none", "str", "scalar", "list", "bool", "row", "complex")


def _criterion(form: str):
    def fn(ids, scores, **kwargs):
        rows = ids.shape[0]
        return {
            "true": True, "false": False, "one": 1, "zero": 0, "two": 2, "np-bool": np.bool_(ids[0, -1] % 2 == 0),
            "per-row": ids[:, -1] % 3 == 0, "per-row-list": [bool(t % 3 == 0) for t in ids[:, -1]],
            "broadcast": np.array([ids.shape[1] > 3]), "uint8": (ids[:, -1] % 2).astype(np.uint8),
            "ints-2": np.full(rows, 2), "none": None, "str": "yes", "float": np.full(rows, 0.5),
            "nan": np.full(rows, np.nan), "wrong-length": np.zeros(rows + 1, dtype=bool),
            "column": np.zeros((rows, 1), dtype=bool), "empty": np.zeros(0, dtype=bool),
        }[form]
    return fn


CRITERION_FORMS = ("true", "false", "one", "zero", "two", "np-bool", "per-row", "per-row-list", "broadcast", "uint8",
                   "ints-2", "none", "str", "float", "nan", "wrong-length", "column", "empty")


def _for_hf(kind: str, fn):
    """The same callable as HF calls it (torch tensors in); what it returns as the torch code of the same intent would
    (numpy arrays as tensors, a numpy bool as a 0-d tensor, a per-row list of bools as a tensor: elx's plain callables
    live in numpy, where a list of bools is an array)."""
    def call(*args, **kwargs):
        args = [a.numpy() if isinstance(a, torch.Tensor) else a for a in args]
        out = fn(*args, **kwargs)
        if kind == "prefix":
            return out  # HF indexes its mask with what the function returns, numpy arrays included
        if isinstance(out, np.bool_):
            return torch.tensor(bool(out))
        if isinstance(out, np.ndarray):
            return torch.from_numpy(np.ascontiguousarray(out))
        if kind == "criterion" and isinstance(out, list):
            return torch.tensor(out)
        if kind == "processor" and isinstance(out, list):
            return torch.tensor(out)
        return out
    return call


NAMES = {"prefix": "prefix_allowed_tokens_fn", "processor": "logits processor", "criterion": "stopping criterion"}


def _options(kind: str, fn) -> dict:
    if kind == "prefix":
        return {"prefix_allowed_tokens_fn": fn}
    return {"logits_processor" if kind == "processor" else "stopping_criteria": [fn]}


def _hf(model, kind: str, form: str, run: dict):
    options = {k: v for k, v in run.items() if k != "seed"}
    maker = {"prefix": _prefix, "processor": _processor, "criterion": _criterion}[kind]
    torch.manual_seed(run.get("seed", 0))
    with torch.no_grad():
        return model.generate(torch.tensor(INPUTS), attention_mask=torch.ones(2, 4, dtype=torch.long),
                              **options, **_options(kind, _for_hf(kind, maker(form)))).numpy()


def check_callback(t5, kind: str, form: str, run: dict) -> str:
    """elx and HF on one drawn callable: "refused" (one ElxError line naming it), "same" (HF's tokens), else fails."""
    generator, model = t5
    maker = {"prefix": _prefix, "processor": _processor, "criterion": _criterion}[kind]
    try:
        elx = generator.generate(input_ids=INPUTS, **run, **_options(kind, maker(form))).sequences
    except ElxError as err:
        text = str(err)
        assert "\n" not in text and NAMES[kind] in text, (kind, form, run, text)
        return "refused"
    try:
        hf = _hf(model, kind, form, run)
    except Exception as err:  # noqa: BLE001 - HF refused what elx ran
        pytest.fail(f"{kind} {form} {run}: elx accepted, HF raised {type(err).__name__}: {err}")
    assert elx.tolist() == hf.tolist(), (kind, form, run)
    return "same"


RUNS = st.sampled_from([dict(max_new_tokens=4), dict(max_new_tokens=4, num_beams=2),
                        dict(max_new_tokens=4, num_beams=3, num_return_sequences=2),
                        dict(max_new_tokens=4, do_sample=True, seed=3),
                        dict(max_new_tokens=4, do_sample=True, seed=5, top_k=0),
                        dict(max_new_tokens=4, do_sample=True, num_beams=2, seed=7)])


@st.composite
def callbacks(draw):
    kind = draw(st.sampled_from(["prefix", "processor", "criterion"]))
    forms = {"prefix": PREFIX_FORMS, "processor": PROCESSOR_FORMS, "criterion": CRITERION_FORMS}[kind]
    return kind, draw(st.sampled_from(forms)), draw(RUNS)


@settings(max_examples=300 if LONG else 60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(drawn=callbacks())
def test_drawn_callbacks_get_one_line_or_hfs_tokens(t5, drawn):
    """Every drawn return value (wrong types, shapes, NaN, ±inf, and valid forms) of the three kinds of callables, in
    greedy, beam, beam-with-return-sequences, sampled and beam-sampled runs: elx refuses it in one ElxError line naming
    the callable, or returns HF's tokens (HF must accept it then)."""
    check_callback(t5, *drawn)


# the issue's cases one by one: what each gave before, what it gives now
@pytest.mark.parametrize("kind,form,run,expected", [
    ("prefix", "none", {}, "refused"),  # before: TypeError 'NoneType' object is not iterable
    ("prefix", "str", {}, "refused"),  # before: '5' read as token 5 (HF: TypeError)
    ("prefix", "float", {}, "refused"),  # before: 5.7 used as token 5
    ("prefix", "outside", {}, "refused"),  # before: IndexError
    ("prefix", "negative", {}, "refused"),  # before: -1 used as the last token
    ("prefix", "bool", {}, "refused"),  # before: True used as token 1 (HF: IndexError)
    ("prefix", "set", {}, "refused"),  # before: accepted (HF: IndexError)
    ("prefix", "nested", {"num_beams": 2}, "same"),
    ("processor", "nan-one", {"do_sample": True, "seed": 1}, "refused"),  # before: torch's RuntimeError
    ("processor", "posinf-one", {"do_sample": True, "seed": 1}, "refused"),  # before: torch's RuntimeError
    ("processor", "neginf-all", {"do_sample": True, "seed": 1}, "refused"),  # before: torch's RuntimeError
    ("processor", "posinf-one", {}, "same"),  # greedy search takes the +inf token, as HF's argmax does
    ("processor", "nan-one", {"num_beams": 2}, "refused"),
    ("criterion", "none", {}, "refused"),  # before: None read as False (HF: TypeError)
    ("criterion", "str", {}, "refused"),  # before: "yes" read as True
    ("criterion", "float", {}, "refused"),  # before: 0.5 read as True (HF: NotImplementedError)
    ("criterion", "per-row", {}, "same"),
])
def test_the_issues_callbacks(t5, kind, form, run, expected):
    assert check_callback(t5, kind, form, {"max_new_tokens": 4, **run}) == expected


def test_sampling_refusal_names_the_processor(t5):
    generator, _ = t5

    def add_inf(ids, scores):
        scores[:, 3] = np.inf
        return scores

    with pytest.raises(ElxError, match=r"do_sample=True: row 0's scores hold \+inf, which cannot be sampled from; "
                                       r"logits processor add_inf returned such scores"):
        generator.generate(input_ids=INPUTS, max_new_tokens=3, do_sample=True, seed=0, logits_processor=[add_inf])


@pytest.mark.parametrize("value,match", [
    ([[0.0, 5.7]], "decoder_input_ids row 0 holds a float"),  # before: truncated to [0, 5] (HF: RuntimeError)
    (np.array([[0.0, 5.0], [0, 6]]), "decoder_input_ids must hold integers, got an array of float64"),
    (torch.tensor([[0.0, 5.0], [0, 6]]), "decoder_input_ids must hold integers, got an array of float32"),
    ([[0, 5], [0]], "decoder_input_ids rows have different lengths"),
    ("0 5", "decoder_input_ids must be rows of token ids"),
])
def test_decoder_input_ids_of_other_types_are_refused(t5, value, match):
    generator, _ = t5
    with pytest.raises(ElxError, match=match):
        generator.generate(input_ids=INPUTS, decoder_input_ids=value, max_new_tokens=3)


def test_decoder_input_ids_as_one_row_or_int_arrays(t5):
    generator, model = t5
    rows = generator.generate(input_ids=INPUTS, decoder_input_ids=np.array([[0, 5], [0, 6]]), max_new_tokens=3)
    with torch.no_grad():
        hf = model.generate(torch.tensor(INPUTS), decoder_input_ids=torch.tensor([[0, 5], [0, 6]]), max_new_tokens=3)
    assert rows.sequences.tolist() == hf.tolist()
    one = generator.generate(input_ids=INPUTS[:1], decoder_input_ids=[0, 5], max_new_tokens=3).sequences
    assert one.tolist() == hf[:1].tolist()


# -- issue 42 item 5: flags a run ignores warn once, as HF's GenerationConfig.validate does ------------------------

@pytest.mark.parametrize("options", [
    dict(top_p=0.5), dict(top_k=5, temperature=0.7), dict(do_sample=False, top_p=0.5), dict(top_k=50),
    dict(temperature=1.0), dict(length_penalty=2.0), dict(early_stopping=True), dict(num_beams=2, length_penalty=2.0),
    dict(output_scores=True), dict(min_p=0.0), dict(top_p=None), dict(do_sample=True, top_p=0.5, seed=1),
    dict(num_beams=2, typical_p=0.9, epsilon_cutoff=0.01), dict(return_dict_in_generate=True, output_logits=True),
])
def test_ignored_flags_warn_once_as_hf_does(t5, capsys, options):
    """elx warns (one ``elx: warning:`` line naming the flags) exactly where HF warns "The following generation flags
    are not valid and may be ignored: [...]", naming the same flags; the same flags again: no second warning (HF's
    ``warning_once``).  Before: `--top-p 0.9` without `--do-sample` was silently greedy."""
    import logging
    import re

    import transformers.utils.logging as hf_logging

    from elx.runners import options as elx_options

    generator, model = t5
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    hf_logger = logging.getLogger("transformers")
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_warning()
    hf_logger.addHandler(handler)
    hf_logging.warning_once.cache_clear()
    try:
        with torch.no_grad():
            model.generate(torch.tensor(INPUTS), max_new_tokens=2, **{k: v for k, v in options.items() if k != "seed"})
    finally:
        hf_logger.removeHandler(handler)
        hf_logging.set_verbosity(verbosity)
    hf_flags = [re.findall(r"'(\w+)'", m.split(":", 1)[1]) for m in records if "not valid and may be ignored" in m]
    elx_options._WARNED.clear()
    capsys.readouterr()
    for _ in range(2):
        generator.generate(input_ids=INPUTS, max_new_tokens=2, **options)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("elx: warning:")]
    assert len(lines) == len(hf_flags) <= 1, (lines, hf_flags)
    for line, flags in zip(lines, hf_flags):
        assert [f for f in re.findall(r"(\w+)=", line.split(":", 2)[2]) if f not in ("do_sample", "num_beams",
                                                                                     "return_dict_in_generate")] == flags


def test_the_cli_warns_and_quiet_silences_the_warning(exported, capsys):
    """``elx generate --top-p 0.9`` without ``--do-sample`` says it is greedy (HF warns); ``--quiet`` silences that
    warning, for that command only (the ``elx`` logger's level is put back)."""
    import logging

    from elx.cli import run as elx_run
    from elx.runners import options as elx_options

    folder = str(exported("t5"))
    for quiet in (True, False, True):
        elx_options._WARNED.clear()
        capsys.readouterr()
        assert elx_run(["generate", folder, "--input-ids", "5 6 7", "--top-p", "0.9", "--max-new-tokens", "2",
                        *(["--quiet"] if quiet else [])]) == 0
        warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("elx: warning:")]
        assert (warnings == []) if quiet else (len(warnings) == 1 and "top_p" in warnings[0]), warnings
    assert logging.getLogger("elx").level == logging.NOTSET
