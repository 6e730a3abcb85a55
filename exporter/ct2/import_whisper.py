"""Import a faster-whisper (CTranslate2) Whisper checkpoint as a Hugging Face model folder.

``import_ct2(source, output_dir)`` reads ``model.bin`` (joining ``.partN`` files), maps every
tensor to its ``WhisperForConditionalGeneration`` name, upcasts to float32 and writes a folder
that ``from_pretrained`` loads offline: ``config.json``, ``generation_config.json``,
``model.safetensors``, ``tokenizer.json`` + ``tokenizer_config.json`` and
``preprocessor_config.json``.

Name mapping (CTranslate2 -> HF), per layer ``i``:

* ``{enc,dec}/layer_i/self_attention/linear_0`` is Q, K, V stacked on the output axis -> ``q_proj``,
  ``k_proj``, ``v_proj``; ``linear_1`` -> ``out_proj``.  HF's ``k_proj`` has no bias: the K bias is
  dropped, which is exact (it adds ``q . b_k`` to every score of a query, a constant that softmax
  removes); CTranslate2's converter stores zeros there anyway.
* ``decoder/layer_i/attention/linear_0`` -> ``encoder_attn.q_proj``, ``linear_1`` (K and V stacked)
  -> ``k_proj`` / ``v_proj``, ``linear_2`` -> ``out_proj``.
* ``.../layer_norm/{gamma,beta}`` -> ``..._layer_norm.{weight,bias}`` (``self_attn_layer_norm``,
  ``encoder_attn_layer_norm``; the ``ffn`` norm is ``final_layer_norm``); ``ffn/linear_{0,1}`` ->
  ``fc1`` / ``fc2``.
* ``encoder/conv{1,2}`` as is; ``{encoder,decoder}/position_encodings/encodings`` ->
  ``embed_positions.weight`` (sinusoids for the encoder, learned for the decoder);
  ``decoder/embeddings/weight`` -> ``embed_tokens.weight``, tied with ``proj_out`` when
  ``decoder/projection/weight`` is an alias of it (or equal to it).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from elx.exporter.atomic import output_path, staged_folder
from elx.exporter.ct2.format import Ct2Files, Ct2Model, locate_ct2_files, read_ct2_model, resolve
from elx.runners.errors import ElxError

WHISPER_SPEC = "WhisperSpec"
SAMPLING_RATE = 16000
HOP_LENGTH = 160
N_FFT = 400
NUM_TIMESTAMPS = 1501  # <|0.00|> ... <|30.00|>
TOKENIZER_MAX_LENGTH = 1024  # model_max_length in openai's tokenizer_config.json
MAX_INITIAL_TIMESTAMP_INDEX = 50  # openai's max_initial_timestamp = 1.0 s at 0.02 s per token
MULTILINGUAL_MIN_VOCAB = 51865  # openai's rule: English-only models have 51864 tokens
GELU = 3  # CTranslate2's ActivationType::GELU
# Scalar settings of the CTranslate2 spec that HF Whisper hard-codes, with the value it implies.
EXPECTED_FLAGS = {
    "decoder/activation": GELU,
    "decoder/pre_norm": 1,
    "decoder/alibi": 0,
    "decoder/scale_embeddings": 0,
    "decoder/start_from_zero_embedding": 0,
}
# Scalars that only matter to CTranslate2's runtime (heads are read separately).
IGNORED_SCALARS = {"decoder/alignment_heads", "decoder/alignment_layer", "decoder/num_heads", "encoder/num_heads"}
SPECIAL_NAMES = {
    "eot": "<|endoftext|>",
    "sot": "<|startoftranscript|>",
    "translate": "<|translate|>",
    "transcribe": "<|transcribe|>",
    "startoflm": "<|startoflm|>",
    "startofprev": "<|startofprev|>",
    "notimestamps": "<|notimestamps|>",
}
NOSPEECH_NAMES = ("<|nospeech|>", "<|nocaptions|>")
_LANGUAGE_RE = re.compile(r"<\|[a-z]{2,3}\|>$")


# ----------------------------------------------------------------------------- weights


@dataclass(frozen=True)
class WhisperDims:
    """Model sizes read from the tensor shapes (and the stored head counts)."""

    d_model: int
    encoder_layers: int
    decoder_layers: int
    encoder_attention_heads: int
    decoder_attention_heads: int
    encoder_ffn_dim: int
    decoder_ffn_dim: int
    vocab_size: int
    num_mel_bins: int
    max_source_positions: int
    max_target_positions: int


class _Tensors:
    """Reads CTranslate2 variables by name, remembering which were used."""

    def __init__(self, model: Ct2Model, label: str):
        self.model = model
        self.label = label
        self.used: set[str] = set()

    def get(self, name: str) -> np.ndarray:
        array = resolve(self.model, name)
        if array is None:
            raise ElxError(f"{self.label} lacks variable {name}: it is not a complete Whisper checkpoint")
        self.used.add(self.model.aliases.get(name, name))
        return array

    def scalar(self, name: str) -> int:
        return int(self.get(name).reshape(()))

    def layer_count(self, stack: str) -> int:
        pattern = re.compile(rf"{stack}/layer_(\d+)/")
        numbers = {int(m.group(1)) for m in map(pattern.match, self.model.variables) if m}
        if not numbers or numbers != set(range(len(numbers))):
            raise ElxError(f"{self.label} has no complete {stack} layers: it is not a Whisper checkpoint")
        return len(numbers)

    def unused(self) -> list[str]:
        return sorted(set(self.model.variables) - self.used - IGNORED_SCALARS - set(EXPECTED_FLAGS))


def _f32(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array, dtype=np.float32)


def _linear(src: _Tensors, ct2: str, hf: str) -> dict[str, np.ndarray]:
    return {f"{hf}.weight": _f32(src.get(f"{ct2}/weight")), f"{hf}.bias": _f32(src.get(f"{ct2}/bias"))}


def _norm(src: _Tensors, ct2: str, hf: str) -> dict[str, np.ndarray]:
    return {f"{hf}.weight": _f32(src.get(f"{ct2}/gamma")), f"{hf}.bias": _f32(src.get(f"{ct2}/beta"))}


def _split_linear(src: _Tensors, ct2: str, hf_names: list[str]) -> dict[str, np.ndarray]:
    """Split a stacked projection (rows Q|K|V or K|V) into HF linears; ``k_proj`` loses its bias."""
    weights = np.split(src.get(f"{ct2}/weight"), len(hf_names), axis=0)
    biases = np.split(src.get(f"{ct2}/bias"), len(hf_names), axis=0)
    out = {}
    for hf, weight, bias in zip(hf_names, weights, biases):
        out[f"{hf}.weight"] = _f32(weight)
        if not hf.endswith("k_proj"):
            out[f"{hf}.bias"] = _f32(bias)
    return out


def _attention_block(src: _Tensors, ct2: str, hf: str) -> dict[str, np.ndarray]:
    """A self-attention block: pre-norm, fused QKV, output projection."""
    return {
        **_norm(src, f"{ct2}/self_attention/layer_norm", f"{hf}.self_attn_layer_norm"),
        **_split_linear(src, f"{ct2}/self_attention/linear_0", [f"{hf}.self_attn.{p}_proj" for p in "qkv"]),
        **_linear(src, f"{ct2}/self_attention/linear_1", f"{hf}.self_attn.out_proj"),
    }


def _cross_attention_block(src: _Tensors, ct2: str, hf: str) -> dict[str, np.ndarray]:
    """The decoder's cross-attention: pre-norm, Q, fused KV, output projection."""
    return {
        **_norm(src, f"{ct2}/attention/layer_norm", f"{hf}.encoder_attn_layer_norm"),
        **_linear(src, f"{ct2}/attention/linear_0", f"{hf}.encoder_attn.q_proj"),
        **_split_linear(src, f"{ct2}/attention/linear_1", [f"{hf}.encoder_attn.{p}_proj" for p in "kv"]),
        **_linear(src, f"{ct2}/attention/linear_2", f"{hf}.encoder_attn.out_proj"),
    }


def _ffn_block(src: _Tensors, ct2: str, hf: str) -> dict[str, np.ndarray]:
    return {
        **_norm(src, f"{ct2}/ffn/layer_norm", f"{hf}.final_layer_norm"),
        **_linear(src, f"{ct2}/ffn/linear_0", f"{hf}.fc1"),
        **_linear(src, f"{ct2}/ffn/linear_1", f"{hf}.fc2"),
    }


def _encoder(src: _Tensors, layers: int) -> dict[str, np.ndarray]:
    tensors = {
        **_linear(src, "encoder/conv1", "model.encoder.conv1"),
        **_linear(src, "encoder/conv2", "model.encoder.conv2"),
        "model.encoder.embed_positions.weight": _f32(src.get("encoder/position_encodings/encodings")),
        **_norm(src, "encoder/layer_norm", "model.encoder.layer_norm"),
    }
    for i in range(layers):
        ct2, hf = f"encoder/layer_{i}", f"model.encoder.layers.{i}"
        tensors.update(_attention_block(src, ct2, hf))
        tensors.update(_ffn_block(src, ct2, hf))
    return tensors


def _decoder(src: _Tensors, layers: int) -> dict[str, np.ndarray]:
    tensors = {
        "model.decoder.embed_tokens.weight": _f32(src.get("decoder/embeddings/weight")),
        "model.decoder.embed_positions.weight": _f32(src.get("decoder/position_encodings/encodings")),
        **_norm(src, "decoder/layer_norm", "model.decoder.layer_norm"),
    }
    for i in range(layers):
        ct2, hf = f"decoder/layer_{i}", f"model.decoder.layers.{i}"
        tensors.update(_attention_block(src, ct2, hf))
        tensors.update(_cross_attention_block(src, ct2, hf))
        tensors.update(_ffn_block(src, ct2, hf))
    return tensors


def _output_projection(src: _Tensors) -> dict[str, np.ndarray]:
    """``proj_out.weight`` when it differs from the token embedding; {} when tied."""
    embeddings = src.get("decoder/embeddings/weight")
    projection = src.get("decoder/projection/weight")
    if projection is embeddings or np.array_equal(projection, embeddings):
        return {}
    return {"proj_out.weight": _f32(projection)}


def _check_spec(model: Ct2Model, label: str) -> None:
    """Errors unless the checkpoint is an unquantized Whisper that HF Whisper can represent."""
    if model.spec != WHISPER_SPEC:
        raise ElxError(
            f"{label} holds a CTranslate2 {model.spec or 'unnamed'} model, not Whisper: "
            "only faster-whisper checkpoints can be imported"
        )
    scaled = [name for name in model.variables if name.endswith("_scale")]
    if scaled:
        raise ElxError(
            f"{label} is quantized ({scaled[0]}): re-convert it with ct2-transformers-converter --quantization float16"
        )
    for name, expected in EXPECTED_FLAGS.items():
        value = resolve(model, name)
        if value is not None and int(value.reshape(())) != expected:
            found = int(value.reshape(()))
            raise ElxError(f"{label} sets {name}={found}, which HF Whisper cannot represent (expects {expected})")


def whisper_state_dict(model: Ct2Model, label: str = "model.bin") -> tuple[dict[str, np.ndarray], WhisperDims, bool]:
    """HF ``WhisperForConditionalGeneration`` tensors (float32), the sizes, and whether proj_out is tied."""
    _check_spec(model, label)
    src = _Tensors(model, label)
    encoder_layers, decoder_layers = src.layer_count("encoder"), src.layer_count("decoder")
    tensors = {**_encoder(src, encoder_layers), **_decoder(src, decoder_layers), **_output_projection(src)}
    leftover = src.unused()
    if leftover:
        raise ElxError(
            f"{label} has variables with no HF Whisper counterpart ({leftover[0]}, ...): not a plain Whisper model"
        )
    embeddings = tensors["model.decoder.embed_tokens.weight"]
    dims = WhisperDims(
        d_model=embeddings.shape[1],
        encoder_layers=encoder_layers,
        decoder_layers=decoder_layers,
        encoder_attention_heads=src.scalar("encoder/num_heads"),
        decoder_attention_heads=src.scalar("decoder/num_heads"),
        encoder_ffn_dim=tensors["model.encoder.layers.0.fc1.weight"].shape[0],
        decoder_ffn_dim=tensors["model.decoder.layers.0.fc1.weight"].shape[0],
        vocab_size=embeddings.shape[0],
        num_mel_bins=tensors["model.encoder.conv1.weight"].shape[1],
        max_source_positions=tensors["model.encoder.embed_positions.weight"].shape[0],
        max_target_positions=tensors["model.decoder.embed_positions.weight"].shape[0],
    )
    return tensors, dims, "proj_out.weight" not in tensors


# ----------------------------------------------------------------------------- tokens


@dataclass(frozen=True)
class WhisperTokens:
    """Ids of Whisper's special tokens, read from tokenizer.json."""

    eot: int
    sot: int
    translate: int
    transcribe: int
    startoflm: int
    startofprev: int
    nospeech: int
    notimestamps: int
    languages: dict[str, int]  # "<|en|>" -> id, in id order

    @property
    def timestamp_begin(self) -> int:
        return self.notimestamps + 1


def whisper_tokens(tokenizer: dict, label: str = "tokenizer.json") -> WhisperTokens:
    """Find the special tokens (and the language tokens between sot and translate) by their text."""
    ids = dict(tokenizer.get("model", {}).get("vocab", {}))
    ids.update({token["content"]: token["id"] for token in tokenizer.get("added_tokens", [])})
    missing = [text for text in SPECIAL_NAMES.values() if text not in ids]
    nospeech = next((ids[text] for text in NOSPEECH_NAMES if text in ids), None)
    if missing or nospeech is None:
        token = (missing or list(NOSPEECH_NAMES))[0]
        raise ElxError(f"{label} lacks Whisper's special token {token}: use the tokenizer.json of this Whisper model")
    found = {key: ids[text] for key, text in SPECIAL_NAMES.items()}
    languages = {
        text: i for text, i in sorted(ids.items(), key=lambda item: item[1])
        if found["sot"] < i < found["translate"] and _LANGUAGE_RE.match(text)
    }
    return WhisperTokens(**found, nospeech=nospeech, languages=languages)


def _with_timestamp_tokens(tokenizer: dict, tokens: WhisperTokens, vocab_size: int) -> dict:
    """tokenizer.json with ``<|0.00|>`` ... added after <|notimestamps|> when it lacks them."""
    added = tokenizer.get("added_tokens", [])
    if any(token["id"] >= tokens.timestamp_begin for token in added):
        return tokenizer
    count = min(NUM_TIMESTAMPS, vocab_size - tokens.timestamp_begin)
    extra = [
        {"id": tokens.timestamp_begin + i, "content": f"<|{i * 0.02:.2f}|>", "single_word": False,
         "lstrip": False, "rstrip": False, "normalized": False, "special": False}
        for i in range(count)
    ]
    return {**tokenizer, "added_tokens": added + extra}


def _tokenizer_config(tokenizer: dict, tokens: WhisperTokens, max_length: int) -> dict:
    eot = SPECIAL_NAMES["eot"]
    added = tokenizer.get("added_tokens", [])
    specials = [t["content"] for t in added if t.get("special") and t["id"] <= tokens.notimestamps]
    return {
        "tokenizer_class": "WhisperTokenizer",
        "processor_class": "WhisperProcessor",
        "bos_token": eot,
        "eos_token": eot,
        "unk_token": eot,
        "pad_token": eot,
        "additional_special_tokens": specials,
        "add_prefix_space": False,
        "errors": "replace",
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "return_attention_mask": False,
    }


# ----------------------------------------------------------------------------- configs


def is_multilingual(dims: WhisperDims) -> bool:
    """openai's rule: multilingual models have at least 51865 tokens, English-only ones 51864."""
    return dims.vocab_size >= MULTILINGUAL_MIN_VOCAB


def model_config(dims: WhisperDims, tokens: WhisperTokens, ct2_config: dict, tied: bool) -> dict:
    """config.json in the layout of openai's HF Whisper repos (generation fields live in generation_config)."""
    multilingual = is_multilingual(dims)
    return {
        "architectures": ["WhisperForConditionalGeneration"],
        "model_type": "whisper",
        **{name: getattr(dims, name) for name in WhisperDims.__dataclass_fields__},
        "activation_function": "gelu",
        "scale_embedding": False,
        "tie_word_embeddings": tied,
        "is_encoder_decoder": True,
        "use_cache": True,
        "dropout": 0.0,
        "attention_dropout": 0.0,
        "activation_dropout": 0.0,
        "encoder_layerdrop": 0.0,
        "decoder_layerdrop": 0.0,
        "init_std": 0.02,
        "median_filter_width": 7,
        **_token_ids(tokens, multilingual),
        "suppress_tokens": list(ct2_config.get("suppress_ids", [])),
        "begin_suppress_tokens": _begin_suppress(ct2_config, tokens),
        "torch_dtype": "float32",
    }


def _token_ids(tokens: WhisperTokens, multilingual: bool) -> dict:
    # openai's repos ship bos_token_id 50257 for both kinds: <|endoftext|> in the multilingual
    # vocabulary, <|startoftranscript|> in the English-only one.
    return {
        "bos_token_id": tokens.eot if multilingual else tokens.sot,
        "eos_token_id": tokens.eot,
        "pad_token_id": tokens.eot,
        "decoder_start_token_id": tokens.sot,
    }


def _begin_suppress(ct2_config: dict, tokens: WhisperTokens) -> list[int]:
    """Suppressed at the first sampled position: " " (220) and <|endoftext|>, unless the checkpoint says."""
    return list(ct2_config.get("suppress_ids_begin", [220, tokens.eot]))


def generation_config(dims: WhisperDims, tokens: WhisperTokens, ct2_config: dict) -> dict:
    """generation_config.json matching openai's repos: tiny.en style or multilingual (base) style."""
    multilingual = is_multilingual(dims)
    config = {
        **_token_ids(tokens, multilingual),
        "max_length": dims.max_target_positions,
        "suppress_tokens": list(ct2_config.get("suppress_ids", [])),
        "begin_suppress_tokens": _begin_suppress(ct2_config, tokens),
        "no_timestamps_token_id": tokens.notimestamps,
        "prev_sot_token_id": tokens.startofprev,
        "max_initial_timestamp_index": MAX_INITIAL_TIMESTAMP_INDEX,
        "return_timestamps": False,
        "is_multilingual": multilingual,
    }
    if "alignment_heads" in ct2_config:
        config["alignment_heads"] = [list(pair) for pair in ct2_config["alignment_heads"]]
    if multilingual:  # language detected at position 1, then <|transcribe|>
        config["forced_decoder_ids"] = [[1, None], [2, tokens.transcribe]]
        config["lang_to_id"] = dict(tokens.languages)
        config["task_to_id"] = {"translate": tokens.translate, "transcribe": tokens.transcribe}
    else:
        config["forced_decoder_ids"] = [[1, tokens.notimestamps]]
    return config


def preprocessor_config(dims: WhisperDims) -> dict:
    """WhisperFeatureExtractor settings: 16 kHz, 25 ms window, 10 ms hop, 30 s chunks."""
    frames = 2 * dims.max_source_positions  # conv2 has stride 2
    samples = frames * HOP_LENGTH
    return {
        "feature_extractor_type": "WhisperFeatureExtractor",
        "processor_class": "WhisperProcessor",
        "feature_size": dims.num_mel_bins,
        "sampling_rate": SAMPLING_RATE,
        "hop_length": HOP_LENGTH,
        "n_fft": N_FFT,
        "chunk_length": samples // SAMPLING_RATE,
        "n_samples": samples,
        "nb_max_frames": frames,
        "padding_side": "right",
        "padding_value": 0.0,
        "return_attention_mask": False,
    }


# ----------------------------------------------------------------------------- writing


def _check_output_dir(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ElxError(f"output {out} already exists and is not empty: choose a new folder or delete it")


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _read_json(path: Path | None, what: str) -> dict:
    if path is None:
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ElxError(f"cannot read {what} {path} ({err.__class__.__name__}): re-download the model") from None


def _write_weights(path: Path, tensors: dict[str, np.ndarray]) -> None:
    from safetensors.numpy import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})
    path.chmod(path.parent.stat().st_mode & 0o666)  # safetensors creates it owner-only


def import_ct2(source: str | Path, output_dir: str | Path) -> Path:
    """Convert a faster-whisper checkpoint (path, folder or installed package) into an HF folder.

    Returns the output folder.  Nothing is left behind on failure: files are written to a
    temporary folder beside ``output_dir`` that is renamed into place at the end.
    """
    out = output_path(output_dir)
    _check_output_dir(out)
    files: Ct2Files = locate_ct2_files(source)
    tokenizer_path = files.side_file("tokenizer.json")
    if tokenizer_path is None:
        raise ElxError(f"no tokenizer.json beside {files.parts[0]}: copy this Whisper model's tokenizer.json there")
    tokenizer = _read_json(tokenizer_path, "tokenizer")
    ct2_config = _read_json(files.side_file("config.json"), "config")
    tensors, dims, tied = whisper_state_dict(read_ct2_model(files), files.label)
    tokens = whisper_tokens(tokenizer, str(tokenizer_path))
    if tokens.notimestamps >= dims.vocab_size:
        raise ElxError(
            f"{tokenizer_path} does not match the model ({dims.vocab_size} tokens): use this model's tokenizer.json"
        )
    with staged_folder(out) as staging:
        _write_weights(staging / "model.safetensors", tensors)
        _write_json(staging / "config.json", model_config(dims, tokens, ct2_config, tied))
        _write_json(staging / "generation_config.json", generation_config(dims, tokens, ct2_config))
        _write_json(staging / "preprocessor_config.json", preprocessor_config(dims))
        _write_json(staging / "tokenizer.json", _with_timestamp_tokens(tokenizer, tokens, dims.vocab_size))
        _write_json(staging / "tokenizer_config.json", _tokenizer_config(tokenizer, tokens, TOKENIZER_MAX_LENGTH))
    return out
