"""Write a folder completely or not at all: build it in a temporary sibling, then rename it into place."""
from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from runners.errors import ElxError


def check_output(output: Path, force: bool) -> Path:
    output = Path(output).expanduser().absolute()
    if output.exists() and not output.is_dir():
        raise ElxError(f"output {output} exists and is not a folder; choose another --output")
    if output.is_dir() and any(output.iterdir()) and not force:
        raise ElxError(f"output folder {output} is not empty; choose another --output or pass --force to replace it")
    parent = output.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ElxError(f"cannot create {parent} ({err.strerror}); choose a writable --output")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ElxError(f"cannot write in {parent} (permission denied); choose a writable --output")
    return output


@contextmanager
def staged_folder(output: Path, force: bool = False):
    """Yield a temporary folder next to ``output``; on success it becomes ``output``, on error it vanishes."""
    output = check_output(output, force)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.", suffix=".partial", dir=output.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if output.exists():
        old = output.with_name(f".{output.name}.old-{os.getpid()}")
        output.rename(old)
    tmp.rename(output)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
