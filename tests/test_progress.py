"""Progress of long steps (exporter/progress.py, issue 27 item 1): export stages, engine builds, bench rounds.

Off a terminal each finished stage is one plain line, in order; ``--quiet`` prints nothing; on a terminal
a bar names the running stage and its ETA.  No timing is asserted, only what is said and in which order.
"""
from __future__ import annotations

import io
import re

import pytest

from elx.exporter.progress import Progress, mode_of, say
from elx.runners.errors import ElxError
from elx.cli import run as elx_run


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def stage_names(text: str, title: str) -> list[str]:
    """The stage of each ``TITLE: NAME[: detail] (S s)`` line, in order."""
    names = []
    for line in text.splitlines():
        match = re.fullmatch(rf"{re.escape(title)}: (.+?)(: .*)? \(\d+\.\d s\)", line)
        if match:
            names.append(match.group(1))
    return names


def test_modes():
    off, on = io.StringIO(), Terminal()
    assert [mode_of(None, off), mode_of(None, on)] == ["none", "bar"]  # the Python API's default
    assert [mode_of(True, off), mode_of("auto", off), mode_of("auto", on)] == ["plain", "plain", "bar"]
    assert [mode_of(False, on), mode_of("plain", on), mode_of("none", off)] == ["none", "plain", "none"]
    with pytest.raises(ElxError, match="progress must be"):
        mode_of("loud", off)


def test_plain_lines_in_order_with_details_and_none_prints_nothing():
    for mode, expected in (("plain", ["first", "second", "third"]), ("none", [])):
        stream = io.StringIO()
        with Progress("elx test", 6, mode, stream) as progress:
            with progress.stage("first"):
                pass
            with progress.stage("second", 2, steps=2) as stage:
                stage.step("half")
                stage.detail = "done well"
            with progress.stage("third", 3):
                pass
            progress.say("elx test: the end")
        say("elx test: outside", mode, stream)
        assert stage_names(stream.getvalue(), "elx test") == expected
        lines = stream.getvalue().splitlines()
        if mode == "plain":
            assert "elx test: second: done well (" in lines[1] and lines[-2:] == ["elx test: the end",
                                                                                    "elx test: outside"]
        else:
            assert stream.getvalue() == ""


def test_a_failed_stage_says_nothing():
    stream = io.StringIO()
    with pytest.raises(RuntimeError):
        with Progress("elx test", 2, "plain", stream) as progress:
            with progress.stage("ok"):
                pass
            with progress.stage("broken"):
                raise RuntimeError("no")
    assert stage_names(stream.getvalue(), "elx test") == ["ok"]


def test_terminal_bar_names_the_running_stage_and_its_eta():
    stream = Terminal()
    with Progress("elx test", 4, "auto", stream) as progress:
        with progress.stage("tracing decoder.onnx", 3):
            progress.bar.refresh()
            live = stream.getvalue()
    assert "elx test: tracing decoder.onnx" in live and "ETA" in live
    assert "elx test: tracing decoder.onnx (" in stream.getvalue()  # the finished stage's line stays


def test_export_plain_lines_list_the_stages_in_order(model_folders, tmp_path, capsys):
    assert elx_run(["export", "--model", str(model_folders["t5"]), "--pass", "el", "--output",
                    str(tmp_path / "el")]) == 0
    err = capsys.readouterr().err
    assert stage_names(err, "elx export") == [
        f"load {model_folders['t5']}", "encoder.onnx", "cross_kv.onnx", "decoder.onnx", "verify vs PyTorch",
        "pass el", "store weights once", "write manifest"]
    summary = err.splitlines()[-1]
    assert re.fullmatch(rf"elx export: wrote {re.escape(str(tmp_path / 'el'))} \(\d+\.\d MB in 4 files\) in "
                        r"\d+\.\d s", summary), summary


def test_export_quiet_prints_nothing(model_folders, tmp_path, capsys):
    assert elx_run(["export", "--model", str(model_folders["gpt2"]), "--output", str(tmp_path / "g"), "--quiet"]) == 0
    assert capsys.readouterr() == ("", "")
    assert (tmp_path / "g" / "manifest.json").is_file()


def test_bench_rounds_plain_lines(exported, capsys):
    from elx.exporter.bench.bench import BenchSettings, run_bench

    settings = BenchSettings(batch_size=1, input_length=6, num_beams=2, new_tokens=2, repeats=2, threads=1)
    run_bench([exported("t5")], settings, progress="plain")
    run_bench([exported("t5")], settings, progress="none")
    stream = capsys.readouterr()
    assert stream.out == ""
    assert stage_names(stream.err, "elx bench") == [
        "matmul peak and read bandwidth of this machine", "load the elx runners and the PyTorch model",
        "warm-up (tokens and live state)", "round 1 of 2", "round 2 of 2"]


def test_build_engine_plain_lines_and_quiet(exported, tmp_path, capsys):
    pytest.importorskip("tensorrt_rtx")
    import shutil

    folder = tmp_path / "t5"
    shutil.copytree(exported("t5"), folder)
    common = ["build-engine", str(folder), "--compute-capability", "8.6", "--max-batch-size", "2", "--max-beams",
              "2", "--max-input-length", "16", "--max-new-tokens", "8"]
    assert elx_run(common) == 0
    out, err = capsys.readouterr()
    assert stage_names(err, "elx build-engine") == ["decoder engine", "encoder engine", "cross_kv engine",
                                                    "write engines and manifest"]
    assert out == f"wrote {folder / 'engines'}\n"
    assert elx_run(common + ["--quiet"]) == 0
    assert capsys.readouterr() == (f"wrote {folder / 'engines'}\n", "")  # the result, no progress
