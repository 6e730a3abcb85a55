"""FSMT's attention, batch-first, through elx's attention function (for tracing its graphs).

HF's FSMT (fairseq's WMT transformer) computes attention in its own module, in fairseq's
time-major layout ([t, B, D]) with ``bmm`` over [B·h, t, d_k], and never calls transformers'
``AttentionInterface``.  The exported graphs must look like the other families' (the passes
find attention by structure: projections of [rows, t, D] tensors, a QKᵀ MatMul, scale, additive
mask, Softmax, a PV MatMul) and take cross K/V once per input sequence (batch B) while the
queries come per beam (rows = B·beam).  ``batch_first_attention`` swaps each FSMT ``Attention``
module's ``forward`` for one that computes the same function of the same weights:

    x = queryᵀ (batch-first)       q = x·W_Q + b_Q           K, V: the cache's, or H·W_K + b_K, H·W_V + b_V
    o = attention(q, K, V, mask, scale d_k^-1/2)   (``elx.exporter.capture.attention.attention_forward``)
    out = (o·W_O + b_O)ᵀ  (time-major again, as FSMT's layers expect)

Masks as HF FSMT applies them: the key padding mask (True at padded keys) becomes an additive
``finfo.min`` (HF fills the score with it; either way the probability is 0), and an ``attn_mask``
(FSMT's causal mask, [t, S] additive) is added.  HF scales q before QKᵀ, elx scales the scores:
the same product up to float32 rounding (the export is verified against HF's own forward).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from elx.exporter.capture.attention import attention_forward


def _heads(x: torch.Tensor, module) -> torch.Tensor:
    """[B, t, h·d_k] → [B, h, t, d_k]"""
    b, t, _ = x.shape
    return x.view(b, t, module.num_heads, module.head_dim).transpose(1, 2)


def _keys_values(module, query_bf: torch.Tensor, key, layer_state):
    """The layer's K and V [B', h, S, d_k]: cached cross K/V, or projected (and appended to the cache)."""
    cache = None
    if layer_state is not None:
        cache = layer_state.cross_attention_cache if module.encoder_decoder_attention else \
            layer_state.self_attention_cache
    if module.encoder_decoder_attention and layer_state is not None and layer_state.is_updated.get(module.layer_idx):
        layer = cache.layers[module.layer_idx]
        return layer.keys, layer.values
    source = key.transpose(0, 1) if module.encoder_decoder_attention else query_bf  # batch-first
    k, v = _heads(module.k_proj(source), module), _heads(module.v_proj(source), module)
    if cache is not None:
        k, v = cache.update(k, v, module.layer_idx)
        if module.encoder_decoder_attention:
            layer_state.is_updated[module.layer_idx] = True
    return k, v


def fsmt_attention_forward(module, query, key, key_padding_mask=None, layer_state=None, attn_mask=None,
                           output_attentions=False, **kwargs):
    """HF FSMT ``Attention.forward``'s arguments and result (time-major), computed batch-first."""
    x = query.transpose(0, 1)  # [rows, t, D]
    q = _heads(module.q_proj(x), module)
    k, v = _keys_values(module, x, key, layer_state)
    mask = None
    if key_padding_mask is not None and key_padding_mask.dim() != 0:  # [B, S] bool, True at padding
        mask = torch.zeros(key_padding_mask.shape, dtype=q.dtype).masked_fill(key_padding_mask,
                                                                              torch.finfo(q.dtype).min)
        mask = mask[:, None, None, :]
    if attn_mask is not None:
        mask = attn_mask if mask is None else mask + attn_mask
    out, _ = attention_forward(module, q, k, v, mask, scaling=module.scaling)  # [rows, t, h, d_k]
    out = module.out_proj(out.reshape(x.shape[0], x.shape[1], -1))
    return out.transpose(0, 1), None


@contextmanager
def batch_first_attention(model):
    """Within the block every FSMT attention module of ``model`` runs ``fsmt_attention_forward``."""
    from transformers.models.fsmt.modeling_fsmt import Attention

    modules = [m for m in model.modules() if isinstance(m, Attention)]
    try:
        for module in modules:
            module.forward = fsmt_attention_forward.__get__(module)
        yield model
    finally:
        for module in modules:
            del module.forward
