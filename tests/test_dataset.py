"""``elx generate --input-file``: order, per-item exactness, formats, bad lines, crash safety, resume, Ray.

A tiny random T5 export (the conftest fixture) with a word-level tokenizer ("w5 w6" → [5, 6]).
Every output is checked against ``Generator.generate`` of each input alone, and every interrupted
or resumed run against an uninterrupted one, byte for byte.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from elx.cli import main as elx_main
from runners import dataset
from runners.dataset import Progress, generate_file
from runners.errors import ElxError
from runners.generate import Generator
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
    from runners.dataset_io import Record

    lengths = [5, 40, 3, 41, 17, 2, 39, 18, 90]
    records = [Record(i, i + 1, i, "input_ids", None, tokens=[7] * n) for i, n in enumerate(lengths)]
    batches = dataset.plan_batches(records, batch_size=3, max_tokens=100, sort=True)
    assert [[len(r.tokens) for r in b] for b in batches] == [[90], [41, 40], [39, 18], [17, 5, 3], [2]]
    assert all(len(b) * len(b[0].tokens) <= 100 for b in batches if len(b) > 1)  # rows × longest
    assert sorted(r.index for b in batches for r in b) == list(range(9))
    plain = dataset.plan_batches(records, batch_size=4, max_tokens=None, sort=False)
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


def test_never_overwrites_without_resume_or_force(tmp_path, folder, capsys):
    source = write_jsonl(tmp_path / "in.jsonl", [{"input_ids": r} for r in token_rows(3)])
    out = tmp_path / "out.jsonl"
    out.write_text("my notes\n")
    argv = ["generate", str(folder), "--input-file", str(source), "--output-file", str(out), "--quiet",
            "--max-new-tokens", "4"]
    for extra, message in ([], "--resume"), (["--resume"], "not an elx result line"):
        assert elx_main([*argv, *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
        assert out.read_text() == "my notes\n"
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_text('{"id": "zz", "tokens": [0]}\n')
    assert elx_main([*argv[:5], str(foreign), "--resume", "--quiet", "--max-new-tokens", "4"]) == 2
    assert "does not have" in capsys.readouterr().err and foreign.read_text() == '{"id": "zz", "tokens": [0]}\n'
    assert elx_main([*argv, "--force"]) == 0
    assert [line["id"] for line in read_lines(out)] == [1, 2, 3]


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "elx.cli", "generate", *args]


def test_resume_after_sigkill_gives_the_uninterrupted_output(tmp_path, folder, monkeypatch):
    # the killed and resumed runs import no torch, so their search uses numpy's log-softmax (runners/log_softmax.py);
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
    target, when = {"read": ("check_tokens", 10), "generate": ("run_batch", 4), "write": ("result_text", 4)}[stage]
    original = getattr(dataset, target)

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == when:
            raise RuntimeError(f"{stage} broke")
        return original(*args, **kwargs)

    monkeypatch.setattr(dataset, target, flaky)
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
    monkeypatch.setattr(dataset, target, original)
    summary = generate_file(folder, source, out, resume=True, **run)
    assert summary.skipped == finished and summary.written == 24 - finished
    assert out.read_bytes() == expected.read_bytes()


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
    assert "4/10" in term.text and "item/s" in term.text and "tok/s" in term.text
    plain = Progress(10, "auto", stream=type("Pipe", (Terminal,), {"isatty": lambda self: False})())
    assert plain.mode == "plain"
    plain.update(1, 10)
    plain.first = (plain.first[0] - 2.0, *plain.first[1:])  # the first batch came 2 s ago
    plain.update(4, 40)
    assert plain.rates() == pytest.approx((2.0, 20.0), rel=0.05)
    line = plain.line()
    assert line.startswith("5/10 items, 2.0") and "20 tokens/s" in line and "ETA 00:00:0" in line


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
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "audio": f"clips/{i}.wav"} for i in range(3)]
                         + [{"id": 9, "audio": "clips/missing.wav"}])
    out = tmp_path / "out.jsonl"
    generate_file(folder, source, out, batch_size=2, skip_bad=True, progress="none", num_beams=2, max_new_tokens=5)
    lines = read_lines(out)
    generator = Generator.from_folder(folder)
    for i in range(3):
        alone = generator.generate(audio=str(tmp_path / "clips" / f"{i}.wav"), num_beams=2, max_new_tokens=5)
        assert lines[i]["id"] == i and lines[i]["tokens"] == alone.sequences[0].tolist()
    assert lines[3]["id"] == 9 and "not found" in lines[3]["error"]


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
