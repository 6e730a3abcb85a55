"""The runtime's progress meter: one stage counted in items (and generated tokens), with one rate.

``Meter(total, mode)`` starts when its stage starts (a dataset run's generate stage: after the model is loaded)
and measures from there: items/s = items done / seconds since the start.  The bar on a terminal, the plain lines
in logs and the summary at the end all read that one rate (``rates``, ``line``), so that they cannot disagree:
before, the bar showed tqdm's smoothed rate from the first finished batch on (11.1 items/s) while the summary
divided by the whole run's time, model loading included (5.51 items/s).

Modes: ``bar`` (tqdm on stderr; its own rate and ETA are not shown, the meter's are), ``plain`` (one line every
``PLAIN_SECONDS``), ``none``; ``auto``: a bar on a terminal, plain lines otherwise.

The export, engine-build and bench stages report through ``exporter/progress.py`` (weighted stages, no item
counts), which takes its modes (``MODES``, ``resolve_mode``, ``is_terminal``) and its tqdm bar (``tqdm_bar``) from
here: one place decides what ``auto`` means and how a bar is drawn (the exporter imports the runtime, never the
reverse).
"""
from __future__ import annotations

import sys
import time

from elx.runners.errors import ElxError

PLAIN_SECONDS = 10.0
BAR_SECONDS = 0.5
MODES = ("auto", "bar", "plain", "none")


def is_terminal(stream) -> bool:
    return bool(getattr(stream, "isatty", lambda: False)())


def resolve_mode(mode: str, stream) -> str:
    """``auto`` → ``bar`` on a terminal, ``plain`` otherwise; other modes as they are (one line if unknown)."""
    if mode == "auto":
        return "bar" if is_terminal(stream) else "plain"
    if mode not in MODES:
        raise ElxError(f"progress must be auto, bar, plain or none, not {mode!r}")
    return mode


def tqdm_bar(stream, total: float, bar_format: str, **options):
    """elx's tqdm bar: on ``stream``, as wide as the terminal, drawn by ``bar_format`` (tqdm is imported here, only
    when a bar is shown)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, file=stream, dynamic_ncols=True, bar_format=bar_format, **options)


class Meter:
    """Items (and generated tokens) of one stage: counts, one rate, an ETA, shown by mode."""

    def __init__(self, total: int, mode: str = "auto", stream=None, title: str = "elx generate"):
        self.stream = stream or sys.stderr
        self.mode, self.total, self.title = resolve_mode(mode, self.stream), total, title
        self.items = self.tokens = 0
        self.start = self.shown = self.last = time.monotonic()  # last: when the latest items were counted
        self.bar = None
        if self.mode == "bar":
            # the meter's line where tqdm would put its own rate: the {desc} field, after the bar
            self.bar = tqdm_bar(self.stream, total, title.replace("{", "{{").replace("}", "}}")
                                + ": {percentage:3.0f}%|{bar}| {desc}", unit="item", desc=self.line())

    def update(self, items: int, tokens: int) -> None:
        now = time.monotonic()
        self.items += items
        self.tokens += tokens
        self.last = now
        if self.bar is not None:
            self.bar.update(items)
            if now - self.shown >= BAR_SECONDS or self.items >= self.total:
                self.bar.set_description_str(self.line(now), refresh=True)
                self.shown = now
        elif self.mode == "plain" and now - self.shown >= PLAIN_SECONDS:
            self.shown = now
            print(f"{self.title}: {self.line(now)}", file=self.stream, flush=True)

    def seconds(self, now: float | None = None) -> float:
        """Seconds since the stage started, to ``now`` (default: the latest count)."""
        return (self.last if now is None else now) - self.start

    def rates(self, now: float | None = None) -> tuple[float, float]:
        """Items/s and generated tokens/s since the stage started (``now``: default the latest count)."""
        elapsed = self.seconds(now)
        if elapsed <= 0 or not self.items:
            return 0.0, 0.0
        return self.items / elapsed, self.tokens / elapsed

    def line(self, now: float | None = None) -> str:
        rate, token_rate = self.rates(now)
        eta = (self.total - self.items) / rate if rate > 0 else None
        eta_text = time.strftime("%H:%M:%S", time.gmtime(eta)) if eta is not None else "?"
        return f"{self.items}/{self.total} items, {rate:.2f} items/s, {token_rate:.0f} tokens/s, ETA {eta_text}"

    def close(self) -> None:
        if self.bar is not None:
            self.bar.set_description_str(self.line(), refresh=True)
            self.bar.close()
            self.bar = None
