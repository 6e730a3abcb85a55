"""Reading a small file the user names on the command line (``--messages FILE.json``; meant for other options too).

A path given by a user can name something that is no file to read whole: a directory, a FIFO (reading
blocks until some writer opens it, perhaps never), a device (``/dev/zero`` never ends, ``/dev/tty`` waits
for a keyboard) or a regular file far larger than any input of its kind.  ``read_user_file`` refuses each of
these at once, in one ``ElxError`` line naming the option and the path:

* the path is ``stat``-ed first, so a FIFO or a device is refused without being opened (opening some devices
  acts: a tape rewinds, a terminal becomes the process's controlling one);
* it is then opened without blocking and checked again on the open descriptor (``fstat``), so a FIFO swapped
  in between the two steps is refused too;
* at most ``limit`` bytes are read (16 MiB by default), one more to tell that the file is longer: a file
  that grows while it is read cannot make elx read without end.
"""
from __future__ import annotations

import os
import stat

from elx.runners.errors import ElxError

MAX_BYTES = 16 * 1024 * 1024  # 16 MiB: far more than any chat, yet read in well under a second
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _size(limit: int) -> str:
    return f"{limit // (1024 * 1024)} MiB" if limit % (1024 * 1024) == 0 else f"{limit} bytes"


def _refuse_kind(mode: int, option: str, path) -> None:
    for test, kind in _KINDS:
        if test(mode):
            raise ElxError(f"{option} {path} is {kind}, not a file; name a regular file")
    if not stat.S_ISREG(mode):
        raise ElxError(f"{option} {path} is not a regular file; name one")


def _os_error(err: OSError, option: str, path) -> ElxError:
    if isinstance(err, FileNotFoundError):
        return ElxError(f"{option} {path}: no such file; check the path")
    if isinstance(err, PermissionError):
        return ElxError(f"{option} {path}: permission denied; check its permissions")
    return ElxError(f"{option} {path}: cannot read it ({err.strerror or type(err).__name__})")


def read_user_file(path, option: str, limit: int = MAX_BYTES) -> bytes:
    """The bytes of the regular file at ``path`` (at most ``limit`` of them); else one line naming ``option``."""
    shown = os.fspath(path)
    try:
        _refuse_kind(os.stat(path).st_mode, option, shown)
        flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
        descriptor = os.open(path, flags)
    except OSError as err:
        raise _os_error(err, option, shown) from None
    with os.fdopen(descriptor, "rb") as handle:
        try:
            status = os.fstat(handle.fileno())
            _refuse_kind(status.st_mode, option, shown)
            if status.st_size > limit:
                raise ElxError(f"{option} {shown} is {status.st_size} bytes, more than elx reads ({_size(limit)}); "
                               "pass a smaller file")
            data = handle.read(limit + 1)
        except OSError as err:
            raise _os_error(err, option, shown) from None
    if len(data) > limit:
        raise ElxError(f"{option} {shown} holds more than elx reads ({_size(limit)}); pass a smaller file")
    return data
