"""elx as a drop-in for transformers' generation models: ``generate()`` and ``pipeline()`` code runs unchanged.

``ElxModelForCausalLM``, ``ElxModelForSeq2SeqLM`` and ``ElxModelForSpeechSeq2Seq`` take the place of
``AutoModelForCausalLM`` / ``AutoModelForSeq2SeqLM`` / ``AutoModelForSpeechSeq2Seq`` (or Optimum's ``ORTModelFor...``)::

    from elx.hf import ElxModelForSeq2SeqLM
    model = ElxModelForSeq2SeqLM.from_pretrained("my-t5")          # an HF folder: exported once, then cached
    model.generate(**tokenizer(texts, return_tensors="pt", padding=True), num_beams=4)   # HF's LongTensor
    transformers.pipeline("text-generation", model=ElxModelForCausalLM.from_pretrained("my-gpt2"), tokenizer=tok)

``from_pretrained`` loads an elx export folder as it is, and exports a transformers folder (``config.json`` and
weights, as ``save_pretrained`` writes it) with ``elx.export`` into a cache folder, reused while the source folder's
files are unchanged: ``$ELX_CACHE_DIR/hf`` (default ``~/.cache/elx/hf``, or ``cache_dir=``), one folder per source
content hash, passes, precision, prompt cache form and elx version.  The search is elx's own (``elx.Generator``:
exported graphs on ONNX Runtime or TensorRT), with HF ``generate``'s semantics and tokens; this module only converts
the call's tensors to arrays and the result back to what HF ``generate`` returns: a ``torch.LongTensor``, or with
``return_dict_in_generate=True`` HF's ``Generate[Beam]{EncoderDecoder,DecoderOnly}Output``.

``import elx`` imports neither PyTorch nor transformers; this module needs both (it is the transformers drop-in).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig, GenerationConfig
from transformers.generation.utils import (GenerateBeamDecoderOnlyOutput, GenerateBeamEncoderDecoderOutput,
                                           GenerateDecoderOnlyOutput, GenerateEncoderDecoderOutput)

import elx
from elx._version import __version__
from elx.exporter.atomic import HF_CONFIG_FILES
from elx.exporter.cache_root import cache_root
from elx.exporter.gguf.metadata import file_sha256
from elx.runners.errors import ElxError
from elx.runners.generate import Generator
from elx.runners.manifest import FILENAME, Manifest

__all__ = ["ElxModelForCausalLM", "ElxModelForSeq2SeqLM", "ElxModelForSpeechSeq2Seq", "ElxPreTrainedModel",
           "default_cache_dir"]

CONFIG_FILE, GENERATION_CONFIG_FILE = HF_CONFIG_FILES
_DIGESTS_FILE = "file-digests.json"  # per-file SHA-256, keyed by path and stat, so unchanged files are read once
_DIGESTS_KEPT = 4096
# Generator.generate's own inputs and flags that are no part of HF generate: elx.Generator takes them
_GENERATOR_ONLY = ("text", "audio", "messages", "decode", "track_memory")


def default_cache_dir() -> Path:
    """Where ``from_pretrained`` keeps its exports: ``$ELX_CACHE_DIR/hf``, else ``$XDG_CACHE_HOME/elx/hf``, else
    ``~/.cache/elx/hf`` (``$ELX_CACHE_DIR`` is also where elx keeps its compiled TensorRT plugins)."""
    return cache_root() / "hf"


class _SupportedModelFilter(logging.Filter):
    """transformers' pipelines log an error when the model's class name is not in the task's list of transformers
    classes (``Pipeline.check_model_type``, a name check only); elx's classes run those tasks with HF's outputs
    (``tests/test_hf_dropin.py``), so that one message is dropped for them, and nothing else."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(message.startswith(f"The model '{name}' is not supported for") for name in _KINDS.values())


# -- the family a folder holds --------------------------------------------------------------------------------------

_KINDS = {"causal": "ElxModelForCausalLM", "seq2seq": "ElxModelForSeq2SeqLM", "speech": "ElxModelForSpeechSeq2Seq"}
_KIND_WORDS = {"causal": "decoder-only text", "seq2seq": "encoder-decoder text", "speech": "speech encoder-decoder"}


logging.getLogger("transformers.pipelines.base").addFilter(_SupportedModelFilter())


def _kind(family: str, is_encoder_decoder: bool) -> str:
    if family == "whisper":
        return "speech"
    return "seq2seq" if is_encoder_decoder else "causal"


# -- exporting a transformers folder once ---------------------------------------------------------------------------

def _write_json_atomically(path: Path, data) -> None:
    """``path`` replaced in one rename (a killed write leaves the old file, never half a file)."""
    handle, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temp, 0o666 & ~umask)  # as open() would create it (mkstemp makes it private)
        with os.fdopen(handle, "w") as out:
            json.dump(data, out, indent=1)
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def source_digest(folder: Path, cache: Path) -> str:
    """SHA-256 over the relative paths and contents of every file in ``folder`` (hidden entries aside; links
    followed, as in the hub cache's snapshots).  A file's digest is remembered in ``cache`` under its path, size,
    inode and change time (``st_ctime`` moves with every write), so an unchanged checkpoint is read once."""
    memo_path = cache / _DIGESTS_FILE
    try:
        memo = json.loads(memo_path.read_text())
        memo = memo if isinstance(memo, dict) else {}
    except (OSError, ValueError):
        memo = {}
    total, seen = hashlib.sha256(), {}
    files = sorted(p for p in folder.rglob("*")
                   if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts))
    for path in files:
        stat = path.stat()
        key = f"{path.resolve()}|{stat.st_size}|{stat.st_ino}|{stat.st_mtime_ns}|{stat.st_ctime_ns}"
        seen[key] = memo.get(key) or file_sha256(path)
        total.update(f"{path.relative_to(folder).as_posix()}\0{seen[key]}\n".encode())
    if any(key not in memo for key in seen):
        kept = {k: v for k, v in memo.items() if k not in seen}
        kept = dict(list(kept.items())[-(_DIGESTS_KEPT - len(seen)):]) if len(seen) < _DIGESTS_KEPT else {}
        try:
            cache.mkdir(parents=True, exist_ok=True)
            _write_json_atomically(memo_path, {**kept, **seen})
        except OSError:  # a read-only cache still works, it only hashes again next time
            pass
    return total.hexdigest()


def _export_key(digest: str, passes: str | None, precision: str, prompt_cache: str | None) -> str:
    passes = ",".join(p.strip() for p in passes.split(",")) if passes else ""
    record = {"source": digest, "passes": passes, "precision": precision, "prompt_cache": prompt_cache,
              "elx": __version__}
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:16]


def _copy_hf_configs(source: Path, export: Path) -> None:
    """The source's ``config.json`` and ``generation_config.json`` beside the graphs (what ``.config`` and
    ``.generation_config`` load), the latter built as transformers builds it when the source has none."""
    for name in HF_CONFIG_FILES:
        if (source / name).is_file():
            _write_json_atomically(export / name, json.loads((source / name).read_text()))
    if not (export / GENERATION_CONFIG_FILE).is_file():
        config = AutoConfig.from_pretrained(source, local_files_only=True)
        _write_json_atomically(export / GENERATION_CONFIG_FILE,
                               GenerationConfig.from_model_config(config).to_diff_dict())


def cached_export(source: Path, *, cache_dir=None, passes: str | None = None, precision: str = "fp32",
                  prompt_cache: str | None = None, again: bool = False, progress=None) -> Path:
    """The export of the transformers folder ``source`` in the cache (made with ``elx.export`` when missing, or
    ``again``): ``CACHE/<folder name>-<key>``, the key hashing the source's contents and the export's options."""
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    key = _export_key(source_digest(source, cache), passes, precision, prompt_cache)
    parts = source.resolve().parts  # a hub snapshot (models--org--name/snapshots/HASH) is named by its repository
    name = parts[-3] if len(parts) > 3 and parts[-2] == "snapshots" else parts[-1]
    out = cache / f"{name or 'model'}-{key}"
    if again or not (out / FILENAME).is_file():
        elx.export(str(source), out, passes=passes, precision=precision, prompt_cache=prompt_cache,
                   force=out.exists(), progress=progress)
    _copy_hf_configs(source, out)
    return out


# -- configs ----------------------------------------------------------------------------------------------------------

def _config_class(architecture: str):
    import transformers

    return getattr(transformers, architecture).config_class


def _stated_config(manifest: Manifest) -> dict | None:
    """The source's config as written, found through the manifest's ``source`` record (a folder, a hub snapshot, a
    preset or a GGUF file), or None when it is gone."""
    from elx.exporter.source.locate import locate_model

    source = manifest.data.get("source") or {}
    spec = source.get("path") or source.get("model")
    if not spec:
        return None
    try:
        return locate_model(str(spec), random_init=source.get("kind") == "random-init").config()
    except ElxError:
        return None


def load_config(folder: Path, manifest: Manifest):
    """The transformers ``PretrainedConfig`` of the exported model: the folder's ``config.json`` (written by
    ``from_pretrained``'s export and by ``save_pretrained``), else the source's config found through the manifest,
    else one rebuilt from the manifest alone (the class, vocabulary size and special tokens; other sizes are the
    class's defaults)."""
    architecture = manifest.data["architecture"]
    if (folder / CONFIG_FILE).is_file():
        return AutoConfig.from_pretrained(folder, local_files_only=True)
    config_class = _config_class(architecture)
    stated = _stated_config(manifest)
    if stated is not None:
        config = config_class.from_dict(stated)
    else:
        tokens = {k: _unlisted(v) for k, v in manifest.tokens.items() if v is not None}
        config = config_class(vocab_size=manifest.dims["vocab_size"], **tokens)
    config.architectures = config.architectures or [architecture]
    return config


def _unlisted(value):
    """A one-id list as the id (how transformers writes a single EOS)."""
    return value[0] if isinstance(value, list) and len(value) == 1 else value


def load_generation_config(folder: Path, manifest: Manifest) -> GenerationConfig:
    """The folder's ``generation_config.json``, else ``searched_generation_config``."""
    if (folder / GENERATION_CONFIG_FILE).is_file():
        return GenerationConfig.from_pretrained(folder, local_files_only=True)
    return searched_generation_config(manifest)


def searched_generation_config(manifest: Manifest) -> GenerationConfig:
    """The generation config elx's search applies when a call sets nothing: the manifest's generation defaults and
    special tokens (what ``elx export`` read from the model's ``generation_config``)."""
    defaults = {k: v for k, v in manifest.data.get("generation_defaults", {}).items() if k != "language_codes"}
    tokens = {k: _unlisted(v) for k, v in manifest.tokens.items() if v is not None}
    return GenerationConfig(**defaults, **tokens)


# -- tensors in, HF's outputs out -------------------------------------------------------------------------------------

def _torch_device(device) -> torch.device:
    """``"cpu"``, ``"cuda"``, ``"cuda:1"``, an index (-1: the CPU) or a ``torch.device``; CUDA always with its index."""
    try:
        if isinstance(device, int) and not isinstance(device, bool):
            device = torch.device("cpu") if device < 0 else torch.device("cuda", device)
        device = torch.device(device)
    except (TypeError, ValueError, RuntimeError):
        raise ElxError(f"device must be 'cpu', 'cuda', 'cuda:N' or a torch.device, got {device!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise ElxError(f"elx runs on the CPU or a CUDA GPU, not on {device.type!r}; pass device='cpu' or 'cuda'")
    return torch.device("cuda", device.index or 0) if device.type == "cuda" else torch.device("cpu")


def _as_array(value):
    """A tensor as a numpy array (floating point as float32); anything else as it came."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        return (value.float() if value.is_floating_point() else value).numpy()
    return value


class ElxPreTrainedModel:
    """An elx export dressed as a transformers generation model: ``generate`` returns what HF ``generate`` returns,
    and ``config``, ``generation_config``, ``device``, ``can_generate()``, ``main_input_name``, ``eval()``, ``to()``
    are there for the code (pipelines included) that reads them.  Use one of the three subclasses."""

    main_input_name = "input_ids"
    input_modalities = ("text",)
    output_modalities = ("text",)
    _kind = ""

    def __init__(self, generator: Generator, config, generation_config: GenerationConfig, *,
                 backend: str = "ort", threads: int | None = None):
        self.generator = generator
        self.config = config
        self.generation_config = generation_config
        # what the search applies by itself; generate passes the fields where generation_config differs from it
        self._baseline = searched_generation_config(generator.manifest).to_dict()
        self._backend, self._threads = backend, threads
        self._device = _torch_device(generator.model.backend.torch_device)

    # -- loading ---------------------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, model_name_or_path, *, export: bool | None = None, cache_dir=None,
                        passes: str | None = None, precision: str | None = None, prompt_cache: str | None = None,
                        backend: str = "ort", device="cpu", threads: int | None = None, progress=None, **unexpected):
        """Load an elx export folder, or a transformers model folder (or hub id in the local cache) exported with
        ``elx.export`` into the cache on first use and reused after (see the module's docstring).

        ``export``: None (default) exports a transformers folder and loads an export as it is; True exports again
        (replacing the cached export); False refuses a transformers folder.  ``passes``, ``precision`` (default
        fp32) and ``prompt_cache`` are ``elx.export``'s (for an export folder, when given, what it was made with);
        ``backend`` ("ort", "ort-io", "tensorrt"), ``device`` ("cpu", "cuda", "cuda:N") and ``threads`` are
        ``elx.Generator.from_folder``'s; ``progress`` is ``elx.export``'s (a bar on a terminal by default)."""
        if unexpected:
            raise ElxError(f"from_pretrained got {', '.join(map(repr, sorted(unexpected)))}, which elx does not take; "
                           "it takes export, cache_dir, passes, precision, prompt_cache, backend, device, threads, "
                           "progress")
        if export not in (None, True, False):
            raise ElxError(f"export must be None, True or False, got {export!r}")
        if passes is not None and not isinstance(passes, str):
            raise ElxError(f"passes must be a string such as 'el' or 'el,el-self', got {passes!r}")
        target = _torch_device(device)
        folder = _local_folder(model_name_or_path)
        if (folder / FILENAME).is_file():
            if export:
                raise ElxError(f"{folder} is an elx export already; drop export=True, or pass the transformers "
                               "folder it was exported from")
            _check_export_options(Manifest.load(folder), passes, precision, prompt_cache)
        else:
            if export is False:
                raise ElxError(f"{folder} is a transformers model folder, not an elx export; leave export unset "
                               "(or pass export=True) to export it")
            cls._check_source_kind(folder)
            folder = cached_export(folder, cache_dir=cache_dir, passes=passes, precision=precision or "fp32",
                                   prompt_cache=prompt_cache, again=bool(export), progress=progress)
        manifest = Manifest.load(folder)
        cls._check_kind(_kind(manifest.family, manifest.data.get("is_encoder_decoder", True)),
                        f"{folder} holds a {manifest.data['architecture']}")
        generator = Generator.from_folder(folder, backend=backend, device=target.type, device_id=target.index or 0,
                                          threads=threads)
        config = load_config(folder, manifest)
        config._name_or_path = str(model_name_or_path)  # as transformers names it: what the caller passed
        return cls(generator, config, load_generation_config(folder, manifest), backend=backend, threads=threads)

    @classmethod
    def _check_source_kind(cls, folder: Path) -> None:
        from elx.exporter.families.catalog import family_for_architecture
        from elx.exporter.source.locate import architecture_of

        architecture = architecture_of(folder)
        family = family_for_architecture(architecture)
        cls._check_kind(_kind(family.name, family.is_encoder_decoder), f"{folder} holds a {architecture}")

    @classmethod
    def _check_kind(cls, kind: str, what: str) -> None:
        if kind != cls._kind:
            raise ElxError(f"{what} ({_KIND_WORDS[kind]} model), which elx.hf.{cls.__name__} does not run: load it "
                           f"with elx.hf.{_KINDS[kind]}.from_pretrained")

    # -- what transformers' code reads -----------------------------------------------------------------------------
    @property
    def folder(self) -> Path:
        """The export folder the graphs are loaded from."""
        return Path(self.generator.manifest.folder)

    @property
    def name_or_path(self) -> str:
        """What ``from_pretrained`` was given (transformers' ``config.name_or_path``)."""
        return self.config.name_or_path

    @property
    def device(self) -> torch.device:
        """Where the graphs run and where ``generate`` returns its tensors."""
        return self._device

    @property
    def dtype(self) -> torch.dtype:
        """The export's precision as a torch dtype (int8 exports compute in float32 around their int8 weights)."""
        return torch.float16 if self.generator.manifest.data.get("precision") == "fp16" else torch.float32

    @classmethod
    def can_generate(cls) -> bool:
        return True

    def eval(self):
        """A no-op (the graphs have no training mode); returns the model, as ``torch.nn.Module.eval`` does."""
        return self

    def to(self, *args, **kwargs):
        """Move the graphs to another device (``"cpu"``, ``"cuda:N"``: the backend is loaded again there); a dtype
        other than the export's precision is refused (precision is chosen at export).  Returns the model."""
        wanted = [*args, *kwargs.values()]
        for value in wanted:
            if isinstance(value, torch.dtype):
                if value != self.dtype:
                    raise ElxError(f"this export computes in {self.dtype}; the precision is chosen at export: "
                                   "from_pretrained(..., precision='fp16') instead of .to(dtype)")
                continue
            target = _torch_device(value)
            if target != self._device:
                self.generator = Generator.from_folder(self.folder, backend=self._backend, device=target.type,
                                                       device_id=target.index or 0, threads=self._threads)
                self._device = target
        return self

    def __call__(self, *args, **kwargs):
        raise ElxError(f"{type(self).__name__} runs its graphs inside generate(); a forward pass returning logits is "
                       "not part of the drop-in: call generate()")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.generator!r}, device={str(self._device)!r})"

    # -- generate ----------------------------------------------------------------------------------------------------
    def generate(self, inputs=None, **kwargs):
        """HF ``generate``: the encoder inputs (``input_ids`` / ``attention_mask``, ``input_features`` for speech; as
        torch tensors, numpy arrays or lists; ``inputs`` is the ``main_input_name`` one) and HF's generation options
        (``num_beams``, ``max_new_tokens``, ``generation_config``, ``logits_processor``, ...; refused in one
        ``elx.ElxError`` line where elx does not implement them).  ``model.generation_config`` (edited, or read from
        a saved folder) gives the defaults when the call passes no ``generation_config``, as in HF.

        Returns HF's ``torch.LongTensor`` of sequences (same shape, padding and order), on ``self.device``; with
        ``return_dict_in_generate=True`` HF's output class with ``sequences``, ``sequences_scores`` (beam search with
        ``output_scores``), ``scores``, ``logits``, ``beam_indices`` (beam search) as tensors; Whisper with
        ``return_segments=True`` ``{"sequences", "segments"}`` (each segment's ``start``, ``end``, ``tokens``,
        ``idxs``; HF's inner ``result`` is not kept)."""
        if inputs is not None:
            if kwargs.get(self.main_input_name) is not None:
                raise ElxError(f"pass the inputs once: as inputs= or as {self.main_input_name}=")
            kwargs[self.main_input_name] = inputs
        refused = [name for name in _GENERATOR_ONLY if name in kwargs]
        if refused:
            raise ElxError(f"generate() takes HF generate's arguments; {refused[0]}= is elx.Generator's (use "
                           f"model.generator.generate(..., {refused[0]}=...) for it)")
        kwargs = {name: _as_array(value) for name, value in kwargs.items()}
        if kwargs.get("generation_config") is None:
            changed = {k: v for k, v in self.generation_config.to_dict().items()
                       if self._baseline.get(k) != v and not k.startswith("_") and k != "transformers_version"}
            if changed:
                kwargs["generation_config"] = changed
        out = self.generator.generate(decode=False, **kwargs)
        return self._hf_output(out, return_segments=bool(kwargs.get("return_segments")))

    def _tensor(self, array) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self._device)

    def _hf_output(self, out, return_segments: bool):
        sequences = self._tensor(np.asarray(out.sequences, dtype=np.int64))
        if return_segments and out.segments is not None:
            segments = [[{k: self._tensor(np.asarray(v)) for k, v in segment.items()} for segment in item]
                        for item in out.segments]
            return {"sequences": sequences, "segments": segments}
        settings = out.settings
        if not settings.return_dict_in_generate:
            return sequences
        steps = (lambda values: None if values is None else tuple(self._tensor(v) for v in values))
        encoder_decoder = self.generator.manifest.data.get("is_encoder_decoder", True)
        if settings.num_beams > 1:
            kind = GenerateBeamEncoderDecoderOutput if encoder_decoder else GenerateBeamDecoderOnlyOutput
            scores = self._tensor(out.sequences_scores) if settings.output_scores else None
            return kind(sequences=sequences, sequences_scores=scores, scores=steps(out.scores),
                        logits=steps(out.logits), beam_indices=self._tensor(out.beam_indices))
        kind = GenerateEncoderDecoderOutput if encoder_decoder else GenerateDecoderOnlyOutput
        return kind(sequences=sequences, scores=steps(out.scores), logits=steps(out.logits))

    # -- saving ----------------------------------------------------------------------------------------------------
    def save_pretrained(self, save_directory, **unexpected) -> None:
        """Copy the export (graphs, weights, manifest, tokenizer) into ``save_directory`` with the model's
        ``config.json`` and ``generation_config.json`` (as they are now), so that ``from_pretrained(save_directory)``
        loads it again.  Files already there that are no part of the export are left alone (the tokenizer a
        pipeline's ``save_pretrained`` writes beside it, say); the manifest is written last."""
        if unexpected:
            raise ElxError(f"save_pretrained got {', '.join(map(repr, sorted(unexpected)))}, which elx does not take "
                           "(it writes a local folder)")
        target = Path(save_directory).expanduser()
        if target.exists() and not target.is_dir():
            raise ElxError(f"{target} is a file; save_pretrained writes a folder")
        target.mkdir(parents=True, exist_ok=True)
        if target.resolve() != self.folder.resolve():
            files = sorted((p for p in self.folder.rglob("*") if p.is_file() and p.name not in HF_CONFIG_FILES),
                           key=lambda p: p.name == FILENAME)  # the manifest last: a half copy has none new
            for path in files:
                destination = target / path.relative_to(self.folder)
                destination.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, destination)
        _write_json_atomically(target / CONFIG_FILE, self.config.to_dict())
        _write_json_atomically(target / GENERATION_CONFIG_FILE, self.generation_config.to_diff_dict())


def _local_folder(spec) -> Path:
    """``spec`` as a local folder: a path, or a hub id's snapshot in the local HF cache (elx never downloads)."""
    if not isinstance(spec, (str, os.PathLike)):
        raise ElxError(f"from_pretrained takes a folder path (str or pathlib.Path), got {type(spec).__name__}")
    folder = Path(spec).expanduser()
    if folder.is_dir():
        return folder
    if str(spec).lower().endswith(".gguf"):
        raise ElxError(f"{spec} is a GGUF file; export it first ('elx export --model {spec} --output DIR') and pass "
                       "DIR, or convert it ('elx import-gguf') and pass the transformers folder")
    if folder.exists():
        raise ElxError(f"{folder} is a file; pass an elx export folder or a transformers model folder")
    from elx.exporter.source.locate import locate_model

    return locate_model(str(spec)).folder  # a hub id's snapshot, else one line saying it is neither


def _check_export_options(manifest: Manifest, passes: str | None, precision: str | None,
                          prompt_cache: str | None) -> None:
    """An export folder loads as it was made: export options asking for something else are refused."""
    folder, made = manifest.folder, manifest.pass_names()
    if passes is not None and [p.strip().split("=")[0] for p in passes.split(",") if p.strip()] != made:
        raise ElxError(f"{folder} is an export with passes {','.join(made) or 'none'!r}; passes={passes!r} is chosen "
                       "at export: drop it, or pass the transformers folder to export it with those passes")
    made_in = manifest.data.get("precision", "fp32")
    if precision is not None and precision != made_in:
        raise ElxError(f"{folder} is an {made_in} export; precision={precision!r} is chosen at export: drop it, or "
                       "pass the transformers folder to export it in that precision")
    if prompt_cache is not None:
        raise ElxError(f"{folder} is an export already; prompt_cache= is chosen at export: drop it")


class ElxModelForCausalLM(ElxPreTrainedModel):
    """Decoder-only models (GPT-2, OPT, Llama, Mistral, Qwen2/3, Phi-3, Gemma, GPT-NeoX) in place of
    ``AutoModelForCausalLM``: ``generate`` returns the prompt and the new tokens, left padding kept, as HF does."""

    _kind = "causal"


class ElxModelForSeq2SeqLM(ElxPreTrainedModel):
    """Encoder-decoder text models (T5, BART, Marian, mBART, M2M100/NLLB, Pegasus, FSMT) in place of
    ``AutoModelForSeq2SeqLM``: ``generate`` returns the decoder's sequences from the start token, as HF does."""

    _kind = "seq2seq"


class ElxModelForSpeechSeq2Seq(ElxPreTrainedModel):
    """Whisper in place of ``AutoModelForSpeechSeq2Seq`` (``WhisperForConditionalGeneration``): ``generate`` takes
    ``input_features`` and Whisper's options (language, task, timestamps, long-form) and returns what HF's Whisper
    ``generate`` returns."""

    main_input_name = "input_features"
    input_modalities = ("audio",)
    _kind = "speech"
