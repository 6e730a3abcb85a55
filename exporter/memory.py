"""Memory given back to the system between the heavy phases of one process (exports, passes, bench systems).

After a 1.7B export the freed tensors stay in the C allocator's free lists: the process still holds gigabytes
that the next phase (a second export, a pass loading ONNX Runtime sessions) needs.  ``release_memory`` runs
Python's cycle collector, then asks glibc to return free pages (``malloc_trim``); elsewhere it does nothing."""
from __future__ import annotations

import contextlib
import ctypes
import gc


def release_memory() -> None:
    gc.collect()
    return_free_pages()


@contextlib.contextmanager
def collector_skips_existing_objects():
    """Inside the block, Python's cycle collector leaves alone the objects that exist when it starts (``gc.freeze``;
    given back to it after: ``gc.unfreeze``).  After PyTorch, transformers and onnx are imported, a full collection
    walks ~400,000 of their objects, 0.4 s each time (three ``release_memory`` calls and the automatic collections
    of a whisper-base export); their modules and classes are never garbage.  Nothing is done where something else
    froze objects already (the traces' child process: ``exporter/capture/parallel.py``)."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def return_free_pages() -> None:
    """glibc's free pages back to the system (``malloc_trim``), without the cycle collector: a few milliseconds,
    cheap enough between two verification cases.  Tensors of 1-32 MB come from glibc's heap once it has freed one
    that size (its mmap threshold adapts upwards), and stay there after they are freed: the whisper-base export's
    float64 reference grew by ~500 MB over its four cases that way."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def free_weights(model) -> None:
    """Release every parameter and buffer of a PyTorch module (moved to the meta device: the module stays, its
    tensors hold no memory), then give the memory back (``release_memory``).  Whoever still holds the module
    can no longer run it."""
    model.to("meta")
    release_memory()


# -- the export's memory, estimated before any weight is read ---------------------------------------------------
# Measured on the real SmolLM2-135M (538 MB of float32 weights; elx export, 2026-11-28): peak 1761 MiB when the
# verification held HF's model in float64 (2 copies) and then one ONNX Runtime session per graph, each with its own
# prepacked copy (2 copies).  Since the float64 reference runs layer by layer and the graphs' sessions share one
# mapping of weights.data (``exporter/verification/fp32_noise.py``, ``runners/backends/ort_mapped.py``): 1572 MiB,
# TinyLlama-1.1B dims 7211 MiB (was 9699), SmolLM2-1.7B dims 10098 MiB (was 14409).  The estimate below keeps
# 2 copies: the bound the export is held to (issue 41: 2 x the weights + 1 GiB), and room for the process itself
# (Python, PyTorch, transformers, onnx, ONNX Runtime and the traces' working memory: 600-700 MiB).
PROCESS_BYTES = 800 * 2**20
FP32_COPIES = 2  # float32 weight copies alive at the export's peak (fp32 exports)
KEPT_COPIES = 3  # fp16/int8 exports keep HF's model beside the sessions of the passes and the conversion


def _size(count: int) -> str:
    value, unit = (count / 1e9, "GB") if count >= 1e9 else (count / 1e6, "MB")
    return f"{value:.3g} {unit}"


def float32_weight_bytes(location) -> int | None:
    """The float32 bytes of the model ``location`` (``exporter/source/locate.py``) names, from its config alone: its
    parameters counted on PyTorch's meta device (nothing allocated), each tensor once (a tied head counts once);
    a GGUF file's from its tensor table.  None when the config cannot say."""
    if location.gguf is not None:
        return int(location.gguf.float32_bytes)
    try:
        import torch
        import transformers

        model_cls = getattr(transformers, location.architecture())
        if location.folder is not None:
            config = model_cls.config_class.from_pretrained(location.folder, local_files_only=True)
        else:
            config = model_cls.config_class(**location.config())
        with torch.device("meta"):
            model = model_cls(config)
        return 4 * sum(p.numel() for p in model.parameters())
    except Exception:  # noqa: BLE001 - a config transformers refuses: the load says why, with its own message
        return None


def check_export_memory(location, precision: str = "fp32", available: int | None = None) -> dict | None:
    """Refuse, before the weights are read, an export whose estimated peak exceeds the memory available: one line
    with the estimate, how it is made, and the memory available.  Returns the estimate (None when unknown)."""
    weights = float32_weight_bytes(location)
    if weights is None:
        return None
    copies = FP32_COPIES if precision == "fp32" else KEPT_COPIES
    needed = copies * weights + PROCESS_BYTES
    if available is None:
        from elx.runners.inputs.validation import available_memory

        available = available_memory()
    estimate = {"float32_weight_bytes": weights, "copies": copies, "process_bytes": PROCESS_BYTES,
                "needed_bytes": needed, "available_bytes": available}
    if available is not None and needed > available:
        from elx.runners.errors import ElxError

        raise ElxError(f"exporting {location.spec} needs about {_size(needed)} of memory ({copies} copies of its "
                       f"{_size(weights)} of float32 weights at the verification, plus {_size(PROCESS_BYTES)} for elx "
                       f"itself) and {_size(available)} is available: free memory or export on a machine with more")
    return estimate
