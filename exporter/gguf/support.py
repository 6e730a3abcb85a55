"""Can transformers load this GGUF file, and can elx export what it loads?  Decided before PyTorch is imported.

* Architectures: transformers reads a GGUF file's config through the tables of
  ``transformers.integrations.ggml`` (``GGUF_CONFIG_MAPPING``: one entry per architecture its loader
  dequantizes) and ``transformers.integrations.gguf.gguf_config_mapping`` (``GGUF_CONFIG_ARCHS``: the
  architectures of its newer loader).  Both import without PyTorch.  A file spells some names with a hyphen
  or none where transformers writes an underscore (``gpt-oss``, ``qwen2moe``): names are compared without
  them.
* Tensor types: transformers' loader dequantizes each tensor with ``gguf.quants.dequantize``; the types it
  implements are found by asking it to dequantize one zero block of each type (the gguf package's own
  answer, not a list copied here).  The architectures of transformers' newer loader (``GGUF_CONFIG_ARCHS``)
  dequantize with transformers' own kernels: their types are left to transformers, whose refusal is still
  reported in one line.
* Memory: the weights dequantized to float32, about three times over while loading (the dequantized
  tensors, the model transformers builds from them, the plain model elx copies them into), against the
  memory this process can still take.
* Export: ``ELX_ARCHITECTURES`` maps the GGUF architectures whose transformers class elx exports
  (``exporter/families/catalog.py``) to that class; others can be imported (``elx import-gguf``) but not exported.
"""
from __future__ import annotations

from functools import lru_cache

from elx.exporter.gguf.metadata import GgufInfo
from elx.runners.errors import ElxError

LOAD_COPIES = 3  # float32 copies of the weights alive at once while loading (see the module docstring)
# GGUF architecture -> the transformers class it loads as, for the families elx exports
ELX_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                     "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "gpt2": "GPT2LMHeadModel"}


def _plain(name: str) -> str:
    return name.lower().replace("-", "").replace("_", "")


@lru_cache(maxsize=1)
def _transformers_tables() -> tuple[dict, dict]:
    try:
        from transformers.integrations.ggml import GGUF_CONFIG_MAPPING
    except ImportError as err:
        raise ElxError(f"reading GGUF files needs transformers ({err}); pip install 'elx[export,gguf]'") from None
    try:
        from transformers.integrations.gguf.gguf_config_mapping import GGUF_CONFIG_ARCHS
    except ImportError:  # transformers before the packed-GGUF loader
        GGUF_CONFIG_ARCHS = {}
    legacy = {name: value for name, value in GGUF_CONFIG_MAPPING.items() if name not in ("general", "tokenizer")}
    return legacy, dict(GGUF_CONFIG_ARCHS)


def supported_architectures() -> list[str]:
    """The GGUF architectures this transformers loads."""
    legacy, newer = _transformers_tables()
    return sorted(set(legacy) | set(newer))


def transformers_architecture(info: GgufInfo) -> str:
    """The architecture's name in transformers' tables (``qwen2moe`` -> ``qwen2_moe``); refused when it has
    none, with the list of what transformers loads."""
    names = {_plain(name): name for name in supported_architectures()}
    found = names.get(_plain(info.architecture))
    if found is None:
        raise ElxError(f"{info.path.name}: GGUF architecture {info.architecture!r} cannot be loaded by transformers "
                       f"(it loads {', '.join(supported_architectures())}); elx imports through transformers")
    if found == "llama" and info.name == "mistral":  # as transformers' loader renames a file llama.cpp calls llama
        return "mistral"
    return found


@lru_cache(maxsize=1)
def dequantizable_types() -> frozenset:
    """The tensor type names ``gguf.quants.dequantize`` implements (F32 and F16 included)."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    found = set()
    for kind in GGMLQuantizationType:
        block_size, type_size = GGML_QUANT_SIZES.get(kind, (0, 0))
        if not type_size:
            continue
        try:
            dequantize(np.zeros((1, type_size), dtype=np.uint8), kind)
        except NotImplementedError:
            continue
        except Exception:  # noqa: BLE001 - a type whose one-block probe fails otherwise is not relied on
            continue
        found.add(kind.name)
    return frozenset(found)


def check_tensor_types(info: GgufInfo) -> None:
    """Refuse a file holding a tensor type transformers' (gguf-package) dequantization does not implement."""
    _, newer = _transformers_tables()
    if transformers_architecture(info) in newer:
        return  # transformers' own kernels: it decides at load
    supported = dequantizable_types()
    unknown = sorted(kind for kind in info.tensor_types if kind not in supported)
    if unknown:
        raise ElxError(f"{info.path.name} holds tensors of type {', '.join(unknown)}, which transformers cannot "
                       f"dequantize (it dequantizes {', '.join(sorted(supported))}); convert the model to one of "
                       "those types with llama.cpp's llama-quantize")


def check_memory(info: GgufInfo, available: int | None = None) -> None:
    """Refuse a model whose float32 weights, as many times as loading holds them, exceed the free memory."""
    if available is None:
        from elx.runners.inputs.validation import available_memory

        available = available_memory()
    needed = LOAD_COPIES * info.float32_bytes
    if available is not None and needed > available:
        raise ElxError(f"{info.path.name} dequantizes to {_size(info.float32_bytes)} of float32 weights; loading it "
                       f"needs about {_size(needed)} and {_size(available)} of memory is free: free memory or use a "
                       "machine with more")


def _size(count: int) -> str:
    value, unit = (count / 1e9, "GB") if count >= 1e9 else (count / 1e6, "MB")
    return f"{value:.0f} {unit}" if value >= 1000 else f"{value:.3g} {unit}"


def check_loadable(info: GgufInfo) -> None:
    """Everything decided before PyTorch: the architecture, the tensor types, the memory."""
    transformers_architecture(info)
    check_tensor_types(info)
    check_memory(info)


def elx_architecture(info: GgufInfo) -> str:
    """The transformers class an exportable GGUF file loads as; refused for architectures elx does not export."""
    name = transformers_architecture(info)
    if name not in ELX_ARCHITECTURES:
        raise ElxError(f"{info.path.name}: GGUF architecture {info.architecture!r} loads in transformers but elx does "
                       f"not export it (GGUF architectures elx exports: {', '.join(sorted(ELX_ARCHITECTURES))}); "
                       "'elx import-gguf' still converts it to an HF folder")
    return ELX_ARCHITECTURES[name]


def stated_config(info: GgufInfo) -> dict:
    """The config entries the file states, under transformers' names (``llama.attention.head_count`` ->
    ``num_attention_heads``), through transformers' own table: what the early checks read (head counts)."""
    name = transformers_architecture(info)
    legacy, _ = _transformers_tables()
    config = {}
    for key, hf_name in legacy.get(name, {}).items():
        value = info.metadata.get(f"{info.architecture}.{key}")
        if isinstance(hf_name, str) and value is not None:
            config[hf_name] = value
    return config
