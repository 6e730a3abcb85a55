"""Which TensorRT: NVIDIA's TensorRT (``tensorrt``) or TensorRT for RTX (``tensorrt_rtx``), with one-line errors.

Both Python modules expose the same Builder / NetworkDefinition / OnnxParser / Runtime / IPluginV3 API
family, so the builder and the backend take the module as a value.  ``auto`` means ``tensorrt`` when it
imports, else ``tensorrt_rtx``.

TensorRT for RTX 1.7.1 (PyPI ``tensorrt-rtx-cu13``) has a packaging gap that matters for plugins: when
its ONNX parser imports a node as a plugin it ``dlopen``s ``libtensorrt_rtx.so`` (no version suffix;
found through the parser's ``$ORIGIN`` rpath or ``LD_LIBRARY_PATH``), but the wheel ships only
``libtensorrt_rtx.so.1``.  The failed ``dlopen`` throws inside a ``noexcept`` function and the process
dies with "terminate called without an active exception" right after "Successfully created plugin".
``library_shim`` makes a folder holding the missing name (a symlink to the shipped library); the
engine builder puts it on ``LD_LIBRARY_PATH`` of its build process (``exporter/tensorrt/worker.py``),
which must be set before that process starts.
"""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from pathlib import Path

from elx.runners.errors import ElxError


@dataclass(frozen=True)
class RuntimeInfo:
    name: str  # canonical: the Python module name
    label: str
    pip: str  # what to install


RUNTIMES = {
    "tensorrt": RuntimeInfo("tensorrt", "NVIDIA TensorRT", "tensorrt (NVIDIA's pip package or a TensorRT install)"),
    "tensorrt_rtx": RuntimeInfo("tensorrt_rtx", "TensorRT for RTX", "tensorrt-rtx-cu13==1.7.1.116 (pip install 'elx[tensorrt]')"),
}
_ALIASES = {"tensorrt": "tensorrt", "trt": "tensorrt", "tensorrt-rtx": "tensorrt_rtx", "tensorrt_rtx": "tensorrt_rtx",
            "rtx": "tensorrt_rtx"}
CHOICES = ("auto", "tensorrt", "tensorrt-rtx")


def _try_import(name: str):
    try:
        return importlib.import_module(name)
    except (ImportError, OSError):  # a placeholder wheel fails with OSError on a missing .so
        return None


def resolve(runtime: str = "auto") -> RuntimeInfo:
    """``auto`` | ``tensorrt`` | ``tensorrt-rtx`` → the runtime to use; fails when it does not import."""
    key = str(runtime).strip().lower()
    if key == "auto":
        for name in ("tensorrt", "tensorrt_rtx"):
            if _try_import(name) is not None:
                return RUNTIMES[name]
        raise ElxError("no TensorRT Python module is installed; pip install tensorrt-rtx-cu13==1.7.1.116 "
                       "(pip install 'elx[tensorrt]'), or NVIDIA's tensorrt")
    if key not in _ALIASES:
        raise ElxError(f"unknown TensorRT runtime {runtime!r}; choose one of {', '.join(CHOICES)}")
    info = RUNTIMES[_ALIASES[key]]
    load(info)
    return info


def load(info: RuntimeInfo | str):
    """The runtime's Python module, or a one-line error naming the pip package."""
    info = info if isinstance(info, RuntimeInfo) else RUNTIMES[_ALIASES.get(info, info)]
    module = _try_import(info.name)
    if module is None:
        raise ElxError(f"{info.label} is not installed (Python module {info.name!r}); pip install {info.pip}")
    return module


def version(module) -> str:
    return str(getattr(module, "__version__", "unknown"))


def library_shim(module, folder: Path) -> Path | None:
    """For TensorRT for RTX wheels without ``libtensorrt_rtx.so``: a folder in ``folder`` holding that name.

    Returns None when nothing is missing (or for NVIDIA's TensorRT)."""
    if module.__name__ != "tensorrt_rtx":
        return None
    libs = _try_import("tensorrt_rtx_libs")
    where = [Path(p) for p in getattr(libs, "__path__", [])] if libs is not None else []
    for directory in where:
        shipped = directory / "libtensorrt_rtx.so.1"
        if not shipped.is_file():
            continue
        if (directory / "libtensorrt_rtx.so").exists():
            return None
        shim = Path(folder) / "tensorrt-rtx-libs"
        shim.mkdir(parents=True, exist_ok=True)
        link = shim / "libtensorrt_rtx.so"
        if not link.exists():
            os.symlink(shipped, link)
        return shim
    return None
