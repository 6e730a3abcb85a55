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


# config.json entries that are model sizes: each must be a positive integer when present
DIMENSIONS = ("vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_decoder_layers", "num_heads",
              "encoder_layers", "decoder_layers", "encoder_attention_heads", "decoder_attention_heads",
              "encoder_ffn_dim", "decoder_ffn_dim", "max_position_embeddings", "num_mel_bins", "max_source_positions",
              "max_target_positions", "relative_attention_num_buckets", "hidden_size", "num_attention_heads",
              "num_hidden_layers", "src_vocab_size", "tgt_vocab_size")


def _read_config(folder: Path) -> dict:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ElxError(f"{folder} has no config.json; pass a folder written by save_pretrained")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ElxError(f"{config_path} is not valid JSON ({err}); re-save the model with save_pretrained")
    if not isinstance(config, dict):
        raise ElxError(f"{config_path} holds a JSON {type(config).__name__}, not an object; re-save the model with "
                       "save_pretrained")
    return config


def _check_dimensions(config: dict, config_path: Path) -> None:
    for name in DIMENSIONS:
        value = config.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ElxError(f"{config_path}: {name} is {value!r}; model sizes must be positive integers: fix "
                           "config.json or re-save the model with save_pretrained")


def _architecture_of(folder: Path) -> str:
    config = _read_config(folder)
    config_path = folder / "config.json"
    architectures = config.get("architectures") or []
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise ElxError(f"{config_path}: architectures is {architectures!r}, not a list of class names; re-save the "
                       "model with save_pretrained")
    if not architectures:
        raise ElxError(f"{config_path} names no architecture; re-save the model with save_pretrained")
    _check_dimensions(config, config_path)
    return architectures[0]


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else type(err).__name__


def _load_folder(folder: Path, random_init: bool, seed: int) -> tuple[torch.nn.Module, Family]:
    architecture = _architecture_of(folder)
    family = family_for_architecture(architecture)
    model_cls, config_cls = _config_class(architecture)
    try:
        config = config_cls.from_pretrained(folder, local_files_only=True)
    except Exception as err:  # noqa: BLE001 - bad config values: transformers raises many types
        raise ElxError(f"cannot load the config in {folder} ({type(err).__name__}: {_first_line(err)}); check "
                       "config.json or re-save the model with save_pretrained") from None
    family.check_config(config)  # before any weights are read
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
    return model.eval(), family


def _load_preset(preset: dict, seed: int) -> tuple[torch.nn.Module, Family]:
    family = family_for_architecture(preset["architecture"])
    model_cls, config_cls = _config_class(preset["architecture"])
    config = config_cls(**preset["config"])
    family.check_config(config)
    torch.manual_seed(seed)
    model = model_cls(config)
    return model.eval(), family


def resolve_model(spec: str, random_init: bool = False, seed: int = DEFAULT_SEED) -> LoadedModel:
    """Load ``spec``: a local folder, a hub id in the local cache, or (``random_init``) a preset."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if not str(spec).strip():
        raise ElxError("--model is empty; pass a local HF folder, a hub id in the local cache, or a preset name with "
                       f"--random-init (presets: {', '.join(preset_names())})")
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
