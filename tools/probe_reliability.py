"""Issue 23's hostile-user probes of the dataset mode, ``--force`` and the runtime (classes 1, 2, 3, 6 and 7).

    python tools/probe_reliability.py [--repo PATH] [--work DIR] [--only PREFIX]

Each probe runs elx as a user would (the CLI in a subprocess, or the Python API in a fresh
interpreter) against ``--repo`` (default: this checkout; point it at an unpacked older commit to
count what failed before a fix) and checks the one thing that must hold: a one-line
``elx: error:`` and exit 2 for what is refused, nothing of the user's changed, no hang (every
subprocess has a time limit), a dataset row equal to the input's own generation.  Prints one line
per probe (``ok`` or ``FAIL`` with what was seen) and the counts per class.

Tiny random exports (T5, GPT-2, Whisper from ``tests/conftest.py``'s configs) are made once into
``--work`` (default ``/tmp/elx-probes``).  No probe starts more than a few dozen threads: the
thread-count probes ask for 64 threads (32 x the cores of the 2-core machine these were written on),
far enough above the core count to be refused by the cap and harmless where they are not.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OPTIONS = ["--num-beams", "2", "--max-new-tokens", "4", "--quiet"]


class Probes:
    def __init__(self, repo: Path, work: Path):
        self.repo, self.work = repo, work
        self.results = []  # (class, name, ok, detail)
        self.case_dir = None

    # -- running elx ------------------------------------------------------------------------------
    def env(self, **extra) -> dict:
        return {**os.environ, "PYTHONPATH": str(self.repo), "OMP_NUM_THREADS": "1", "ELX_LOG_SOFTMAX": "numpy",
                **extra}

    def elx(self, *args, timeout: float = 120, env=None) -> subprocess.CompletedProcess:
        try:
            return subprocess.run([sys.executable, "-m", "elx.cli", *map(str, args)], capture_output=True, text=True,
                                  timeout=timeout, env=env or self.env(), cwd=self.case_dir)
        except subprocess.TimeoutExpired:
            return subprocess.CompletedProcess(args, "timeout", "", f"(no answer within {timeout} s)")

    def python(self, code: str, timeout: float = 120) -> subprocess.CompletedProcess:
        try:
            return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                                  timeout=timeout, env=self.env(), cwd=self.case_dir)
        except subprocess.TimeoutExpired:
            return subprocess.CompletedProcess(code, "timeout", "", f"(no answer within {timeout} s)")

    def killed_run(self, folder: Path, source: Path, out: Path, signum: int) -> subprocess.CompletedProcess:
        """A dataset run sent ``signum`` once it has written 4 lines; its exit status (negative: killed) and stderr."""
        proc = subprocess.Popen([sys.executable, "-m", "elx.cli", "generate", str(folder), "--input-file",
                                 str(source), "--output-file", str(out), "--batch-size", "2", *OPTIONS],
                                env=self.env(), stderr=subprocess.PIPE, text=True, cwd=self.case_dir)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None and (
                not out.exists() or out.read_bytes().count(b"\n") < 4):
            time.sleep(0.01)
        proc.send_signal(signum)
        try:
            _, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        return subprocess.CompletedProcess(proc.args, proc.returncode, "", err)

    def case(self, name: str) -> Path:
        self.case_dir = self.work / "cases" / name
        shutil.rmtree(self.case_dir, ignore_errors=True)
        self.case_dir.mkdir(parents=True)
        return self.case_dir

    def record(self, cls: str, name: str, ok: bool, detail: str = "") -> None:
        self.results.append((cls, name, bool(ok), detail))
        print(f"[{cls}] {'ok  ' if ok else 'FAIL'} {name}" + ("" if ok else f": {detail[:300]}"), flush=True)

    def refused(self, cls: str, name: str, proc, *, expect: str = "", intact=()) -> None:
        """Exit 2 with exactly one ``elx: error:`` line (containing ``expect``), no traceback, files unchanged."""
        err = proc.stderr or ""
        lines = [line for line in err.strip().splitlines() if line.startswith("elx: error:")]
        problems = []
        if proc.returncode != 2:
            problems.append(f"exit {proc.returncode}")
        if len(lines) != 1 or "Traceback" in err or "terminate called" in err:
            problems.append(f"stderr {err.strip()[-200:]!r}")
        elif expect and expect.lower() not in lines[0].lower():
            problems.append(f"message {lines[0]!r} lacks {expect!r}")
        for path, before in intact:
            if not os.path.lexists(path) or (Path(path).is_file() and Path(path).read_bytes() != before):
                problems.append(f"{path} changed")
        self.record(cls, name, not problems, "; ".join(problems))


# -- inputs ---------------------------------------------------------------------------------------

def token_records(count: int, seed: int = 0, high: int = 20) -> list[dict]:
    rng = random.Random(seed)
    return [{"id": i, "input_ids": [rng.randint(3, 120) for _ in range(rng.randint(1, high))]} for i in range(count)]


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def wav_bytes(samples: bytes, *, tag: int = 1, channels: int = 1, rate: int = 16000, block: int = 2,
              bits: int = 16, fmt_size: int = 16, data_size: int | None = None) -> bytes:
    fmt = struct.pack("<HHIIHH", tag, channels, rate, rate * block, block, bits)[:fmt_size]
    size = len(samples) if data_size is None else data_size
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", size) + samples
    return b"RIFF" + struct.pack("<I", len(body)) + body


def make_exports(work: Path) -> dict:
    """Tiny exports, made once (their own interpreter, this checkout's exporter)."""
    folders = {family: work / f"export-{family}" for family in ("t5", "gpt2", "whisper", "opt")}
    missing = [f for f, path in folders.items() if not (path / "manifest.json").is_file()]
    if missing:
        code = f"""
        import json, sys
        from pathlib import Path
        sys.path.insert(0, {str(ROOT)!r})
        from tests.conftest import make_model_folder
        from tests.test_runtime_imports import _word_tokenizer
        from elx.exporter.export import export_model
        work = Path({str(work)!r})
        for family in {missing!r}:
            model = make_model_folder(work / "models", family)
            out = export_model(str(model), work / f"export-{{family}}", quiet=True)
            if family == "whisper":
                (out / "tokenizer").mkdir(exist_ok=True)
                (out / "tokenizer" / "preprocessor_config.json").write_text(json.dumps(
                    {{"feature_extractor_type": "WhisperFeatureExtractor", "feature_size": 80}}))
            else:
                _word_tokenizer(out, 128)
        """
        subprocess.run([sys.executable, "-c", textwrap.dedent(code)], check=True, env={**os.environ,
                       "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    return folders


# -- class 1: data loss ---------------------------------------------------------------------------

def probe_data_loss(p: Probes, ex: dict) -> None:
    t5 = ex["t5"]
    records = token_records(12)

    def fresh(name: str) -> tuple[Path, Path, bytes]:
        d = p.case(name)
        source = write_jsonl(d / "in.jsonl", records)
        return d, source, source.read_bytes()

    for force in (True, False):
        d, source, data = fresh(f"hardlink-{force}")
        os.link(source, d / "out.jsonl")
        p.refused("1", f"output a hard link to the input{' --force' if force else ''}",
                  p.elx("generate", t5, "--input-file", source, "--output-file", d / "out.jsonl", *OPTIONS,
                        *(["--force"] if force else [])), expect="input", intact=[(source, data)])
    d, source, data = fresh("symlink-input")
    (d / "out.jsonl").symlink_to(source)
    p.refused("1", "output a symbolic link to the input --force",
              p.elx("generate", t5, "--input-file", source, "--output-file", d / "out.jsonl", *OPTIONS, "--force"),
              intact=[(source, data)])
    d, source, data = fresh("respelled")
    (d / "sub").mkdir()
    p.refused("1", "output the input spelled sub/../in.jsonl --force",
              p.elx("generate", t5, "--input-file", "in.jsonl", "--output-file", "sub/../in.jsonl", *OPTIONS,
                    "--force"), intact=[(source, data)])
    for name, label in (("manifest.json", "the export's manifest.json"), ("results.jsonl", "a new file inside the "
                        "export folder"), ("tokenizer/out.jsonl", "a file in the export's tokenizer/")):
        d, source, data = fresh(f"in-export-{name.replace('/', '-')}")
        copy = d / "export"  # the export is a copy: a failing probe destroys it
        shutil.copytree(t5, copy)
        manifest = (copy / "manifest.json").read_bytes()
        p.refused("1", f"output {label} --force",
                  p.elx("generate", copy, "--input-file", source, "--output-file", copy / name, *OPTIONS, "--force"),
                  expect="export", intact=[(copy / "manifest.json", manifest)])

    d, source, data = fresh("resume-user-file")
    user = d / "out.jsonl"
    user.write_bytes(b'{"id": 0, "note": "my own file"}\n{"id": 1, "note": "no newline at the end"}')
    mine = user.read_bytes()
    p.refused("1", "--resume on a user's JSONL file without a trailing newline",
              p.elx("generate", t5, "--input-file", source, "--output-file", user, *OPTIONS, "--resume"),
              intact=[(user, mine)])
    d, source, data = fresh("resume-copy")
    shutil.copy(source, d / "out.jsonl")
    p.refused("1", "--resume on a copy of the input",
              p.elx("generate", t5, "--input-file", source, "--output-file", d / "out.jsonl", *OPTIONS, "--resume"),
              intact=[(d / "out.jsonl", data)])
    d, source, data = fresh("force-user-file")
    (d / "out.jsonl").write_bytes(mine)
    p.refused("1", "--force on a file elx did not write",
              p.elx("generate", t5, "--input-file", source, "--output-file", d / "out.jsonl", *OPTIONS, "--force"),
              intact=[(d / "out.jsonl", mine)])

    # a partial elx output (what a killed run leaves), then --resume with other options, model or input
    d, source, data = fresh("resume-mismatch")
    write_jsonl(source, token_records(150, seed=4, high=30))
    out = d / "out.jsonl"
    killed = p.killed_run(t5, source, out, signal.SIGKILL)
    partial = out.read_bytes()
    if killed.returncode != -signal.SIGKILL or not partial:
        p.record("1", "a killed run for the resume probes", False, f"exit {killed.returncode}")
        return
    other = write_jsonl(d / "other.jsonl", token_records(150, seed=9, high=30))
    for label, model, source_file, options in (
            ("other generation options", t5, source, ["--num-beams", "3", "--max-new-tokens", "4", "--quiet"]),
            ("another model", ex["opt"], source, OPTIONS), ("another input holding the same ids", t5, other, OPTIONS)):
        p.refused("1", f"--resume with {label}", p.elx("generate", model, "--input-file", source_file, "--output-file",
                                                      out, *options, "--batch-size", "2", "--resume"),
                  intact=[(out, partial)])
        out.write_bytes(partial)  # for the next probe, whatever this one did
    side = [f for f in d.iterdir() if f.name not in ("in.jsonl", "other.jsonl", "out.jsonl")]
    done = p.elx("generate", t5, "--input-file", source, "--output-file", out, *OPTIONS, "--batch-size", "2",
                 "--resume", timeout=600)
    expected = d / "expected.jsonl"
    p.elx("generate", t5, "--input-file", source, "--output-file", expected, *OPTIONS, "--batch-size", "2",
          timeout=600)
    full = out.read_bytes()
    p.record("1", "--resume with the same options gives the uninterrupted output", done.returncode == 0 and
             full == expected.read_bytes(), done.stderr[-200:])
    again = p.elx("generate", t5, "--input-file", source, "--output-file", out, *OPTIONS, "--resume")
    p.record("1", "--resume of a finished output changes nothing", again.returncode == 0 and
             out.read_bytes() == full, again.stderr)
    for f in side:  # the run's identity record, where there is one, removed: OUT is no longer provably elx's
        f.unlink()
    if side:
        p.refused("1", "--resume of an output whose run record is gone",
                  p.elx("generate", t5, "--input-file", source, "--output-file", out, *OPTIONS, "--resume"),
                  intact=[(out, full)])
    else:
        p.record("1", "--resume of an output whose run record is gone", False, "no run record beside OUT")

    # two concurrent runs on one OUT
    d, source, data = fresh("concurrent")
    write_jsonl(source, token_records(150, seed=3, high=30))
    out = d / "out.jsonl"
    args = [sys.executable, "-m", "elx.cli", "generate", t5, "--input-file", source, "--output-file", out,
            "--batch-size", "2", *OPTIONS]
    procs = [subprocess.Popen(list(map(str, args)), env=p.env(), stderr=subprocess.PIPE, text=True, cwd=d)
             for _ in range(2)]
    codes = [proc.wait(timeout=600) for proc in procs]
    errs = [proc.stderr.read() for proc in procs]
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()] if out.exists() else []
    p.record("1", "two concurrent runs on one output", sorted(codes) == [0, 2] and sorted(ids) == list(range(150))
             and any("another elx process" in e for e in errs), f"exits {codes}, {len(ids)} lines, {errs}")

    # an output that is a symbolic link to another file: refused, both untouched
    d, source, data = fresh("symlink-out")
    real = d / "real.jsonl"
    real.write_bytes(b"")
    (d / "out.jsonl").symlink_to(real)
    proc = p.elx("generate", t5, "--input-file", source, "--output-file", d / "out.jsonl", *OPTIONS)
    p.refused("1", "output a symbolic link", proc, expect="symbolic link")
    # an output with another hard link: the final rename would leave the other name a stale copy
    d, source, data = fresh("hardlinked-out")
    (d / "out.jsonl").write_bytes(b"")
    os.link(d / "out.jsonl", d / "also.jsonl")
    p.refused("1", "output with another hard link",
              p.elx("generate", t5, "--input-file", source, "--output-file", d / "out.jsonl", *OPTIONS),
              expect="link")

    # export --force and the user's files inside tokenizer/ and engines/
    for sub in ("tokenizer", "engines"):
        d = p.case(f"export-force-{sub}")
        out = d / "export"
        shutil.copytree(t5, out)
        if sub == "engines":
            (out / "engines").mkdir()
            (out / "engines" / "build.json").write_text("{}")
            data = json.loads((out / "manifest.json").read_text())
            data["engines"] = {"folder": "engines", "graphs": {}}
            (out / "manifest.json").write_text(json.dumps(data))
        (out / sub / "my-notes.txt").write_text("keep me")
        proc = p.elx("export", "--model", p.work / "models" / "t5-0", "--output", out, "--force", "--quiet",
                     timeout=600)
        survived = (out / sub / "my-notes.txt").is_file()
        p.record("1", f"export --force keeps a user file in {sub}/", survived and (
            proc.returncode == 0 or (proc.returncode == 2 and "my-notes.txt" in proc.stderr)),
                 f"exit {proc.returncode}, survived {survived}: {proc.stderr.strip()[-200:]}")


# -- class 1/2: full disks ------------------------------------------------------------------------

def tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    return os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                                                capture_output=True).returncode == 0


KEPT = ("out.jsonl", ".out.jsonl.elx-run.json")  # the output and its run record (not temporary)


def probe_disk_full(p: Probes, ex: dict) -> None:
    d = p.case("disk-full")
    disk = d / "disk"
    if not tmpfs(disk, "64k"):
        p.record("1", "disk full (tmpfs)", False, "cannot mount a tmpfs (needs root)")
        return
    try:
        source = write_jsonl(d / "in.jsonl", token_records(400, seed=5, high=30))
        out = disk / "out.jsonl"
        proc = p.elx("generate", ex["t5"], "--input-file", source, "--output-file", out, "--batch-size", "3",
                     *OPTIONS, timeout=600)
        left = sorted(f.name for f in disk.iterdir() if f.name not in KEPT)
        p.refused("1", "disk full while writing lines", proc, expect="space")
        p.record("1", "disk full while writing lines leaves no temporary file", not left, f"left {left}")
        intact = out.exists() and all(json.loads(line) for line in out.read_text().splitlines())
        p.record("1", "disk full while writing lines keeps complete lines", intact)
        # full while the finished file is put in order: a file that fits once, not twice
        subprocess.run(["umount", str(disk)], check=True)
        small = write_jsonl(d / "small.jsonl", token_records(40, seed=6, high=30))
        probe = d / "probe.jsonl"
        done = p.elx("generate", ex["t5"], "--input-file", small, "--output-file", probe, "--batch-size", "3",
                     *OPTIONS)
        size = probe.stat().st_size if done.returncode == 0 else 20000
        tmpfs(disk, str(int(size * 1.5) + 8192))
        proc = p.elx("generate", ex["t5"], "--input-file", small, "--output-file", disk / "out.jsonl",
                     "--batch-size", "3", *OPTIONS)
        left = sorted(f.name for f in disk.iterdir() if f.name not in KEPT)
        p.record("1", "disk full while the output is put in order: no temporary file left",
                 not left and proc.returncode in (0, 2), f"exit {proc.returncode}, left {left}: {proc.stderr[-200:]}")
        if proc.returncode == 2:
            p.refused("1", "disk full while the output is put in order: one line", proc, expect="space")
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


# -- class 2: hangs -------------------------------------------------------------------------------

def probe_hangs(p: Probes, ex: dict) -> None:
    t5 = ex["t5"]
    d = p.case("threads")
    source = write_jsonl(d / "in.jsonl", token_records(3))
    p.refused("2", "--threads 64 on generate", p.elx("generate", t5, "--input-ids", "5 6 7", "--threads", "64",
                                                     "--max-new-tokens", "2", timeout=60), expect="threads")
    p.refused("2", "--threads 64 on a dataset", p.elx("generate", t5, "--input-file", source, "--output-file",
                                                      d / "o.jsonl", "--threads", "64", *OPTIONS, timeout=60),
              expect="threads")
    for name, code in (("Generator.from_folder(threads=64)", f"elx.Generator.from_folder({str(t5)!r}, threads=64)"),
                       ("generate_file(threads=64)", f"elx.generate_file({str(t5)!r}, {str(source)!r}, "
                                                     f"{str(d / 'p.jsonl')!r}, threads=64, progress='none')")):
        proc = p.python(f"import elx\ntry:\n    {code}\nexcept elx.ElxError as e:\n    print('ElxError', e)\n",
                        timeout=60)
        p.record("2", f"{name} refused", proc.returncode == 0 and "ElxError" in proc.stdout and "thread" in proc.stdout,
                 f"exit {proc.returncode}: {(proc.stdout + proc.stderr)[-200:]}")
    d = p.case("fifo")
    source = write_jsonl(d / "in.jsonl", token_records(3))
    os.mkfifo(d / "out.jsonl")
    p.refused("2", "output a FIFO", p.elx("generate", t5, "--input-file", source, "--output-file", d / "out.jsonl",
                                          *OPTIONS, timeout=30))
    os.mkfifo(d / "in.fifo.jsonl")
    p.refused("2", "input a FIFO", p.elx("generate", t5, "--input-file", d / "in.fifo.jsonl", "--output-file",
                                         d / "o2.jsonl", *OPTIONS, timeout=30), expect="not a regular file")
    p.refused("2", "output a character device", p.elx("generate", t5, "--input-file", source, "--output-file",
                                                      "/dev/null", *OPTIONS, "--force", timeout=30))
    try:
        import ray  # noqa: F401
    except ImportError:
        p.record("2", "--ray with an unreachable cluster", False, "ray not installed")
        return
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))  # a port nobody answers on (bound, not listening)
    port = listener.getsockname()[1]
    started = time.monotonic()
    proc = p.elx("generate", t5, "--input-file", source, "--output-file", d / "ray.jsonl", *OPTIONS,
                 "--ray", f"127.0.0.1:{port}", timeout=180)
    listener.close()
    p.refused("2", f"--ray with an unreachable cluster ({time.monotonic() - started:.0f} s)", proc, expect="ray")


# -- class 3: crashes -----------------------------------------------------------------------------

def probe_crashes(p: Probes, ex: dict) -> None:
    t5 = ex["t5"]
    for signum in (signal.SIGTERM, signal.SIGHUP):
        d = p.case(f"signal-{signum}")
        source = write_jsonl(d / "in.jsonl", token_records(400, seed=2, high=30))
        out = d / "out.jsonl"
        proc = p.killed_run(t5, source, out, signum)
        text = out.read_bytes() if out.exists() else b""
        complete = text.endswith(b"\n") and all(json.loads(line) for line in text.splitlines())
        p.record("3", f"{signal.Signals(signum).name} during generate --input-file",
                 proc.returncode == 128 + signum and complete and "terminate called" not in proc.stderr
                 and "Traceback" not in proc.stderr, f"exit {proc.returncode}, complete lines {complete}: "
                 f"{proc.stderr[-200:]}")

    d = p.case("nested")
    nested = '{"id": 1, "input_ids": ' + "[" * 100000 + "]" * 100000 + "}"
    source = d / "in.jsonl"
    source.write_text(json.dumps({"id": 0, "input_ids": [5, 6]}) + "\n" + nested + "\n")
    p.refused("3", "deeply nested JSON line", p.elx("generate", t5, "--input-file", source, "--output-file",
                                                    d / "out.jsonl", *OPTIONS), expect="line 2")
    proc = p.elx("generate", t5, "--input-file", source, "--output-file", d / "skip.jsonl", *OPTIONS, "--skip-bad")
    lines = (d / "skip.jsonl").read_text().splitlines() if (d / "skip.jsonl").exists() else []
    p.record("3", "deeply nested JSON line under --skip-bad", proc.returncode == 0 and len(lines) == 2 and
             "error" in json.loads(lines[1]), f"exit {proc.returncode}: {proc.stderr[-200:]}")
    copy = d / "export"
    shutil.copytree(t5, copy)
    (copy / "manifest.json").write_text('{"format": "elx-manifest", "x": ' + "[" * 100000 + "]" * 100000 + "}")
    p.refused("3", "deeply nested manifest", p.elx("generate", copy, "--input-ids", "5 6"), expect="manifest")

    d = p.case("long")
    rng = random.Random(1)
    long_ids = [rng.randint(3, 120) for _ in range(40000)]
    source = write_jsonl(d / "in.jsonl", [{"id": 0, "input_ids": long_ids}])
    p.refused("3", "40k-token line on T5", p.elx("generate", t5, "--input-file", source, "--output-file",
                                                  d / "out.jsonl", *OPTIONS, timeout=300), expect="line 1")
    p.refused("3", "40k-token line on GPT-2", p.elx("generate", ex["gpt2"], "--input-file", source, "--output-file",
                                                     d / "g.jsonl", *OPTIONS, timeout=300), expect="64")
    near = write_jsonl(d / "near.jsonl", [{"id": 0, "input_ids": long_ids[:62]}, {"id": 1, "input_ids": [5, 6]}])
    p.refused("3", "GPT-2 prompt that leaves no room for max_new_tokens", p.elx(
        "generate", ex["gpt2"], "--input-file", near, "--output-file", d / "n.jsonl", "--max-new-tokens", "8",
        "--quiet"), expect="line 1")
    p.refused("3", "40k tokens with --input-ids on T5", p.elx("generate", t5, "--input-ids", " ".join(
        map(str, long_ids)), "--max-new-tokens", "2", timeout=300))
    p.refused("3", "num_beams 10**6 (CLI)", p.elx("generate", t5, "--input-ids", "5 6 7", "--num-beams", "1000000",
                                                  timeout=120), expect="num_beams")
    proc = p.python(f"""
        import elx
        try:
            elx.Generator.from_folder({str(t5)!r}).generate(input_ids=[[5, 6, 7]], num_beams=10**6)
        except elx.ElxError as e:
            print('ElxError', e)
        """, timeout=120)
    p.record("3", "num_beams 10**6 (Python)", proc.returncode == 0 and "ElxError" in proc.stdout,
             f"exit {proc.returncode}: {(proc.stdout + proc.stderr)[-200:]}")

    # malformed WAV files on Whisper: one line naming the file, an error record under --skip-bad
    whisper = ex["whisper"]
    d = p.case("wav")
    pcm = struct.pack("<800h", *([1000, -1000] * 400))
    bad = {"odd block_align": wav_bytes(pcm, block=3), "zero channels": wav_bytes(pcm, channels=0),
           "block_align not a multiple of channels": wav_bytes(pcm, channels=2, block=3),
           "65535 channels": wav_bytes(pcm, channels=65535, block=2),
           "short fmt chunk": wav_bytes(pcm, fmt_size=10),
           "1 Hz sampling rate": wav_bytes(pcm * 20, rate=1), "header only": wav_bytes(b""),
           "bits 0": wav_bytes(pcm, bits=0), "float with block_align 3": wav_bytes(pcm, tag=3, block=3, bits=24)}
    for i, (label, data) in enumerate(bad.items()):
        (d / f"{i}.wav").write_bytes(data)
        p.refused("3", f"WAV with {label}", p.elx("generate", whisper, "--audio", d / f"{i}.wav", "--max-new-tokens",
                                                  "2", timeout=120), expect=f"{i}.wav")
    # a data chunk whose size runs past the end (a recording cut short, a stream's placeholder size): decoded as far
    # as it goes, as audio tools do
    (d / "cut.wav").write_bytes(wav_bytes(pcm, data_size=0xFFFFFFFF))
    proc = p.elx("generate", whisper, "--audio", d / "cut.wav", "--max-new-tokens", "2", timeout=120)
    p.record("3", "WAV whose data size runs past the end is decoded as far as it goes", proc.returncode == 0,
             proc.stderr[-200:])
    (d / "good.wav").write_bytes(wav_bytes(pcm))
    source = write_jsonl(d / "in.jsonl", [{"id": "good", "audio": "good.wav"}] +
                         [{"id": i, "audio": f"{i}.wav"} for i in range(len(bad))])
    proc = p.elx("generate", whisper, "--input-file", source, "--output-file", d / "out.jsonl", "--max-new-tokens",
                 "2", "--quiet", "--skip-bad", timeout=300)
    lines = [json.loads(x) for x in (d / "out.jsonl").read_text().splitlines()] if (d / "out.jsonl").exists() else []
    p.record("3", "malformed WAVs under --skip-bad become error records", proc.returncode == 0 and
             len(lines) == len(bad) + 1 and sum("error" in x for x in lines) == len(bad),
             f"exit {proc.returncode}, {len(lines)} lines: {proc.stderr[-200:]}")


# -- class 6: messages ----------------------------------------------------------------------------

def probe_messages(p: Probes, ex: dict) -> None:
    d = p.case("messages")
    pcm = struct.pack("<800h", *([1000, -1000] * 400))
    (d / "pcm.wav").write_bytes(wav_bytes(pcm, block=3))
    proc = p.elx("generate", ex["whisper"], "--audio", d / "pcm.wav", "--max-new-tokens", "2")
    p.record("6", "a PCM file with a bad block_align is not told to use PCM", proc.returncode == 2 and
             "use PCM" not in proc.stderr and "block" in proc.stderr, proc.stderr[-200:])
    proc = p.elx("generate", ex["t5"], "--input-ids", "5 6", "--threads", "64", "--max-new-tokens", "2", timeout=60)
    p.record("6", "a thread-count error does not blame the export", proc.returncode == 2 and
             "re-run 'elx export'" not in proc.stderr and "--threads" in proc.stderr, proc.stderr[-200:])
    for flag, value in (("--input-ids", "5 6"), ("--text", "hello")):
        proc = p.elx("generate", ex["whisper"], flag, value, "--max-new-tokens", "2")
        p.record("6", f"Whisper {flag} names CLI flags", proc.returncode == 2 and "--audio" in proc.stderr and
                 "audio=" not in proc.stderr, proc.stderr[-200:])


# -- class 7: a wrong answer ----------------------------------------------------------------------

def probe_decoder_only_rows(p: Probes, ex: dict) -> None:
    d = p.case("rows")
    rows = [[5, 6, 7, 8, 9, 10, 11, 12], [13, 14], [15, 16, 17, 18], [19], [20, 21, 22, 23, 24, 25]]
    source = write_jsonl(d / "in.jsonl", [{"id": i, "input_ids": r} for i, r in enumerate(rows)])
    cases = [("gpt2", dict(num_beams=2, max_length=14)), ("gpt2", dict(max_length=12)),
             ("gpt2", dict(num_beams=2, min_length=12, max_new_tokens=6)),
             ("gpt2", dict(num_beams=2, no_repeat_ngram_size=1, max_new_tokens=6)),
             ("opt", dict(num_beams=2, max_length=13)), ("gpt2", dict(num_beams=3, max_new_tokens=5))]
    for i, (family, options) in enumerate(cases):
        proc = p.python(f"""
            import json, elx
            rows, options = {rows!r}, {options!r}
            out = {str(d / f'out{i}.jsonl')!r}
            elx.generate_file({str(ex[family])!r}, {str(source)!r}, out, batch_size=5, progress="none", **options)
            g = elx.Generator.from_folder({str(ex[family])!r})
            lines = [json.loads(x) for x in open(out)]
            bad = [i for i, (r, line) in enumerate(zip(rows, lines))
                   if line["tokens"] != g.generate(input_ids=[r], **options).sequences[0].tolist()]
            print("mismatch", bad)
            """)
        p.record("7", f"{family} dataset rows with {options} equal per-input generation",
                 proc.returncode == 0 and "mismatch []" in proc.stdout, (proc.stdout + proc.stderr)[-300:])


GROUPS = {"1": [probe_data_loss, probe_disk_full], "2": [probe_hangs], "3": [probe_crashes], "6": [probe_messages],
          "7": [probe_decoder_only_rows]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repo", type=Path, default=ROOT, help="the elx checkout to probe (default: this one)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/elx-probes"))
    ap.add_argument("--only", default="", help="classes to run, e.g. 1,7 (default: all)")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    exports = make_exports(args.work)
    probes = Probes(args.repo.resolve(), args.work)
    for cls, functions in GROUPS.items():
        if args.only and cls not in args.only.split(","):
            continue
        for function in functions:
            function(probes, exports)
    counts = Counter((cls, ok) for cls, _, ok, _ in probes.results)
    print(f"\nprobes of {args.repo}:")
    for cls in sorted({c for c, *_ in probes.results}):
        total = counts[(cls, True)] + counts[(cls, False)]
        print(f"  class {cls}: {total} probes, {counts[(cls, False)]} failed")
    print(f"  all: {len(probes.results)} probes, {sum(not ok for *_, ok, _ in probes.results)} failed")


if __name__ == "__main__":
    main()
