#!/usr/bin/env python3
"""Time the n-gram blocking CUDA kernel against the CPU references and print a table.

    python tools/bench_ngram_kernel.py [--lib build/libelx_ngram_kernel.so] [--repeats 50]

Columns (milliseconds per call):
  gpu          ngramRepeatBlockLaunch on device data (CUDA events, averaged over --repeats launches)
  cpu_numpy    elx.runners.search.ngram_reference.block_ngrams_inplace on host data
  cpu+copy     what a host implementation costs inside a GPU decoder: device->host copy of history
               and scores, block_ngrams_inplace, host->device copy of the scores
  cpu_python   the plain-Python reference block_ngrams (only with --python, small cases)
Every GPU result is checked for exact equality with cpu_numpy.

Needs torch with CUDA (or cupy) and nvcc for the kernel library (built with tools/build_plugin.py
--target kernel unless --lib is given).  Without a GPU only the CPU columns are printed.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from elx.runners.search.ngram_reference import block_ngrams, block_ngrams_inplace  # noqa: E402

CONFIGS = [
    # rows, cur_len, vocab, n
    (16, 128, 32128, 3),
    (64, 256, 32128, 3),
    (256, 200, 32128, 2),
    (64, 1024, 50265, 3),
    (128, 1024, 50265, 3),
    (64, 3000, 50000, 3),
    (32, 8000, 32000, 4),
]


def _history(rng, rows, cur_len, n, alphabet=200):
    h = rng.integers(0, alphabet, size=(rows, cur_len), dtype=np.int64)
    for r in range(rows):
        if cur_len > 2 * n:
            src = int(rng.integers(0, cur_len - 2 * n))
            h[r, cur_len - n + 1:] = h[r, src:src + n - 1]
    return h


def _time_cpu(fn, repeats):
    fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats * 1e3


def _fmt(ms: float, width: int, digits: int = 4) -> str:
    return f"{'-':>{width}}" if ms != ms else f"{ms:>{width}.{digits}f}"


def _load_kernel(lib_arg):
    if lib_arg:
        path = Path(lib_arg)
    else:
        spec = importlib.util.spec_from_file_location("elx_build_plugin", REPO / "tools" / "build_plugin.py")
        bp = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bp)
        import torch

        major, minor = torch.cuda.get_device_capability()
        path = bp.build(REPO / "build" / "plugins_cuda", target="kernel", arch=f"{major}{minor}")
    lib = ctypes.CDLL(str(path))
    f = lib.ngramRepeatBlockLaunch
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                  ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p]
    return f


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lib", help="prebuilt libelx_ngram_kernel.so (or the plugin library)")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--fp16", action="store_true", help="float16 scores (default float32)")
    ap.add_argument("--python", action="store_true", help="also time the plain-Python reference")
    args = ap.parse_args(argv)

    try:
        import torch

        gpu = torch.cuda.is_available()
    except ImportError:
        torch, gpu = None, False
    launch = _load_kernel(args.lib) if gpu else None
    if not gpu:
        print("no CUDA device: printing CPU timings only")
    else:
        print(f"device: {torch.cuda.get_device_name()}")

    dtype = np.float16 if args.fp16 else np.float32
    rng = np.random.default_rng(0)
    header = f"{'rows':>5} {'cur_len':>7} {'vocab':>6} {'n':>2} | {'gpu':>9} {'cpu_numpy':>9} {'cpu+copy':>9} {'cpu_python':>10} {'speedup':>8}"
    print(f"scores {np.dtype(dtype).name}, ms per call")
    print(header)
    print("-" * len(header))
    for rows, cur_len, vocab, n in CONFIGS:
        hist = _history(rng, rows, cur_len, n)
        scores = rng.standard_normal((rows, vocab)).astype(dtype)
        expected = block_ngrams_inplace(hist, scores.copy(), n)
        work = scores.copy()
        cpu_ms = _time_cpu(lambda: block_ngrams_inplace(hist, work, n), args.repeats)
        py_ms = float("nan")
        if args.python and rows * cur_len <= 64 * 1024:
            py_ms = _time_cpu(lambda: block_ngrams(hist, scores, n), max(1, args.repeats // 10))
        gpu_ms = copy_ms = float("nan")
        if gpu:
            d_hist = torch.from_numpy(hist).cuda()
            d_scores = torch.from_numpy(scores).cuda()
            sc_type = 1 if dtype == np.float16 else 0
            torch.cuda.synchronize()
            status = launch(d_hist.data_ptr(), 0, d_scores.data_ptr(), sc_type, rows, cur_len, vocab, n, None)
            torch.cuda.synchronize()
            if status != 0:
                print(f"kernel launch failed with CUDA error {status}")
                return 1
            if not np.array_equal(d_scores.cpu().numpy(), expected):
                print(f"MISMATCH for rows={rows} cur_len={cur_len} vocab={vocab} n={n}")
                return 1
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.repeats):
                launch(d_hist.data_ptr(), 0, d_scores.data_ptr(), sc_type, rows, cur_len, vocab, n, None)
            end.record()
            torch.cuda.synchronize()
            gpu_ms = start.elapsed_time(end) / args.repeats

            def host_roundtrip():
                h = d_hist.cpu().numpy()
                s = d_scores.cpu().numpy()
                block_ngrams_inplace(h, s, n)
                d_scores.copy_(torch.from_numpy(s))
                torch.cuda.synchronize()

            copy_ms = _time_cpu(host_roundtrip, max(1, args.repeats // 5))
        speedup = f"{copy_ms / gpu_ms:.1f}x" if gpu else "-"
        print(f"{rows:>5} {cur_len:>7} {vocab:>6} {n:>2} | {_fmt(gpu_ms, 9)} {_fmt(cpu_ms, 9)} {_fmt(copy_ms, 9)} "
              f"{_fmt(py_ms, 10, 3)} {speedup:>8}")
    if gpu:
        print("speedup = cpu+copy / gpu")
    return 0


if __name__ == "__main__":
    sys.exit(main())
