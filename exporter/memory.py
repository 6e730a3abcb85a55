"""Memory given back to the system between the heavy phases of one process (exports, passes, bench systems).

After a 1.7B export the freed tensors stay in the C allocator's free lists: the process still holds gigabytes
that the next phase (a second export, a pass loading ONNX Runtime sessions) needs.  ``release_memory`` runs
Python's cycle collector, then asks glibc to return free pages (``malloc_trim``); elsewhere it does nothing."""
from __future__ import annotations

import ctypes
import gc


def release_memory() -> None:
    gc.collect()
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


def own_copies(model) -> None:
    """Give every parameter and buffer of ``model`` its own memory, one tensor at a time, instead of views of the
    weights file ``from_pretrained`` mapped (safetensors): the file's mapping is released with the last view.

    A mapped model converted in place to float64 (the verification's ``in_float64``) holds the whole mapping
    until every tensor is converted: float32 mapped + float64 at once, 3× the weights (measured on the real
    SmolLM2-135M: peak 2096 MiB during the conversion).  With its own copies each float32 tensor is freed as
    its float64 one is made: 2× the weights."""
    import torch

    with torch.no_grad():
        for module in model.modules():
            for table in (module._parameters, module._buffers):
                for key, tensor in table.items():
                    if tensor is not None and not tensor.is_meta:
                        tensor.data = tensor.data.clone()
    release_memory()
