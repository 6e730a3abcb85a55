"""The attention function the baseline export traces: HF's eager math, with beam-shared cross caches.

HF's modules compute projections, layer norms, position biases and FFNs; only the core
``softmax(q·kᵀ·scale + bias + mask)·v`` is ours, registered through transformers'
``AttentionInterface`` under the name ``"elx"``.  Self-attention is plain eager attention.
Cross-attention gets FastSeq's cache de-duplication (seed 001, §4.1): the cross keys and values
arrive at batch B (one copy per input sequence) while the queries arrive at B·beam rows, so
the beams of one item are stacked into the query-length axis of a single batched product:

    q  [B·beam, h, t, d_k] → [B, h, beam·t, d_k]
    P  = softmax(q·Kᵀ·scale + mask[B, 1, 1, N])          [B, h, beam·t, N]
    o  = P·V → [B·beam, t, h, d_k]

With beam = 1 this is exactly eager attention.  The beam count is never baked in: it follows
from the two batch sizes at run time.

Decoder-only self-attention with a beam-shared prompt (``exporter/capture/shared_prompt.py``) takes the
prompt's keys and values through the keyword ``elx_prompt``, which HF's modules hand on to the
attention function unchanged.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from elx.exporter.capture.grouped_attention import probs_values, query_key_scores
from elx.exporter.capture.shared_prompt import PROMPT_KWARG, shared_prompt_attention

ATTN_IMPLEMENTATION = "elx"
_CROSS_FLAG = "_elx_beam_shared_cross"


def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                  position_bias=None, **kwargs):
    if scaling is None:
        scaling = query.size(-1) ** -0.5
    if getattr(module, _CROSS_FLAG, False):
        # Cross-attention never carries a position bias in these families (T5 passes zeros).
        return _beam_shared_attention(query, key, value, attention_mask, scaling), None
    if kwargs.get(PROMPT_KWARG) is not None:
        prompt = kwargs[PROMPT_KWARG]
        return shared_prompt_attention(query, key, value, attention_mask, scaling, prompt, module.layer_idx), None
    scores = query_key_scores(query, key) * scaling  # GQA/MQA: exporter/capture/grouped_attention.py
    if position_bias is not None:
        scores = scores + position_bias
    if attention_mask is not None:
        scores = scores + attention_mask
    probs = torch.softmax(scores, dim=-1)
    return probs_values(probs, value).transpose(1, 2).contiguous(), None


def _beam_shared_attention(query, key, value, mask, scaling):
    rows, heads, t, d_k = query.shape
    batch = key.shape[0]
    q = query.reshape(batch, -1, heads, t, d_k).transpose(1, 2).reshape(batch, heads, -1, d_k)
    scores = torch.matmul(q, key.transpose(2, 3)) * scaling
    if mask is not None:
        scores = scores + mask
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, value)  # [B, h, beam·t, d_k]
    return out.reshape(batch, heads, -1, t, d_k).permute(0, 2, 3, 1, 4).reshape(rows, t, heads, d_k)


AttentionInterface.register(ATTN_IMPLEMENTATION, attention_forward)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, eager_mask)


@contextmanager
def elx_attention(model, family):
    """Within the block, every sub-config of ``model`` uses the elx attention and its cross-attention
    modules take beam-shared caches; on exit the model is as it was (the reference for verification)."""
    configs = {id(m.config): m.config for m in model.modules() if hasattr(getattr(m, "config", None), "_attn_implementation")}
    saved = {key: cfg._attn_implementation for key, cfg in configs.items()}
    cross = ([family.cross_attention(layer) for layer in family.decoder_layers(model)]
             if family.is_encoder_decoder else [])
    try:
        for cfg in configs.values():
            cfg._attn_implementation = ATTN_IMPLEMENTATION
        for module in cross:
            setattr(module, _CROSS_FLAG, True)
        with family.attention_patch(model):  # families whose own attention bypasses the interface (FSMT)
            yield model
    finally:
        for key, cfg in configs.items():
            cfg._attn_implementation = saved[key]
        for module in cross:
            delattr(module, _CROSS_FLAG)
