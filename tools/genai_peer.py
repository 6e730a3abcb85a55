"""ONNX Runtime GenAI (PyPI ``onnxruntime-genai``) as a GPT-2 peer for ``tools/measure_gpt2.py``.

Its model builder (``onnxruntime_genai.models.builder``, 0.18) has no GPT-2 (it builds RoPE
decoders: Llama, Phi, Qwen, Gemma, ...), but its runtime still knows ``"type": "gpt2"``: one
decoder graph run for the prompt and then per token, with the older combined cache layout
``past_{i}`` / ``present_{i}`` = stack(K, V) [2, batch, heads, length, head_size], and inputs
``input_ids``, ``attention_mask`` [batch, past + new], ``position_ids``; ``logits`` [batch, new,
vocab].  This module writes such a graph for an HF GPT-2 model (TorchScript exporter: the mask
length past + new has two free dimensions, which the dynamo exporter cannot express) and a
``genai_config.json``, then runs GenAI's own greedy/beam search.  Its search is not HF's: tokens
are compared, not assumed equal.
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np


def build(model, folder: Path, context_length: int) -> Path:
    """Write ``model.onnx`` + ``genai_config.json`` for GPT-2 ``model`` into ``folder`` (reused if present)."""
    import onnx
    import torch
    from torch import nn
    from transformers.cache_utils import DynamicCache

    folder = Path(folder)
    config = model.config
    layers, heads, head_size = config.n_layer, config.n_head, config.n_embd // config.n_head
    if not (folder / "genai_config.json").is_file():
        folder.mkdir(parents=True, exist_ok=True)

        class Single(nn.Module):
            def __init__(self):
                super().__init__()
                self.model = model

            def forward(self, input_ids, attention_mask, position_ids, *past):
                cache = DynamicCache([(p[0], p[1]) for p in past])
                out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                 past_key_values=cache, use_cache=True)
                return (out.logits, *(torch.stack([l.keys, l.values]) for l in out.past_key_values.layers))

        saved = config._attn_implementation
        config._attn_implementation = "eager"
        args = (torch.randint(3, 100, (2, 3)), torch.ones(2, 7, dtype=torch.int64),
                torch.arange(4, 7).expand(2, 3).contiguous(), *[torch.randn(2, 2, heads, 4, head_size)
                                                                for _ in range(layers)])
        past = [f"past_{i}" for i in range(layers)]
        present = [f"present_{i}" for i in range(layers)]
        axes = {"input_ids": {0: "batch", 1: "new"}, "attention_mask": {0: "batch", 1: "total"},
                "position_ids": {0: "batch", 1: "new"}, "logits": {0: "batch", 1: "new"},
                **{n: {1: "batch", 3: "past"} for n in past}, **{n: {1: "batch", 3: "total"} for n in present}}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(Single(), args, str(folder / "model.onnx"), dynamo=False, opset_version=17,
                              input_names=["input_ids", "attention_mask", "position_ids", *past],
                              output_names=["logits", *present], dynamic_axes=axes)
        config._attn_implementation = saved
        proto = onnx.load(str(folder / "model.onnx"))
        proto.ir_version = min(proto.ir_version, 10)
        onnx.save(proto, str(folder / "model.onnx"))
        eos = int(config.eos_token_id)
        genai = {"model": {
            "type": "gpt2", "bos_token_id": int(config.bos_token_id), "eos_token_id": eos, "pad_token_id": eos,
            "context_length": context_length, "vocab_size": config.vocab_size,
            "decoder": {"filename": "model.onnx", "head_size": head_size, "hidden_size": config.n_embd,
                        "num_attention_heads": heads, "num_key_value_heads": heads, "num_hidden_layers": layers,
                        "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask",
                                   "position_ids": "position_ids", "past_names": "past_%d"},
                        "outputs": {"logits": "logits", "present_names": "present_%d"},
                        "session_options": {"log_id": "elx-peer", "provider_options": []}}},
            "search": {"do_sample": False, "num_beams": 1, "num_return_sequences": 1, "max_length": context_length,
                       "min_length": 0, "early_stopping": True, "length_penalty": 1.0, "no_repeat_ngram_size": 0,
                       "past_present_share_buffer": False, "top_k": 1, "top_p": 1.0, "temperature": 1.0,
                       "repetition_penalty": 1.0, "diversity_penalty": 0.0}}
        (folder / "genai_config.json").write_text(json.dumps(genai, indent=1))
    return folder


class GenAIPeer:
    """GenAI's generator on the graph ``build`` wrote; prompts are left-padded with the pad (EOS) id."""

    name = "onnxruntime-genai (own search)"

    def __init__(self, folder: Path):
        import onnxruntime_genai as og

        self.og = og
        self.model = og.Model(str(folder))

    def generate(self, inputs: dict, num_beams: int, new_tokens: int) -> np.ndarray:
        ids = inputs["input_ids"]
        batch, width = ids.shape
        params = self.og.GeneratorParams(self.model)
        params.set_search_options(num_beams=num_beams, max_length=width + new_tokens, min_length=width + new_tokens,
                                  batch_size=batch, early_stopping=True)
        generator = self.og.Generator(self.model, params)
        generator.append_tokens(np.ascontiguousarray(ids, dtype=np.int32))
        while not generator.is_done():
            generator.generate_next_token()
        return np.array([generator.get_sequence(i) for i in range(batch)], dtype=np.int64)
