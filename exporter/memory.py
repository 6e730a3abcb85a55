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
