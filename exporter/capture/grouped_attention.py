"""Grouped-query attention (GQA, MQA) without repeating the keys and values per query head.

With h query heads and h_kv key/value heads (g = h / h_kv queries per key head; MQA: h_kv = 1),
query head j reads key/value head ⌊j / g⌋, as HF's ``repeat_kv`` arranges it.  Instead of copying
each key/value head g times, the g query heads of a group are stacked into the query axis of one
product per key head (a reshape, no copy: [N, h, m, d] is [N, h_kv, g·m, d] in memory):

    S = q·Kᵀ:   q [N, h, m, d] → [N, h_kv, g·m, d];  · Kᵀ [N, h_kv, d, S] → [N, h_kv, g·m, S] → [N, h, m, S]
    O = P·V:    P [N, h, m, S] → [N, h_kv, g·m, S];  · V [N, h_kv, S, d] → [N, h_kv, g·m, d] → [N, h, m, d]

Every score and output is the same dot product as with repeated keys/values.  With h_kv = h these
are the plain products (the graphs of multi-head models are unchanged).
"""
from __future__ import annotations

import torch


def query_key_scores(query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """q·Kᵀ [N, h, m, S] for queries [N, h, m, d] and keys [N, h_kv, S, d]."""
    n, heads, m, d = query.shape
    kv_heads = key.shape[1]
    if kv_heads == heads:
        return torch.matmul(query, key.transpose(2, 3))
    return torch.matmul(query.reshape(n, kv_heads, -1, d), key.transpose(2, 3)).reshape(n, heads, m, -1)


def probs_values(probs: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """P·V [N, h, m, d] for probabilities [N, h, m, S] and values [N, h_kv, S, d]."""
    n, heads, m, s = probs.shape
    kv_heads = value.shape[1]
    if kv_heads == heads:
        return torch.matmul(probs, value)
    return torch.matmul(probs.reshape(n, kv_heads, -1, s), value).reshape(n, heads, m, -1)
