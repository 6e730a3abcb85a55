"""Traced templates kept between exports: a second export of the same model skips the trace.

**Why.**  Tracing a template is the fixed cost of every export (``exporter/capture/stitched.py``): 7.8 s for the
real SmolLM2-135M's prefill and 13.3 s for its step graph on the project's 2-core machine, most of it torch.export's
symbolic-shape arithmetic; nothing else on the critical path of a small model's export is as long.  Users export
the same checkpoint again and again: another ``--pass``, another ``--precision``, another ``--prompt-cache``, a
re-export after an error.  The template does not change between them.

**What is kept.**  The traced template (``onnx.ModelProto``, its tensors in a data file beside it) under
``$ELX_CACHE_DIR/templates/<key>/`` (default ``~/.cache/elx/templates``), keyed by everything its trace depends
on: the elx source (the bytes of every module of ``elx``, ``elx.exporter``, ``elx.runners``), the versions of
torch, transformers, onnx and onnxscript, the graph's file name, the template model's class, config and attention
implementation, the wrapper's class, input and output names, example shapes and dtypes and dynamic axes, and the
bytes of every tensor the template takes from the model (embeddings, head, norms, buffers: its layers' tensors are
synthetic, drawn from a fixed seed).  A graph traced whole (a model of 3 layers or fewer per stack no builder
describes, or one the stitcher refuses) is kept the same way, keyed by the bytes of all the model's tensors, where they take at most a
tenth of the cache (``whole_graph_key``): the distilled and tiny checkpoints whose export is mostly the trace.  A hit gives the graph the trace gave, byte for byte, and the export goes on
exactly as after a trace (stitching, the verification against PyTorch in full).  Beside it, the template's
bindings (which initializer holds which model tensor: ``exporter/capture/weights.py``'s ``bind``, a function of
what the key covers) once an export has computed them: a hit with bindings reads only the template's unbound
initializers and binds nothing (``load_bound``).  A template holds the
model's own non-layer tensors: the cache is the user's, like the exports ``elx.from_pretrained`` keeps beside it.

**Bounds and faults.**  At most ``ELX_TEMPLATE_CACHE_GB`` (default 4) GB: the least recently used entries go
first.  ``ELX_TEMPLATE_CACHE=0`` turns the cache off.  An entry is written to a temporary folder and renamed into
place (a killed export leaves no half entry, only a hidden partial folder removed an hour later; two exports
storing the same key keep one); an entry that cannot be
read is removed and the template traced; a cache that cannot be written (disk full, read-only) costs only the
line that says so.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import time
from pathlib import Path

import onnx

ENTRY = "template.onnx"
BINDINGS = "bindings.json"
DEFAULT_GB = 4.0
_SOURCE_DIGEST = None


def enabled() -> bool:
    """``ELX_TEMPLATE_CACHE`` is not 0/false/no/off; a malformed ``ELX_TEMPLATE_CACHE_GB`` is refused here, before
    the first template is traced or read."""
    _limit_bytes()
    return os.environ.get("ELX_TEMPLATE_CACHE", "1").strip().lower() not in ("0", "false", "no", "off")


def cache_dir() -> Path:
    from elx.exporter.cache_root import cache_root

    return cache_root() / "templates"


def _limit_bytes() -> float:
    text = os.environ.get("ELX_TEMPLATE_CACHE_GB", "").strip() or str(DEFAULT_GB)
    try:
        limit = float(text)
    except ValueError:
        limit = -1.0
    if not limit >= 0:  # NaN too
        from elx.runners.errors import ElxError

        raise ElxError(f"ELX_TEMPLATE_CACHE_GB is {text!r}; give the template cache's size in GB (a number >= 0, "
                       f"default {DEFAULT_GB:g}), or ELX_TEMPLATE_CACHE=0 to turn it off")
    return limit * 1e9


def source_digest() -> str:
    """The bytes of elx's own modules (any change to the code that traces may change the graph)."""
    global _SOURCE_DIGEST
    if _SOURCE_DIGEST is None:
        import elx
        import elx.exporter
        import elx.runners

        digest = hashlib.sha256()
        for package in (elx, elx.exporter, elx.runners):
            root = Path(package.__file__).parent
            for path in sorted(root.rglob("*.py")):
                digest.update(str(path.relative_to(root)).encode())
                digest.update(path.read_bytes())
        _SOURCE_DIGEST = digest.hexdigest()
    return _SOURCE_DIGEST


def _describe(value) -> str:
    """Shapes and dtypes of (nested) example inputs, not their values (the trace sees fake tensors)."""
    import torch

    if isinstance(value, torch.Tensor):
        return f"T{tuple(value.shape)}{value.dtype}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_describe(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_describe(v)}" for k, v in value.items()) + "}"
    return repr(value)


def _named_tensors(model) -> list:
    return sorted([*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)],
                  key=lambda item: item[0])


def _digest_tensors(model, synthetic=None) -> str:
    """The names, shapes and dtypes of ``model``'s tensors and the bytes of each (once per storage), except those
    whose names ``synthetic`` matches."""
    import torch

    digest, seen = hashlib.sha256(), set()
    for tensor_name, tensor in _named_tensors(model):
        digest.update(f"{tensor_name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        if (synthetic is not None and synthetic.match(tensor_name)) or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        digest.update(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()


def tensors_digest(template) -> str:
    """The names, shapes and dtypes of the template's tensors and the bytes of those it takes from the model (its
    layers' are synthetic, drawn from a fixed seed): computed once per export, shared by its graphs' keys."""
    from elx.exporter.capture.template import STACK

    return _digest_tensors(template.model, synthetic=STACK)


def _graph_key(name: str, spec, model, tensors: str) -> str:
    from importlib.metadata import version

    import torch
    import transformers

    digest = hashlib.sha256()
    for part in (source_digest(), torch.__version__, transformers.__version__, onnx.__version__,
                 version("onnxscript"), name, type(model).__qualname__, model.config.to_json_string(),
                 str(model.config._attn_implementation), type(spec.module).__qualname__, repr(spec.input_names),
                 repr(spec.output_names), _describe(spec.args), repr(spec.dynamic_shapes), tensors):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:40]


def template_key(name: str, spec, template, tensors: str | None = None) -> str:
    """The cache key of graph ``name``'s template traced from ``spec`` (the module docstring says what it covers);
    ``tensors``: ``tensors_digest(template)`` where the caller already has it."""
    return _graph_key(name, spec, template.model, tensors or tensors_digest(template))


def whole_graph_limit() -> float:
    """The largest model (bytes of its tensors) whose whole traced graph is kept: a tenth of the cache."""
    return _limit_bytes() / 10


def whole_graph_key(name: str, spec, model, tensors: str | None = None) -> str | None:
    """The cache key of graph ``name`` of ``model`` traced whole from ``spec`` (a model of 3 layers or fewer per
    stack, or one the stitcher refuses): as a template's, with every tensor's bytes in it; ``tensors``:
    ``model_digest(model)`` where the caller already has it.  None for a model larger than ``whole_graph_limit``."""
    if tensors is None:
        tensors = model_digest(model)
    return None if tensors is None else _graph_key("whole:" + name, spec, model, tensors)


def tensor_bytes(model) -> int:
    """The bytes of ``model``'s parameters and buffers (a tied tensor counted once per name)."""
    return sum(t.numel() * t.element_size() for _, t in _named_tensors(model))


def model_digest(model) -> str | None:
    """Every tensor of ``model`` in a digest (computed once per export); None where it is larger than
    ``whole_graph_limit`` (a large graph is not kept whole: its weights would take the cache's room)."""
    return None if tensor_bytes(model) > whole_graph_limit() else _digest_tensors(model)


def load(key: str) -> onnx.ModelProto | None:
    """The cached template, or None (a miss; an unreadable entry is removed)."""
    entry = cache_dir() / key
    path = entry / ENTRY
    if not path.is_file():
        return None
    try:
        model = onnx.load(str(path))
        _check_complete(model)
    except Exception:  # noqa: BLE001 - whatever is wrong with it, the trace replaces it
        shutil.rmtree(entry, ignore_errors=True)
        return None
    try:
        os.utime(entry)  # recently used: evicted last
    except OSError:
        pass
    return model


def load_bound(key: str):
    """The cached template and its bindings (``exporter/capture/weights.py``'s ``bind`` on it, kept by
    ``store_bindings``), or None (no entry, or no bindings kept for it).  Only the initializers no binding names are
    read from the data file: the bound ones (the template's weights, which stitching points at the user's model) are
    left without values.  TinyLlama-1.1B dims: the template's 1.0 GB read and ~5 s of binding (bit-for-bit compares of
    every weight) skipped on each re-export."""
    import json

    from elx.exporter.capture.weights import Binding

    entry = cache_dir() / key
    path, listed = entry / ENTRY, entry / BINDINGS
    if not (path.is_file() and listed.is_file()):
        return None
    try:
        bindings = {name: Binding(*fields) for name, fields in json.loads(listed.read_text()).items()}
        model = onnx.load(str(path), load_external_data=False)
        _read_unbound(model, entry, bindings)
    except Exception:  # noqa: BLE001 - whatever is wrong with it, the trace replaces it
        shutil.rmtree(entry, ignore_errors=True)
        return None
    try:
        os.utime(entry)
    except OSError:
        pass
    return model, bindings


def _read_unbound(model: onnx.ModelProto, entry: Path, bindings: dict) -> None:
    """Read the data of the initializers ``bindings`` does not name; empty the bound ones (no values, no location).
    Every binding must name an initializer, and the data file must hold every tensor's bytes."""
    from onnx.external_data_helper import load_external_data_for_tensor, uses_external_data

    names = {t.name for t in model.graph.initializer}
    if not set(bindings) <= names:
        raise ValueError("bindings name initializers the template lacks")
    data = entry / (ENTRY + ".data")
    size = data.stat().st_size if data.is_file() else 0
    for tensor in model.graph.initializer:
        if not uses_external_data(tensor):
            continue
        info = {e.key: e.value for e in tensor.external_data}
        if int(info.get("offset", 0)) + int(info.get("length", 0)) > size:
            raise ValueError(f"initializer {tensor.name}: beyond the end of the data file")
        if tensor.name in bindings:
            del tensor.external_data[:]
            tensor.ClearField("data_location")
            continue
        load_external_data_for_tensor(tensor, str(entry))
        del tensor.external_data[:]
        tensor.ClearField("data_location")
    _check_complete(model)


def store_bindings(key: str, bindings: dict) -> None:
    """Keep ``bindings`` beside the entry ``key`` (written to a temporary file and renamed: whole or absent);
    nothing when the entry is not there or cannot be written (the next export binds again)."""
    import json

    entry = cache_dir() / key
    if not entry.is_dir() or (entry / BINDINGS).is_file():
        return
    partial = entry / f".{BINDINGS}.{os.getpid()}.partial"
    try:
        partial.write_text(json.dumps({name: [b.source, b.transform, b.shift] for name, b in bindings.items()}))
        os.replace(partial, entry / BINDINGS)
    except OSError:
        partial.unlink(missing_ok=True)


def as_saved(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` as it was before ``onnx.save_model(..., save_as_external_data=True)`` and ``onnx.load``: the latter
    sets ``data_location`` to its default on each tensor it read from the data file, a field the traced graph did not
    have (so a template read from a file, the cache's or the second process's, stitches to the same bytes)."""
    for tensor in model.graph.initializer:
        if tensor.HasField("data_location") and tensor.data_location == onnx.TensorProto.DEFAULT:
            tensor.ClearField("data_location")
    return model


def _check_complete(model: onnx.ModelProto) -> None:
    """Every initializer holds as many bytes as its dims say (``onnx.load`` reads a truncated data file without a
    word); ``as_saved``."""
    as_saved(model)
    for tensor in model.graph.initializer:
        if not tensor.HasField("raw_data"):
            continue
        count = 1
        for d in tensor.dims:
            count *= d
        itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
        if len(tensor.raw_data) != count * itemsize:
            raise ValueError(f"initializer {tensor.name}: {len(tensor.raw_data)} bytes, {count * itemsize} expected")


def store(key: str, model: onnx.ModelProto) -> str | None:
    """Keep ``model`` under ``key``; None, or why it was not kept (the export goes on either way).  ``model`` is not
    changed (its tensors are written from a copy of the proto that points them at the entry's data file)."""
    root = cache_dir()
    entry = root / key
    if entry.is_dir():
        return None
    partial = root / f".{key}.{os.getpid()}.partial"
    try:
        partial.mkdir(parents=True, exist_ok=True)
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        onnx.save_model(copy, str(partial / ENTRY), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=ENTRY + ".data", size_threshold=1024)
        del copy
        try:
            os.rename(partial, entry)
        except OSError:
            if not entry.is_dir():
                raise
        _evict(root, keep=entry)
        return None
    except OSError as err:
        return f"{type(err).__name__}: {err.strerror or err}"
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def _evict(root: Path, keep: Path) -> None:
    """The least recently used entries removed until the cache is within ``ELX_TEMPLATE_CACHE_GB``."""
    entries = []
    for entry in root.iterdir():
        if entry.name.endswith(".partial"):  # an export killed while storing: gone after an hour
            try:
                if time.time() - entry.stat().st_mtime > 3600:
                    shutil.rmtree(entry, ignore_errors=True)
            except OSError:
                pass
            continue
        if entry.name.startswith(".") or not entry.is_dir():
            continue
        try:
            size = sum(f.stat().st_size for f in entry.iterdir())
            entries.append((entry.stat().st_mtime, size, entry))
        except OSError:
            continue
    total, limit = sum(size for _, size, _ in entries), _limit_bytes()
    for _, size, entry in sorted(entries, key=lambda e: e[0]):
        if total <= limit:
            break
        if entry == keep:
            continue
        shutil.rmtree(entry, ignore_errors=True)
        total -= size
