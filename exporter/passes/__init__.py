"""Graph passes: ONNX rewrites of an exported folder, each verified before anything is written.

A pass is a module in this package exposing ``NAME``, ``ORDER`` (its place in the canonical
order: passes always run in that order, whatever order the user lists them in) and
``apply(folder, manifest, argument) -> dict``.  ``apply`` rewrites graph files inside the
(temporary) export folder, updates the manifest in place, and returns the record stored in the
manifest's ``passes`` list, which must hold the measured verification error.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

from runners.errors import ElxError

# name → module; the order of application is each module's ORDER.
KNOWN = {"el": "el", "slim": "slim", "slim-cross": "slim_cross", "ngram": "ngram"}
KNOWN["el-self"] = "el_self"


@dataclass(frozen=True)
class PassRequest:
    name: str
    argument: str | None
    module: object

    @property
    def order(self) -> int:
        return self.module.ORDER


def _load(name: str):
    try:
        return importlib.import_module(f"{__name__}.{KNOWN[name]}")
    except ModuleNotFoundError as err:
        if err.name and err.name.endswith(KNOWN[name]):
            raise ElxError(f"pass {name!r} is not available in this elx build")
        raise


def parse_passes(text: str | None) -> list[PassRequest]:
    """``"el,slim,ngram=3"`` → requests in canonical order. Unknown or repeated names fail clearly."""
    if not text:
        return []
    requests, seen = [], set()
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, _, argument = item.partition("=")
        if name not in KNOWN:
            raise ElxError(f"unknown pass {name!r}; available passes: {', '.join(KNOWN)}")
        if name in seen:
            raise ElxError(f"pass {name!r} is listed twice; list each pass once")
        seen.add(name)
        requests.append(PassRequest(name, argument or None, _load(name)))
    return sorted(requests, key=lambda r: r.order)
