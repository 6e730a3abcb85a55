"""``elx generate --input-file``: order, per-item exactness, formats, bad lines, crash safety, resume, Ray.

A tiny random T5 export (the conftest fixture) with a word-level tokenizer ("w5 w6" → [5, 6]).
Every output is checked against ``Generator.generate`` of each input alone, and every interrupted
or resumed run against an uninterrupted one, byte for byte.
"""
from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from elx.cli import main as elx_main
from elx.runners.dataset import job as dataset_job
from elx.runners.dataset import writer
from elx.runners.dataset import pipeline as dataset
from elx.runners.dataset.pipeline import Progress, generate_file
from elx.runners.errors import ElxError
from elx.runners.generate import Generator
from tests.test_runtime_imports import BLOCKER, _word_tokenizer

ROOT = Path(__file__).resolve().parents[1]
OPTIONS = dict(num_beams=3, max_new_tokens=6)


@pytest.fixture(scope="module")
def folder(tmp_path_factory, exported):
    out = tmp_path_factory.mktemp("dataset") / "t5-el"
    shutil.copytree(exported("t5", "el"), out)
    _word_tokenizer(out, 128)
    return out


@pytest.fixture(scope="module")
def generator(folder):
    return Generator.from_folder(folder)


def token_rows(count: int, seed: int = 0, low: int = 1, high: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randint(3, 127) for _ in range(rng.randint(low, high))] for _ in range(count)]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def unpadded(rows: np.ndarray, width: int, pad: int) -> list[int]:
    """A row HF returned for one input, cut to ``width``; what is cut must be padding."""
    assert all(int(t) == pad for t in rows[width:])
    return [int(t) for t in rows[:width]]


def test_order_restored_and_tokens_equal_per_item_generation(tmp_path, folder, generator):
    rows = token_rows(23)
    records = [{"id": f"s{i}", "input_ids": r} for i, r in enumerate(rows)]
    source = write_jsonl(tmp_path / "in.jsonl", records)
    out = tmp_path / "out.jsonl"
    summary = generate_file(folder, source, out, batch_size=4, max_tokens_per_batch=90, progress="none", **OPTIONS)
    assert summary.written == 23 and summary.errors == 0
    assert summary.reordered  # length-sorted batches finished out of input order: the file was put back in order
    lines = read_lines(out)
    assert [line["id"] for line in lines] == [r["id"] for r in records]
    for line, row in zip(lines, rows):
        alone = generator.generate(input_ids=[row], **OPTIONS)
        assert line["tokens"] == alone.sequences[0].tolist()
        assert line["score"] == pytest.approx(float(alone.sequences_scores[0]), abs=1e-5)
        assert line["text"] == alone.text[0]

    # greedy: no score; several return sequences: lists, best first, each row HF's for the input alone
    greedy = tmp_path / "greedy.jsonl"
    generate_file(folder, source, greedy, batch_size=5, progress="none", max_new_tokens=6)
    for line, row in zip(read_lines(greedy), rows):
        assert "score" not in line and line["tokens"] == generator.generate(input_ids=[row], max_new_tokens=6)\
            .sequences[0].tolist()
    several = tmp_path / "several.jsonl"
    generate_file(folder, source, several, batch_size=6, progress="none", num_beams=3, num_return_sequences=2,
                  max_new_tokens=6)
    for line, row in zip(read_lines(several), rows):
        alone = generator.generate(input_ids=[row], num_beams=3, num_return_sequences=2, max_new_tokens=6)
        assert len(line["tokens"]) == len(line["text"]) == len(line["score"]) == 2
        for tokens, expected in zip(line["tokens"], alone.sequences):
            assert tokens == unpadded(expected, len(tokens), 0)
        assert line["score"] == pytest.approx(alone.sequences_scores.tolist(), abs=1e-5)


def test_batches_are_length_sorted_and_capped():
    from elx.runners.dataset.io import Record

    lengths = [5, 40, 3, 41, 17, 2, 39, 18, 90]
    records = [Record(i, i + 1, i, "input_ids", None, tokens=[7] * n) for i, n in enumerate(lengths)]
    batches = dataset_job.plan_batches(records, batch_size=3, max_tokens=100, sort=True)
    assert [[len(r.tokens) for r in b] for b in batches] == [[90], [41, 40], [39, 18], [17, 5, 3], [2]]
    assert all(len(b) * len(b[0].tokens) <= 100 for b in batches if len(b) > 1)  # rows × longest
    assert sorted(r.index for b in batches for r in b) == list(range(9))
    plain = dataset_job.plan_batches(records, batch_size=4, max_tokens=None, sort=False)
    assert [[r.index for r in b] for b in plain] == [[0, 1, 2, 3], [4, 5, 6, 7], [8]]


def test_batching_does_not_change_the_output(tmp_path, folder, generator):
    """Sorted or not, pipelined or not, any batch size: the same bytes."""
    source = write_jsonl(tmp_path / "in.jsonl", [{"input_ids": r} for r in token_rows(17, seed=3)])
    outputs = []
    for i, kw in enumerate([dict(batch_size=1), dict(batch_size=4, window=8), dict(batch_size=16, sort=False),
                            dict(batch_size=5, pipeline=False)]):
        out = tmp_path / f"out{i}.jsonl"
        generate_file(folder, source, out, generator=generator, progress="none", **kw, **OPTIONS)
        outputs.append(out.read_bytes())
    assert all(o == outputs[0] for o in outputs)
    assert [line["id"] for line in read_lines(tmp_path / "out0.jsonl")] == list(range(1, 18))  # ids: line numbers


def test_txt_jsonl_parquet_give_the_same_results(tmp_path, folder):
    texts = [" ".join(f"w{t}" for t in row) for row in token_rows(9, seed=5, high=12)]
    txt = tmp_path / "in.txt"
    txt.write_text("\n".join(texts) + "\n")
    jsonl = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "text": t} for i, t in enumerate(texts, 1)])
    ids = write_jsonl(tmp_path / "ids.jsonl", [{"id": i, "input_ids": [int(w[1:]) for w in t.split()]}
                                               for i, t in enumerate(texts, 1)])
    results = {}
    for source in (txt, jsonl, ids):
        out = tmp_path / f"{source.name}.out"
        assert elx_main(["generate", str(folder), "--input-file", str(source), "--output-file", str(out),
                         "--batch-size", "3", "--num-beams", "3", "--max-new-tokens", "6", "--quiet"]) == 0
        results[source.name] = out.read_text()
    assert results["in.txt"] == results["in.jsonl"] == results["ids.jsonl"]
    assert [line["id"] for line in read_lines(tmp_path / "in.txt.out")] == list(range(1, 10))

    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    parquet = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": list(range(1, 10)), "text": texts}), parquet)
    out = tmp_path / "parquet.out"
    generate_file(folder, parquet, out, batch_size=3, progress="none", **OPTIONS)
    assert out.read_text() == results["in.txt"]


def test_bad_lines_stop_with_one_line_or_become_error_lines(tmp_path, folder, capsys):
    good = token_rows(4, seed=7)
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join([json.dumps({"id": "a", "input_ids": good[0]}),
                                 '{"id": "b", "input_ids": [5, 6',  # line 2: torn JSON
                                 json.dumps({"id": "c", "input_ids": good[1]}),
                                 json.dumps({"id": "d", "input_ids": [5, 999]}),  # line 4: outside the vocabulary
                                 "",  # blank lines are not records
                                 json.dumps({"id": "f", "prompt": "w5"}),  # line 6: no input field
                                 json.dumps({"id": "g", "input_ids": good[2]})]) + "\n")
    out = tmp_path / "out.jsonl"
    argv = ["generate", str(folder), "--input-file", str(source), "--output-file", str(out), "--num-beams", "3",
            "--max-new-tokens", "6", "--quiet"]
    assert elx_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("elx: error:") and "in.jsonl line 2" in err[0], err
    assert not out.exists()  # checked before anything was written

    assert elx_main([*argv, "--skip-bad"]) == 0
    lines = read_lines(out)
    assert [line["id"] for line in lines] == ["a", 2, "c", "d", "f", "g"]  # an unreadable line's id: its number
    errors = {line["id"]: line for line in lines if "error" in line}
    assert sorted(errors, key=str) == [2, "d", "f"]
    assert errors[2]["line"] == 2 and errors["d"]["line"] == 4 and errors["f"]["line"] == 6
    assert "vocabulary" in errors["d"]["error"] and "exactly one of" in errors["f"]["error"]
    assert all("tokens" in line for line in lines if "error" not in line)

    dup = write_jsonl(tmp_path / "dup.jsonl", [{"id": 1, "input_ids": [5]}, {"id": 1, "input_ids": [6]}])
    with pytest.raises(ElxError, match="dup.jsonl line 2: id 1 already on line 1"):
        generate_file(folder, dup, tmp_path / "dup.out", skip_bad=True, progress="none")  # always: ids key the output
    assert not (tmp_path / "dup.out").exists()


def refused(capsys, argv: list, expected: str = "") -> str:
    """``elx ARGV`` fails with exit 2 and one line ``elx: error: ...`` (containing ``expected``), which is returned."""
    assert elx_main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("elx: error:") and expected in err[0], err
    return err[0]


def partial_output(folder, source: Path, out: Path, generator, monkeypatch, batches: int = 2, **run) -> bytes:
    """What a run that stopped after ``batches`` batches leaves in ``out`` (its finished lines and run record)."""
    original, calls = dataset.run_batch, []

    def stop(*args, **kwargs):
        calls.append(1)
        if len(calls) > batches:
            raise RuntimeError("stopped")
        return original(*args, **kwargs)

    monkeypatch.setattr(dataset, "run_batch", stop)
    with pytest.raises(RuntimeError, match="stopped"):
        generate_file(folder, source, out, generator=generator, progress="none", **run)
    monkeypatch.setattr(dataset, "run_batch", original)
    assert out.read_bytes().count(b"\n") == batches * run.get("batch_size", 16)
    return out.read_bytes()


def test_never_overwrites_a_file_elx_did_not_write(tmp_path, folder, capsys):
    """Only an output provably elx's (its run record, its bytes) is continued (--resume) or replaced (--force)."""
    source = write_jsonl(tmp_path / "in.jsonl", [{"input_ids": r} for r in token_rows(3)])
    out = tmp_path / "out.jsonl"
    argv = ["generate", folder, "--input-file", source, "--output-file", out, "--quiet", "--max-new-tokens", "4"]
    mimic = '{"id": 1, "tokens": [0, 5]}\n{"id": 2, "tokens": [0, 6]}'  # elx-like lines, no trailing newline
    for content in ("my notes\n", mimic, source.read_text()):  # notes; what looks like elx's; a copy of the input
        out.write_text(content)
        refused(capsys, [*argv], "--resume")
        for flag in ("--resume", "--force"):
            refused(capsys, [*argv, flag], "no elx run record")
            assert out.read_text() == content

    out.unlink()
    assert elx_main([str(a) for a in argv]) == 0  # elx's own output: --force replaces it, --resume finds it complete
    finished = out.read_bytes()
    assert elx_main([str(a) for a in argv] + ["--resume"]) == 0 and out.read_bytes() == finished
    record = tmp_path / ".out.jsonl.elx-run.json"
    for edit in (lambda: out.write_bytes(finished + b'{"note": "mine"}\n'),  # a line of the user's appended
                 lambda: out.write_bytes(finished.replace(b'"id": 2', b'"id": 7')),  # a line edited
                 lambda: out.write_bytes(source.read_bytes())):  # overwritten, the record left beside it
        edit()
        changed = out.read_bytes()
        for flag in ("--resume", "--force"):
            refused(capsys, [*argv, flag], "elx")
            assert out.read_bytes() == changed
    out.write_bytes(finished)
    record.unlink()  # the record gone: OUT is no longer provably elx's
    refused(capsys, [*argv, "--resume"], "no elx run record")
    assert out.read_bytes() == finished


@pytest.mark.parametrize("what", ["hard link to the input", "symbolic link to the input", "the input respelled",
                                  "the export's manifest", "a new file in the export", "a file in tokenizer/",
                                  "a symbolic link", "a file with another hard link", "a folder", "a device"])
def test_output_that_writing_would_destroy_something_through_is_refused(tmp_path, folder, capsys, what):
    export = tmp_path / "export"  # a copy: a failure destroys it
    shutil.copytree(folder, export)
    source = write_jsonl(tmp_path / "in.jsonl", [{"input_ids": r} for r in token_rows(3)])
    keep = {path: path.read_bytes() for path in (source, export / "manifest.json")}
    (tmp_path / "sub").mkdir()
    (tmp_path / "other.jsonl").write_text("")
    out = {"hard link to the input": tmp_path / "out.jsonl", "symbolic link to the input": tmp_path / "out.jsonl",
           "the input respelled": tmp_path / "sub" / ".." / "in.jsonl",
           "the export's manifest": export / "manifest.json",
           "a new file in the export": export / "out.jsonl", "a file in tokenizer/": export / "tokenizer" / "o.jsonl",
           "a symbolic link": tmp_path / "out.jsonl", "a file with another hard link": tmp_path / "out.jsonl",
           "a folder": tmp_path / "sub", "a device": Path("/dev/zero")}[what]  # /dev/null discards (accepted)
    if what == "hard link to the input":
        os.link(source, out)
    elif what == "symbolic link to the input":
        out.symlink_to(source)
    elif what == "a symbolic link":
        out.symlink_to(tmp_path / "other.jsonl")
    elif what == "a file with another hard link":
        os.link(tmp_path / "other.jsonl", out)
    for flag in ([], ["--force"]):
        refused(capsys, ["generate", export, "--input-file", source, "--output-file", out, "--quiet",
                         "--max-new-tokens", "4", *flag], "--output-file")
        assert {path: path.read_bytes() for path in keep} == keep
    assert not (export / "out.jsonl").exists() and not (export / "tokenizer" / "o.jsonl").exists()
    expected = {"export", "in.jsonl", "other.jsonl", "sub"} | ({out.name} if out.parent == tmp_path else set())
    assert {p.name for p in tmp_path.iterdir()} == expected  # no lock, record or temporary file left


def test_fifo_output_and_input_are_refused_at_once(tmp_path, folder):
    """A FIFO output would block the run (nothing reads it), a FIFO input cannot be read twice: refused, no hang."""
    source = write_jsonl(tmp_path / "in.jsonl", [{"input_ids": r} for r in token_rows(3)])
    os.mkfifo(tmp_path / "out.jsonl")
    os.mkfifo(tmp_path / "in.fifo.jsonl")
    for args, expected in (([source, "--output-file", tmp_path / "out.jsonl"], "not a regular file"),
                           ([tmp_path / "in.fifo.jsonl", "--output-file", tmp_path / "o.jsonl"], "not a regular file")):
        proc = subprocess.run(_cli(str(folder), "--input-file", *map(str, args), "--quiet", "--max-new-tokens", "4"),
                              capture_output=True, text=True, timeout=120, env=_env())
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and expected in proc.stderr, proc.stderr


@pytest.mark.parametrize("change", ["options", "model", "input"])
def test_resume_refuses_another_run(tmp_path, folder, generator, monkeypatch, capsys, exported, change):
    """--resume continues the run that wrote OUT: the same export, options and inputs, or nothing is touched."""
    rows = token_rows(12, seed=21)
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "input_ids": r} for i, r in enumerate(rows)])
    out = tmp_path / "out.jsonl"
    run = dict(batch_size=3, num_beams=3, max_new_tokens=6)
    partial = partial_output(folder, source, out, generator, monkeypatch, **run)
    other_model = tmp_path / "other-model"
    shutil.copytree(exported("t5"), other_model)  # the same vocabulary and ids, another export
    _word_tokenizer(other_model, 128)
    done = json.loads(partial.splitlines()[0])["id"]
    changed = [[t + 1 for t in r] if i == done else r for i, r in enumerate(rows)]  # a finished input edited
    other_input = write_jsonl(tmp_path / "other.jsonl", [{"id": i, "input_ids": r} for i, r in enumerate(changed)])
    argv = ["generate", {"model": other_model}.get(change, folder), "--input-file",
            {"input": other_input}.get(change, source), "--output-file", out, "--batch-size", "3", "--num-beams",
            {"options": "4"}.get(change, "3"), "--max-new-tokens", "6", "--quiet", "--resume"]
    line = refused(capsys, argv, "--resume continues the same")
    assert {"options": "num_beams 3 then, 4 now", "model": "export", "input": "inputs of"}[change] in line
    assert out.read_bytes() == partial
    expected = tmp_path / "expected.jsonl"
    generate_file(folder, source, expected, generator=generator, progress="none", **run)
    generate_file(folder, source, out, generator=generator, progress="none", resume=True, **run)
    assert out.read_bytes() == expected.read_bytes()


def test_a_second_run_on_the_same_output_is_refused(tmp_path, folder, capsys):
    """Two runs on one OUT would interleave their lines (784 lines for 400 inputs): the second is refused at once.
    (The lock is an flock on its own open file: held here, it is held against this process's next open too.)"""
    from elx.runners.output_lock import output_lock

    source = write_jsonl(tmp_path / "in.jsonl", [{"input_ids": r} for r in token_rows(4)])
    out = tmp_path / "out.jsonl"
    argv = ["generate", folder, "--input-file", source, "--output-file", out, "--quiet", "--max-new-tokens", "4"]
    with output_lock(out):
        for flag in ([], ["--resume"], ["--force"]):
            line = refused(capsys, [*argv, *flag], "another elx process")
            assert f"(pid {os.getpid()})" in line and not out.exists()
    assert elx_main([str(a) for a in argv]) == 0 and len(read_lines(out)) == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.jsonl.elx-run.json", "in.jsonl", "out.jsonl"]


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "elx.cli", "generate", *args]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def test_resume_after_sigkill_gives_the_uninterrupted_output(tmp_path, folder, monkeypatch):
    # the killed and resumed runs import no torch, so their search uses numpy's log-softmax (runners/search/log_softmax.py);
    # the expected output is made with the same kernel: the scores' last bits depend on it
    monkeypatch.setenv("ELX_LOG_SOFTMAX", "numpy")
    rows = token_rows(400, seed=11, high=30)
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": f"x{i}", "input_ids": r} for i, r in enumerate(rows)])
    expected = tmp_path / "expected.jsonl"
    generate_file(folder, source, expected, batch_size=4, window=64, progress="none", num_beams=4,
                  max_new_tokens=12)
    out = tmp_path / "out.jsonl"
    args = [str(folder), "--input-file", str(source), "--output-file", str(out), "--batch-size", "4",
            "--sort-window", "64", "--num-beams", "4", "--max-new-tokens", "12", "--quiet"]
    blocker = tmp_path / "blocker"  # the runs also show that the dataset runtime imports neither torch nor transformers
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(BLOCKER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocker), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(_cli(*args), env=env, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if out.exists() and out.read_bytes().count(b"\n") >= 6:
            break
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    partial = out.read_bytes()
    complete = partial[: partial.rfind(b"\n") + 1]
    ids = [json.loads(line)["id"] for line in complete.splitlines()]
    assert 6 <= len(ids) < 400 and len(set(ids)) == len(ids)
    with open(out, "ab") as f:  # a torn last line, as a kill in the middle of a write leaves one
        f.write(b'{"id": "x399", "tokens": [0, 5')

    proc = subprocess.run(_cli(*args, "--resume"), env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes() == expected.read_bytes()  # no line lost, none twice, same content, input order
    assert elx_main(["generate", *args, "--resume"]) == 0  # nothing left to do: unchanged
    assert out.read_bytes() == expected.read_bytes()


@pytest.mark.parametrize("stage", ["read", "generate", "write"])
def test_a_failing_stage_stops_cleanly_and_keeps_finished_lines(tmp_path, folder, generator, monkeypatch, stage):
    source = write_jsonl(tmp_path / "in.jsonl", [{"input_ids": r} for r in token_rows(24, seed=13)])
    expected = tmp_path / "expected.jsonl"
    run = dict(generator=generator, batch_size=3, window=6, progress="none", **OPTIONS)
    generate_file(folder, source, expected, **run)
    calls = []
    # read: the 10th input's check (2nd window); generate: the 4th batch; write: the 4th line
    # each patched where the stage looks it up: the reader in job.py, the generate stage in pipeline.py, the writer
    module, target, when = {"read": (dataset_job, "check_tokens", 10), "generate": (dataset, "run_batch", 4),
                            "write": (writer, "result_text", 4)}[stage]
    original = getattr(module, target)

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == when:
            raise RuntimeError(f"{stage} broke")
        return original(*args, **kwargs)

    monkeypatch.setattr(module, target, flaky)
    out = tmp_path / "out.jsonl"
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=f"{stage} broke"):
        generate_file(folder, source, out, **run)
    assert time.monotonic() - started < 60  # no hang
    finished = len(out.read_text().splitlines())
    if stage == "read":  # the batches generated before the reader failed (the others were dropped unstarted)
        assert finished in (0, 3, 6)
    else:  # everything that finished before the failure: 3 batches, or 3 lines
        assert finished == (9 if stage == "generate" else 3)
    monkeypatch.setattr(module, target, original)
    summary = generate_file(folder, source, out, resume=True, **run)
    assert summary.skipped == finished and summary.written == 24 - finished
    assert out.read_bytes() == expected.read_bytes()


class Stop(BaseException):
    """What the CLI's SIGTERM handler raises (elx.cli.Terminated): not an Exception."""


def test_a_signal_stops_every_stage_before_it_is_raised(tmp_path, folder, generator, monkeypatch):
    """The cause of ``terminate called without an active exception`` (exit 134) after SIGTERM: the exception left
    the pipeline at once, the generate thread still inside ONNX Runtime, and the interpreter exited under it.  Now
    the batch in flight is finished and written and every stage has stopped before the signal's exception goes on."""
    source = write_jsonl(tmp_path / "in.jsonl", [{"input_ids": r} for r in token_rows(24, seed=31)])
    original, calls = dataset.run_batch, []

    def signalled(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # the signal arrives while this batch is being generated
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.5)
        return original(*args, **kwargs)

    def stop(signum, frame):
        raise Stop()

    monkeypatch.setattr(dataset, "run_batch", signalled)
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        with pytest.raises(Stop):
            generate_file(folder, source, tmp_path / "out.jsonl", generator=generator, batch_size=3, window=6,
                          progress="none", **OPTIONS)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert [t.name for t in threading.enumerate() if t.name.startswith("elx-")] == []
    assert len(read_lines(tmp_path / "out.jsonl")) == 9  # two batches, and the one in flight


def test_progress_bar_and_plain_lines():
    class Terminal:
        def __init__(self):
            self.text = ""

        def write(self, s):
            self.text += s

        def flush(self):
            pass

        def isatty(self):
            return True

    term = Terminal()
    bar = Progress(10, "auto", stream=term)
    assert bar.mode == "bar"
    bar.start -= 1.0
    bar.shown -= 1.0
    bar.update(4, 120)
    bar.close()
    assert "4/10 items" in term.text and "items/s" in term.text and "tokens/s" in term.text
    assert "it/s" not in term.text  # tqdm's own (smoothed) rate is not shown: one rate, the meter's
    plain = Progress(10, "auto", stream=type("Pipe", (Terminal,), {"isatty": lambda self: False})())
    assert plain.mode == "plain"
    plain.update(1, 10)
    plain.update(4, 40)
    # rates and ETA at a given time, 2 s after the stage started: the format and the arithmetic, not the wall clock
    # (issue 27 item 8: a rate measured on a loaded machine is 1.99, not 2.0); the first batch counts (issue 42: the
    # bar said 11.1 items/s from the first batch on while the summary said 5.51 over the whole run)
    now = plain.start + 2.0
    assert plain.rates(now) == (2.5, 25.0)  # 5 items and 50 tokens since the stage started, in 2 s
    assert plain.line(now) == "5/10 items, 2.50 items/s, 25 tokens/s, ETA 00:00:02"
    assert Progress(3, "plain").line() == "0/3 items, 0.00 items/s, 0 tokens/s, ETA ?"  # nothing finished yet


def test_summary_rate_is_the_bars(tmp_path, folder, capsys):
    """The summary's items/s is the generate stage's meter's (the rate the bar showed), next to the whole run's
    time: one rate per stage."""
    from elx.runners.dataset.job import DatasetSummary

    source = write_jsonl(tmp_path / "in.jsonl", [{"input_ids": r} for r in token_rows(6)])
    out = tmp_path / "out.jsonl"
    summary = generate_file(folder, source, out, batch_size=2, progress="none", max_new_tokens=3)
    assert summary.generate_seconds is not None and 0 < summary.generate_seconds <= summary.seconds
    assert summary.items_per_second == summary.written / summary.generate_seconds
    assert DatasetSummary(out, 6, 6, 0, 0, 60, 3.0).items_per_second == 2.0  # without a meter: the whole run
    assert elx_main(["generate", str(folder), "--input-file", str(source), "--output-file", str(tmp_path / "o2.jsonl"),
                     "--max-new-tokens", "3"]) == 0
    err = capsys.readouterr().err
    assert re.search(r"in \d+\.\d s; generating: \d+\.\d s, \d+\.\d\d items/s", err), err


def test_audio_inputs_on_whisper(tmp_path, exported):
    """Whisper: ``audio`` paths (relative to the input file) → the tokens of ``generate(audio=path)`` alone."""
    from tests.test_whisper import speech_tools

    folder = tmp_path / "whisper"
    shutil.copytree(exported("whisper"), folder)
    (folder / "tokenizer").mkdir(exist_ok=True)
    (folder / "tokenizer" / "preprocessor_config.json").write_text(json.dumps({
        "feature_extractor_type": "WhisperFeatureExtractor", "feature_size": 80}))
    rng = np.random.default_rng(0)
    write_wav = speech_tools().write_wav
    (tmp_path / "clips").mkdir()
    for i, seconds in enumerate([1.0, 2.5, 0.5]):
        write_wav(tmp_path / "clips" / f"{i}.wav", rng.standard_normal(int(16000 * seconds)).astype(np.float32) * 0.1,
                  16000)
    damaged = bytearray((tmp_path / "clips" / "0.wav").read_bytes())
    damaged[32:34] = (3).to_bytes(2, "little")  # block_align 3 for 16-bit mono: a damaged header (before: ValueError)
    (tmp_path / "clips" / "damaged.wav").write_bytes(bytes(damaged))
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "audio": f"clips/{i}.wav"} for i in range(3)]
                         + [{"id": 9, "audio": "clips/missing.wav"}, {"id": 10, "audio": "clips/damaged.wav"}])
    out = tmp_path / "out.jsonl"
    generate_file(folder, source, out, batch_size=2, skip_bad=True, progress="none", num_beams=2, max_new_tokens=5)
    lines = read_lines(out)
    generator = Generator.from_folder(folder)
    for i in range(3):
        alone = generator.generate(audio=str(tmp_path / "clips" / f"{i}.wav"), num_beams=2, max_new_tokens=5)
        assert lines[i]["id"] == i and lines[i]["tokens"] == alone.sequences[0].tolist()
    assert lines[3]["id"] == 9 and "not found" in lines[3]["error"]
    assert lines[4] == {"id": 10, "line": 5, "error": lines[4]["error"]}
    assert "block_align is 3 bytes" in lines[4]["error"]
    source = write_jsonl(tmp_path / "two.jsonl", [{"id": 0, "audio": "clips/0.wav"},
                                                  {"id": 1, "audio": "clips/damaged.wav"}])
    with pytest.raises(ElxError, match="two.jsonl line 2: .*damaged.wav: malformed WAV header"):  # without --skip-bad
        generate_file(folder, source, tmp_path / "stop.jsonl", batch_size=2, progress="none", max_new_tokens=5)


def test_ray_local_instance_gives_the_same_output(tmp_path, folder, generator):
    pytest.importorskip("ray.data", reason="Ray Data is not installed: pip install 'elx[ray]'")
    rows = token_rows(20, seed=17)
    records = [{"id": i, "input_ids": r} for i, r in enumerate(rows)]
    records.insert(5, {"id": "bad", "input_ids": []})
    source = write_jsonl(tmp_path / "in.jsonl", records)
    local = tmp_path / "local.jsonl"
    generate_file(folder, source, local, generator=generator, batch_size=3, skip_bad=True, progress="none",
                  **OPTIONS)
    distributed = tmp_path / "ray.jsonl"
    summary = generate_file(folder, source, distributed, batch_size=3, skip_bad=True, progress="none", ray=True,
                            ray_actors=2, ray_ship=True, threads=1, **OPTIONS)
    assert summary.written == 21 and summary.errors == 1
    assert distributed.read_bytes() == local.read_bytes()


# -- full disks (simulated here; on a real tmpfs in tests/test_faults.py) ---------------------------------

def _no_space(*args):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_disk_full_while_writing_lines_keeps_complete_lines(tmp_path, folder, generator, monkeypatch):
    """ENOSPC in the middle of a line: the torn part is cut off at once, one line says what to do, --resume ends
    the job with the uninterrupted run's bytes."""
    source = write_jsonl(tmp_path / "in.jsonl", [{"input_ids": r} for r in token_rows(20, seed=23)])
    run = dict(generator=generator, batch_size=4, progress="none", **OPTIONS)
    expected = tmp_path / "expected.jsonl"
    generate_file(folder, source, expected, **run)
    out = tmp_path / "out.jsonl"
    real_write, writes = os.write, []

    def fill_up(fd, data):
        if os.path.realpath(f"/proc/self/fd/{fd}") == str(out):
            writes.append(1)
            if len(writes) == 7:  # the 7th line: half of it fits
                real_write(fd, bytes(data)[: len(data) // 2])
                _no_space()
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", fill_up)
    with pytest.raises(ElxError, match="no space left on the device; the finished lines are kept: free space, then "
                                        "rerun with resume=True"):  # Python names the keyword
        generate_file(folder, source, out, **run)
    monkeypatch.setattr(os, "write", real_write)
    assert out.read_bytes().endswith(b"\n") and len(read_lines(out)) == 6
    assert not [p for p in tmp_path.iterdir() if p.name.endswith((".lock", ".sorting", ".run"))]
    generate_file(folder, source, out, resume=True, **run)
    assert out.read_bytes() == expected.read_bytes()


@pytest.mark.parametrize("when", ["sorted copy", "record"])
def test_disk_full_while_putting_the_output_in_order(tmp_path, folder, generator, monkeypatch, when):
    """The finished file is put in input order through a sorted copy: a full disk there leaves the file whole (its
    lines in finishing order), no copy behind it, and --resume sorts it."""
    from elx.runners.dataset import io as dataset_io
    from elx.runners.dataset import run_record as dataset_run

    source = write_jsonl(tmp_path / "in.jsonl", [{"input_ids": r} for r in token_rows(20, seed=29)])
    run = dict(generator=generator, batch_size=4, progress="none", **OPTIONS)
    expected = tmp_path / "expected.jsonl"
    generate_file(folder, source, expected, **run)
    out = tmp_path / "out.jsonl"
    if when == "sorted copy":
        real_open = open

        def no_room_for_a_copy(path, mode="r", *args, **kwargs):
            if str(path).endswith(".sorting"):
                handle = real_open(path, mode, *args, **kwargs)
                handle.write = _no_space
                return handle
            return real_open(path, mode, *args, **kwargs)

        monkeypatch.setattr(dataset_io, "open", no_room_for_a_copy, raising=False)
    else:  # the run record's save that announces the sorted file
        real_save = dataset_run.RunRecord.save
        def announcing_the_sorted_file(self, *states, durable=True):  # the only durable save of two states
            if len(states) == 2 and durable:
                _no_space()
            return real_save(self, *states, durable=durable)

        monkeypatch.setattr(dataset_run.RunRecord, "save", announcing_the_sorted_file)
    with pytest.raises(ElxError, match="putting in input order .* failed: no space left on the device; its lines are "
                                       "complete"):
        generate_file(folder, source, out, **run)
    monkeypatch.undo()
    unordered = read_lines(out)
    assert sorted(map(json.dumps, unordered)) == sorted(map(json.dumps, read_lines(expected)))
    assert not [p for p in tmp_path.iterdir() if p.name.endswith((".lock", ".sorting", ".run"))]
    summary = generate_file(folder, source, out, resume=True, **run)
    assert summary.written == 0 and summary.reordered
    assert out.read_bytes() == expected.read_bytes()


# -- bad lines the reader must survive -------------------------------------------------------------------

def test_deeply_nested_json_line(tmp_path, folder, capsys):
    """A line nested deeper than Python's recursion limit is a bad line like any other, named by its number."""
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"id": "a", "input_ids": [5, 6]}) + "\n" +
                      '{"id": "b", "input_ids": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    out = tmp_path / "out.jsonl"
    argv = ["generate", folder, "--input-file", source, "--output-file", out, "--quiet", "--max-new-tokens", "4"]
    refused(capsys, argv, "in.jsonl line 2: JSON nested too deeply")
    assert elx_main([str(a) for a in argv] + ["--skip-bad"]) == 0
    lines = read_lines(out)
    assert lines[0]["id"] == "a" and lines[1] == {"id": 2, "line": 2, "error": lines[1]["error"]}
    assert "nested too deeply" in lines[1]["error"]


# -- decoder-only rows: each input's own generation, whatever the batch (issue 23, class 7) ------------------

@pytest.mark.parametrize("options", [dict(num_beams=2, max_length=14), dict(max_length=12),
                                     dict(num_beams=2, min_length=12, max_new_tokens=6),
                                     dict(num_beams=2, no_repeat_ngram_size=1, max_new_tokens=5)],
                         ids=["beam-max_length", "greedy-max_length", "min_length", "ngram-1"])
def test_decoder_only_rows_equal_per_input_generation(tmp_path, exported, options):
    """HF counts a decoder-only batch's left padding as prompt: a padded row would get max_length − (the batch's
    width) new tokens, not max_length − (its own length), reach min_length early, and have its pad (EOS) tokens
    blocked as n-grams.  Dataset rows must be the input's own generation: batches mix only lengths that change
    nothing (elx.runners.dataset.pipeline.padding_key)."""
    folder = exported("gpt2")
    rows = [[5, 6, 7, 8, 9, 10, 11, 12], [13, 14], [15, 16, 17, 18], [19], [20, 21, 22, 23, 24, 25], [26, 27]]
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "input_ids": r} for i, r in enumerate(rows)])
    out = tmp_path / "out.jsonl"
    generate_file(folder, source, out, batch_size=6, progress="none", **options)
    generator = Generator.from_folder(folder)
    for row, line in zip(rows, read_lines(out)):
        alone = generator.generate(input_ids=[row], **options)
        assert line["tokens"] == alone.sequences[0].tolist()
        if alone.sequences_scores is not None:
            assert line["score"] == pytest.approx(float(alone.sequences_scores[0]), abs=1e-5)


def test_decoder_only_batches_mix_lengths_only_where_padding_changes_nothing():
    from elx.runners.dataset.io import Record
    from elx.runners.search.settings import GenerationSettings

    class FakeJob:  # what padding_key reads: the manifest's family and the settings
        def __init__(self, family, **settings):
            self.manifest = type("M", (), {"family": family})()
            self.settings = GenerationSettings(**settings)

    records = [Record(i, i + 1, i, "input_ids", None, tokens=[7] * n) for i, n in enumerate([9, 9, 5, 4, 4, 1])]

    def widths(job):
        batches = dataset_job.plan_batches(records, 16, None, True, key=dataset_job.padding_key(job))
        return [[len(r.tokens) for r in b] for b in batches]

    assert widths(FakeJob("gpt2", max_new_tokens=4)) == [[9, 9, 5, 4, 4, 1]]  # the same number of new tokens
    assert widths(FakeJob("gpt2", max_length=12)) == [[9, 9], [5], [4, 4], [1]]  # max_length − length each
    assert widths(FakeJob("gpt2", max_new_tokens=4, min_length=5)) == [[9, 9, 5], [4, 4], [1]]  # floors 0, 1, 4
    assert widths(FakeJob("gpt2", max_new_tokens=4, no_repeat_ngram_size=2)) == [[9, 9], [5], [4, 4], [1]]
    assert widths(FakeJob("t5", max_length=12, decoder_start_token_id=0)) == [[9, 9, 5, 4, 4, 1]]  # encoder padding


def test_decoder_only_prompt_too_long_for_the_run_is_a_bad_line(tmp_path, exported, capsys):
    """A prompt that leaves no room for the new tokens within the model's positions: refused naming its line (an
    error line under --skip-bad), before anything is generated, as generating it alone is refused."""
    folder = exported("gpt2")  # 64 positions
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": 0, "input_ids": [5, 6]}, {"id": 1, "input_ids": [7] * 60}])
    out = tmp_path / "out.jsonl"
    argv = ["generate", folder, "--input-file", source, "--output-file", out, "--quiet", "--max-new-tokens", "8"]
    refused(capsys, argv, "in.jsonl line 2: this run needs 67 positions")
    assert elx_main([str(a) for a in argv] + ["--skip-bad"]) == 0
    lines = read_lines(out)
    assert "tokens" in lines[0] and lines[1]["line"] == 2 and "64 (n_positions)" in lines[1]["error"]
