"""Where ``--model`` comes from: a local HF folder, the local HF cache, a preset with random weights, or a
GGUF file (dequantized by transformers into a plain float32 model: ``exporter/gguf/load.py``).

Nothing here downloads.  ``resolve_model`` returns the model in eval mode, its family and a
``source`` record for the manifest, so that ``elx compare`` can rebuild the very same PyTorch
model later (the preset name and seed for random weights, the folder or cache path otherwise).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from elx.runners.errors import ElxError
from elx.runners.wording import arg
from elx.exporter.families.config_checks import check_generation_config, check_model_config
from elx.exporter.families.catalog import Family, family_for_architecture
from elx.exporter.source.locate import architecture_of, locate_model, preset_names  # noqa: F401 - preset_names: also here
from elx.exporter.source.locate import find_preset as _find_preset  # noqa: F401 - tests read presets through this module

DEFAULT_SEED = 0


@dataclass
class LoadedModel:
    model: torch.nn.Module
    family: Family
    source: dict  # recorded in the manifest
    save_tokenizer: Callable | None = None  # save_tokenizer(folder) where the tokenizer is no folder's (GGUF)


def _config_class(architecture: str):
    import transformers

    model_cls = getattr(transformers, architecture)
    return model_cls, model_cls.config_class


def _first_line(err: BaseException) -> str:
    """The message's first line (two where the first only announces the second, as transformers' validators do)."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    return (" ".join(lines[:2]) if lines[0].endswith(":") and len(lines) > 1 else lines[0])[:300]


def _load_folder(folder: Path, random_init: bool, seed: int) -> tuple[torch.nn.Module, Family]:
    architecture = architecture_of(folder)
    family = family_for_architecture(architecture)
    model_cls, config_cls = _config_class(architecture)
    try:
        config = config_cls.from_pretrained(folder, local_files_only=True)
    except Exception as err:  # noqa: BLE001 - bad config values: transformers raises many types
        raise ElxError(f"cannot load the config in {folder} ({type(err).__name__}: {_first_line(err)}); check "
                       "config.json or re-save the model with save_pretrained") from None
    check_model_config(config, family)  # before any weights are read: one line naming a bad key
    try:
        if random_init:
            torch.manual_seed(seed)
            model = model_cls(config)
        else:
            # float32 whatever the checkpoint's dtype (transformers 5 loads dtype "auto": bf16 Llama weights
            # would stay bf16); the export and its verification are fp32
            model = model_cls.from_pretrained(folder, config=config, local_files_only=True, dtype=torch.float32)
    except Exception as err:  # noqa: BLE001 - truncated weights, bad config values: transformers raises many types
        raise ElxError(f"cannot load the model in {folder} ({type(err).__name__}: {_first_line(err)}); check its "
                       "files or re-save it with save_pretrained") from None
    check_generation_config(model, family)  # generation_config.json's special tokens, read with the model
    return model.eval(), family


def _load_preset(preset: dict, seed: int) -> tuple[torch.nn.Module, Family]:
    family = family_for_architecture(preset["architecture"])
    model_cls, config_cls = _config_class(preset["architecture"])
    config = config_cls(**preset["config"])
    check_model_config(config, family)
    torch.manual_seed(seed)
    model = model_cls(config)
    return model.eval(), family


def _load_gguf(spec: str, info) -> LoadedModel:
    from elx.exporter.gguf.load import load_model, load_tokenizer

    tokenizer = load_tokenizer(info)
    model = load_model(info)
    family = family_for_architecture(type(model).__name__)
    check_model_config(model.config, family)
    check_generation_config(model, family)
    source = {"kind": "gguf", "model": spec, "path": str(info.path), "random_init": False, "seed": None,
              "gguf": info.record()}
    return LoadedModel(model, family, source, save_tokenizer=tokenizer.save_pretrained)


def resolve_model(spec: str, random_init: bool = False, seed: int = DEFAULT_SEED) -> LoadedModel:
    """Load ``spec``: a local folder, a hub id in the local cache, a GGUF file, or (``random_init``) a preset."""
    where = locate_model(spec, random_init)
    if where.kind == "gguf":
        return _load_gguf(spec, where.gguf)
    if where.preset is not None:
        model, family = _load_preset(where.preset, seed)
        return LoadedModel(model, family, {"kind": where.kind, "model": spec, "preset": where.preset["name"],
                                           "random_init": True, "seed": seed})
    model, family = _load_folder(where.folder, where.random_init, seed)
    path = str(where.folder.resolve()) if where.kind != "hub-cache" else str(where.folder)
    return LoadedModel(model, family, {"kind": where.kind, "model": spec, "path": path,
                                       "random_init": where.random_init, "seed": seed if where.random_init else None})


def reload_model(source: dict) -> torch.nn.Module:
    """Rebuild the PyTorch model a manifest's ``source`` record describes (for ``elx compare``)."""
    kind = source.get("kind")
    if kind == "random-init":
        return resolve_model(source["model"], random_init=True, seed=source["seed"]).model
    if kind in ("local", "local-random-init", "hub-cache"):
        path = source["path"]
        if not Path(path).is_dir():
            raise ElxError(f"the model folder {path} recorded in the manifest is gone; pass its new place with "
                           f"{arg('model')}, re-export, or restore it")
        return resolve_model(path, random_init=source.get("random_init", False), seed=source.get("seed") or 0).model
    if kind == "gguf":
        from elx.exporter.gguf.metadata import read_gguf

        path, recorded = source["path"], (source.get("gguf") or {}).get("sha256")
        if not Path(path).is_file():
            raise ElxError(f"the GGUF file {path} recorded in the manifest is gone; pass its new place with "
                           f"{arg('model')}, re-export, or restore it")
        if recorded and read_gguf(path).sha256() != recorded:
            raise ElxError(f"the GGUF file {path} differs from the one exported (its SHA-256 changed); re-export it")
        return resolve_model(path).model
    raise ElxError(f"the manifest's source kind {kind!r} is unknown; re-export the model with this elx")
