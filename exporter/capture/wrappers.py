"""Torch modules with flat tensor interfaces, one per exported graph.

* ``EncoderGraph``: encoder inputs (token ids + mask, or log-mel features) → ``last_hidden_state``.
* ``CrossKVGraph``: ``encoder_hidden_states`` [B, N, D] → per layer ``present.{i}.encoder.key|value``
  [B, h, N, d_k], once per input sequence (batch B, never per beam).
* ``DecoderGraph``: one decoder step over ``input_ids`` [rows, t] with the self-attention past
  [rows, h, P, d_k] and the beam-shared cross K/V [B, h, N, d_k]; returns the last position's
  ``logits`` [rows, vocab] and the presents [rows, h, P + t, d_k].  rows = B·beam.

The decoder calls the HF model's own forward (so embeddings, position biases, layer norms,
logit scaling and final biases are HF's), handing it the caches as an ``EncoderDecoderCache``.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers.cache_utils import DynamicCache, EncoderDecoderCache

from elx.exporter.families.catalog import Family


class _Graph(nn.Module):
    """Base: remembers the HF model and family (the exporter switches the attention implementation)."""

    def __init__(self, model, family: Family):
        super().__init__()
        object.__setattr__(self, "hf_model", model)  # not a registered submodule
        self.family = family


class EncoderGraph(_Graph):
    def __init__(self, model, family: Family):
        super().__init__(model, family)
        self.encoder = model.get_encoder()
        self.names = [spec.name for spec in family.encoder_inputs(model.config)]

    def forward(self, *inputs):
        return self.encoder(**dict(zip(self.names, inputs))).last_hidden_state


class _CrossKV(nn.Module):
    """One decoder layer's cross-attention keys and values from the encoder output (a module per layer, so that
    the exported nodes of layer ``i`` carry its name: ``exporter/capture`` copies a layer by it)."""

    def __init__(self, k_proj, v_proj, heads: int, d_kv: int):
        super().__init__()
        self.k_proj, self.v_proj = k_proj, v_proj
        self.heads, self.d_kv = heads, d_kv

    def forward(self, encoder_hidden_states):
        b, n, _ = encoder_hidden_states.shape
        return tuple(proj(encoder_hidden_states).view(b, n, self.heads, self.d_kv).transpose(1, 2)
                     for proj in (self.k_proj, self.v_proj))


class CrossKVGraph(_Graph):
    def __init__(self, model, family: Family):
        super().__init__(model, family)
        dims = family.dims(model.config)
        layers = family.decoder_layers(model)
        self.layers = nn.ModuleList(_CrossKV(*family.cross_projections(family.cross_attention(layer)),
                                             dims["num_heads"], dims["d_kv"]) for layer in layers)
        # the HF model's decoder layer stack ("model.decoder.layers") is this wrapper's "layers" (exporter/capture)
        paths = {id(m): name for name, m in model.named_modules()}
        first = paths.get(id(layers[0]), "") if layers else ""
        self.layer_stacks = {first.rsplit(".", 1)[0]: "layers"} if first.endswith(".0") else {}

    def forward(self, encoder_hidden_states):
        out = []
        for layer in self.layers:
            out.extend(layer(encoder_hidden_states))
        return tuple(out)


class DecoderGraph(_Graph):
    def __init__(self, model, family: Family):
        super().__init__(model, family)
        self.model = model
        self.layers = family.dims(model.config)["num_decoder_layers"]
        self.d_model = family.dims(model.config)["d_model"]
        self.uses_mask = family.uses_encoder_mask

    def forward(self, input_ids, *rest):
        if self.uses_mask:
            mask, flat = rest[0], rest[1:]
        else:
            mask, flat = None, rest
        n = self.layers
        past = [(flat[2 * i], flat[2 * i + 1]) for i in range(n)]
        cross = [(flat[2 * n + 2 * i], flat[2 * n + 2 * i + 1]) for i in range(n)]
        cache = EncoderDecoderCache(DynamicCache(past), DynamicCache(cross))
        batch, _, src_len, _ = cross[0][0].shape
        # The cross K/V come precomputed; the hidden states only tell HF the batch and source length.
        hidden = torch.zeros(batch, src_len, self.d_model, dtype=cross[0][0].dtype)
        additive = None
        if mask is not None and self.family.step_mask is not None:  # the family's own form (FSMT: [B, N] 0/1)
            additive = self.family.step_mask(mask, hidden.dtype)
        elif mask is not None:  # [B, N] 0/1 → [B, 1, 1, N] additive, HF's eager convention
            additive = (1.0 - mask[:, None, None, :].to(hidden.dtype)) * torch.finfo(hidden.dtype).min
        out = self.model(encoder_outputs=(hidden,), attention_mask=additive, decoder_input_ids=input_ids,
                         past_key_values=cache, use_cache=True)
        presents = []
        for layer in out.past_key_values.self_attention_cache.layers:
            presents += [layer.keys, layer.values]
        return (out.logits[:, -1, :], *presents)
