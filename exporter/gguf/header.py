"""Is this path a GGUF file?  Answered from ``stat`` and the first 8 bytes, without the ``gguf`` package.

A GGUF file starts with the magic ``b"GGUF"`` and a ``uint32`` version (little endian, or big endian in
files written for big-endian machines: the ``gguf`` reader tells them apart by which half of the word is
zero, and so does this check).  Anything that is not a regular file (a folder, a FIFO, a device) is refused
from its ``stat`` alone, before it is opened: reading a FIFO would block, a device could be endless.
"""
from __future__ import annotations

import os
import stat
import struct
from pathlib import Path

from elx.runners.errors import ElxError
from elx.runners.inputs.user_files import open_user_file

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)  # what gguf's reader and transformers read (version 1 counted in 32 bits)


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def check_gguf_file(path) -> Path:
    """``path`` as an absolute ``Path`` when it is a regular file starting with a GGUF header elx can read;
    ``ElxError`` otherwise (a missing path, a folder/FIFO/device, other magic bytes, an unknown version)."""
    if path is None or not str(path).strip():
        raise ElxError("the GGUF file name is empty; pass the path of a .gguf file")
    path = Path(os.path.abspath(Path(str(path)).expanduser()))
    try:
        mode = path.stat().st_mode  # follows a symbolic link to what it names
    except FileNotFoundError:
        raise ElxError(f"GGUF file {path} does not exist; check the path") from None
    except OSError as err:
        raise ElxError(f"cannot read {path} ({err.strerror}); check the path and its permissions") from None
    if not stat.S_ISREG(mode):
        raise ElxError(f"{path} is {_kind(mode)}, not a GGUF file; pass the path of a .gguf file")
    # opened without blocking and checked again on the descriptor: a FIFO swapped in since the stat is refused too
    with open_user_file(path, "GGUF file", limit=None) as f:
        try:
            head = f.read(8)
        except OSError as err:
            raise ElxError(f"cannot read {path} ({err.strerror}); check its permissions") from None
    if head[:4] != MAGIC:
        found = "is empty" if not head else f"starts with {head[:4]!r}, not {MAGIC!r}"
        raise ElxError(f"{path} is not a GGUF file (it {found}); pass a .gguf file written by llama.cpp or the gguf "
                       "package")
    if len(head) < 8:
        raise ElxError(f"{path} is truncated: {len(head)} bytes, less than a GGUF header; download or convert it "
                       "again")
    version = struct.unpack("<I", head[4:])[0]
    if version & 0xFFFF == 0:  # written on a big-endian machine: the version sits in the other half
        version = struct.unpack(">I", head[4:])[0]
    if version not in SUPPORTED_VERSIONS:
        raise ElxError(f"{path} is GGUF version {version}; elx (through the gguf package and transformers) reads "
                       f"versions {', '.join(map(str, SUPPORTED_VERSIONS))}: convert it again with a recent llama.cpp")
    return path
