"""What ``--model`` names, read without loading it: a local folder's ``config.json``, a preset's JSON,
a hub id's snapshot in the local HF cache (elx never downloads), or a GGUF file's metadata (a path ending in
``.gguf``: ``exporter/gguf/``, with the gguf package and transformers' GGUF tables, no PyTorch).

Light on purpose (json, no PyTorch or transformers): the command line finds the model's architecture
here, and so its family, to refuse what does not apply to it (a pass, an option) before any heavy
import.  ``exporter/source/load.py`` loads the model from the same ``ModelLocation``.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from elx.runners.errors import ElxError
from elx.runners.inputs.user_files import read_user_file


@dataclass(frozen=True)
class ModelLocation:
    """Where ``--model`` points: ``kind`` is local, local-random-init, random-init (a preset), hub-cache or gguf."""

    spec: str
    kind: str
    folder: Path | None = None  # local and hub-cache models
    preset: dict | None = None  # random-init: the preset's JSON, its name included
    gguf: object | None = None  # gguf: the file's summary (exporter/gguf/metadata.py's GgufInfo)

    @property
    def random_init(self) -> bool:
        return self.kind in ("random-init", "local-random-init")

    def architecture(self) -> str:
        """The HF class name (``config.json``'s first ``architectures`` entry, the preset's, or the class a GGUF
        file's architecture loads as)."""
        if self.gguf is not None:
            from elx.exporter.gguf.support import elx_architecture

            return elx_architecture(self.gguf)
        return self.preset["architecture"] if self.preset is not None else architecture_of(self.folder)

    def config(self) -> dict:
        """The config as written (``config.json``, the preset's ``config`` or a GGUF file's metadata under
        transformers' names): no defaults filled in."""
        if self.gguf is not None:
            from elx.exporter.gguf.support import stated_config

            return stated_config(self.gguf)
        return dict(self.preset["config"]) if self.preset is not None else read_config(self.folder)


def locate_model(spec: str, random_init: bool = False) -> ModelLocation:
    """Where ``spec`` is: a local folder, (``random_init``) a preset, or a hub id in the local cache."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if not str(spec).strip():
        raise ElxError("--model is empty; pass a local HF folder, a hub id in the local cache, or a preset name with "
                       f"--random-init (presets: {', '.join(preset_names())})")
    folder = Path(spec).expanduser()
    if folder.is_dir():
        return ModelLocation(spec, "local-random-init" if random_init else "local", folder=folder)
    if str(spec).lower().endswith(".gguf"):  # a GGUF file (a folder of that name is a folder, above)
        return locate_gguf(spec, random_init)
    if random_init:
        preset = find_preset(spec)
        if preset is None and _looks_like_a_path(str(spec)):
            what = f"--model {spec!r} is a file, not a folder" if folder.exists() else f"model folder {spec!r} does not exist"
            raise ElxError(f"{what}; with --random-init, --model is a local HF folder or a preset: {', '.join(preset_names())}")
        if preset is None:
            raise ElxError(f"no preset named {spec!r} for --random-init; presets: {', '.join(preset_names())}")
        return ModelLocation(spec, "random-init", preset=preset)
    cached = cached_folder(spec)
    if cached is not None:
        return ModelLocation(spec, "hub-cache", folder=cached)
    raise ElxError(
        f"model {spec!r} is neither a local folder nor in the local Hugging Face cache (elx never downloads); "
        f"pass a folder written by save_pretrained, or add --random-init to build a preset with random weights "
        f"(presets: {', '.join(preset_names())})"
    )


def locate_gguf(spec: str, random_init: bool = False) -> ModelLocation:
    """A GGUF file: read and checked (a GGUF file, whole, an architecture and tensor types transformers loads,
    room in memory) before any heavy import."""
    if random_init:
        raise ElxError(f"--random-init does not apply to a GGUF file ({spec}): its weights are the model; drop "
                       "--random-init")
    from elx.exporter.gguf.metadata import read_gguf
    from elx.exporter.gguf.support import check_loadable

    info = read_gguf(spec)
    check_loadable(info)
    return ModelLocation(spec, "gguf", gguf=info)


def _looks_like_a_path(spec: str) -> bool:
    """A --model value meant as a folder (a separator, ``~`` or a leading dot), not a preset name."""
    return os.sep in spec or "/" in spec or spec.startswith(("~", "."))


def preset_names() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("elx.exporter.presets").iterdir() if p.name.endswith(".json"))


def find_preset(name: str) -> dict | None:
    for preset in preset_names():
        data = json.loads(resources.files("elx.exporter.presets").joinpath(f"{preset}.json").read_text())
        if name == preset or name in data["aliases"]:
            return {"name": preset, **data}
    return None


def cached_folder(model_id: str) -> Path | None:
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


def read_config(folder: Path) -> dict:
    config_path = folder / "config.json"
    if not config_path.exists():
        raise ElxError(f"{folder} has no config.json; pass a folder written by save_pretrained")
    raw = read_user_file(config_path, "the model's")  # a regular file (a FIFO would block, a device never end)
    try:
        config = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ElxError(f"{config_path} is not valid JSON ({err}); re-save the model with save_pretrained")
    if not isinstance(config, dict):
        raise ElxError(f"{config_path} holds a JSON {type(config).__name__}, not an object; re-save the model with "
                       "save_pretrained")
    return config


def check_dimensions(config: dict, config_path: Path) -> None:
    for name in DIMENSIONS:
        value = config.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ElxError(f"{config_path}: {name} is {value!r}; model sizes must be positive integers: fix "
                           "config.json or re-save the model with save_pretrained")


def architecture_of(folder: Path) -> str:
    config = read_config(folder)
    config_path = folder / "config.json"
    architectures = config.get("architectures") or []
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise ElxError(f"{config_path}: architectures is {architectures!r}, not a list of class names; re-save the "
                       "model with save_pretrained")
    if not architectures:
        raise ElxError(f"{config_path} names no architecture; re-save the model with save_pretrained")
    check_dimensions(config, config_path)
    return architectures[0]


def relocated_source(source: dict, model, family: str) -> dict:
    """The manifest's ``source`` record with the model read from ``model`` instead of its recorded path (``elx compare
    --model``, when the folder or GGUF file moved).  Light, for the command line: the new place must be the same kind
    (a folder, or a GGUF file, whose SHA-256 ``reload_model`` still checks) and hold a model of the export's
    ``family``; a seeded preset needs no weights and is refused.  Its weights are then held to the export's by the
    comparison itself."""
    from elx.runners.wording import arg

    kind = source.get("kind")
    if kind == "random-init":
        raise ElxError(f"this export's weights are the seeded preset {source.get('model')!r}, rebuilt from its manifest; "
                       f"drop {arg('model')}")
    if kind not in ("local", "local-random-init", "hub-cache", "gguf"):
        raise ElxError(f"the manifest's source kind {kind!r} is unknown; re-export the model with this elx")
    path = Path(os.path.abspath(Path(str(model)).expanduser()))
    if kind == "gguf":
        where = locate_gguf(str(path))
    else:
        if not path.is_dir():
            raise ElxError(f"{arg('model')} {model}: no such folder; name the HF folder this export was made from")
        where = locate_model(str(path), random_init=bool(source.get("random_init")))
    from elx.exporter.families.catalog import family_for_architecture

    found = family_for_architecture(where.architecture()).name
    if found != family:
        raise ElxError(f"{arg('model')} {model} holds a {found} model; this export is {family}: name the model it "
                       "was exported from")
    return {**source, "path": str(path)}
