"""One elx writer per output path, and the temporary siblings that killed writers leave.

``output_lock(output)`` holds an exclusive lock on ``.NAME.lock`` beside ``output`` for as long as a write
lasts, so that a second elx process writing the same output is refused at once (one line naming the
holder's pid) instead of interleaving its results with the first one's.  The lock is ``filelock``'s native
primitive on our own descriptor (``lock_descriptor``: ``flock`` on POSIX, ``LockFileEx`` on Windows), tried
once; the descriptor is elx's so that the pid goes in and the file goes away exactly as before (with
filelock's ``FileLock`` object instead, an export interrupted by Ctrl-C right after taking the lock died by
SIGINT after its cleanup in 1 run of 3, exit -2 instead of 130: tests/test_reliability.py).  A lock file another process unlinked
between our open and our lock is not taken.  The operating system drops a lock when its process dies
(SIGKILL, power loss): a killed writer never blocks the next one.  The lock is taken on its own open file, so
that it holds against this same process's next attempt too.

Temporary siblings are named ``.NAME.PID-XXXXXXXX.KIND`` (``temp_sibling``): the PID says whose they
are, so that the next writer (holding the lock) removes those of dead processes (``dead_siblings``)
and never one of a live process, nor any file of the user's.  Export folders
(``exporter/atomic.py``) and dataset outputs (``runners/dataset/pipeline.py``) share this module, and
``write_failure``, the words for a write that failed (a full disk, a read-only file system).
"""
from __future__ import annotations

import errno
import os
import re
import secrets
import signal
from contextlib import contextmanager
from pathlib import Path

from elx.runners.errors import ElxError
from elx.runners.wording import arg

_DEFERRED_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
_WRITE_ERRORS = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
                 errno.EFBIG: "file too large for the file system", errno.EROFS: "read-only file system",
                 errno.EACCES: "permission denied", errno.EPERM: "operation not permitted", errno.EIO: "I/O error"}


def write_failure(err: BaseException) -> str | None:
    """Why a write failed, in words (disk full, read-only, ...); None for errors that are not such a failure."""
    return _WRITE_ERRORS.get(err.errno) if isinstance(err, OSError) else None


@contextmanager
def signals_deferred():
    """Hold Ctrl-C/SIGTERM/SIGHUP back while a short critical section runs (delivered right after)."""
    try:
        old = signal.pthread_sigmask(signal.SIG_BLOCK, _DEFERRED_SIGNALS)
    except (AttributeError, ValueError, OSError):  # not the main thread, or no pthread_sigmask
        old = None
    try:
        yield
    finally:
        if old is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


def lock_path(output: Path) -> Path:
    return output.parent / f".{output.name}.lock"


def _lock_holder(fd: int) -> str:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return ""
    return f" (pid {text})" if text.isdigit() else ""


def _option_name(option: str) -> str:
    """``option`` as the message names it: a keyword (``output_file``: ``--output-file`` on the command line,
    ``output_file`` in Python; runners/wording.py), or words used as they are (``export folder``)."""
    keyword = option[2:].replace("-", "_") if option.startswith("--") else option
    return arg(keyword) if keyword.isidentifier() else option


def _acquire(path: Path, output: Path, option: str) -> int:
    """The descriptor of ``path`` locked exclusively (created if needed); ElxError when another process holds it."""
    from filelock import lock_descriptor

    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise ElxError(f"cannot write in {path.parent} ({write_failure(err) or err.strerror}); choose another "
                           f"{_option_name(option)}") from None
        try:
            locked = lock_descriptor(fd, blocking=False)
        except BaseException:
            os.close(fd)
            raise
        if not locked:
            holder = _lock_holder(fd)
            os.close(fd)
            raise ElxError(f"another elx process{holder} is writing {output} right now; wait for it to finish or "
                           f"choose another {_option_name(option)}") from None
        try:  # the holder before us may have removed the file between our open and our lock: lock the new one
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


@contextmanager
def output_lock(output: Path, option: str = "output"):
    """Hold an exclusive lock for writing ``output``; refuse at once when another process holds it.

    ``option``: the argument that names the output (a keyword: ``--flag`` on the command line), for the message."""
    path, fd = lock_path(output), None
    try:
        with signals_deferred():  # a signal lands after ``fd`` is set, inside the try: the lock file goes
            fd = _acquire(path, output, option)
        try:  # who holds it, for the second writer's message (a full disk leaves it empty: the lock still holds)
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
        except OSError:
            pass
        yield
    finally:
        if fd is not None:
            try:
                os.unlink(path)
            except OSError:
                pass
            os.close(fd)


# -- temporary siblings ---------------------------------------------------------------------------------

def temp_sibling(output: Path, kind: str) -> Path:
    """A fresh name ``.NAME.PID-XXXXXXXX.KIND`` beside ``output`` (not created)."""
    return output.parent / f".{output.name}.{os.getpid()}-{secrets.token_hex(4)}.{kind}"


def sibling_pattern(output: Path, kinds: tuple[str, ...]) -> re.Pattern:
    """Matches the temporary siblings of ``output`` of these kinds; group 1 is the writer's pid, group 2 the kind."""
    return re.compile(rf"^\.{re.escape(output.name)}\.(\d+)-[0-9a-f]+\.({'|'.join(map(re.escape, kinds))})$")


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def dead_siblings(output: Path, kinds: tuple[str, ...]) -> list[tuple[Path, str]]:
    """The temporary siblings of ``output`` whose writer is gone, with their kind (call it holding the lock)."""
    pattern, found = sibling_pattern(output, kinds), []
    for entry in sorted(output.parent.iterdir()) if output.parent.is_dir() else ():
        match = pattern.match(entry.name)
        if match and not entry.is_symlink() and not process_alive(int(match.group(1))):
            found.append((entry, match.group(2)))
    return found
