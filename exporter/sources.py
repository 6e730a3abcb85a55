"""Where ``--model`` comes from: a local HF folder, the local HF cache, or a preset with random weights.

Nothing here downloads.  ``resolve_model`` returns the model in eval mode, its family and a
``source`` record for the manifest, so that ``elx compare`` can rebuild the very same PyTorch
model later (the preset name and seed for random weights, the folder or cache path otherwise).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from runners.errors import ElxError
from .families import Family, family_for_architecture

DEFAULT_SEED = 0


@dataclass
class LoadedModel:
    model: torch.nn.Module
    family: Family
    source: dict  # recorded in the manifest


def preset_names() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("exporter.presets").iterdir() if p.name.endswith(".json"))


def _find_preset(name: str) -> dict | None:
    for preset in preset_names():
        data = json.loads(resources.files("exporter.presets").joinpath(f"{preset}.json").read_text())
        if name == preset or name in data["aliases"]:
            return {"name": preset, **data}
    return None


def _config_class(architecture: str):
    import transformers

    model_cls = getattr(transformers, architecture)
    return model_cls, model_cls.config_class


def _cached_folder(model_id: str) -> Path | None:
    """The snapshot folder of ``model_id`` in the local HF cache, or None (never downloads)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - transformers depends on huggingface_hub
        return None
    try:
        found = try_to_load_from_cache(model_id, "config.json")
    except Exception:  # an id that is not a valid repo name
        return None
    return Path(found).parent if isinstance(found, str) else None


def _architecture_of(folder: Path) -> str:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ElxError(f"{folder} has no config.json; pass a folder written by save_pretrained")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ElxError(f"{config_path} is not valid JSON ({err}); re-save the model with save_pretrained")
    architectures = config.get("architectures") or []
    if not architectures:
        raise ElxError(f"{config_path} names no architecture; re-save the model with save_pretrained")
    return architectures[0]


def _load_folder(folder: Path, random_init: bool, seed: int) -> tuple[torch.nn.Module, Family]:
    architecture = _architecture_of(folder)
    family = family_for_architecture(architecture)
    model_cls, config_cls = _config_class(architecture)
    try:
        if random_init:
            config = config_cls.from_pretrained(folder, local_files_only=True)
            torch.manual_seed(seed)
            model = model_cls(config)
        else:
            model = model_cls.from_pretrained(folder, local_files_only=True)
    except OSError as err:
        raise ElxError(f"cannot load the model in {folder}: {str(err).splitlines()[0]}")
    return model.eval(), family


def _load_preset(preset: dict, seed: int) -> tuple[torch.nn.Module, Family]:
    family = family_for_architecture(preset["architecture"])
    model_cls, config_cls = _config_class(preset["architecture"])
    config = config_cls(**preset["config"])
    torch.manual_seed(seed)
    model = model_cls(config)
    return model.eval(), family


def resolve_model(spec: str, random_init: bool = False, seed: int = DEFAULT_SEED) -> LoadedModel:
    """Load ``spec``: a local folder, a hub id in the local cache, or (``random_init``) a preset."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    folder = Path(spec).expanduser()
    if folder.is_dir():
        model, family = _load_folder(folder, random_init, seed)
        kind = "local-random-init" if random_init else "local"
        return LoadedModel(model, family, {"kind": kind, "model": spec, "path": str(folder.resolve()),
                                           "random_init": random_init, "seed": seed if random_init else None})
    if random_init:
        preset = _find_preset(spec)
        if preset is None:
            raise ElxError(f"no preset named {spec!r} for --random-init; presets: {', '.join(preset_names())}")
        model, family = _load_preset(preset, seed)
        return LoadedModel(model, family, {"kind": "random-init", "model": spec, "preset": preset["name"],
                                           "random_init": True, "seed": seed})
    cached = _cached_folder(spec)
    if cached is not None:
        model, family = _load_folder(cached, False, seed)
        return LoadedModel(model, family, {"kind": "hub-cache", "model": spec, "path": str(cached),
                                           "random_init": False, "seed": None})
    raise ElxError(
        f"model {spec!r} is neither a local folder nor in the local Hugging Face cache (elx never downloads); "
        f"pass a folder written by save_pretrained, or add --random-init to build a preset with random weights "
        f"(presets: {', '.join(preset_names())})"
    )


def reload_model(source: dict) -> torch.nn.Module:
    """Rebuild the PyTorch model a manifest's ``source`` record describes (for ``elx compare``)."""
    kind = source.get("kind")
    if kind == "random-init":
        return resolve_model(source["model"], random_init=True, seed=source["seed"]).model
    if kind in ("local", "local-random-init", "hub-cache"):
        path = source["path"]
        if not Path(path).is_dir():
            raise ElxError(f"the model folder {path} recorded in the manifest is gone; re-export or restore it")
        return resolve_model(path, random_init=source.get("random_init", False), seed=source.get("seed") or 0).model
    raise ElxError(f"the manifest's source kind {kind!r} is unknown; re-export the model with this elx")
