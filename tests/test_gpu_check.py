"""tools/gpu_check.sh on this CPU machine: a dry run that lists the GPU tests (from their skip markers), the
kernel benchmark and the ``elx bench --device cuda`` runs, writes only its output folder and exits 0."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tools_loader import load_tool

REPO = Path(__file__).resolve().parents[1]
gpu_check = load_tool("gpu_check")

NEW_GPU_TEST = '''
import pytest

@pytest.mark.skipif(True, reason="needs a CUDA GPU")
def test_new_on_the_gpu():
    pass

@pytest.mark.skipif(True, reason="set ELX_LONG_TESTS=1")
def test_long_on_the_cpu():
    pass
'''


def _files(root: Path, skip: Path | None = None) -> dict:
    """Every file under ``root`` (not .git, not ``skip``) with its size and modification time."""
    found = {}
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d != ".git" and Path(folder, d) != skip]
        for name in names:
            path = Path(folder, name)
            stat = path.lstat()
            found[str(path)] = (stat.st_size, stat.st_mtime_ns)
    return found


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    if gpu_check.cuda_found(gpu_check.probe()):
        pytest.skip("a CUDA device is here: tools/gpu_check.sh would run for real")
    root = tmp_path_factory.mktemp("gpu_check")
    extra = root / "extra"
    extra.mkdir()
    (extra / "test_new_gpu.py").write_text(NEW_GPU_TEST)
    out = root / "out"
    before = _files(REPO)
    done = subprocess.run(["bash", str(REPO / "tools" / "gpu_check.sh"), "--out", str(out), "--tests",
                           str(REPO / "tests"), str(extra)], capture_output=True, text=True, timeout=300,
                          cwd=REPO, env=dict(os.environ, PYTHON=sys.executable))
    return done, out, before, _files(REPO)


def test_dry_run_exits_zero_and_says_why(dry_run):
    done, out, _, _ = dry_run
    assert done.returncode == 0, done.stdout + done.stderr
    assert "dry run: no CUDA device found" in done.stdout
    result = json.loads((out / "results.json").read_text())
    assert result["dry_run"] == "no CUDA device found" and "device" in result
    assert "Dry run" in (out / "summary.md").read_text()


def test_lists_the_tests_that_skip_for_want_of_a_gpu(dry_run):
    done, out, _, _ = dry_run
    selected = {t["nodeid"] for t in json.loads((out / "results.json").read_text())["tests"]["selected"]}
    kernel = {n for n in selected if "test_ngram_plugin.py::test_kernel_matches_reference[" in n}
    assert len(kernel) == 10  # 5 n-gram sizes × 2 score types, from the module's needs_gpu skipif
    assert any("test_tensorrt_backend.py::test_engines_match_onnx_runtime[" in n for n in selected)
    new = [n for n in selected if n.endswith("test_new_gpu.py::test_new_on_the_gpu")]
    assert len(new) == 1  # a new test picked up by its skip reason alone
    assert not any(n.endswith("test_long_on_the_cpu") for n in selected)
    assert not any("test_tensorrt_build.py" in n for n in selected)  # engines build on the CPU: CI runs them
    for nodeid in selected:  # every one printed, with the pytest command that would run them
        assert nodeid in done.stdout
    assert "-m pytest -q -p no:cacheprovider -rA --basetemp" in done.stdout


def test_lists_the_kernel_bench_and_every_cuda_bench(dry_run):
    done, _, _, _ = dry_run
    lines = done.stdout.splitlines()
    assert any("tools/build_plugin.py" in line and "--target kernel" in line for line in lines)
    assert sum("tools/bench_ngram_kernel.py" in line for line in lines) == 2  # fp32, fp16
    fp16_flag = gpu_check.bench_has_precision()
    for batch in gpu_check.BATCHES:
        for precision in gpu_check.PRECISIONS:
            [line] = [ln for ln in lines if ln.startswith(f"[bench] ort {precision} batch {batch}:")]
            if precision == "fp16" and not fp16_flag:
                assert "not supported: elx bench has no --precision option" in line
                continue
            assert "-m elx bench --device cuda --backend ort --model t5-base --random-init" in line
            assert f"--batch-size {batch}" in line and "--num-beams 4" in line and "'baseline|el'" in line


def test_writes_nothing_outside_its_output_folder(dry_run):
    _, out, before, after = dry_run
    assert after == before
    assert sorted(p.name for p in out.iterdir()) == ["results.json", "summary.md"]


def test_wheel_pieces_split_and_join_back_exactly(tmp_path):
    script = str(REPO / "tools" / "wheel_pieces.sh")
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    wheel.write_bytes(os.urandom(2500))
    env = dict(os.environ, PIECE_BYTES="1000")
    split = subprocess.run(["bash", script, "split", str(wheel), str(tmp_path / "pieces")], env=env,
                           capture_output=True, text=True)
    assert split.returncode == 0, split.stderr
    pieces = sorted((tmp_path / "pieces").glob("*.part-*"))
    assert [p.stat().st_size for p in pieces] == [1000, 1000, 500]
    joined = subprocess.run(["bash", script, "join", str(tmp_path / "pieces"), str(tmp_path / "out")],
                            capture_output=True, text=True)
    assert joined.returncode == 0, joined.stderr
    assert (tmp_path / "out" / wheel.name).read_bytes() == wheel.read_bytes()
    pieces[1].unlink()  # a lost piece: refused, and no damaged wheel is left behind
    lost = subprocess.run(["bash", script, "join", str(tmp_path / "pieces"), str(tmp_path / "bad")],
                          capture_output=True, text=True)
    assert lost.returncode == 2 and "a piece is missing or damaged" in lost.stderr
    assert list((tmp_path / "bad").iterdir()) == []


def test_lists_the_search_step_on_the_gpu(dry_run):
    done, _, _, _ = dry_run
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("[search] ")]
    assert len(lines) == len(gpu_check.SEARCH_BATCHES)
    for batch, line in zip(gpu_check.SEARCH_BATCHES, lines):
        assert "tools/measure_search_host.py --device cuda --path both" in line and f"--batch-size {batch}" in line


def test_refuses_the_ort_bench_on_a_gpu_without_the_cuda_provider():
    """On a GPU machine whose onnxruntime is the CPU build the ORT rows say why instead of failing after an
    export; a dry run without a GPU, or onnxruntime-gpu, lists them."""
    gpu = {"device_line": "GPU 0: H200", "nvcc": None, "tensorrt": None, "tensorrt_rtx": None,
           "torch": {"cuda": True, "capability": "9.0"}, "cupy": {"devices": 1},
           "onnxruntime": {"version": "1.30.0", "providers": ["CPUExecutionProvider"]}}
    assert "no CUDAExecutionProvider" in gpu_check._ort_refusal(gpu)
    runs = gpu_check.bench_runs(gpu, Path("o"), Path("w"), [8], True)
    assert runs and all("no CUDAExecutionProvider" in r["unsupported"] for r in runs if r["backend"] == "ort")
    with_gpu_wheel = {**gpu, "onnxruntime": {"version": "1.30.0", "providers": ["CUDAExecutionProvider"]}}
    assert gpu_check._ort_refusal(with_gpu_wheel) is None
    no_gpu = {**gpu, "torch": {"cuda": False}, "cupy": {"devices": 0}}
    assert gpu_check._ort_refusal(no_gpu) is None
