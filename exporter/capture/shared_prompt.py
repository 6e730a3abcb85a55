"""Self-attention over a prompt shared by all beams of an item and a per-beam generated part.

FastSeq's cache de-duplication (§4.1) applied to a decoder-only model's prompt: the prompt's keys
and values are computed once per input (batch B) and read by every beam of the item; only the
tokens generated after it have per-beam cache entries.  The attention has the structure EL-attention
gives decoder-only self-attention (§3.2): "attention weights for the input and the previous output
are computed separately, then concatenated before applying softmax, then split for building the
attention result from input and output, followed by element-wise addition".

For one head, with ``k`` beams per item, ``t`` new tokens per row, queries ``q`` [B·k, t, d_k],
the item's prompt keys/values ``K_p, V_p`` [B, P, d_k] with additive padding mask ``m_p``
[B, 1, P] (0 or the float minimum), and the row's generated keys/values ``K_g, V_g``
[B·k, G + t, d_k] (this step's tokens included) with causal mask ``m_g``:

    S_p = q·K_pᵀ·s + m_p          [B·k, t, P]      (all beams of item b against the one K_p[b])
    S_g = q·K_gᵀ·s + m_g          [B·k, t, G + t]
    A   = softmax([S_p ; S_g])    one softmax over the concatenated key axis
    o   = A[..., :P]·V_p + A[..., P:]·V_g

which is exactly ``softmax(q·[K_p ; K_g]ᵀ·s + [m_p ; m_g])·[V_p ; V_g]``, plain attention over the
per-beam cache ``[K_p repeated per beam ; K_g]``, without the repeat.  The beams of item b are
stacked into the query axis of one batched product against ``K_p[b]``:
``q`` [B·k, h, t, d_k] → [B, h, k·t, d_k].  The beam count is never baked into a graph: it is
the ratio of the two batch sizes at run time.  With fewer key/value heads than query heads
(GQA, MQA) both parts group the query heads of each key head (``exporter/capture/grouped_attention.py``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from elx.exporter.capture.grouped_attention import probs_values, query_key_scores

PROMPT_KWARG = "elx_prompt"  # the keyword HF's modules pass through to the attention function


@dataclass
class SharedPrompt:
    """Per layer the prompt's keys and values [B, h, P, d_k], and its additive mask [B, 1, 1, P]."""

    keys: list
    values: list
    mask: torch.Tensor


def shared_prompt_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, gen_mask, scaling: float,
                            prompt: SharedPrompt, layer: int) -> torch.Tensor:
    """``o`` [B·k, t, h, d_k] (HF's attention-output layout) for queries [B·k, h, t, d_k] and the
    row's generated keys/values [B·k, h, G + t, d_k]; see the module doc."""
    rows, heads, t, d_k = query.shape
    k_p, v_p = prompt.keys[layer], prompt.values[layer]
    batch, _, width, _ = k_p.shape
    q_items = _beams_into_queries(query, batch)  # [B, h, k·t, d_k]
    s_p = query_key_scores(q_items, k_p) * scaling + prompt.mask  # [B, h, k·t, P]
    s_p = _queries_into_beams(s_p, rows, t)  # [B·k, h, t, P]
    s_g = query_key_scores(query, key) * scaling  # [B·k, h, t, G + t]
    if gen_mask is not None:
        s_g = s_g + gen_mask
    probs = torch.softmax(torch.cat([s_p, s_g], dim=-1), dim=-1)
    p_p, p_g = probs[..., :width], probs[..., width:]
    o_p = _queries_into_beams(probs_values(_beams_into_queries(p_p, batch), v_p), rows, t)  # [B·k, h, t, d_k]
    out = o_p + probs_values(p_g, value)
    return out.transpose(1, 2).contiguous()


def _beams_into_queries(x: torch.Tensor, batch: int) -> torch.Tensor:
    """[B·k, h, t, n] → [B, h, k·t, n]: the beams of an item become query rows of one product."""
    rows, heads, t, n = x.shape
    return x.reshape(batch, -1, heads, t, n).transpose(1, 2).reshape(batch, heads, -1, n)


def _queries_into_beams(x: torch.Tensor, rows: int, t: int) -> torch.Tensor:
    """[B, h, k·t, n] → [B·k, h, t, n], the inverse of ``_beams_into_queries``."""
    batch, heads, _, n = x.shape
    return x.reshape(batch, heads, -1, t, n).transpose(1, 2).reshape(rows, heads, t, n)
