"""Decoder-only families with rotary positions (RoPE): Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma, GPT-NeoX.

Their exports are GPT-2's (``exporter/capture/decoder_only.py``: prefill + step graphs, the prompt shared by
the beams): the graphs trace HF's own modules, so RMSNorm, SwiGLU/GeGLU, Gemma's embedding scale,
Qwen2's q/k/v biases, Qwen3's q/k norms, Phi-3's fused ``qkv_proj``/``gate_up_proj``, GPT-NeoX's
parallel residual, tied or untied heads and the rotary embedding itself are HF's.  What a family
adds here is structural: where its layers are, its dims (``num_kv_heads`` for GQA/MQA, ``d_kv`` the
head width, which need not be d_model / heads, ``rotary_dim`` for partial rotary), and the config
features the exported graphs would not reproduce, refused in one line naming the config key.

RoPE as HF computes it: the rotary module runs in the traced graph on the fed position ids, with
the inverse frequencies and attention scaling its ``rope_type`` computed once at load
(``default``, ``linear``, ``llama3``, ``yarn``: constants of the graph).  ``dynamic`` and
``longrope`` recompute the frequencies from the sequence length at run time (HF updates them per
forward call), which a traced graph would freeze: refused.

A sliding window (Mistral, Phi-3, Qwen2/Qwen3 with ``use_sliding_window``) is recorded in the
manifest's dims (``sliding_window``) and the runner refuses a run that could see more tokens than
the window (``runners/families.py``: ``RopeDecoderOnlyRules``): within the window HF's mask is the
causal one the graphs apply.
"""
from __future__ import annotations

from elx.runners.errors import ElxError

from elx.exporter.families.family import Family

# rope types whose frequencies are fixed at load (the traced graph holds them as constants)
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
SOFTCAPS = ("attn_logit_softcapping", "final_logit_softcapping")


def _no_cross_attention(_):
    raise ElxError("decoder-only models have no cross-attention")


def rope_parameters(config) -> dict:
    params = getattr(config, "rope_parameters", None) or {}
    return params if isinstance(params, dict) else {}


def check_rope_config(config) -> None:
    """Refuse what the exported graphs would not reproduce (one line naming the config key)."""
    params = rope_parameters(config)
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ElxError(f"config.json rope_parameters is set per layer type ({', '.join(params)}); elx reproduces one "
                       "rotary embedding for all layers: this model cannot be exported")
    kind = params.get("rope_type", "default")
    if kind not in STATIC_ROPE_TYPES:
        raise ElxError(f"config.json rope_scaling / rope_parameters rope_type is {kind!r}; elx reproduces "
                       f"{', '.join(STATIC_ROPE_TYPES)} (frequencies fixed at load), not RoPE recomputed from the "
                       "sequence length at run time: this model cannot be exported")
    for key in SOFTCAPS:
        if getattr(config, key, None) is not None:
            raise ElxError(f"config.json sets {key} = {getattr(config, key)!r}; elx does not reproduce softcapping: "
                           "this model cannot be exported")
    _check_rope_values(params, kind, config)
    _check_sliding_window(config)


def _check_rope_values(params: dict, kind: str, config) -> None:
    """The RoPE numbers transformers builds the inverse frequencies from (it warns about some, crashes on others
    inside the traced graph, or gives NaN): each refused naming its key."""
    from elx.exporter.families.config_checks import finite_number, positive_int

    where = "config.json rope_parameters"
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    if partial is not None:
        finite_number(partial, "partial_rotary_factor", 0.0, where, inclusive=False)
        if partial > 1:
            raise ElxError(f"{where} sets partial_rotary_factor = {partial!r}; it is the share of each head that "
                           "rotates, at most 1: this model cannot be exported (fix the config)")
    if params.get("rope_theta") is not None:
        finite_number(params["rope_theta"], "rope_theta", 0.0, where, inclusive=False)
    if kind in ("linear", "llama3", "yarn"):
        finite_number(params.get("factor"), "factor", 1.0, where)  # transformers: "a float or int >= 1"
    if kind in ("llama3", "yarn"):
        positive_int(_Values(params), "original_max_position_embeddings", where)
    if kind == "llama3":
        low, high = params.get("low_freq_factor"), params.get("high_freq_factor")
        finite_number(low, "low_freq_factor", 0.0, where, inclusive=False)
        finite_number(high, "high_freq_factor", 0.0, where, inclusive=False)
        if high <= low:  # transformers divides by their difference
            raise ElxError(f"{where} sets high_freq_factor = {high!r}, not above low_freq_factor = {low!r}: this "
                           "model cannot be exported (fix the config)")
    for key in ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
        if kind == "yarn" and params.get(key) is not None:
            finite_number(params[key], key, 0.0, where)


class _Values:
    """A dict's entries as attributes (for the config checks' helpers)."""

    def __init__(self, values: dict):
        self.__dict__.update(values)


def verification_tokens() -> int:
    """The most tokens one sequence of the export's verification feeds (prompt, steps and the last token)."""
    from elx.exporter.verification.shapes import DECODER_ONLY_SHAPES

    return max(shape.source + shape.past + shape.step for shape in DECODER_ONLY_SHAPES)


def _check_sliding_window(config) -> None:
    """A window elx can export: a positive length, no shorter than the sequences its verification runs (the graphs
    attend to every earlier token; HF's window changes nothing up to its length, and runs past it are refused)."""
    window, types = getattr(config, "sliding_window", None), getattr(config, "layer_types", None)
    if window is None or (types is not None and "sliding_attention" not in types):  # as ``sliding_window`` reads it
        return
    if not (isinstance(window, int) and not isinstance(window, bool) and window >= 1):
        raise ElxError(f"config.json sets sliding_window = {window!r}; it must be a number of tokens >= 1: this model "
                       "cannot be exported (fix the config)")
    needed = verification_tokens()
    if window < needed:
        raise ElxError(f"config.json sets sliding_window = {window}, shorter than the {needed} tokens the export's "
                       "verification feeds: elx's graphs do not apply the window (runs longer than it are refused), "
                       f"so a model with a window under {needed} tokens cannot be exported")


def sliding_window(config) -> int | None:
    """The attention window HF applies, or None.  Qwen2/Qwen3 apply it to the layers ``layer_types`` marks
    ``sliding_attention``; Mistral and Phi-3 to every layer when ``sliding_window`` is set."""
    window = getattr(config, "sliding_window", None)
    if window is None:
        return None
    types = getattr(config, "layer_types", None)
    if types is not None and "sliding_attention" not in types:
        return None
    return int(window)


def rope_dims(config) -> dict:
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    partial = rope_parameters(config).get("partial_rotary_factor", 1.0) or 1.0
    dims = dict(d_model=config.hidden_size, num_heads=heads,
                num_kv_heads=getattr(config, "num_key_value_heads", None) or heads, d_kv=head_dim,
                num_decoder_layers=config.num_hidden_layers, num_encoder_layers=0, vocab_size=config.vocab_size,
                max_position_embeddings=config.max_position_embeddings, rotary_dim=int(head_dim * partial),
                rope_type=rope_parameters(config).get("rope_type", "default"))
    window = sliding_window(config)
    if window is not None:
        dims["sliding_window"] = window
    return dims


def _rope_family(name: str, architectures: tuple, layers) -> Family:
    return Family(name=name, architectures=architectures, encoder_inputs=lambda config: (), decoder_layers=layers,
                  cross_attention=_no_cross_attention, cross_projections=_no_cross_attention, dims=rope_dims,
                  uses_encoder_mask=False, is_encoder_decoder=False, check_config=check_rope_config)


def _model_layers(m):
    return list(m.model.layers)


LLAMA = _rope_family("llama", ("LlamaForCausalLM",), _model_layers)  # Llama 2/3, CodeLlama, SmolLM2, TinyLlama
MISTRAL = _rope_family("mistral", ("MistralForCausalLM",), _model_layers)
QWEN2 = _rope_family("qwen2", ("Qwen2ForCausalLM",), _model_layers)  # q/k/v biases
QWEN3 = _rope_family("qwen3", ("Qwen3ForCausalLM",), _model_layers)  # RMSNorm of q and k per head
PHI3 = _rope_family("phi3", ("Phi3ForCausalLM",), _model_layers)  # fused qkv_proj and gate_up_proj
GEMMA = _rope_family("gemma", ("GemmaForCausalLM",), _model_layers)  # embedding scale, head_dim ≠ d/h, GeGLU
# partial rotary (rotary_pct, default 0.25), parallel residual, q/k/v fused per head
GPT_NEOX = _rope_family("gpt_neox", ("GPTNeoXForCausalLM",), lambda m: list(m.gpt_neox.layers))

ROPE_FAMILIES = (LLAMA, MISTRAL, QWEN2, QWEN3, PHI3, GEMMA, GPT_NEOX)


def is_rotary(family: str) -> bool:
    """Whether ``family`` (a manifest's family name) is one of these rotary-position families."""
    return family in {f.name for f in ROPE_FAMILIES}
