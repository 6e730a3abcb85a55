"""Tiny GGUF files for the tests, written with the gguf package's ``GGUFWriter`` (nothing is downloaded).

``write_llama_gguf`` writes a random tiny Llama (2 layers, hidden 64, 4 heads / 2 key-value heads, head 16)
the way llama.cpp's converter lays one out: llama.cpp's tensor names, Q and K rows permuted per head (llama.cpp
interleaves the two rotary halves; transformers undoes it on load), a tied head (no ``output.weight``), the
2-D weights in F32 or quantized with ``gguf.quants.quantize`` (Q8_0, ...) and the norms in F32.  Its tokenizer
is a byte-level BPE (``tokenizer.ggml.model = "gpt2"``) of about 300 tokens trained here with the tokenizers
library on a fixed text: tokens, merges and token types (the three ChatML specials marked CONTROL), BOS
``<|im_start|>``, EOS and PAD ``<|im_end|>`` as in SmolLM2, and a ChatML ``tokenizer.chat_template``.

``write_gguf`` writes any architecture's metadata with a given list of raw tensors (files transformers
cannot load: another architecture, a tensor type it cannot dequantize).
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import numpy as np

SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BOS, EOS = 1, 2
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
TEXT = ("the quick brown fox jumps over the lazy dog", "hello world, this is a tiny model for tests",
        "user assistant system: what is the capital of France? Paris is.", "numbers 0123456789 and symbols !?.,;")
DIMS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0)


@lru_cache(maxsize=1)
def tiny_bpe(vocab_size: int = 300) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(tokens in id order, merges as "a b"): a byte-level BPE trained on ``TEXT``, the specials first."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(list(TEXT) * 10, trainer)
    model = json.loads(tokenizer.to_str())["model"]
    tokens = tuple(token for token, _ in sorted(model["vocab"].items(), key=lambda item: item[1]))
    merges = tuple(" ".join(m) if isinstance(m, list) else m for m in model["merges"])
    return tokens, merges


def tiny_llama(seed: int = 0, vocab_size: int | None = None):
    """The random tiny Llama ``write_llama_gguf`` writes (tied head, BOS 1, EOS = PAD 2)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size or len(tiny_bpe()[0]), tie_word_embeddings=True, bos_token_id=BOS,
                         eos_token_id=EOS, pad_token_id=EOS, **DIMS)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # spread the logits like a trained model's (random init gives near-uniform ones)
        model.model.embed_tokens.weight.mul_(20)
    return model


def permute_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's layout of a Q or K projection: within each head, the rows of the two rotary halves interleaved
    (row i of the first half, row i of the second, ...)."""
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


LAYER_TENSORS = {  # llama.cpp name -> HF name inside model.layers.N
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def llama_tensors(model) -> dict[str, np.ndarray]:
    """The model's weights under llama.cpp's names, Q and K permuted."""
    config = model.config
    state = {name: value.detach().numpy().astype(np.float32) for name, value in model.state_dict().items()}
    out = {"token_embd.weight": state["model.embed_tokens.weight"]}
    for i in range(config.num_hidden_layers):
        for gguf_name, hf_name in LAYER_TENSORS.items():
            weight = state[f"model.layers.{i}.{hf_name}.weight"]
            if gguf_name == "attn_q":
                weight = permute_rows(weight, config.num_attention_heads)
            elif gguf_name == "attn_k":
                weight = permute_rows(weight, config.num_key_value_heads)
            out[f"blk.{i}.{gguf_name}.weight"] = weight
    out["output_norm.weight"] = state["model.norm.weight"]
    if not config.tie_word_embeddings:
        out["output.weight"] = state["lm_head.weight"]
    return out


def write_gguf(path, architecture: str, metadata: dict, tensors: dict, name: str = "tiny") -> Path:
    """A GGUF file: ``metadata`` as ``(GGUFWriter method, value)`` pairs by key, ``tensors`` name -> array (F32) or
    (raw bytes array, GGMLQuantizationType)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name(name)
    for method, value in metadata.values():
        getattr(writer, method)(value)
    for tensor_name, value in tensors.items():
        if isinstance(value, tuple):
            writer.add_tensor(tensor_name, value[0], raw_dtype=value[1])
        else:
            writer.add_tensor(tensor_name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def tokenizer_metadata(chat_template: str | None = CHATML) -> dict:
    tokens, merges = tiny_bpe()
    meta = {"model": ("add_tokenizer_model", "gpt2"), "pre": ("add_tokenizer_pre", "default"),
            "tokens": ("add_token_list", list(tokens)), "merges": ("add_token_merges", list(merges)),
            "types": ("add_token_types", [3 if t in SPECIAL else 1 for t in tokens]),
            "bos": ("add_bos_token_id", BOS), "eos": ("add_eos_token_id", EOS), "pad": ("add_pad_token_id", EOS),
            "unk": ("add_unk_token_id", 0)}
    if chat_template is not None:
        meta["chat"] = ("add_chat_template", chat_template)
    return meta


def llama_metadata(config) -> dict:
    import gguf

    head = config.hidden_size // config.num_attention_heads
    return {"blocks": ("add_block_count", config.num_hidden_layers),
            "context": ("add_context_length", config.max_position_embeddings),
            "embedding": ("add_embedding_length", config.hidden_size),
            "ffn": ("add_feed_forward_length", config.intermediate_size),
            "heads": ("add_head_count", config.num_attention_heads),
            "kv_heads": ("add_head_count_kv", config.num_key_value_heads),
            "rope_base": ("add_rope_freq_base", float(config.rope_parameters["rope_theta"])),
            "rope_dims": ("add_rope_dimension_count", head),
            "eps": ("add_layer_norm_rms_eps", float(config.rms_norm_eps)),
            "vocab": ("add_vocab_size", config.vocab_size),
            "file_type": ("add_file_type", int(gguf.LlamaFileType.ALL_F32))}


FILE_TYPES = {"F32": "ALL_F32", "F16": "MOSTLY_F16", "Q8_0": "MOSTLY_Q8_0", "Q4_0": "MOSTLY_Q4_0",
              "Q4_1": "MOSTLY_Q4_1"}


def write_llama_gguf(path, qtype: str = "F32", seed: int = 0, model=None, chat_template: str | None = CHATML) -> Path:
    """The tiny Llama (``tiny_llama(seed)`` unless ``model`` is given) as a GGUF file, its 2-D weights in
    ``qtype`` (F32, F16, Q8_0, Q4_0, ...), the norms in F32."""
    import gguf

    model = model if model is not None else tiny_llama(seed)
    kind = gguf.GGMLQuantizationType[qtype]
    tensors = {}
    for name, weight in llama_tensors(model).items():
        if weight.ndim == 2 and kind != gguf.GGMLQuantizationType.F32:
            tensors[name] = (gguf.quants.quantize(weight, kind), kind)
        else:
            tensors[name] = weight
    metadata = {**llama_metadata(model.config), **tokenizer_metadata(chat_template)}
    metadata["file_type"] = ("add_file_type", int(gguf.LlamaFileType[FILE_TYPES[qtype]]))
    return write_gguf(path, "llama", metadata, tensors, name="tiny llama")
