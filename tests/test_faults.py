"""Faults in the middle of a dataset run (issue 23): a signal or a full disk at a random point, then ``--resume``.

Each case runs ``elx generate --input-file`` in a subprocess and breaks it at a point drawn from a seeded
generator: SIGKILL or SIGTERM once OUT holds k lines (k drawn; k = all lines lands in the final sort or
after it), or a disk full at a drawn size (a real tmpfs, so ENOSPC can land on a result line, on the run
record or on the sorted copy).  What must hold afterwards: a one-line error where the process could say
one (exit 2 for a full disk, 143 for SIGTERM), OUT holds complete lines only, nothing temporary is left
beside it, and ``--resume`` (after freeing space) ends with a file equal to an uninterrupted run's, byte
for byte.

By default two cases run (one signal, one full disk: ~1 minute on the project's 2-core machine);
``ELX_LONG_TESTS=1`` runs ``LONG_CASES`` drawn cases, each with up to three faults in a row before the
resume.  The disk-full cases need root (to mount a tmpfs) and skip otherwise.
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

import pytest

from tests.test_dataset import token_rows, write_jsonl
from tests.test_runtime_imports import _word_tokenizer

ROOT = Path(__file__).resolve().parents[1]
SEED = 2023
LONG = os.environ.get("ELX_LONG_TESTS") == "1"
LONG_CASES = 16
ITEMS = 160
ARGS = ["--batch-size", "3", "--sort-window", "48", "--num-beams", "3", "--max-new-tokens", "8", "--quiet"]
PAGE = 4096


def draw_cases(count: int, seed: int = SEED) -> list[list[tuple]]:
    """``count`` cases, each a list of faults: ("SIGKILL" | "SIGTERM", lines) or ("disk", pages)."""
    rng = random.Random(seed)
    cases = []
    for i in range(count):
        faults = []
        for _ in range(rng.randint(1, 3) if LONG else 1):
            kind = rng.choice(["SIGKILL", "SIGTERM", "disk"]) if LONG else ("SIGKILL", "disk")[i % 2]
            faults.append((kind, rng.randint(2, 12)) if kind == "disk" else (kind, rng.randint(1, ITEMS)))
        cases.append(faults)
    return cases


CASES = draw_cases(LONG_CASES if LONG else 2)


@pytest.fixture(scope="module")
def job(tmp_path_factory, exported):
    """The export (tiny T5, el, a word tokenizer), IN, and the uninterrupted run's OUT bytes."""
    root = tmp_path_factory.mktemp("faults")
    folder = root / "t5-el"
    shutil.copytree(exported("t5", "el"), folder)
    _word_tokenizer(folder, 128)
    source = write_jsonl(root / "in.jsonl", [{"id": f"r{i}", "input_ids": r}
                                             for i, r in enumerate(token_rows(ITEMS, seed=SEED, high=30))])
    expected = root / "expected.jsonl"
    done = run(folder, source, expected)
    assert done.returncode == 0, done.stderr
    return folder, source, expected.read_bytes()


def env() -> dict:
    # the same log-softmax kernel in every run (the scores' last bits depend on it: runners/search/log_softmax.py)
    return {**os.environ, "ELX_LOG_SOFTMAX": "numpy", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def command(folder: Path, source: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "elx.cli", "generate", str(folder), "--input-file", str(source), "--output-file",
            str(out), *ARGS, *extra]


def run(folder: Path, source: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(command(folder, source, out, *extra), capture_output=True, text=True, env=env(),
                          timeout=900, cwd=out.parent)


def count_lines(out: Path) -> int:
    return out.read_bytes().count(b"\n") if out.exists() else 0


def _default_signals() -> None:
    """The run starts with SIGTERM/SIGHUP at their defaults: under ``nohup pytest`` it would inherit an ignored
    SIGHUP, which elx leaves ignored by design (``elx/cli.py``), and the SIGHUP case would see exit 0."""
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)


def signal_after(folder: Path, source: Path, out: Path, signum: int, lines: int, *extra: str):
    """Run; send ``signum`` once OUT holds ``lines`` lines and one more than it held before (the run is writing,
    its handlers installed), or once the run has ended."""
    wanted = max(lines, count_lines(out) + 1)
    proc = subprocess.Popen(command(folder, source, out, *extra), stderr=subprocess.PIPE, text=True, env=env(),
                            cwd=out.parent, preexec_fn=_default_signals)
    deadline = time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline and count_lines(out) < wanted:
        time.sleep(0.002)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=600)
    return proc.returncode, err


def mount_tmpfs(path: Path, pages: int, remount: bool = False) -> None:
    options = f"{'remount,' if remount else ''}size={pages * PAGE}"
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")


def assert_whole(out: Path) -> None:
    """OUT holds complete JSON lines only; nothing temporary beside it (the run record may stay)."""
    data = out.read_bytes() if out.exists() else b""
    assert not data or data.endswith(b"\n"), data[-80:]
    for line in data.splitlines():
        json.loads(line)
    left = [p.name for p in out.parent.iterdir() if p.name not in (out.name, f".{out.name}.elx-run.json")]
    assert not left, left


@pytest.mark.parametrize("faults", CASES, ids=lambda c: "+".join(f"{k}-{n}" for k, n in c))
def test_fault_then_resume_gives_the_uninterrupted_output(tmp_path, job, faults):
    folder, source, expected = job
    disk = tmp_path / "disk"
    disk.mkdir()
    if any(kind == "disk" for kind, _ in faults):
        if os.geteuid() != 0:
            pytest.skip("a full disk is a tmpfs of a given size: mounting one needs root")
        mount_tmpfs(disk, 4096)
    out = disk / "out.jsonl"
    try:
        for i, (kind, value) in enumerate(faults):
            resume = ("--resume",) if i else ()
            if kind == "disk":
                used = sum(-(-p.stat().st_size // PAGE) for p in disk.iterdir())
                mount_tmpfs(disk, used + value, remount=True)
                done = run(folder, source, out, *resume)
                if done.returncode != 0:  # the disk filled up (it may have sufficed, at the end of a resumed run)
                    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
                    assert "no space left on the device" in done.stderr, done.stderr
                mount_tmpfs(disk, 4096, remount=True)  # space freed
            else:
                signum = getattr(signal, kind)
                code, err = signal_after(folder, source, out, signum, value, *resume)
                if code == -signal.SIGKILL:  # a torn last line, the lock file, a temporary file: the resume's to clean
                    continue
                if code != 0:  # SIGTERM: the batch in flight is finished and written
                    assert code == 128 + signum and "terminate called" not in err and "Traceback" not in err, err
                    assert err.count("\n") == 1 and f"interrupted by {kind}" in err, err
            assert_whole(out)
        done = run(folder, source, out, "--resume")
        assert done.returncode == 0, done.stderr
        assert out.read_bytes() == expected  # no line lost, none twice, the same bytes, in input order
        assert_whole(out)
    finally:
        if os.path.ismount(disk):
            subprocess.run(["umount", str(disk)], check=True)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_signal_ends_a_dataset_run_with_its_status(tmp_path, job, signum):
    """SIGTERM/SIGHUP stop the run as Ctrl-C does: the batch in flight is finished and written, every thread stops
    before the interpreter exits (before: ``terminate called without an active exception``, exit 134), one line,
    exit 128 + the signal number."""
    folder, source, _ = job
    out = tmp_path / "out.jsonl"
    code, err = signal_after(folder, source, out, signum, 3)
    assert code == 128 + signum, err
    name = signal.Signals(signum).name
    assert err.strip().splitlines() == [f"elx: error: interrupted by {name}; the finished lines are in {out}: "
                                        "rerun with --resume to continue"]
    assert_whole(out)
    assert 3 <= out.read_bytes().count(b"\n") < ITEMS
