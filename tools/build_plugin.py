#!/usr/bin/env python3
"""Build the NGramRepeatBlock TensorRT plugin (plugins_cuda/) with nvcc.

    python tools/build_plugin.py --output DIR [--target plugin|kernel|shim] [--arch 80,90] [--force]

Prints the path of the built shared library on stdout (last line).  Targets:

plugin  libelx_ngram_plugin.so: IPluginV3 plugin + kernel launcher; needs TensorRT headers.
kernel  libelx_ngram_kernel.so: only the kernel and its C launcher ``ngramRepeatBlockLaunch``
        (for ctypes/CuPy tests); needs no TensorRT headers.
shim    libelx_ngram_lifecycle_shim.so: the test shim of plugins_cuda/tests, linked against the
        plugin library (built as well, next to it).

TensorRT headers (NvInferRuntime.h, TensorRT >= 10 for IPluginV3) are searched in this order:
``$TRT_INCLUDE_DIR``; /usr/include/x86_64-linux-gnu, /usr/local/TensorRT/include,
/opt/tensorrt/include (and ``$TENSORRT_ROOT/include``, /usr/include); finally the headers shipped by
the PyPI package ``kernel-lens`` (``kernel_lens/include/tensorrt`` in site-packages).  They are used
in place, never copied.  nvcc is ``$NVCC``, ``$CUDACXX``, ``nvcc`` on PATH, ``$CUDA_HOME/bin/nvcc``
or the newest /usr/local/cuda*/bin/nvcc.  CUDA architectures: ``--arch``, else ``$ELX_CUDA_ARCHS``
(comma-separated, e.g. ``80,90``), else a default list with PTX for newer GPUs.

The library links the CUDA runtime statically (nvcc's default) and calls no TensorRT function, so
loading it needs neither libnvinfer nor libcudart nor a GPU.  Any failure is one line on stderr,
exit status 2.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "plugins_cuda"
KERNEL_SOURCES = [SRC / "ngram_repeat_block.cu"]
PLUGIN_SOURCES = KERNEL_SOURCES + [SRC / "ngram_plugin.cpp"]
SHIM_SOURCE = SRC / "tests" / "lifecycle_shim.cpp"
HEADERS = [SRC / "ngram_repeat_block.h", SRC / "ngram_plugin.h"]

PLUGIN_LIB = "libelx_ngram_plugin.so"
KERNEL_LIB = "libelx_ngram_kernel.so"
SHIM_LIB = "libelx_ngram_lifecycle_shim.so"

# SASS for Turing..Blackwell (nvcc 13 dropped anything older than sm_75) and PTX of the newest one
# so that later GPUs can JIT-compile it.
DEFAULT_ARCHS = ["75", "80", "86", "89", "90", "100", "120"]

STANDARD_TRT_DIRS = [
    "/usr/include/x86_64-linux-gnu",
    "/usr/local/TensorRT/include",
    "/opt/tensorrt/include",
]


class BuildError(RuntimeError):
    """A build prerequisite is missing or the compiler failed."""


def find_nvcc() -> str:
    for var in ("NVCC", "CUDACXX"):
        value = os.environ.get(var)
        if value:
            if shutil.which(value):
                return shutil.which(value)
            raise BuildError(f"${var}={value} is not an executable nvcc")
    on_path = shutil.which("nvcc")
    if on_path:
        return on_path
    candidates = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(os.path.join(os.environ[var], "bin", "nvcc"))
    candidates.append("/usr/local/cuda/bin/nvcc")
    candidates += sorted(glob.glob("/usr/local/cuda-*/bin/nvcc"), key=_version_key, reverse=True)
    for c in candidates:
        if os.access(c, os.X_OK):
            return c
    raise BuildError("nvcc not found (set $NVCC or $CUDA_HOME, or put nvcc on PATH)")


def _version_key(path: str):
    return [int(x) for x in re.findall(r"\d+", path)]


def find_cuda_include(nvcc: str) -> str | None:
    """Directory holding cuda_runtime_api.h next to this nvcc (nvcc adds it anyway; explicit here)."""
    candidates = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(os.path.join(os.environ[var], "include"))
    candidates.append(os.path.join(os.path.dirname(os.path.realpath(nvcc)), "..", "include"))
    # /usr/local/bin/nvcc is often a wrapper script around a versioned install: ask the script.
    try:
        text = Path(nvcc).read_text(errors="ignore")[:4096]
        for m in re.findall(r"(/\S+?)/bin/nvcc", text):
            candidates.append(os.path.join(m, "include"))
    except OSError:
        pass
    candidates.append("/usr/local/cuda/include")
    candidates += sorted(glob.glob("/usr/local/cuda-*/include"), key=_version_key, reverse=True)
    for c in candidates:
        if os.path.isfile(os.path.join(c, "cuda_runtime_api.h")):
            return os.path.normpath(c)
    return None


def _kernel_lens_dirs() -> list[str]:
    dirs = []
    try:
        spec = importlib.util.find_spec("kernel_lens")  # locates the package without importing it
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            dirs.append(os.path.join(loc, "include", "tensorrt"))
    for p in sys.path:
        if p and os.path.isdir(p):
            dirs.append(os.path.join(p, "kernel_lens", "include", "tensorrt"))
    return dirs


def trt_header_version(include_dir: str) -> tuple[int, int, int] | None:
    try:
        text = Path(include_dir, "NvInferVersion.h").read_text(errors="ignore")
    except OSError:
        return None
    nums = []
    for part in ("MAJOR", "MINOR", "PATCH"):
        m = re.search(rf"#define\s+TRT_{part}_\w+\s+(\d+)", text) or re.search(
            rf"#define\s+NV_TENSORRT_{part}\s+(\d+)", text
        )
        nums.append(int(m.group(1)) if m else 0)
    return tuple(nums)


def find_trt_include() -> str:
    explicit = os.environ.get("TRT_INCLUDE_DIR")
    if explicit:
        if not os.path.isfile(os.path.join(explicit, "NvInferRuntime.h")):
            raise BuildError(f"$TRT_INCLUDE_DIR={explicit} has no NvInferRuntime.h")
        candidates = [explicit]
    else:
        candidates = list(STANDARD_TRT_DIRS)
        if os.environ.get("TENSORRT_ROOT"):
            candidates.insert(0, os.path.join(os.environ["TENSORRT_ROOT"], "include"))
        candidates.append("/usr/include")
        candidates += _kernel_lens_dirs()
    for c in candidates:
        if os.path.isfile(os.path.join(c, "NvInferRuntime.h")):
            version = trt_header_version(c)
            if version is not None and version[0] < 10:
                if explicit:
                    raise BuildError(f"TensorRT headers in {c} are {version}; IPluginV3 needs TensorRT >= 10")
                continue
            return os.path.normpath(c)
    raise BuildError(
        "TensorRT headers (NvInferRuntime.h, TensorRT >= 10) not found: set $TRT_INCLUDE_DIR "
        "or `pip install kernel-lens`"
    )


def _arch_flags(archs: list[str]) -> list[str]:
    flags = []
    for a in archs:
        flags += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    newest = max(archs, key=int)
    flags += ["-gencode", f"arch=compute_{newest},code=compute_{newest}"]
    return flags


def _parse_archs(arch: str | None) -> list[str]:
    text = arch or os.environ.get("ELX_CUDA_ARCHS") or ""
    archs = [a.strip().replace("sm_", "").replace(".", "") for a in re.split(r"[,; ]+", text) if a.strip()]
    for a in archs:
        if not a.isdigit():
            raise BuildError(f"bad CUDA architecture {a!r} (expected numbers such as 80,90)")
    return archs or list(DEFAULT_ARCHS)


def _run_cached(cmd: list[str], output: Path, inputs: list[Path], force: bool) -> Path:
    """Run `cmd` unless `output` was built by the same command from the same input contents."""
    digest = hashlib.sha256("\0".join(cmd).encode())
    for f in inputs:
        digest.update(f.read_bytes())
    stamp = output.with_name(output.name + ".stamp")
    key = digest.hexdigest()
    if not force and output.is_file() and stamp.is_file() and stamp.read_text() == key:
        return output
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [ln for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
        errors = [ln for ln in lines if "error" in ln.lower()] or lines
        raise BuildError(f"nvcc failed building {output.name}: " + " | ".join(errors[:5]))
    stamp.write_text(key)
    return output


def build(output_dir, target: str = "plugin", arch: str | None = None, force: bool = False) -> Path:
    """Build `target` into `output_dir` and return the library path (raises BuildError)."""
    if target not in ("plugin", "kernel", "shim"):
        raise BuildError(f"unknown target {target!r}")
    out = Path(output_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    nvcc = find_nvcc()
    archs = _parse_archs(arch)
    base = [nvcc, "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden",
            "-Xlinker", "-Bsymbolic", "-cudart", "static", "-I", str(SRC)]
    cuda_inc = find_cuda_include(nvcc)
    if cuda_inc:
        base += ["-I", cuda_inc]

    if target == "kernel":
        lib = out / KERNEL_LIB
        cmd = base + _arch_flags(archs) + [str(s) for s in KERNEL_SOURCES] + ["-o", str(lib)]
        return _run_cached(cmd, lib, KERNEL_SOURCES + HEADERS[:1], force)

    trt_inc = find_trt_include()
    trt_flags = ["-isystem", trt_inc]
    lib = out / PLUGIN_LIB
    cmd = base + trt_flags + _arch_flags(archs) + [str(s) for s in PLUGIN_SOURCES] + ["-o", str(lib)]
    _run_cached(cmd, lib, PLUGIN_SOURCES + HEADERS, force)
    if target == "plugin":
        return lib

    shim = out / SHIM_LIB
    cmd = base + trt_flags + [str(SHIM_SOURCE), "-L", str(out), "-l" + PLUGIN_LIB[3:-3],
                              "-Xlinker", "-rpath,$ORIGIN", "-o", str(shim)]
    return _run_cached(cmd, shim, [SHIM_SOURCE, lib] + HEADERS, force)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="directory for the built library")
    parser.add_argument("--target", choices=["plugin", "kernel", "shim"], default="plugin")
    parser.add_argument("--arch", help="CUDA architectures, e.g. 80,90 (default: $ELX_CUDA_ARCHS or a fixed list)")
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    parser.add_argument("--print-trt-include", action="store_true",
                        help="only print the TensorRT include directory that would be used")
    args = parser.parse_args(argv)
    try:
        if args.print_trt_include:
            print(find_trt_include())
            return 0
        print(build(args.output, args.target, args.arch, args.force))
    except BuildError as e:
        print(f"build_plugin: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
