"""elx: text generation with transformer models, faster, with HF ``generate``'s exact tokens.

The public Python API (heavy modules load on first use)::

    import elx
    folder = elx.export("t5-small", "t5-small-el", passes="el", random_init=True)
    generator = elx.Generator.from_folder(folder)           # ONNX Runtime; no PyTorch needed
    out = generator.generate(input_ids=[[37, 423, 5]], num_beams=4, max_new_tokens=20)
    out.sequences, out.sequences_scores, out.text
    generator.generate(messages=[{"role": "user", "content": "Hi!"}])  # instruct models: the chat template's prompt
    elx.build_engine(folder, precision="fp16")                # TensorRT engines into folder/engines
    elx.generate_file(folder, "in.jsonl", "out.jsonl", num_beams=4)  # a dataset: batched, pipelined, resumable

Errors a user can fix are ``elx.ElxError`` (one line saying what is wrong and what to do).
"""
from __future__ import annotations

import os as _os

# ``elx.exporter`` and ``elx.runners`` live in the repository's ``exporter/`` and ``runners/`` folders; an
# install maps them under ``elx/`` (pyproject's package-dir), a source checkout finds them beside this folder.
_HERE = _os.path.dirname(_os.path.abspath(__file__))
_CHECKOUT = _os.path.dirname(_HERE)
if not _os.path.isdir(_os.path.join(_HERE, "runners")) and all(
        _os.path.isfile(_os.path.join(_CHECKOUT, part, "__init__.py")) for part in ("exporter", "runners")):
    __path__.append(_CHECKOUT)  # noqa: F821 - the package's own search path

from elx._version import __version__  # noqa: E402
from elx.runners.arguments import check_arguments
from elx.runners.errors import ElxError

__all__ = ["ElxError", "Generator", "build_engine", "export", "generate_file", "__version__"]


def export(model: str, output, *, passes: str | None = None, random_init: bool = False, seed: int = 0,
           force: bool = False, quiet: bool = False, precision: str = "fp32", prompt_cache: str | None = None,
           progress=None, fp32_draws: str = "needed"):
    """Export ``model`` (a local HF folder, a hub id in the local cache, or with ``random_init`` a preset) to
    ``output``: ONNX graphs + ``manifest.json``, passes applied and verified. Returns the folder's path.
    ``precision="fp16"`` converts the verified fp32 graphs last and checks them (``exporter/precision/fp16.py``).
    ``prompt_cache`` (decoder-only models): ``"shared"`` (default: the prompt's K/V once per input, read by
    all beams) or ``"per-beam"`` (HF's layout).  ``progress``: None (default) shows a bar on stderr when it
    is a terminal and nothing otherwise; True also prints one line per stage when it is not; False (or
    ``quiet=True``) prints nothing (``exporter/progress.py``).  ``elx.build_engine`` takes the same.
    ``fp32_draws``: ``"needed"`` (default) measures fp32's other rounding draws only where the graphs are outside
    a bar of the first (the same verdict, ``exporter/verification/verify.py``: ``LaterDraws``), ``"all"`` always
    (the widest bars in the manifest, for passes applied later with ``elx.apply_passes``).

    Needs the export extra (PyTorch, transformers): ``pip install 'elx[export]'``."""
    check_arguments("export", locals())  # runners/arguments.py: one line naming a wrong argument
    if fp32_draws not in ("needed", "all"):  # before the exporter's imports (torch, transformers: seconds)
        raise ElxError(f"unknown fp32_draws {fp32_draws!r}; use one of needed, all")
    from elx.exporter.export import export_model

    return export_model(model, output, random_init=random_init, passes=passes, seed=seed, force=force, quiet=quiet,
                        precision=precision, prompt_cache=prompt_cache, progress=progress, fp32_draws=fp32_draws)


def __dir__() -> list[str]:
    """The public names, the lazily loaded ones (``Generator``, ``build_engine``, ``generate_file``) included."""
    return sorted(set(globals()) | set(__all__))


def __getattr__(name: str):
    if name == "Generator":
        from elx.runners.generate import Generator

        return Generator
    if name == "build_engine":  # TensorRT engines for an export folder (exporter/tensorrt/build.py)
        from elx.exporter.tensorrt.build import build_engine

        return build_engine
    if name == "hf":  # the transformers drop-in (elx/hf.py); it imports PyTorch and transformers
        import importlib

        return importlib.import_module("elx.hf")
    if name == "generate_file":
        from elx.runners.dataset.pipeline import generate_file

        return generate_file
    raise AttributeError(f"module 'elx' has no attribute {name!r}")
