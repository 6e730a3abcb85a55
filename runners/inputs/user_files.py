"""Reading a file the user names: ``--messages``, ``--generation-config``, ``--audio`` (and the audio files a dataset
names), ``--input-file``, a GGUF file, a model folder's ``config.json``, an export's ``manifest.json``.

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

``open_user_file`` does the same checks and returns the open file, for readers that stream (a dataset read line
by line, with ``read_lines`` capping each line; a GGUF file's header); ``check_user_file`` only ``stat``-s.
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


def check_user_file(path, option: str) -> None:
    """Refuse (one line naming ``option``) a ``path`` that is missing or is not a regular file, from ``stat`` alone."""
    try:
        _refuse_kind(os.stat(path).st_mode, option, os.fspath(path))
    except OSError as err:
        raise _os_error(err, option, os.fspath(path)) from None


def open_user_file(path, option: str, limit: int | None = MAX_BYTES):
    """The regular file at ``path``, open for binary reading; else one line naming ``option``.  ``limit``: refuse a
    file larger than this many bytes (None: any size, for a reader that bounds what it holds itself)."""
    shown = os.fspath(path)
    check_user_file(path, option)
    try:
        flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
        descriptor = os.open(path, flags)
    except OSError as err:
        raise _os_error(err, option, shown) from None
    handle = os.fdopen(descriptor, "rb")
    try:
        status = os.fstat(handle.fileno())
        _refuse_kind(status.st_mode, option, shown)  # swapped for a FIFO or a device since the stat
        if limit is not None and status.st_size > limit:
            raise ElxError(f"{option} {shown} is {status.st_size} bytes, more than elx reads ({_size(limit)}); "
                           "pass a smaller file")
        os.set_blocking(descriptor, True)  # a regular file: reads never wait anyway
    except OSError as err:
        handle.close()
        raise _os_error(err, option, shown) from None
    except BaseException:
        handle.close()
        raise
    return handle


def read_user_file(path, option: str, limit: int = MAX_BYTES) -> bytes:
    """The bytes of the regular file at ``path`` (at most ``limit`` of them); else one line naming ``option``."""
    shown = os.fspath(path)
    with open_user_file(path, option, limit) as handle:
        try:
            data = handle.read(limit + 1)
        except OSError as err:
            raise _os_error(err, option, shown) from None
    if len(data) > limit:
        raise ElxError(f"{option} {shown} holds more than elx reads ({_size(limit)}); pass a smaller file")
    return data


def read_lines(handle, limit: int = MAX_BYTES):
    """The lines of an open binary file, each with its newline; a line longer than ``limit`` bytes is skipped to its
    end without being held and yields None instead (the reader reports it), so that a file of one endless line
    (``/dev/zero`` copied to disk) cannot fill the memory."""
    while True:
        raw = handle.readline(limit + 1)
        if not raw:
            return
        if len(raw) > limit and not raw.endswith(b"\n"):
            while True:  # the rest of the long line, a MiB at a time
                rest = handle.readline(1 << 20)
                if not rest or rest.endswith(b"\n"):
                    break
            yield None
        else:
            yield raw
