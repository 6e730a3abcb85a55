#!/usr/bin/env python3
"""The one-call GPU check (issue 26): on a CUDA machine, run everything this CPU machine cannot.

    bash tools/gpu_check.sh [--dry-run] [--out DIR] [--only tests,ngram,search,bench] [--batches 1,8,32,128]

Steps, in order, each recorded even when it fails:

1. **environment**: ``nvidia-smi``'s device line, PyTorch (and whether it sees CUDA), CuPy, ONNX Runtime
   and its execution providers (``CUDAExecutionProvider`` only with onnxruntime-gpu), TensorRT /
   TensorRT for RTX, nvcc.
2. **tests**: every test that skips without a GPU, selected from the test files' own markers: a ``gpu``
   mark (pyproject's pytest markers), or a ``skipif`` whose reason names CUDA, a GPU or CuPy (the CUDA
   execution provider included; building TensorRT engines or the kernel needs no GPU, and CI runs those
   tests).  A new test skipped "for want of a GPU" is therefore picked up without editing this script; a test that skips at run time (``pytest.skip`` in
   its body or a fixture) needs the ``gpu`` mark.  They run by node id with pytest's temporary folders
   under the output folder; the JUnit XML gives each outcome and skip reason.
3. **ngram**: the n-gram blocking kernel (``plugins_cuda/``) built for this GPU with
   ``tools/build_plugin.py`` into the output folder, then ``tools/bench_ngram_kernel.py`` (fp32, fp16).
4. **search**: the beam search's own cost per step with the logits on the GPU, host path against device
   path (``tools/measure_search_host.py --device cuda``), beam 4, t5's vocabulary, batch 8/32/128.
5. **bench**: ``elx bench --device cuda`` on t5-base dims (random weights), pass sets baseline and el,
   beam 4, batch 1/8/32/128, in fp32 and fp16, on ONNX Runtime (and on TensorRT when a TensorRT runtime is
   installed; ONNX Runtime rows are refused, with the reason, where its build has no CUDA provider).  HF generate is measured inside each bench run.  fp16 runs only when ``elx bench --help``
   offers ``--precision``; otherwise those rows are recorded as not supported, with the reason.

Everything is written under one folder (default ``gpu_check_results/<UTC timestamp>/``): ``summary.md``,
``results.json`` and each step's log; exports and builds too (``--bench-work`` reuses exports elsewhere).
With ``--dry-run``, or automatically when no CUDA device is found, nothing runs: the script prints the
environment and exactly the commands it would run, writes the same two files, and exits 0.
"""
from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

sys.dont_write_bytecode = True  # a dry run writes nothing outside its output folder

REPO = Path(__file__).resolve().parents[1]
# a skipif reason naming one of these is a test skipped for want of a GPU (CUDAExecutionProvider included);
# TensorRT or nvcc alone are not: engines and the n-gram kernel are built on the CPU, and CI runs those tests
GPU_REASON = re.compile(r"cuda|gpu|cupy", re.IGNORECASE)
BENCH_MODEL = "t5-base"
BATCHES = (1, 8, 32, 128)
PRECISIONS = ("fp32", "fp16")
STEPS = ("tests", "ngram", "search", "bench")
SEARCH_BATCHES = (8, 32, 128)  # the search step's batch sizes (beam 4, t5's vocabulary)


# --------------------------------------------------------------------------------------------------
# environment


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _run_text(cmd: list[str]) -> str | None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def device_line() -> str | None:
    """nvidia-smi's name, driver, memory and compute capability of each GPU (None without nvidia-smi)."""
    if shutil.which("nvidia-smi") is None:
        return None
    query = "--query-gpu=name,driver_version,memory.total,compute_cap"
    return (_run_text(["nvidia-smi", query, "--format=csv,noheader"])
            or _run_text(["nvidia-smi", "-L"]))


def probe() -> dict:
    """What is installed and what it sees; never raises."""
    env: dict = {"python": sys.version.split()[0], "device_line": device_line(), "nvcc": shutil.which("nvcc")}
    torch_info: dict = {"version": _version("torch"), "cuda": False}
    if torch_info["version"] and nvidia_driver():  # importing torch only to hear "no GPU" costs seconds
        try:
            import torch

            torch_info.update(cuda_build=torch.version.cuda, cuda=bool(torch.cuda.is_available()))
            if torch_info["cuda"]:
                major, minor = torch.cuda.get_device_capability()
                torch_info.update(device=torch.cuda.get_device_name(), capability=f"{major}.{minor}")
        except Exception as err:  # a broken install is reported, not fatal
            torch_info["error"] = f"{type(err).__name__}: {err}"
    env["torch"] = torch_info
    cupy_info: dict = {"version": next(filter(None, (_version(d) for d in _cupy_dists())), None), "devices": 0}
    if importlib.util.find_spec("cupy") is not None and nvidia_driver():
        try:
            import cupy

            cupy_info["devices"] = int(cupy.cuda.runtime.getDeviceCount())
        except Exception as err:
            cupy_info["error"] = f"{type(err).__name__}: {err}"
    env["cupy"] = cupy_info
    ort_info: dict = {"version": _version("onnxruntime") or _version("onnxruntime-gpu"),
                      "gpu_wheel": _version("onnxruntime-gpu"), "providers": []}
    try:
        import onnxruntime

        ort_info["providers"] = list(onnxruntime.get_available_providers())
        ort_info["version"] = onnxruntime.__version__  # the one imported: a --target install shadows the image's
    except Exception as err:
        ort_info["error"] = f"{type(err).__name__}: {err}"
    env["onnxruntime"] = ort_info
    env["transformers"] = _version("transformers")  # HF generate's reference: pyproject pins its range
    env["tensorrt"] = _module_version("tensorrt")
    env["tensorrt_rtx"] = _module_version("tensorrt_rtx")
    return env


def nvidia_driver() -> bool:
    """Whether this machine has an NVIDIA driver (its device node or nvidia-smi): else no GPU can be seen."""
    return Path("/dev/nvidiactl").exists() or shutil.which("nvidia-smi") is not None


def _cupy_dists() -> list[str]:
    return ["cupy", "cupy-cuda12x", "cupy-cuda13x", "cupy-cuda11x"]


def _module_version(module: str) -> str | None:
    """The version of the distribution providing ``module`` (e.g. tensorrt_rtx from tensorrt_rtx_cu13)."""
    if importlib.util.find_spec(module) is None:
        return None
    dists = importlib.metadata.packages_distributions().get(module, [])
    return next(filter(None, (_version(d) for d in dists)), "installed")


def cuda_found(env: dict) -> bool:
    return bool(env["torch"].get("cuda") or env["cupy"].get("devices"))


def capability(env: dict) -> str | None:
    """The GPU's compute capability as nvcc spells it (``90``), from PyTorch or nvidia-smi."""
    cap = env["torch"].get("capability")
    if cap is None and env.get("device_line"):
        match = re.search(r",\s*(\d+)\.(\d+)\s*$", env["device_line"].splitlines()[0])
        cap = f"{match.group(1)}.{match.group(2)}" if match else None
    return cap.replace(".", "") if cap else None


# --------------------------------------------------------------------------------------------------
# test selection: a pytest plugin run in a child process (``--collect``)


class _Selector:
    """Collects the node ids of GPU tests, with why each was selected and whether it skips here."""

    def __init__(self):
        self.selected: list[dict] = []

    def pytest_collection_modifyitems(self, items):
        for item in items:
            why, skips_here = [], False
            if item.get_closest_marker("gpu") is not None:
                why.append("gpu mark")
            for mark in item.iter_markers("skipif"):
                reason = str(mark.kwargs.get("reason", ""))
                if GPU_REASON.search(reason):
                    why.append(f"skipif: {reason}")
                    skips_here |= any(c is True for c in mark.args) or not mark.args
            if why:
                self.selected.append({"nodeid": _nodeid(item), "why": why, "skips_here": skips_here})


# a file can select a test only if it has a gpu mark or a reason string naming CUDA/GPU/CuPy (collecting
# every test file would take the CI test past its time)
_CANDIDATE = re.compile(r"mark\.gpu\b|reason\s*=\s*[rf]?[\"'][^\"'\n]*(" + GPU_REASON.pattern + ")", re.IGNORECASE)


def _nodeid(item) -> str:
    """The item's node id with its file relative to the repository, or absolute outside it (pytest's own id
    of a file outside the rootdir drops the path)."""
    path = Path(item.path)
    where = str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)
    return "::".join([where, *item.nodeid.split("::")[1:]])


def candidate_files(paths: list[Path]) -> list[str]:
    """Test files that may hold a GPU test (see ``_CANDIDATE``); the collection decides."""
    files = []
    for path in paths:
        for file in sorted(path.rglob("test_*.py")) if path.is_dir() else [path]:
            if _CANDIDATE.search(file.read_text(encoding="utf-8")):
                files.append(str(file))
    return files


def collect(files: list[str]) -> int:
    """Child process: print the selection of ``files`` as JSON on stdout's last line."""
    import pytest

    selector = _Selector()
    # hypothesis's pytest plugin alone takes seconds to import, and collecting needs nothing of it
    code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "-p", "no:hypothesispytest",
                        "--rootdir", str(REPO), "-c", str(REPO / "pyproject.toml"), *files], plugins=[selector])
    print(json.dumps(selector.selected))
    return 0 if code in (0, 5) else int(code)


def select_gpu_tests(paths: list[Path]) -> tuple[list[dict], str | None]:
    """The GPU tests under ``paths`` (collected in a child process), or ([], the collection error)."""
    files = candidate_files(paths)
    if not files:
        return [], None
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--collect", *files], cwd=REPO,
                          capture_output=True, text=True, env=_child_env(), timeout=600)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return [], f"test collection failed (exit {done.returncode}): {(done.stdout + done.stderr)[-2000:]}"
    return json.loads(lines[-1]), None


def _child_env() -> dict:
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return env


# --------------------------------------------------------------------------------------------------
# the plan: every command, whether it runs or is only printed


def test_command(selected: list[dict], out: Path) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", "--basetemp",
            str(out / "pytest_tmp"), "--junitxml", str(out / "gpu_tests.xml"), *(t["nodeid"] for t in selected)]


def ngram_commands(env: dict, out: Path) -> list[dict]:
    arch = capability(env) or "CC"
    build = out / "build"
    lib = build / "libelx_ngram_kernel.so"
    return [{"name": "build kernel", "cmd": [sys.executable, "tools/build_plugin.py", "--output", str(build),
                                             "--target", "kernel", "--arch", arch]},
            *({"name": f"kernel bench {p}", "cmd": [sys.executable, "tools/bench_ngram_kernel.py", "--lib", str(lib),
                                                     *(["--fp16"] if p == "fp16" else [])]} for p in PRECISIONS)]


def search_commands() -> list[dict]:
    """The beam search's own cost per step with the logits on the GPU (``tools/measure_search_host.py --device
    cuda``): the host path (each step's [rows, vocab] logits copied down, numpy) against the device path
    (``runners/search/device.py``: scorer on the GPU, 2·beams candidates per item copied down), interleaved."""
    return [{"name": f"search batch {b}", "cmd": [sys.executable, "tools/measure_search_host.py", "--device", "cuda",
                                                 "--path", "both", "--batch-size", str(b), "--num-beams", "4",
                                                 "--new-tokens", "32", "--repeats", "5"]} for b in SEARCH_BATCHES]


def bench_has_precision() -> bool:
    """Whether this checkout's ``elx bench`` takes ``--precision`` (fp16 exports and HF in fp16)."""
    done = subprocess.run([sys.executable, "-m", "elx", "bench", "--help"], cwd=REPO, capture_output=True,
                          text=True, env=_child_env(), timeout=120)
    return "--precision" in done.stdout


def bench_runs(env: dict, out: Path, work: Path, batches, fp16_flag: bool, precisions=PRECISIONS) -> list[dict]:
    """One ``elx bench`` per backend, precision and batch size; unsupported ones carry ``unsupported``."""
    backends = ["ort"] + (["tensorrt"] if env.get("tensorrt") or env.get("tensorrt_rtx") else [])
    runs = []
    for backend in backends:
        for precision in precisions:
            # the exports of a precision are shared by the backends; engines are built into them on the first
            # TensorRT run, sized for its batch: the largest batch goes first
            order = sorted(batches, reverse=True) if backend == "tensorrt" else batches
            for batch in order:
                cmd = [sys.executable, "-m", "elx", "bench", "--device", "cuda", "--backend", backend,
                       "--model", BENCH_MODEL, "--random-init", "--pass-sets", "baseline|el", "--num-beams", "4",
                       "--batch-size", str(batch), "--work", str(work / precision), "--quiet"]
                run = {"backend": backend, "precision": precision, "batch": batch, "cmd": cmd,
                       "results": str(work / precision / BENCH_MODEL / "results" / "latest" / "bench.json")}
                if backend == "tensorrt" and (reason := _tensorrt_refusal(env)):
                    run["unsupported"] = reason
                elif backend == "ort" and (reason := _ort_refusal(env)):
                    run["unsupported"] = reason
                elif precision == "fp16":
                    if fp16_flag:
                        cmd += ["--precision", "fp16"]
                    else:
                        run["unsupported"] = ("elx bench has no --precision option in this checkout: HF fp16 and "
                                              "elx fp16 exports are not benchmarked")
                runs.append(run)
    return runs


def _ort_refusal(env: dict) -> str | None:
    """Why the ONNX Runtime bench cannot run on this GPU machine (its onnxruntime has no CUDA execution
    provider: the CPU build), or None.  A dry run without a GPU lists the runs a GPU machine would do."""
    if not cuda_found(env) or "CUDAExecutionProvider" in env["onnxruntime"]["providers"]:
        return None
    return (f"onnxruntime {env['onnxruntime']['version']} here has no CUDAExecutionProvider (the CPU build; "
            "onnxruntime-gpu is needed): elx bench --device cuda --backend ort would stop at its first step")


def _tensorrt_refusal(env: dict) -> str | None:
    """Why the TensorRT bench cannot run on this GPU (only TensorRT for RTX installed, a GPU it does not
    support: Hopper, for one), or None."""
    cap = env["torch"].get("capability")
    if env.get("tensorrt") or cap is None:
        return None
    from elx.exporter.tensorrt.build import RTX_TARGETS

    return None if cap in RTX_TARGETS else f"TensorRT for RTX does not run on compute capability {cap}"


# --------------------------------------------------------------------------------------------------
# running


def run_logged(cmd: list[str], log: Path, timeout: float) -> dict:
    """Run ``cmd`` in the repository, stdout+stderr to ``log``; its exit status (124 on timeout)."""
    with open(log, "w", encoding="utf-8") as fh:
        fh.write(f"$ {shlex.join(cmd)}\n")
        fh.flush()
        try:
            rc = subprocess.run(cmd, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, env=_child_env(),
                                timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
            fh.write(f"\n[gpu_check: timed out after {timeout:.0f} s]\n")
    return {"rc": rc, "log": log.name}


def junit_outcomes(xml: Path) -> list[dict]:
    """Each test case of a JUnit XML file: node id, outcome (passed/failed/error/skipped), message."""
    if not xml.is_file():
        return []
    cases = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome, message = ("failed" if tag == "failure" else tag), node.get("message", "")
                break
        cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      "message": message[:300], "seconds": float(case.get("time", 0))})
    return cases


def run_tests(plan: dict, out: Path, timeout: float) -> dict:
    step = run_logged(plan["command"], out / "gpu_tests.log", timeout)
    cases = junit_outcomes(out / "gpu_tests.xml")
    counts: dict = {}
    for case in cases:
        counts[case["outcome"]] = counts.get(case["outcome"], 0) + 1
    return {**step, "counts": counts, "cases": cases}


def run_commands(step: str, commands: list[dict], out: Path, timeout: float, first_needed: bool) -> list[dict]:
    """Each command in turn, its output's tail recorded (``first_needed``: the others need the first's work)."""
    results = []
    for i, command in enumerate(commands):
        result = {**command, **run_logged(command["cmd"], out / f"{step}_{i}.log", timeout)}
        result["output"] = (out / result["log"]).read_text(encoding="utf-8")[-6000:]
        results.append(result)
        if first_needed and i == 0 and result["rc"] != 0:
            break  # no kernel library, no bench
    return results


def run_bench(runs: list[dict], out: Path, timeout: float):
    """Run each supported bench in turn, yielding it once recorded (``run`` updated in place)."""
    (out / "bench").mkdir(exist_ok=True)
    for run in runs:
        if "unsupported" in run:
            continue
        name = f"{run['backend']}_{run['precision']}_b{run['batch']}"
        stale = Path(run["results"])  # results/latest/: each bench run writes a folder of its own and points at it
        run.update(run_logged(run["cmd"], out / "bench" / f"{name}.log", timeout))
        if run["rc"] == 0 and stale.is_file():
            shutil.copy(stale, out / "bench" / f"{name}.json")
            shutil.copy(stale.with_suffix(".md"), out / "bench" / f"{name}.md")
            run["report"] = json.loads(stale.read_text())
        yield run


# --------------------------------------------------------------------------------------------------
# reporting


def summary_markdown(result: dict) -> str:
    env = result["environment"]
    lines = [f"# elx GPU check, {result['started']}", "",
             f"- command: `{result['command']}`",
             f"- device: {env['device_line'] or 'none (no nvidia-smi)'}",
             f"- PyTorch {env['torch']['version']} (CUDA {env['torch'].get('cuda_build')}, "
             f"sees a GPU: {env['torch']['cuda']}); CuPy {env['cupy']['version']}; "
             f"ONNX Runtime {env['onnxruntime']['version']} ({', '.join(env['onnxruntime']['providers'])}); "
             f"TensorRT {env['tensorrt']}; TensorRT for RTX {env['tensorrt_rtx']}; nvcc {env['nvcc']}; "
             f"transformers {env.get('transformers')}", ""]
    if result["dry_run"]:
        lines += [f"**Dry run** ({result['dry_run']}): nothing was run; the commands below are what a run would do.",
                  ""]
    tests = result.get("tests")
    if tests is not None:
        lines += [f"## GPU tests ({len(tests['selected'])} selected)", "", f"`{shlex.join(tests['command'])}`", ""]
        if tests.get("error"):
            lines += [f"selection failed: {tests['error']}", ""]
        if "counts" in tests:
            lines += ["outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(tests["counts"].items())), "",
                      "| test | outcome | message |", "|---|---|---|"]
            lines += [f"| {c['test']} | {c['outcome']} | {c['message'].replace('|', '/')} |" for c in tests["cases"]]
        else:
            lines += ["| test | selected because | skips here |", "|---|---|---|"]
            lines += [f"| {t['nodeid']} | {'; '.join(t['why'])} | {t['skips_here']} |" for t in tests["selected"]]
        lines.append("")
    for key, title in (("ngram", "n-gram kernel benchmark"),
                       ("search", "beam search per step, logits on the GPU: host path against device path")):
        if result.get(key) is None:
            continue
        lines += [f"## {title}", ""]
        for step in result[key]:
            lines += [f"`{shlex.join(step['cmd'])}`" + (f" (exit {step['rc']})" if "rc" in step else ""), ""]
            if step.get("output"):
                lines += ["```", step["output"].rstrip(), "```", ""]
    if result.get("bench") is not None:
        lines += [f"## elx bench --device cuda ({BENCH_MODEL} dims, random weights, beam 4)", ""]
        for run in result["bench"]:
            head = f"### {run['backend']}, {run['precision']}, batch {run['batch']}"
            if "unsupported" in run:
                lines += [head, "", f"not supported: {run['unsupported']}", ""]
                continue
            lines += [head, "", f"`{shlex.join(run['cmd'])}`" + (f" (exit {run['rc']})" if "rc" in run else ""), ""]
            md = Path(result["out"]) / "bench" / f"{run['backend']}_{run['precision']}_b{run['batch']}.md"
            if md.is_file():
                lines += [md.read_text().rstrip(), ""]
            elif run.get("rc"):
                log = (Path(result["out"]) / "bench" / run["log"]).read_text(encoding="utf-8").splitlines()
                lines += ["```", *log[-12:], "```", ""]
    return "\n".join(lines) + "\n"


def print_plan(result: dict) -> None:
    env = result["environment"]
    print(f"device: {env['device_line'] or 'none (no nvidia-smi)'}")
    print(f"torch {env['torch']['version']} cuda={env['torch']['cuda']}; cupy {env['cupy']['version']}; "
          f"onnxruntime {env['onnxruntime']['version']} providers={','.join(env['onnxruntime']['providers'])}; "
          f"tensorrt {env['tensorrt']}; tensorrt_rtx {env['tensorrt_rtx']}; nvcc {env['nvcc']}")
    print(f"dry run: {result['dry_run']}; would run:")
    tests = result.get("tests")
    if tests is not None:
        print(f"[tests] {len(tests['selected'])} GPU tests:")
        for t in tests["selected"]:
            print(f"  {t['nodeid']}    ({'; '.join(t['why'])})")
        options = tests["command"][:len(tests["command"]) - len(tests["selected"])]
        print(f"  $ {shlex.join(options)} <the {len(tests['selected'])} node ids above>")
        if tests.get("error"):
            print(f"  selection failed: {tests['error']}")
    for step in result.get("ngram") or []:
        unknown = " (CC: the GPU's compute capability, e.g. 90)" if step["cmd"][-1] == "CC" else ""
        print(f"[ngram] {step['name']}: $ {shlex.join(step['cmd'])}{unknown}")
    for step in result.get("search") or []:
        print(f"[search] {step['name']}: $ {shlex.join(step['cmd'])}")
    for run in result.get("bench") or []:
        label = f"[bench] {run['backend']} {run['precision']} batch {run['batch']}"
        print(f"{label}: not supported: {run['unsupported']}" if "unsupported" in run
              else f"{label}: $ {shlex.join(run['cmd'])}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="print what would run; run nothing (automatic without "
                                                           "a CUDA device)")
    ap.add_argument("--out", help="output folder (default gpu_check_results/<UTC timestamp>)")
    ap.add_argument("--only", default=",".join(STEPS), help=f"steps to do, comma-separated: {', '.join(STEPS)}")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)), help="bench batch sizes (default 1,8,32,128)")
    ap.add_argument("--precisions", default=",".join(PRECISIONS), help="bench precisions (default fp32,fp16)")
    ap.add_argument("--bench-work", help="where the bench's exports are cached (default OUT/bench_work)")
    ap.add_argument("--tests", nargs="+", default=[str(REPO / "tests")], help="test folders or files to select from")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds allowed to each command (default 3600)")
    ap.add_argument("--collect", nargs="*", help=argparse.SUPPRESS)  # the child process of select_gpu_tests
    args = ap.parse_args(argv)
    if args.collect is not None:
        return collect(args.collect)

    try:
        batches = [int(b) for b in args.batches.split(",") if b]
    except ValueError:
        batches = []
    if not batches or min(batches) < 1:
        print(f"gpu_check: error: --batches {args.batches!r} is not a list of positive integers like 1,8,32",
              file=sys.stderr)
        return 2
    steps = [s for s in args.only.split(",") if s]
    unknown = sorted(set(steps) - set(STEPS))
    if unknown:
        print(f"gpu_check: error: unknown step(s) {', '.join(unknown)}; choose from {', '.join(STEPS)}",
              file=sys.stderr)
        return 2
    started = dt.datetime.now(dt.timezone.utc)
    out = Path(args.out or REPO / "gpu_check_results" / started.strftime("%Y%m%dT%H%M%SZ")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = probe()
    dry = "--dry-run" if args.dry_run else (None if cuda_found(env) else "no CUDA device found")
    result: dict = {"started": started.isoformat(timespec="seconds"), "command": shlex.join(sys.argv),
                    "out": str(out), "dry_run": dry, "environment": env, "device": env["device_line"]}
    if "tests" in steps:
        selected, error = select_gpu_tests([Path(p) for p in args.tests])
        result["tests"] = {"selected": selected, "command": test_command(selected, out), "error": error}
    if "ngram" in steps:
        result["ngram"] = ngram_commands(env, out)
    if "search" in steps:
        result["search"] = search_commands()
    if "bench" in steps:
        result["bench"] = bench_runs(env, out, Path(args.bench_work).resolve() if args.bench_work
                                     else out / "bench_work", batches, bench_has_precision(),
                                     [p for p in args.precisions.split(",") if p in PRECISIONS])
    print_plan(result)
    if dry:  # never over a real run's results in the same folder
        write_results(out, result, "dry_run" if previous_results(out) else "")
        return 0
    result = {**previous_results(out), **result}  # steps of an earlier call with the same --out are kept
    write_results(out, result)  # after each step too: a run stopped midway leaves what it has measured
    failed = False
    if result.get("tests") and result["tests"]["selected"] and "tests" in steps:
        result["tests"].update(run_tests(result["tests"], out, args.timeout))
        failed |= result["tests"]["rc"] != 0
        write_results(out, result)
    for step in ("ngram", "search"):
        if step in steps:
            result[step] = run_commands(step, result[step], out, args.timeout, first_needed=step == "ngram")
            failed |= any(s["rc"] != 0 for s in result[step])
            write_results(out, result)
    if "bench" in steps:
        for run in run_bench(result["bench"], out, args.timeout):
            failed |= run.get("rc", 0) != 0
            write_results(out, result)
    return 1 if failed else 0


def previous_results(out: Path) -> dict:
    """The steps recorded by an earlier call with this output folder (``--only`` splits a check into calls)."""
    try:
        earlier = json.loads((out / "results.json").read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in earlier.items() if k in STEPS and not earlier.get("dry_run")}


def write_results(out: Path, result: dict, prefix: str = "") -> None:
    """``summary.md`` and ``results.json`` (``<prefix>_summary.md`` ... with a prefix)."""
    result["finished"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    summary, data = (out / f"{prefix}{'_' if prefix else ''}{name}" for name in ("summary.md", "results.json"))
    data.write_text(json.dumps(result, indent=1, default=str) + "\n")
    summary.write_text(summary_markdown(result))
    print(f"wrote {summary} and {data}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
