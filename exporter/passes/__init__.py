"""Graph passes: ONNX rewrites of an exported folder, each verified before anything is written.

``catalog.py`` declares every pass (``PassSpec``): its name, its module here, its place in the
canonical order (passes always run in that order, whatever order the user lists them in), its
``NAME=argument`` parser, the passes it cannot be combined with and the models it does not apply to.
It is light (no onnx, numpy or PyTorch), and so is this module until a pass is applied: the command
line checks ``--pass`` in full (``parse_passes``, ``check_model_kind``) before any heavy import.

A pass module takes its declaration from the catalog (``SPEC``) and exposes
``apply(folder, manifest, argument) -> dict``: it rewrites graph files inside the (temporary)
export folder, updates the manifest in place, and returns the record stored in the manifest's
``passes`` list, which must hold the measured verification error.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

from elx.runners.errors import ElxError

from elx.exporter.passes.catalog import KINDS, PASSES, PassSpec


@dataclass(frozen=True)
class PassRequest:
    name: str
    argument: str | None
    spec: PassSpec

    @property
    def order(self) -> int:
        return self.spec.order

    @property
    def module(self):
        """The pass's module (imported on first use: onnx and onnx-graphsurgeon come with it)."""
        return load_pass(self.name)


def pass_spec(name: str) -> PassSpec:
    """The declaration of pass ``name``; unknown names fail with the list of known ones."""
    if name not in PASSES:
        raise ElxError(f"unknown pass {name!r}; available passes: {', '.join(PASSES)}")
    return PASSES[name]


def load_pass(name: str):
    """The module of pass ``name``."""
    module = pass_spec(name).module
    try:
        return importlib.import_module(f"{__name__}.{module}")
    except ModuleNotFoundError as err:
        if err.name and err.name.endswith(module):
            raise ElxError(f"pass {name!r} is not available in this elx build")
        raise


def conflict(first: str, second: str) -> str | None:
    """Why passes ``first`` and ``second`` cannot be combined, or None (either declaration may say it)."""
    for this, other in ((first, second), (second, first)):
        reason = pass_spec(this).conflicts.get(other)
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
        spec = pass_spec(name)
        if name in seen:
            raise ElxError(f"pass {name!r} is listed twice; list each pass once")
        seen.add(name)
        spec.parse(argument or None)
        requests.append(PassRequest(name, argument or None, spec))
    _check_conflicts([r.name for r in requests])
    return sorted(requests, key=lambda r: r.order)


def model_kind(is_encoder_decoder: bool) -> str:
    return KINDS[1] if is_encoder_decoder else KINDS[0]


def check_model_kind(requests: list[PassRequest], family: str, is_encoder_decoder: bool,
                     dims: dict | None = None) -> None:
    """Refuse passes that do not apply to this kind of model (e.g. cross-attention passes on GPT-2; slim: rotary
    decoder-only models with as many key/value heads as query heads only).  ``dims`` None: only what the
    family and kind decide (the command line, before the model is loaded)."""
    kind = model_kind(is_encoder_decoder)
    for request in requests:
        reason = request.spec.refuses(family, kind, dims)
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
