"""How an error message names an argument: the flag on the command line, the keyword in Python.

The same checks serve ``elx`` and the Python API (``elx.export``, ``generate_file``, ...), so a message cannot
spell an argument one fixed way: ``choose another --output (--force replaces ...)`` reads wrong to a caller of
``elx.export(model, output, force=True)``.  Messages build the name with ``arg``:

    raise ElxError(f"{path} exists; choose another {arg('output')} ({arg('force', True)} replaces an elx export)")

gives ``choose another --output (--force replaces ...)`` while ``elx`` runs a command (``command_line()``, entered
by ``elx.cli.run``) and ``choose another output (force=True replaces ...)`` from Python.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager

_STATE = {"depth": 0}  # > 0 while elx.cli runs a command (threads that command starts see it too)
_LOCK = threading.Lock()


@contextmanager
def command_line():
    """Messages raised inside name command-line flags (``elx.cli.run`` wraps each command in it)."""
    with _LOCK:
        _STATE["depth"] += 1
    try:
        yield
    finally:
        with _LOCK:
            _STATE["depth"] -= 1


def on_command_line() -> bool:
    return _STATE["depth"] > 0


def arg(keyword: str, value=None, flag: str | None = None) -> str:
    """The argument ``keyword`` as the user wrote it: ``--flag`` on the command line (``flag``, else the keyword with
    dashes), the keyword in Python, with ``value`` for a switch (``arg("force", True)``: ``--force`` /
    ``force=True``)."""
    if on_command_line():
        return flag or "--" + keyword.replace("_", "-")
    return keyword if value is None else f"{keyword}={value!r}"
