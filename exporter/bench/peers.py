"""Peers of ``elx bench``: other systems run on the same weights as HF and elx.

* ``ort-beamsearch``: ONNX Runtime's ``com.microsoft.BeamSearch`` op (the whole search in C++), built by
  ``onnxruntime.transformers.convert_generation --model_type t5`` from a ``save_pretrained`` copy of the
  bench's PyTorch model.  Two adjustments make that converter work beside transformers 5.x and
  ONNX Runtime 1.31: the saved config asks for eager attention (its TorchScript export at opset 12 has
  no ``scaled_dot_product_attention``), and the converted model's IR version is lowered to 10 (onnx
  1.23 writes 14; ORT 1.31 loads ≤ 13).  T5 only.  It is converted with ``--custom_attention_mask``
  and fed the bench's attention mask: the mask the op builds by itself when none is given made
  padded rows diverge from HF (measured: t5-small dims, a row with 155 of 256 real tokens
  differed from the first generated token).
* ``ct2``: CTranslate2 (``pip install ctranslate2``), with a vocabulary of unique placeholder tokens; for
  decoder-only models (Llama-family) its ``Generator`` on the prompt tokens (left padding dropped).
  Why its Llama rows differed from HF's on every row (tests/test_llama_bench.py): with default RoPE its
  greedy tokens are HF's, so the conversion (HF's model handed to CTranslate2's own converter) is right; the
  tests' tiny Llama uses Llama 3's rotary scaling (``rope_type: llama3``), and CTranslate2 4.8.5 returns
  exactly the tokens of HF's model with that scaling removed (also with ``original_max_position_embeddings``
  8192, and with it passed to its spec): it applies no llama3 frequency scaling to these configs.  Presets
  with default RoPE (SmolLM2, TinyLlama, Qwen2.5) are not affected by this.
* ``ct2-int8``: the same CTranslate2 conversion loaded with ``compute_type="int8"`` (int8 weights per output
  channel, activations quantized per row at run time): the peer of ``elx export --precision int8``.
* ``ort-genai``: ONNX Runtime GenAI (``pip install onnxruntime-genai``): its model builder
  (``python -m onnxruntime_genai.models.builder``, fp32 CPU) converts a Llama-family ``save_pretrained``
  copy (with a placeholder tokenizer: the builder reads one) and its own greedy/beam search runs the
  left-padded prompts (GenAI masks the pad id).  Decoder-only RoPE models only.

A peer is converted when made (from HF's model) and loads its runtime in ``load()``, dropped by ``release()``.
Each peer caches its converted model in ``work/<peer>/`` next to a ``source.json`` naming the
manifest source it was built from and the conversion recipe, and rebuilds when either differs.  A peer that cannot run here
raises ``PeerUnavailable`` with the reason; the bench prints it and goes on without that peer.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

import elx

PEER_NAMES = ("ort-beamsearch", "ct2", "ct2-int8", "ort-genai")


class PeerUnavailable(Exception):
    """A peer that cannot run with what is installed here (the message says why)."""


def parse_peers(text: str | None) -> list[str]:
    from elx.runners.errors import ElxError

    names = [t.strip() for t in (text or "").split(",") if t.strip()]
    unknown = [n for n in names if n not in PEER_NAMES]
    if unknown:
        raise ElxError(f"unknown peer {', '.join(unknown)}; choose from {', '.join(PEER_NAMES)}")
    return list(dict.fromkeys(names))


RECIPE = 3  # bump when a peer's conversion changes: cached conversions are rebuilt


def _fresh_folder(folder: Path, source: dict, ready: str) -> bool:
    """True when ``folder`` holds ``ready`` built from ``source`` by this recipe; otherwise empties it."""
    marker = folder / "source.json"
    if (folder / ready).is_file() and marker.is_file() and json.loads(marker.read_text()) == _key(source):
        return True
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return False


def _key(source: dict) -> dict:
    return {"source": source, "recipe": RECIPE}


def _padded(rows: list[list[int]]) -> np.ndarray:
    width = max(len(r) for r in rows)
    return np.array([r + [-1] * (width - len(r)) for r in rows], dtype=np.int64)


class Peer:
    """A converted peer; ``model`` is its loaded runtime (None until ``load``, again after ``release``)."""

    name = "peer"
    model = None

    def load(self) -> None:
        raise NotImplementedError

    def release(self) -> None:
        self.model = None

    def generate(self, inputs: dict, settings) -> np.ndarray:
        """HF's layout of the tokens for ``inputs`` (the runtime loaded first if it is not)."""
        if self.model is None:
            self.load()
        return self._generate(inputs, settings)

    def _generate(self, inputs: dict, settings) -> np.ndarray:
        raise NotImplementedError


class OrtBeamSearchPeer(Peer):
    """ONNX Runtime's BeamSearch op, converted from the bench's PyTorch model (T5 only)."""

    name = "ORT BeamSearch op"

    def __init__(self, hf_model, source: dict, work: Path, settings):
        if settings.device != "cpu":
            raise PeerUnavailable("elx bench runs it on the CPU only")
        if getattr(hf_model.config, "model_type", "") != "t5":
            raise PeerUnavailable(f"convert_generation converts T5 (and mT5) only, not {hf_model.config.model_type}")
        self.path = with_ngram(convert_t5_beam_search(hf_model, source, Path(work)), settings.no_repeat_ngram_size)
        self.threads = settings.threads

    def load(self) -> None:
        import onnxruntime as ort

        from elx.runners.backends.ort import session_options

        # elx's own session options (threads, no spinning between runs), so that neither side gains from them
        self.model = ort.InferenceSession(str(self.path), session_options(self.threads),
                                          providers=["CPUExecutionProvider"])

    def _generate(self, inputs: dict, settings) -> np.ndarray:
        length = settings.new_tokens + 1  # the decoder start token counts in max_length
        feeds = {"input_ids": inputs["input_ids"].astype(np.int32),
                 "max_length": np.array([length], np.int32), "min_length": np.array([length], np.int32),
                 "num_beams": np.array([settings.num_beams], np.int32),
                 "num_return_sequences": np.array([1], np.int32),
                 "length_penalty": np.array([1.0], np.float32), "repetition_penalty": np.array([1.0], np.float32),
                 "attention_mask": inputs["attention_mask"].astype(np.int32)}
        sequences = self.model.run(["sequences"], feeds)[0][:, 0, :]  # [batch, length], start token first
        return sequences.astype(np.int64)


def with_ngram(path: Path, ngram: int) -> Path:
    """The converted model with the BeamSearch op's ``no_repeat_ngram_size`` set (same weights file)."""
    import onnx

    if not ngram:
        return path
    out = path.with_name(f"{path.stem}.ngram{ngram}.onnx")
    model = onnx.load(str(path), load_external_data=False)
    node = next(n for n in model.graph.node if n.op_type == "BeamSearch")
    for attribute in node.attribute:
        if attribute.name == "no_repeat_ngram_size":
            attribute.i = ngram
    onnx.save_model(model, str(out))
    return out


def convert_t5_beam_search(hf_model, source: dict, work: Path) -> Path:
    """``onnxruntime.transformers.convert_generation --model_type t5`` on ``hf_model``; the op's file.

    The conversion runs in a child process: it holds several copies of the model (PyTorch, the
    TorchScript export, the ONNX protos), which a long bench process would otherwise keep (t5-base:
    a 12.6 GB bench process, killed for memory on a 23 GB machine)."""
    out = work / "beam_search.onnx"
    if _fresh_folder(work, source, out.name):
        return out
    hf_dir = work / "hf"
    hf_model.save_pretrained(hf_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    config["attn_implementation"] = "eager"  # TorchScript at opset 12 has no scaled_dot_product_attention
    (hf_dir / "config.json").write_text(json.dumps(config, indent=1))
    root = str(Path(elx.__file__).resolve().parents[1])  # the folder that holds the elx package
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run([sys.executable, "-m", "elx.exporter.bench.peers", str(hf_dir), str(out)], env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines() or [f"exit status {proc.returncode}"]
        raise PeerUnavailable(f"convert_generation failed: {lines[-1][:300]}")
    shutil.rmtree(hf_dir)
    (work / "source.json").write_text(json.dumps(_key(source)))
    return out


def _convert(hf_dir: Path, out: Path) -> None:
    """The child process of ``convert_t5_beam_search``."""
    import onnx
    from onnxruntime.transformers import convert_generation

    raw = out.parent / "converted" / out.name
    raw.parent.mkdir(exist_ok=True)
    args = convert_generation.parse_arguments(
        ["-m", str(hf_dir), "--model_type", "t5", "--output", str(raw), "--disable_parity", "--disable_perf_test",
         "--custom_attention_mask"])
    convert_generation.convert_generation_model(args)  # not main(): that reloads a tokenizer to test
    model = onnx.load(str(raw))
    model.ir_version = min(model.ir_version, 10)  # ORT 1.31 refuses the IR version 14 that onnx 1.23 writes
    onnx.save_model(model, str(out), save_as_external_data=True, location=out.name + ".data")
    shutil.rmtree(raw.parent)


class Ct2Peer(Peer):
    """CTranslate2 on the same weights, with a vocabulary of unique placeholder tokens ``<t{id}>``: its
    ``Translator`` for encoder-decoder models, its ``Generator`` for decoder-only ones."""

    name = "CTranslate2"
    compute_type = "default"  # the converted model's own (float32)

    def __init__(self, hf_model, source: dict, work: Path, settings):
        try:
            import ctranslate2  # noqa: F401 - installed, or this peer cannot run
            from ctranslate2.converters import TransformersConverter
        except ImportError as err:
            raise PeerUnavailable(f"ctranslate2 is not installed ({err}); pip install 'elx[bench]'")

        work = Path(work)
        out = work / "model"
        if not _fresh_folder(work, source, "model/model.bin"):
            src = work / "hf"
            hf_model.save_pretrained(src)
            if not hf_model.config.is_encoder_decoder:  # its Llama loader reads a tokenizer
                _placeholder_tokenizer(hf_model.config.vocab_size, src)
            try:
                TransformersConverter(str(src)).convert(str(out), force=True)
            except Exception as err:  # noqa: BLE001 - an architecture the converter does not know
                raise PeerUnavailable(f"its converter failed: {_first_line(err)}")
            vocab = [f"<t{i}>" for i in range(hf_model.config.vocab_size)]
            (out / ("vocabulary.json" if (out / "vocabulary.json").exists() else "shared_vocabulary.json")).write_text(
                json.dumps(vocab))
            if not hf_model.config.is_encoder_decoder:  # the placeholder tokenizer named no special tokens
                config, gen = json.loads((out / "config.json").read_text()), hf_model.generation_config
                eos = gen.eos_token_id[0] if isinstance(gen.eos_token_id, list) else gen.eos_token_id
                config.update(bos_token=f"<t{gen.bos_token_id}>", eos_token=f"<t{eos}>")
                (out / "config.json").write_text(json.dumps(config))
            shutil.rmtree(src)
            (work / "source.json").write_text(json.dumps(_key(source)))
        self.decoder_only = not hf_model.config.is_encoder_decoder
        self.out, self.device, self.threads = out, settings.device, settings.threads
        self.start = hf_model.generation_config.decoder_start_token_id

    def load(self) -> None:
        import ctranslate2

        kind = ctranslate2.Generator if self.decoder_only else ctranslate2.Translator
        self.model = kind(str(self.out), device=self.device, intra_threads=self.threads or 0,
                          compute_type=self.compute_type)

    def _generate(self, inputs: dict, settings) -> np.ndarray:
        batch = []
        for ids, mask in zip(inputs["input_ids"], inputs["attention_mask"]):
            batch.append([f"<t{i}>" for i in ids[mask.astype(bool)]])
        options = dict(beam_size=settings.num_beams, no_repeat_ngram_size=settings.no_repeat_ngram_size,
                       length_penalty=1.0)
        if self.decoder_only:  # HF's layout: the left-padded prompt, then the new tokens
            results = self.model.generate_batch(batch, max_length=settings.new_tokens,
                                                min_length=settings.new_tokens, include_prompt_in_result=False,
                                                **options)
            width = inputs["input_ids"].shape[1]
            return _padded([list(prompt[:width]) + [int(t[2:-1]) for t in r.sequences[0]]
                            for prompt, r in zip(inputs["input_ids"].tolist(), results)])
        results = self.model.translate_batch(batch, max_decoding_length=settings.new_tokens,
                                             min_decoding_length=settings.new_tokens, return_end_token=True, **options)
        return _padded([[self.start] + [int(t[2:-1]) for t in r.hypotheses[0]] for r in results])


class Ct2Int8Peer(Ct2Peer):
    """CTranslate2 with ``compute_type="int8"``: weights quantized to int8 when it loads the converted model
    (per output channel), activations quantized per row at run time; elx's ``--precision int8`` counterpart."""

    name = "CTranslate2 int8"
    compute_type = "int8"


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return (text.splitlines()[0] if text else type(err).__name__)[:300]


GENAI_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma")  # what GenAI's model builder converts


class GenAiPeer(Peer):
    """ONNX Runtime GenAI's own search on its model builder's conversion (fp32, CPU) of the same weights."""

    name = "onnxruntime-genai"

    def __init__(self, hf_model, source: dict, work: Path, settings):
        try:
            import onnxruntime_genai as og
        except ImportError as err:
            raise PeerUnavailable(f"onnxruntime-genai is not installed ({err}); pip install 'elx[bench]'")
        if settings.device != "cpu":
            raise PeerUnavailable("elx bench runs it on the CPU only")
        kind = getattr(hf_model.config, "model_type", "")
        if kind not in GENAI_TYPES:
            raise PeerUnavailable(f"its model builder is used here for {', '.join(GENAI_TYPES)} models, not {kind}")
        work = Path(work)
        out = work / "model"
        if not _fresh_folder(work, source, "model/genai_config.json"):
            _genai_convert(hf_model, work, out)
            (work / "source.json").write_text(json.dumps(_key(source)))
        self.og, self.out, self.threads = og, out, settings.threads

    def load(self) -> None:
        config = self.og.Config(str(self.out))
        if self.threads:  # the builder's config names no thread count; every system gets the bench's
            config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": self.threads}}}}))
        self.model = self.og.Model(config)

    def _generate(self, inputs: dict, settings) -> np.ndarray:
        ids = np.ascontiguousarray(inputs["input_ids"], dtype=np.int32)
        batch, width = ids.shape
        params = self.og.GeneratorParams(self.model)
        params.set_search_options(num_beams=settings.num_beams, max_length=width + settings.new_tokens,
                                  min_length=width + settings.new_tokens, batch_size=batch, do_sample=False,
                                  length_penalty=1.0, no_repeat_ngram_size=settings.no_repeat_ngram_size)
        generator = self.og.Generator(self.model, params)
        generator.append_tokens(ids)
        while not generator.is_done():
            generator.generate_next_token()
        return _padded([list(generator.get_sequence(i)) for i in range(batch)])


def _placeholder_tokenizer(vocab_size: int, folder: Path) -> None:
    """A word-level tokenizer of the tokens ``<t{id}>`` saved into ``folder`` (converters that read one)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({f"<t{i}>": i for i in range(vocab_size)}, unk_token="<t0>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<t0>").save_pretrained(folder)


def _genai_convert(hf_model, work: Path, out: Path) -> None:
    """``save_pretrained`` + a placeholder tokenizer (the builder saves one), then the builder in a child process."""
    src = work / "hf"
    hf_model.save_pretrained(src)
    _placeholder_tokenizer(hf_model.config.vocab_size, src)
    proc = subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(src), "-o", str(out),
                           "-p", "fp32", "-e", "cpu", "-c", str(work / "cache")], capture_output=True, text=True)
    shutil.rmtree(src, ignore_errors=True)
    shutil.rmtree(work / "cache", ignore_errors=True)
    if proc.returncode != 0 or not (out / "genai_config.json").is_file():
        lines = (proc.stderr or proc.stdout).strip().splitlines() or [f"exit status {proc.returncode}"]
        raise PeerUnavailable(f"its model builder failed: {lines[-1][:300]}")


PEERS = {"ort-beamsearch": OrtBeamSearchPeer, "ct2": Ct2Peer, "ct2-int8": Ct2Int8Peer, "ort-genai": GenAiPeer}


def make_peer(name: str, hf_model, source: dict, work: Path, settings):
    """The peer ``name``, converted from ``hf_model`` (or its cached conversion reused); ``load()`` loads its runtime
    (which needs no HF model: ``elx bench --one-at-a-time`` releases HF's model before any peer loads) and
    ``release()`` drops it."""
    return PEERS[name](hf_model, source, Path(work) / name, settings)


if __name__ == "__main__":  # python -m elx.exporter.bench.peers HF_DIR OUT: the conversion's child process
    import warnings

    warnings.filterwarnings("ignore")
    _convert(Path(sys.argv[1]), Path(sys.argv[2]))
