"""Config values that would crash an export, or make a wrong one, refused before any weights load, naming the key.

transformers builds a model from nearly any numbers: a vocabulary of 0, a negative layer count, key/value heads
that do not divide the query heads, an EOS id past the vocabulary, a NaN epsilon.  Some of these fail later
inside PyTorch's tracer or the export's verification (tracebacks), some export and then fail at every
``generate`` (the manifest's token ids are checked against the vocabulary there), some give NaN logits.  Each
is refused here in one ``ElxError`` line naming the ``config.json`` key (or ``generation_config.json``'s, for the
special tokens ``generate`` uses), before the export starts:

* sizes (``vocab_size``, ``hidden_size``, layer and head counts, ``head_dim``, FFN widths, position tables):
  integers >= 1 where set; ``num_key_value_heads`` divides ``num_attention_heads``;
* normalization epsilons: finite numbers >= 0;
* special token ids (``eos_token_id``, a list too, ``pad_token_id``, ``bos_token_id``, ``decoder_start_token_id``,
  ``forced_bos_token_id``, ``forced_eos_token_id``): inside the vocabulary the logits span.

What only a family knows (RoPE parameters, sliding windows) is its ``Family.check_config``
(``exporter/families/rope.py``); ``check_model_config`` runs both.
"""
from __future__ import annotations

import math
from numbers import Integral, Real

from elx.runners.errors import ElxError

# sizes of every family's config classes (transformers' names), integers >= 1 wherever set
SIZES = ("vocab_size", "src_vocab_size", "tgt_vocab_size", "hidden_size", "d_model", "n_embd", "word_embed_proj_dim",
         "num_attention_heads", "num_heads", "n_head", "encoder_attention_heads", "decoder_attention_heads",
         "num_key_value_heads", "head_dim", "d_kv", "num_hidden_layers", "num_layers", "n_layer", "num_decoder_layers",
         "encoder_layers", "decoder_layers", "intermediate_size", "d_ff", "n_inner", "ffn_dim", "encoder_ffn_dim",
         "decoder_ffn_dim", "max_position_embeddings", "n_positions", "max_target_positions", "max_source_positions",
         "num_mel_bins")
EPSILONS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps")
TOKENS = ("eos_token_id", "pad_token_id", "bos_token_id", "decoder_start_token_id", "forced_bos_token_id",
          "forced_eos_token_id")


def _is_int(value) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def positive_int(config, key: str, where: str = "config.json") -> None:
    value = getattr(config, key, None)
    if value is not None and not (_is_int(value) and value >= 1):
        raise ElxError(f"{where} sets {key} = {value!r}; it must be an integer >= 1: this model cannot be exported "
                       "(fix the config)")


def finite_number(value, key: str, low: float, where: str = "config.json", inclusive: bool = True) -> None:
    """``value`` is a finite real number >= ``low`` (> ``low`` when not ``inclusive``)."""
    ok = isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value) and (
        value >= low if inclusive else value > low)
    if not ok:
        bound = f"{'>=' if inclusive else '>'} {low:g}"
        raise ElxError(f"{where} sets {key} = {value!r}; it must be a finite number {bound}: this model cannot be "
                       "exported (fix the config)")


def check_sizes(config) -> None:
    for key in SIZES:
        positive_int(config, key)
    heads, kv = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    if _is_int(heads) and _is_int(kv) and heads % kv:
        raise ElxError(f"config.json sets num_key_value_heads = {kv}, which does not divide num_attention_heads = "
                       f"{heads} (each key/value head serves a whole group of query heads): this model cannot be "
                       "exported (fix the config)")
    for key in EPSILONS:
        value = getattr(config, key, None)
        if value is not None:
            finite_number(value, key, 0.0)


def check_token_ids(source, vocab: int, where: str) -> None:
    """``source``'s special token ids (a config or a generation config) are ids of the ``vocab`` the logits span."""
    for key in TOKENS:
        value = getattr(source, key, None)
        if value is None:
            continue
        ids = list(value) if isinstance(value, (list, tuple)) else [value]
        if key == "eos_token_id" and not ids:
            continue
        bad = next((i for i in ids if not (_is_int(i) and 0 <= i < vocab)), "none")
        if bad != "none":
            shown = f"{value!r}" if len(ids) == 1 else f"{value!r} (holding {bad!r})"
            raise ElxError(f"{where} sets {key} = {shown}; token ids are integers in [0, {vocab}) (the vocabulary): "
                           "this model cannot be exported (fix the config)")


def _vocab(config, family) -> int | None:
    try:
        vocab = family.dims(config).get("vocab_size")
    except (ArithmeticError, AttributeError, TypeError, KeyError, ValueError):
        return None
    return int(vocab) if _is_int(vocab) else None


def check_model_config(config, family) -> None:
    """Everything above and the family's own checks, on a loaded config (before any weights are read)."""
    check_sizes(config)
    family.check_config(config)
    vocab = _vocab(config, family)
    if vocab is not None:
        check_token_ids(config, vocab, "config.json")


def check_generation_config(model, family) -> None:
    """The special tokens of the loaded model's generation config (what the manifest records and generate uses)."""
    vocab = _vocab(model.config, family)
    generation = getattr(model, "generation_config", None)
    if vocab is not None and generation is not None:
        check_token_ids(generation, vocab, "generation_config.json")
