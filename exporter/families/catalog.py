"""Model families elx exports, and what differs between them.

A family answers structural questions about an HF model (where the decoder layers and their
attention modules are, what the encoder consumes, the model dimensions) so that the wrappers,
the exporter and the manifest stay free of per-architecture branches.  Nothing here assumes
token-id encoder inputs (Whisper takes log-mel features) or that an encoder exists at all
(decoder-only families carry ``encoder_inputs=()``).
"""
from __future__ import annotations

from dataclasses import replace

from elx.runners.errors import ElxError

from elx.exporter.families.family import Family, TensorSpec
from elx.exporter.families.rope import ROPE_FAMILIES


def _token_encoder_inputs(config) -> tuple[TensorSpec, ...]:
    return (
        TensorSpec("input_ids", "int64", ("batch", "encoder_sequence"), "input_ids"),
        TensorSpec("attention_mask", "int64", ("batch", "encoder_sequence"), "attention_mask"),
    )


def _whisper_encoder_inputs(config) -> tuple[TensorSpec, ...]:
    frames = 2 * config.max_source_positions  # the conv stack halves the frames
    return (TensorSpec("input_features", "float32", ("batch", config.num_mel_bins, frames), "input_features"),)


def _t5_dims(c) -> dict:
    return dict(d_model=c.d_model, num_heads=c.num_heads, d_kv=c.d_kv, num_decoder_layers=c.num_decoder_layers,
                num_encoder_layers=c.num_layers, vocab_size=c.vocab_size,
                max_position_embeddings=getattr(c, "max_position_embeddings", None))


def _bart_dims(c) -> dict:
    return dict(d_model=c.d_model, num_heads=c.decoder_attention_heads, d_kv=c.d_model // c.decoder_attention_heads,
                num_decoder_layers=c.decoder_layers, num_encoder_layers=c.encoder_layers, vocab_size=c.vocab_size,
                max_position_embeddings=getattr(c, "max_position_embeddings", None))


T5 = Family(
    name="t5",
    architectures=("T5ForConditionalGeneration", "MT5ForConditionalGeneration"),
    encoder_inputs=_token_encoder_inputs,
    decoder_layers=lambda m: list(m.decoder.block),
    cross_attention=lambda layer: layer.layer[1].EncDecAttention,
    cross_projections=lambda attn: (attn.k, attn.v),
    dims=_t5_dims,
)

BART = Family(
    name="bart",
    architectures=("BartForConditionalGeneration", "MarianMTModel", "MBartForConditionalGeneration"),
    encoder_inputs=_token_encoder_inputs,
    decoder_layers=lambda m: list(m.model.decoder.layers),
    cross_attention=lambda layer: layer.encoder_attn,
    cross_projections=lambda attn: (attn.k_proj, attn.v_proj),
    dims=_bart_dims,
)

WHISPER = Family(
    name="whisper",
    architectures=("WhisperForConditionalGeneration",),
    encoder_inputs=_whisper_encoder_inputs,
    decoder_layers=lambda m: list(m.model.decoder.layers),
    cross_attention=lambda layer: layer.encoder_attn,
    cross_projections=lambda attn: (attn.k_proj, attn.v_proj),
    dims=_bart_dims,
    uses_encoder_mask=False,
    padded_inputs=False,  # 30 s of log-mel frames, never padded per row
)

def _no_cross_attention(_):
    raise ElxError("decoder-only models have no cross-attention")


def _gpt2_dims(c) -> dict:
    return dict(d_model=c.n_embd, num_heads=c.n_head, d_kv=c.n_embd // c.n_head, num_decoder_layers=c.n_layer,
                num_encoder_layers=0, vocab_size=c.vocab_size, max_position_embeddings=c.n_positions)


GPT2 = Family(
    name="gpt2",
    architectures=("GPT2LMHeadModel",),
    encoder_inputs=lambda config: (),
    decoder_layers=lambda m: list(m.transformer.h),
    cross_attention=_no_cross_attention,
    cross_projections=_no_cross_attention,
    dims=_gpt2_dims,
    uses_encoder_mask=False,
    is_encoder_decoder=False,
    flattened_projections=True,  # Conv1D exports as Reshape → Gemm → Reshape
)

def _opt_dims(c) -> dict:
    return dict(d_model=c.hidden_size, num_heads=c.num_attention_heads, d_kv=c.hidden_size // c.num_attention_heads,
                num_decoder_layers=c.num_hidden_layers, num_encoder_layers=0, vocab_size=c.vocab_size,
                max_position_embeddings=c.max_position_embeddings)


OPT = Family(  # learned absolute positions (offset 2, inside HF's embedding), fed as GPT-2's are
    name="opt",
    architectures=("OPTForCausalLM",),
    encoder_inputs=lambda config: (),
    decoder_layers=lambda m: list(m.model.decoder.layers),
    cross_attention=_no_cross_attention,
    cross_projections=_no_cross_attention,
    dims=_opt_dims,
    uses_encoder_mask=False,
    is_encoder_decoder=False,
)

# -- the translation families (issue 25) ------------------------------------------------------------------
# mBART / mBART-50 export as BART (``BART.architectures``): the same modules, pre-LN with final layer norms
# inside HF's forward; the language codes are tokens (``forced_bos_token_id``, ``decoder_start_token_id``).

M2M100 = replace(  # M2M100 / NLLB: BART's modules; sinusoidal positions counted past the pad id, scaled embeddings
    BART, name="m2m100", architectures=("M2M100ForConditionalGeneration",), full_sequence_is_stepwise=False)

PEGASUS = replace(BART, name="pegasus", architectures=("PegasusForConditionalGeneration",))  # sinusoidal positions


def _fsmt_dims(c) -> dict:
    # the decoder's (target) vocabulary is the logits' width; the encoder reads ids of the source vocabulary
    return {**_bart_dims(c), "vocab_size": c.tgt_vocab_size, "source_vocab_size": c.src_vocab_size}


def _fsmt_attention_patch(model):
    from elx.exporter.capture.fsmt_attention import batch_first_attention

    return batch_first_attention(model)


FSMT = replace(  # fairseq's WMT transformer: BART's module names, its own (time-major) attention, separate
    BART,          # source and target vocabularies
    name="fsmt",
    architectures=("FSMTForConditionalGeneration",),
    dims=_fsmt_dims,
    attention_patch=_fsmt_attention_patch,
    step_mask=lambda mask, dtype: mask,  # FSMT's decoder inverts a 0/1 [B, N] mask itself
    full_sequence_is_stepwise=False,  # its positions skip pad tokens; uncached, it attends to later tokens
    attention_implementations=("eager",),  # its own attention module: no sdpa
)

# decoder-only families with rotary positions (issue 24) are declared in exporter/families/rope.py
FAMILIES = (T5, BART, WHISPER, GPT2, OPT, M2M100, PEGASUS, FSMT) + ROPE_FAMILIES


def supported_architectures() -> list[str]:
    return sorted(a for f in FAMILIES for a in f.architectures)


def family_named(name: str) -> Family | None:
    """The family a manifest names (``Family.name``), or None."""
    return next((f for f in FAMILIES if f.name == name), None)


def family_for_architecture(architecture: str) -> Family:
    for family in FAMILIES:
        if architecture in family.architectures:
            return family
    raise ElxError(
        f"architecture {architecture!r} is not supported; elx exports {', '.join(supported_architectures())}"
    )


def hf_full_sequence_is_stepwise(model) -> bool:
    """Whether HF's uncached forward over whole decoder sequences (and so HF ``generate(use_cache=False)``)
    computes what its cached ``generate`` computes on ``model`` (not for M2M100 and FSMT)."""
    return family_for_architecture(type(model).__name__).full_sequence_is_stepwise


def hf_attention_applies(model, implementation: str) -> bool:
    """Whether HF can run ``model`` with the attention ``implementation`` ("eager", "sdpa")."""
    return implementation in family_for_architecture(type(model).__name__).attention_implementations
