"""Graph passes: ONNX rewrites of an exported folder, each verified before anything is written.

``PASSES`` below is the one place a pass is declared: its name and module.  The module exposes

* ``NAME`` and ``ORDER`` (its place in the canonical order: passes always run in that order,
  whatever order the user lists them in);
* ``parse_argument(text)``: the ``NAME=text`` argument (``None`` when absent) checked and parsed,
  or an ``ElxError`` saying what it takes; ``parse_passes`` calls it before any heavy work;
* ``CONFLICTS``: ``{other pass name: why they cannot be combined}`` (declaring it on one side
  is enough);
* ``REFUSES`` (optional): ``{model kind: why the pass does not apply to it}``, kinds
  ``"decoder-only"`` and ``"encoder-decoder"``; ``check_model_kind`` refuses before any work
  (or ``refuses(family, kind, dims)``, when the family or dims decide);
* ``apply(folder, manifest, argument) -> dict``: rewrites graph files inside the (temporary)
  export folder, updates the manifest in place, and returns the record stored in the manifest's
  ``passes`` list, which must hold the measured verification error.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

from runners.errors import ElxError

# pass name → module in this package (the order of application is each module's ORDER)
PASSES = {
    "el": "el",
    "slim-cross": "slim_cross",
    "slim": "slim",
    "el-self": "el_self",
    "ngram": "ngram",
}


@dataclass(frozen=True)
class PassRequest:
    name: str
    argument: str | None
    module: object

    @property
    def order(self) -> int:
        return self.module.ORDER


def load_pass(name: str):
    """The module of pass ``name``; unknown names fail with the list of known ones."""
    if name not in PASSES:
        raise ElxError(f"unknown pass {name!r}; available passes: {', '.join(PASSES)}")
    try:
        return importlib.import_module(f"{__name__}.{PASSES[name]}")
    except ModuleNotFoundError as err:
        if err.name and err.name.endswith(PASSES[name]):
            raise ElxError(f"pass {name!r} is not available in this elx build")
        raise


def conflict(first: str, second: str) -> str | None:
    """Why passes ``first`` and ``second`` cannot be combined, or None (either module may declare it)."""
    for this, other in ((first, second), (second, first)):
        reason = getattr(load_pass(this), "CONFLICTS", {}).get(other)
        if reason:
            return reason
    return None


def _check_conflicts(names: list[str], applied: list[str] = ()) -> None:
    for i, name in enumerate(names):
        for other in [*names[:i], *applied]:
            reason = conflict(name, other)
            if reason:
                where = "was already applied to this export" if other in applied else "is also requested"
                raise ElxError(f"pass {name} cannot be combined with {other} ({other} {where}): {reason}; "
                               "use one of them")


def _split(text: str) -> list[tuple[str, str | None]]:
    items = []
    for item in (part.strip() for part in text.split(",")):
        if item:
            name, sep, argument = item.partition("=")
            items.append((name.strip(), argument.strip() if sep else None))
    return items


def parse_passes(text: str | None) -> list[PassRequest]:
    """``"el,slim,ngram=3"`` → requests in canonical order, every name, argument and combination checked.

    Unknown or repeated names, bad arguments and conflicting passes fail here, before any export work.
    """
    if not text:
        return []
    requests, seen = [], set()
    for name, argument in _split(text):
        module = load_pass(name)
        if name in seen:
            raise ElxError(f"pass {name!r} is listed twice; list each pass once")
        seen.add(name)
        module.parse_argument(argument or None)
        requests.append(PassRequest(name, argument or None, module))
    _check_conflicts([r.name for r in requests])
    return sorted(requests, key=lambda r: r.order)


def model_kind(is_encoder_decoder: bool) -> str:
    return "encoder-decoder" if is_encoder_decoder else "decoder-only"


def check_model_kind(requests: list[PassRequest], family: str, is_encoder_decoder: bool,
                     dims: dict | None = None) -> None:
    """Refuse passes that do not apply to this kind of model (e.g. cross-attention passes on GPT-2).

    A pass module may instead define ``refuses(family, kind, dims) -> reason | None`` (e.g. slim: rotary
    decoder-only models with as many key/value heads as query heads only)."""
    kind = model_kind(is_encoder_decoder)
    for request in requests:
        hook = getattr(request.module, "refuses", None)
        reason = hook(family, kind, dims) if hook else getattr(request.module, "REFUSES", {}).get(kind)
        if reason:
            raise ElxError(f"pass {request.name} does not apply to {family} exports ({kind}): {reason}; "
                           f"drop it from --pass")


def check_not_applied(requests: list[PassRequest], applied: list[str]) -> None:
    """Refuse requests for passes already applied to an export, or conflicting with one."""
    for request in requests:
        if request.name in applied:
            raise ElxError(f"pass {request.name!r} was already applied to this export; export again from the model "
                           "to re-apply")
    _check_conflicts([r.name for r in requests], list(applied))
