"""Progress of elx's long steps (export stages, engine builds, bench rounds): the one reporter they call.

    with Progress("elx export", total=9, progress="auto") as progress:
        with progress.stage("encoder.onnx", weight=3) as stage:
            ...                                   # the work
            stage.detail = "..."                  # said after the stage's name once it is done
        progress.say("elx export: wrote DIR")     # a line that is no stage

What the user sees depends on the mode (``mode_of``):

* ``bar``: a tqdm bar on stderr with the running stage's name, the share done, the elapsed time and
  the ETA, redrawn every second while a stage runs; each finished stage leaves its line above it.
* ``plain``: one line per finished stage, ``TITLE: NAME[: DETAIL] (S s)``, for logs and CI.
* ``none``: nothing.

The CLI asks for ``auto`` (a bar on a terminal, plain lines otherwise) or ``none`` (``--quiet``).  The
Python API's default, ``progress=None``, is a bar when stderr is a terminal and nothing otherwise;
``True`` is ``auto`` and ``False`` is ``none``.

The ETA weighs stages: each has a ``weight`` roughly proportional to the time it usually takes
(tracing a graph weighs more than writing the manifest), and tqdm's ETA is the weight left divided by
the weight done per second so far.  A stage of several steps (a bench round: one call per system)
moves the bar step by step with ``Stage.step``.

The modes and the tqdm bar are the runtime's (``runners/progress.py``: ``MODES``, ``resolve_mode``, ``tqdm_bar``),
shared with the meter of ``elx generate --input-file``; this module adds the weighted stages.
"""
from __future__ import annotations

import contextvars
import sys
import threading
import time
from contextlib import contextmanager

from elx.runners.errors import ElxError
from elx.runners.progress import MODES, is_terminal, resolve_mode, tqdm_bar

REFRESH_SECONDS = 1.0
# ETA weights of the export stages: rough seconds per stage for t5-small on the project's 2-core VM (the
# graphs measured at 50, 4 and 60-67 s, verification and a pass at 15-35 s; fp16 estimated); only the ETA reads them
WEIGHTS = {"load": 8, "encoder": 50, "cross_kv": 4, "decoder": 60, "prefill": 60, "verify": 15, "pass": 30,
           "fp16": 30, "store": 3, "write": 1}


def mode_of(progress=None, stream=None) -> str:
    """``bar``, ``plain`` or ``none`` for a user's choice: None (the Python API's default: a bar on a terminal,
    else nothing), True or ``auto`` (a bar on a terminal, else plain lines), False, or a mode's name."""
    stream = stream if stream is not None else sys.stderr
    if progress is None:
        return "bar" if is_terminal(stream) else "none"
    if progress is False:
        return "none"
    if progress is True or progress in MODES:
        return resolve_mode("auto" if progress is True else progress, stream)
    raise ElxError(f"progress must be True, False, None or one of {', '.join(MODES)}, not {progress!r}")


def say(line: str, progress=None, stream=None) -> None:
    """One line outside any running ``Progress`` (stderr), unless ``progress`` means nothing (``mode_of``)."""
    stream = stream if stream is not None else sys.stderr
    if mode_of(progress, stream) != "none":
        print(line, file=stream, flush=True)


class Stage:
    """One running stage: ``detail`` is added to its line; ``step`` moves the bar within it."""

    def __init__(self, progress: "Progress", name: str, weight: float, steps: int):
        self.progress, self.name, self.weight, self.steps = progress, name, weight, max(1, steps)
        self.detail = ""
        self.done_steps = 0
        self.started = time.perf_counter()

    def step(self, label: str | None = None) -> None:
        """One of the stage's ``steps`` is done; ``label`` names the next one on the bar."""
        if self.done_steps < self.steps:
            self.done_steps += 1
            self.progress._advance(self.weight / self.steps)
        if label:
            self.progress._describe(f"{self.name}: {label}")


class Progress:
    """Stages of one long operation, reported by mode (see the module docstring)."""

    def __init__(self, title: str, total: float = 0.0, progress="auto", stream=None):
        self.title, self.stream = title, stream if stream is not None else sys.stderr
        self.mode = mode_of(progress, self.stream)
        self.total, self.done = float(total), 0.0
        self.bar, self._stop, self._thread = None, threading.Event(), None
        if self.mode == "bar":
            self.bar = tqdm_bar(self.stream, max(self.total, 1e-9), "{desc} {percentage:3.0f}%|{bar}| "
                                "{elapsed} elapsed, ETA {remaining}", desc=title, leave=False, smoothing=0)
            self._thread = threading.Thread(target=self._refresh, daemon=True)
            self._thread.start()

    # -- what the steps call -----------------------------------------------------------------------
    @contextmanager
    def stage(self, name: str, weight: float = 1.0, steps: int = 1):
        """A stage of ``weight`` (in the units of ``total``); its line is said when it ends without error."""
        stage = Stage(self, name, weight, steps)
        self._describe(name)
        yield stage
        self._advance(stage.weight - stage.done_steps * stage.weight / stage.steps)
        detail = f": {stage.detail}" if stage.detail else ""
        self.say(f"{self.title}: {name}{detail} ({time.perf_counter() - stage.started:.1f} s)")

    def say(self, line: str) -> None:
        """A line for the user (above the bar on a terminal); nothing in ``none`` mode."""
        if self.mode == "none":
            return
        if self.bar is not None:
            self.bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the bar -----------------------------------------------------------------------------------
    def _advance(self, weight: float) -> None:
        self.done += weight
        if self.bar is not None:
            self.bar.update(weight)

    def _describe(self, text: str) -> None:
        if self.bar is not None:
            self.bar.set_description_str(f"{self.title}: {text}", refresh=True)

    def _refresh(self) -> None:
        while not self._stop.wait(REFRESH_SECONDS):
            bar = self.bar
            if bar is not None:
                bar.refresh()


def quiet(title: str = "elx") -> Progress:
    """A reporter that says nothing (for callers that report no progress)."""
    return Progress(title, progress="none")


# -- lines from inside a pass ---------------------------------------------------------------------------------
# A pass's own steps (its per-layer search above all: ``exporter/passes/culprits.py``) can run for minutes on a
# large model; ``run_passes`` sets where their lines go for the pass it runs, so the passes need no reporter
# argument threaded through every ``apply``.
_PASS_LINES: contextvars.ContextVar = contextvars.ContextVar("elx_pass_lines", default=None)


@contextmanager
def pass_lines(say_line):
    """Lines ``pass_line`` gets inside this block go to ``say_line(text)``."""
    token = _PASS_LINES.set(say_line)
    try:
        yield
    finally:
        _PASS_LINES.reset(token)


def pass_line(text: str) -> None:
    """A progress line from inside a pass (nothing outside ``pass_lines``)."""
    say_line = _PASS_LINES.get()
    if say_line is not None:
        say_line(text)
