"""NGramRepeatBlock: build with nvcc, TensorRT plugin lifecycle without a GPU, kernel on a GPU.

(a) tools/build_plugin.py compiles plugins_cuda/ (skipped when nvcc or TensorRT headers are missing;
    `pip install kernel-lens` provides the headers).
(b) The plugin library is loaded with ctypes and driven through its C++ interfaces by a small shim
    (plugins_cuda/tests/lifecycle_shim.cpp), as TensorRT would; no TensorRT library, no GPU.
(c) On a machine with CUDA (torch.cuda or cupy), the kernel and the plugin's enqueue must agree
    exactly with the CPU reference exporter/plugins/ngram_reference.py; skipped otherwise.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from elx.runners.search.ngram_reference import banned_tokens, block_ngrams_inplace

REPO = Path(__file__).resolve().parents[1]
BUILD_SCRIPT = REPO / "tools" / "build_plugin.py"

_spec = importlib.util.spec_from_file_location("elx_build_plugin", BUILD_SCRIPT)
bp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bp)

# nvinfer1::DataType / PluginFieldType values (NvInferRuntimeBase.h, NvInferPluginBase.h)
DT_FLOAT, DT_HALF, DT_INT8, DT_INT32, DT_BOOL, DT_BF16, DT_INT64 = 0, 1, 2, 3, 4, 7, 8
PF_FLOAT32, PF_INT32, PF_INT64 = 1, 5, 10
# ngram_repeat_block.h
TOK_INT64, TOK_INT32 = 0, 1
SC_F32, SC_F16 = 0, 1
MEM_AUTO, MEM_SHARED, MEM_GLOBAL = 0, 1, 2
CUDA_ERROR_INVALID_VALUE = 1


# --------------------------------------------------------------------------------------------------
# GPU detection (torch.cuda, else cupy) -- never fails on a CPU-only machine


def _cuda_backend():
    try:
        import torch

        if torch.cuda.is_available():
            return "torch"
    except Exception:
        pass
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            return "cupy"
    except Exception:
        pass
    return None


CUDA_BACKEND = _cuda_backend()


def _test_archs() -> str:
    """Compile for the local GPU only (fast); without a GPU one arch is enough to check the build."""
    if CUDA_BACKEND == "torch":
        import torch

        major, minor = torch.cuda.get_device_capability()
        return f"{major}{minor}"
    if CUDA_BACKEND == "cupy":
        import cupy

        return str(cupy.cuda.Device().compute_capability)
    return "80"


# --------------------------------------------------------------------------------------------------
# (a) build


def _require_toolchain(need_trt: bool):
    try:
        bp.find_nvcc()
    except bp.BuildError as e:
        pytest.skip(f"nvcc unavailable: {e}")
    if need_trt:
        try:
            bp.find_trt_include()
        except bp.BuildError as e:
            pytest.skip(f"TensorRT headers unavailable: {e}")


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("ngram_plugin_build")


@pytest.fixture(scope="module")
def plugin_lib(build_dir) -> Path:
    _require_toolchain(need_trt=True)
    # compile errors are failures, not skips
    shim = bp.build(build_dir, target="shim", arch=_test_archs())
    assert shim.name == bp.SHIM_LIB and shim.is_file()
    lib = build_dir / bp.PLUGIN_LIB
    assert lib.is_file()
    return lib


@pytest.fixture(scope="module")
def kernel_lib(build_dir) -> Path:
    _require_toolchain(need_trt=False)
    lib = bp.build(build_dir, target="kernel", arch=_test_archs())
    assert lib.is_file()
    return lib


def test_cli_prints_library_path(plugin_lib):
    out = subprocess.run(
        [sys.executable, str(BUILD_SCRIPT), "--output", str(plugin_lib.parent), "--arch", _test_archs()],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip().splitlines()[-1]) == plugin_lib


def test_cli_one_line_errors(tmp_path):
    # NVCC points at some executable so that the header lookup is reached even without nvcc
    env = dict(os.environ, TRT_INCLUDE_DIR=str(tmp_path / "missing"), NVCC=sys.executable)
    out = subprocess.run([sys.executable, str(BUILD_SCRIPT), "--output", str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "TRT_INCLUDE_DIR" in out.stderr
    env = dict(os.environ, NVCC=str(tmp_path / "no-nvcc"))
    out = subprocess.run([sys.executable, str(BUILD_SCRIPT), "--output", str(tmp_path), "--target", "kernel"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "nvcc" in out.stderr
    assert not list(tmp_path.glob("*.so"))


def test_header_search_order(tmp_path, monkeypatch):
    fake = tmp_path / "trt"
    fake.mkdir()
    (fake / "NvInferRuntime.h").write_text("// fake\n")
    (fake / "NvInferVersion.h").write_text("#define TRT_MAJOR_ENTERPRISE 10\n#define TRT_MINOR_ENTERPRISE 3\n")
    monkeypatch.setenv("TRT_INCLUDE_DIR", str(fake))
    assert bp.find_trt_include() == str(fake)
    (fake / "NvInferVersion.h").write_text("#define NV_TENSORRT_MAJOR 8\n")
    with pytest.raises(bp.BuildError, match=">= 10"):
        bp.find_trt_include()


# --------------------------------------------------------------------------------------------------
# (b) plugin lifecycle through the shim (no GPU, no TensorRT library)


class CreatorInfo(ctypes.Structure):
    _fields_ = [
        ("nbCreators", ctypes.c_int32), ("kind", ctypes.c_char * 64), ("kindMajor", ctypes.c_int32),
        ("name", ctypes.c_char * 64), ("version", ctypes.c_char * 16), ("pluginNamespace", ctypes.c_char * 64),
        ("nbFieldNames", ctypes.c_int32), ("fieldName", ctypes.c_char * 64), ("fieldType", ctypes.c_int32),
        ("fieldLength", ctypes.c_int32),
    ]


class PluginInfo(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_char * 64), ("kindMajor", ctypes.c_int32), ("coreKind", ctypes.c_char * 64),
        ("buildKind", ctypes.c_char * 64), ("runtimeKind", ctypes.c_char * 64), ("name", ctypes.c_char * 64),
        ("version", ctypes.c_char * 16), ("pluginNamespace", ctypes.c_char * 64), ("nbOutputs", ctypes.c_int32),
        ("nbFields", ctypes.c_int32), ("fieldName", ctypes.c_char * 64), ("fieldType", ctypes.c_int32),
        ("fieldLength", ctypes.c_int32), ("fieldValue", ctypes.c_int32), ("workspace", ctypes.c_int64),
    ]


def _load_shim(lib_dir: Path):
    shim = ctypes.CDLL(str(lib_dir / bp.SHIM_LIB))
    vp, i32, i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
    sigs = {
        "shim_creator_info": (ctypes.c_int, [ctypes.POINTER(CreatorInfo)]),
        "shim_create": (vp, [ctypes.c_char_p, i32, i64, i32, i32]),
        "shim_plugin_info": (ctypes.c_int, [vp, ctypes.POINTER(PluginInfo)]),
        "shim_clone": (vp, [vp]),
        "shim_attach": (vp, [vp]),
        "shim_recreate_from_serialized": (vp, [vp]),
        "shim_destroy": (None, [vp]),
        "shim_output_type": (ctypes.c_int, [vp, i32, i32, ctypes.POINTER(i32)]),
        "shim_supports": (ctypes.c_int, [vp, i32, i32, i32, i32, i32]),
        "shim_output_shapes": (ctypes.c_int, [vp, i32, i32]),
        "shim_configure": (ctypes.c_int, [vp, i32, i32, i64, i64]),
        "shim_shape_change": (ctypes.c_int, [vp, i64, i64, i64, i64]),
        "shim_enqueue": (ctypes.c_int, [vp, i32, vp, i64, i64, i32, vp, vp, i64, vp]),
        "shim_last_error": (ctypes.c_char_p, []),
    }
    for name, (res, args) in sigs.items():
        fn = getattr(shim, name)
        fn.restype, fn.argtypes = res, args
    return shim


@pytest.fixture(scope="module")
def shim(plugin_lib):
    return _load_shim(plugin_lib.parent)


@pytest.fixture
def plugin3(shim):
    p = shim.shim_create(b"ngram_size", PF_INT32, 3, 1, 0)
    assert p, shim.shim_last_error()
    yield p
    shim.shim_destroy(p)


def _info(shim, p) -> PluginInfo:
    info = PluginInfo()
    assert shim.shim_plugin_info(p, ctypes.byref(info)) == 0
    return info


def test_library_exports_and_dependencies(plugin_lib):
    lib = ctypes.CDLL(str(plugin_lib))
    for sym in ("getCreators", "setLoggerFinder", "ngramRepeatBlockLaunch", "ngramRepeatBlockLaunchMode"):
        assert hasattr(lib, sym), sym
    readelf = shutil.which("readelf")
    if readelf:
        dyn = subprocess.run([readelf, "-d", str(plugin_lib)], capture_output=True, text=True).stdout
        needed = [ln for ln in dyn.splitlines() if "(NEEDED)" in ln]
        assert needed, dyn
        for bad in ("libnvinfer", "libcudart", "libcuda.so"):
            assert not any(bad in ln for ln in needed), needed


def test_creator(shim):
    info = CreatorInfo()
    assert shim.shim_creator_info(ctypes.byref(info)) == 0
    assert info.nbCreators == 1
    assert info.kind == b"PLUGIN CREATOR_V3ONE" and info.kindMajor == 1
    assert info.name == b"NGramRepeatBlock"
    assert info.version == b"1"
    assert info.pluginNamespace == b""
    assert info.nbFieldNames == 1
    assert (info.fieldName, info.fieldType, info.fieldLength) == (b"ngram_size", PF_INT32, 1)


def test_plugin_lifecycle(shim, plugin3):
    info = _info(shim, plugin3)
    assert (info.kind, info.kindMajor) == (b"PLUGIN", 1)
    assert info.coreKind == b"PLUGIN_V3ONE_CORE"
    assert info.buildKind == b"PLUGIN_V3ONE_BUILD"
    assert info.runtimeKind == b"PLUGIN_V3ONE_RUNTIME"
    assert (info.name, info.version, info.pluginNamespace) == (b"NGramRepeatBlock", b"1", b"")
    assert info.nbOutputs == 1 and info.workspace == 0
    assert (info.nbFields, info.fieldName, info.fieldType, info.fieldLength, info.fieldValue) == (
        1, b"ngram_size", PF_INT32, 1, 3)

    clone = shim.shim_clone(plugin3)
    attached = shim.shim_attach(plugin3)
    restored = shim.shim_recreate_from_serialized(plugin3)
    assert clone and attached and restored
    assert len({clone, attached, restored, plugin3}) == 4
    for other in (clone, attached, restored):
        assert _info(shim, other).fieldValue == 3
    # The clone's serialized field must not point into the original object.
    doomed = shim.shim_create(b"ngram_size", PF_INT32, 4, 1, 0)
    clone4 = shim.shim_clone(doomed)
    shim.shim_destroy(doomed)
    assert _info(shim, clone4).fieldValue == 4
    for other in (clone, attached, restored, clone4):
        shim.shim_destroy(other)


def test_create_variants_and_errors(shim):
    p = shim.shim_create(b"ngram_size", PF_INT64, 5, 1, 1)  # int64 field, runtime phase
    assert p
    assert _info(shim, p).fieldValue == 5
    shim.shim_destroy(p)
    p = shim.shim_create(b"ngram_size", PF_INT32, 1, 1, 0)  # n = 1 is valid
    assert p
    shim.shim_destroy(p)

    for value in (0, -2):
        assert not shim.shim_create(b"ngram_size", PF_INT32, value, 1, 0)
        assert b"ngram_size must be >= 1" in shim.shim_last_error()
    assert not shim.shim_create(b"ngram_size", PF_INT32, 3, 0, 0)
    assert b"missing required field ngram_size" in shim.shim_last_error()
    assert not shim.shim_create(b"ngram", PF_INT32, 3, 1, 0)
    assert b"missing required field ngram_size" in shim.shim_last_error()
    assert not shim.shim_create(b"ngram_size", PF_FLOAT32, 3, 1, 0)
    assert b"int32" in shim.shim_last_error()


def test_build_interface(shim, plugin3):
    out = ctypes.c_int32(-1)
    assert shim.shim_output_type(plugin3, DT_INT64, DT_FLOAT, ctypes.byref(out)) == 0 and out.value == DT_FLOAT
    assert shim.shim_output_type(plugin3, DT_INT32, DT_HALF, ctypes.byref(out)) == 0 and out.value == DT_HALF
    assert shim.shim_output_type(plugin3, DT_INT64, DT_INT32, ctypes.byref(out)) != 0

    sup = shim.shim_supports
    assert sup(plugin3, 0, DT_INT64, DT_FLOAT, DT_FLOAT, 1) == 1
    assert sup(plugin3, 0, DT_INT32, DT_FLOAT, DT_FLOAT, 1) == 1
    assert sup(plugin3, 0, DT_FLOAT, DT_FLOAT, DT_FLOAT, 1) == 0
    assert sup(plugin3, 0, DT_INT64, DT_FLOAT, DT_FLOAT, 0) == 0  # not linear
    assert sup(plugin3, 1, DT_INT64, DT_FLOAT, DT_FLOAT, 1) == 1
    assert sup(plugin3, 1, DT_INT64, DT_HALF, DT_HALF, 1) == 1
    assert sup(plugin3, 1, DT_INT64, DT_BF16, DT_BF16, 1) == 0
    assert sup(plugin3, 1, DT_INT64, DT_INT32, DT_INT32, 1) == 0
    assert sup(plugin3, 2, DT_INT64, DT_HALF, DT_HALF, 1) == 1
    assert sup(plugin3, 2, DT_INT64, DT_HALF, DT_FLOAT, 1) == 0
    assert sup(plugin3, 2, DT_INT64, DT_FLOAT, DT_FLOAT, 1) == 1
    assert sup(plugin3, 3, DT_INT64, DT_FLOAT, DT_FLOAT, 1) == 0

    assert shim.shim_output_shapes(plugin3, 2, 2) == 1
    assert shim.shim_output_shapes(plugin3, 3, 2) == -1
    assert shim.shim_output_shapes(plugin3, 2, 1) == -1

    assert shim.shim_configure(plugin3, 2, 2, 8, 8) == 0
    assert shim.shim_configure(plugin3, 2, 2, -1, 8) == 0  # dynamic rows
    assert shim.shim_configure(plugin3, 2, 2, 8, 4) != 0
    assert shim.shim_configure(plugin3, 3, 2, 8, 8) != 0


def test_runtime_checks_without_gpu(shim, plugin3):
    assert shim.shim_shape_change(plugin3, 4, 10, 4, 100) == 0
    assert shim.shim_shape_change(plugin3, 4, 10, 5, 100) != 0
    assert b"rows" in shim.shim_last_error()
    # an unsupported history type is rejected before any CUDA call
    assert shim.shim_enqueue(plugin3, DT_FLOAT, None, 2, 5, DT_FLOAT, None, None, 7, None) != 0
    assert b"int64 or int32" in shim.shim_last_error()


def test_loads_and_runs_lifecycle_without_gpu(plugin_lib):
    """In a fresh process with no visible GPU: dlopen, full lifecycle, kernel launcher argument checks,
    and neither libnvinfer nor the CUDA driver/runtime libraries get mapped by loading."""
    script = textwrap.dedent(
        f"""
        import ctypes, sys
        sys.modules["torch"] = sys.modules["cupy"] = None  # keep their CUDA libraries out of this process
        sys.path.insert(0, {str(REPO)!r})
        from tests.test_ngram_plugin import _load_shim, CreatorInfo, CUDA_BACKEND
        assert CUDA_BACKEND is None
        from pathlib import Path
        shim = _load_shim(Path({str(plugin_lib.parent)!r}))
        info = CreatorInfo()
        assert shim.shim_creator_info(ctypes.byref(info)) == 0 and info.name == b"NGramRepeatBlock"
        p = shim.shim_create(b"ngram_size", 5, 3, 1, 0)
        c = shim.shim_clone(p)
        assert p and c
        shim.shim_destroy(p); shim.shim_destroy(c)
        maps = open("/proc/self/maps").read()
        for bad in ("libnvinfer", "libcudart", "libcuda.so"):
            assert bad not in maps, bad
        lib = ctypes.CDLL({str(plugin_lib)!r})
        f = lib.ngramRepeatBlockLaunchMode
        f.restype = ctypes.c_int
        f.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64,
                      ctypes.c_int64, ctypes.c_int64, ctypes.c_int32, ctypes.c_int, ctypes.c_void_p]
        fake = ctypes.c_void_p(4096)
        assert f(fake, 0, fake, 0, 2, 10, 50, 0, 0, None) == {CUDA_ERROR_INVALID_VALUE}   # n = 0
        assert f(fake, 0, fake, 2, 2, 10, 50, 3, 0, None) == {CUDA_ERROR_INVALID_VALUE}   # bad score type
        assert f(fake, 0, fake, 0, 2, 2, 50, 3, 0, None) == 0      # cur_len < n: nothing to do
        assert f(fake, 0, fake, 0, 2, 7000, 50, 3, 1, None) == {CUDA_ERROR_INVALID_VALUE}  # too long for shared
        assert f(fake, 0, fake, 0, 2, 10, 50, 3, 0, None) not in (0, {CUDA_ERROR_INVALID_VALUE})  # no device
        g = lib.ngramRepeatBlockMaxSharedTokens
        g.restype = ctypes.c_int64
        assert (g(0), g(1), g(9)) == (6144, 12288, -1)
        print("OK")
        """
    )
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120,
                         cwd=str(REPO))
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stdout + out.stderr


# --------------------------------------------------------------------------------------------------
# (c) GPU: kernel and plugin enqueue vs the CPU reference

needs_gpu = pytest.mark.skipif(CUDA_BACKEND is None, reason="no CUDA device (torch.cuda / cupy)")


class Device:
    """Minimal device-array helper over torch.cuda or cupy."""

    def __init__(self, backend):
        self.backend = backend
        if backend == "torch":
            import torch

            self.torch = torch
        else:
            import cupy

            self.cupy = cupy

    def put(self, array: np.ndarray):
        if self.backend == "torch":
            return self.torch.from_numpy(np.ascontiguousarray(array)).cuda()
        return self.cupy.asarray(np.ascontiguousarray(array))

    def ptr(self, arr) -> int:
        return arr.data_ptr() if self.backend == "torch" else arr.data.ptr

    def get(self, arr) -> np.ndarray:
        return arr.cpu().numpy() if self.backend == "torch" else self.cupy.asnumpy(arr)

    def sync(self):
        if self.backend == "torch":
            self.torch.cuda.synchronize()
        else:
            self.cupy.cuda.runtime.deviceSynchronize()


def _launcher(lib_path: Path):
    lib = ctypes.CDLL(str(lib_path))
    f = lib.ngramRepeatBlockLaunchMode
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                  ctypes.c_int64, ctypes.c_int32, ctypes.c_int, ctypes.c_void_p]
    return f


def _history(rng, rows, cur_len, alphabet, n):
    h = rng.integers(0, alphabet, size=(rows, cur_len), dtype=np.int64)
    for r in range(rows):  # plant a repeat of the suffix in most rows
        if cur_len > 2 * n and rng.random() < 0.8:
            src = int(rng.integers(0, cur_len - 2 * n))
            h[r, cur_len - n + 1:] = h[r, src:src + n - 1]
    return h


GPU_CASES = [
    # rows, cur_len, vocab, alphabet
    (1, 0, 17, 5),
    (3, 4, 17, 3),
    (8, 60, 1000, 6),
    (16, 1024, 32128, 50),
    (5, 1500, 700, 4),       # more windows than 1024 threads, few distinct tokens
    (64, 3000, 50000, 2000),
    (4, 7000, 500, 8),       # does not fit 48 KiB of shared memory as int64: global-memory path
]


@needs_gpu
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("score_dtype", [np.float32, np.float16])
def test_kernel_matches_reference(kernel_lib, n, score_dtype):
    dev = Device(CUDA_BACKEND)
    launch = _launcher(kernel_lib)
    rng = np.random.default_rng(1000 + n)
    sc_type = SC_F32 if score_dtype == np.float32 else SC_F16
    for rows, cur_len, vocab, alphabet in GPU_CASES:
        hist = _history(rng, rows, cur_len, alphabet, n)
        if cur_len:
            hist[0, 0] = vocab + 3  # out-of-vocab ids are ignored
        scores = rng.standard_normal((rows, vocab)).astype(score_dtype)
        t0 = time.perf_counter()
        expected = block_ngrams_inplace(hist, scores.copy(), n)
        cpu_s = time.perf_counter() - t0
        if rows * cur_len <= 2000:
            assert [set(np.flatnonzero(np.isneginf(expected[r]))) for r in range(rows)] == [
                {t for t in b if 0 <= t < vocab} for b in banned_tokens(hist, n)]
        for tok_dtype, tok_type in ((np.int64, TOK_INT64), (np.int32, TOK_INT32)):
            d_hist = dev.put(hist.astype(tok_dtype))
            modes = [MEM_AUTO, MEM_GLOBAL]
            if cur_len * np.dtype(tok_dtype).itemsize <= 48 * 1024:
                modes.append(MEM_SHARED)
            for mode in modes:
                d_scores = dev.put(scores)
                dev.sync()
                t0 = time.perf_counter()
                status = launch(dev.ptr(d_hist), tok_type, dev.ptr(d_scores), sc_type, rows, cur_len, vocab, n,
                                mode, None)
                dev.sync()
                gpu_s = time.perf_counter() - t0
                assert status == 0, (status, rows, cur_len, vocab, mode)
                np.testing.assert_array_equal(dev.get(d_scores), expected,
                                              err_msg=f"rows={rows} cur_len={cur_len} n={n} mode={mode}")
            if cur_len * np.dtype(tok_dtype).itemsize > 48 * 1024:
                assert launch(dev.ptr(d_hist), tok_type, dev.ptr(d_scores), sc_type, rows, cur_len, vocab, n,
                              MEM_SHARED, None) == CUDA_ERROR_INVALID_VALUE
        print(f"n={n} {np.dtype(score_dtype).name} rows={rows} cur_len={cur_len} vocab={vocab}: "
              f"cpu {cpu_s * 1e3:.3f} ms, gpu (last launch incl. sync) {gpu_s * 1e3:.3f} ms")


@needs_gpu
@pytest.mark.parametrize("score_dtype,dt_scores", [(np.float32, DT_FLOAT), (np.float16, DT_HALF)])
@pytest.mark.parametrize("tok_dtype,dt_tokens", [(np.int64, DT_INT64), (np.int32, DT_INT32)])
def test_plugin_enqueue_matches_reference(shim, score_dtype, dt_scores, tok_dtype, dt_tokens):
    dev = Device(CUDA_BACKEND)
    rng = np.random.default_rng(7)
    n, rows, cur_len, vocab = 3, 12, 2500, 30000
    plugin = shim.shim_create(b"ngram_size", PF_INT32, n, 1, 1)
    assert plugin
    try:
        hist = _history(rng, rows, cur_len, 40, n)
        scores = rng.standard_normal((rows, vocab)).astype(score_dtype)
        expected = block_ngrams_inplace(hist, scores.copy(), n)
        d_hist, d_scores = dev.put(hist.astype(tok_dtype)), dev.put(scores)
        d_out = dev.put(np.zeros_like(scores))
        dev.sync()
        status = shim.shim_enqueue(plugin, dt_tokens, dev.ptr(d_hist), rows, cur_len, dt_scores,
                                   dev.ptr(d_scores), dev.ptr(d_out), vocab, None)
        dev.sync()
        assert status == 0, shim.shim_last_error()
        np.testing.assert_array_equal(dev.get(d_out), expected)
        np.testing.assert_array_equal(dev.get(d_scores), scores)  # input untouched
        # in place (output aliases the scores input)
        status = shim.shim_enqueue(plugin, dt_tokens, dev.ptr(d_hist), rows, cur_len, dt_scores,
                                   dev.ptr(d_scores), dev.ptr(d_scores), vocab, None)
        dev.sync()
        assert status == 0
        np.testing.assert_array_equal(dev.get(d_scores), expected)
    finally:
        shim.shim_destroy(plugin)
