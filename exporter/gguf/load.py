"""Load a GGUF file into a plain float32 transformers model and its tokenizer (PyTorch and transformers).

transformers does the work: ``AutoTokenizer.from_pretrained(folder, gguf_file=name)`` rebuilds the tokenizer
(vocabulary, merges, special tokens, chat template) from the metadata, and ``from_pretrained(...,
gguf_file=name, dtype=float32)`` dequantizes every tensor (undoing llama.cpp's Q/K row permutation).  The
model it returns is marked as GGUF-quantized (``config.quantization_config``, its quantizer), which
``save_pretrained`` refuses; so its weights are copied, every key checked, into a fresh model of the same
class built from the config without that mark: a plain model that saves, exports and reloads like any other.
``elx import-gguf`` saves exactly that model, and ``elx export --model X.gguf`` exports it, so an export of
the file and an export of its imported folder hold the same weights.

transformers' GGUF loader prints a tqdm bar on stderr that no switch turns off: stderr is captured while it
runs (its errors still surface as exceptions, reported in one line).
"""
from __future__ import annotations

import contextlib
import io

from elx.exporter.gguf.metadata import GgufInfo
from elx.runners.errors import ElxError


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0][:300]}" if text else type(err).__name__


def _auto_class(architecture: str):
    """AutoModelForSeq2SeqLM for the encoder-decoder model types (T5), AutoModelForCausalLM otherwise."""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES

    seq2seq = architecture in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES
    return AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM


def load_tokenizer(info: GgufInfo):
    from transformers import AutoTokenizer

    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return AutoTokenizer.from_pretrained(str(info.path.parent), gguf_file=info.path.name)
    except MemoryError:
        raise
    except Exception as err:  # noqa: BLE001 - the tokenizer converter raises many types
        raise ElxError(f"transformers cannot build the tokenizer of {info.path.name} ({_first_line(err)}); check "
                       "the file's tokenizer.ggml.* metadata") from None


def load_model(info: GgufInfo):
    """The file's model, dequantized to float32, as a plain transformers model in eval mode."""
    import torch

    from elx.exporter.gguf.support import transformers_architecture

    auto = _auto_class(transformers_architecture(info))
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            loaded = auto.from_pretrained(str(info.path.parent), gguf_file=info.path.name, dtype=torch.float32)
    except MemoryError:
        raise
    except Exception as err:  # noqa: BLE001 - transformers' GGUF loader raises many types
        raise ElxError(f"transformers cannot load {info.path.name} ({_first_line(err)}); check the file or convert "
                       "it again with llama.cpp") from None
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = type(loaded)(config)
    state = loaded.state_dict()
    try:
        result = plain.load_state_dict(state, strict=False)
    except RuntimeError as err:  # a tensor of another shape than the config implies
        raise ElxError(f"{info.path.name}: the dequantized weights do not fit a {type(loaded).__name__} of its config "
                       f"({_first_line(err)}); check the file's metadata") from None
    if result.missing_keys or result.unexpected_keys:
        raise ElxError(f"{info.path.name}: the dequantized weights do not fill a plain {type(loaded).__name__} "
                       f"(missing {result.missing_keys[:3]}, unexpected {result.unexpected_keys[:3]}); report this "
                       "file's architecture")
    plain.generation_config = loaded.generation_config
    del loaded, state
    return plain.eval()
