"""Each weight stored once per export folder: every graph's large tensors live in one shared file.

An export folder runs several graphs over the same weights: GPT-2's ``prefill.onnx`` and
``decoder.onnx`` hold all 124M parameters each, a T5 export holds the shared embedding in its encoder
and its decoder, and a pass graph keeps the weights it does not rewrite.  ``store_weights_once``
moves the bytes of every initializer of at least ``MIN_BYTES`` into ``weights.data`` (ONNX external
data, ``location`` relative to the graph), each distinct byte string once, whatever the tensor's name,
graph, shape or dtype: every tensor with the same bytes points at the same offset.

Why one shared external-data file rather than merged graphs (Optimum's ``If`` node between a
with-past and a without-past decoder):

* the manifest runs one graph per stage and per step, with different inputs each (encoder, cross
  K/V, prefill, decoder); merging them behind an ``If`` would change the runners' plan, the passes
  (which walk one graph's nodes by structure), the fp16 rule and the engine builder, and TensorRT
  builds an engine per graph anyway;
* ONNX Runtime reads external data relative to the graph's file (``InferenceSession(path)``, as
  ``runners/backends/ort.py`` loads graphs); TensorRT (for RTX)'s ONNX parser resolves it relative to
  the parsed file (``parse_from_file``, as ``exporter/tensorrt/worker.py`` calls it); and
  ``onnx.load`` resolves it too, so each graph file stays usable on its own (with ``weights.data``
  beside it);
* passes and the fp16 rewrite keep loading a graph with its data and saving the rewrite as a file of
  its own: ``store_weights_once`` runs when a folder's graphs are final (end of ``elx export`` and of
  ``apply_passes``) and rewrites ``weights.data`` from the graphs the manifest lists, so bytes that
  no graph references any more (weights of a graph a pass replaced) are never kept, and a graph's own
  data file (``X.onnx.data``, written for graphs above protobuf's 2 GB) is folded in and removed.

Memory: this halves the disk, not what ONNX Runtime holds: each session keeps its own prepacked
copy of its MatMul weights (measured on GPT-2: loading a ``Generator`` grew the resident set by 984
MiB instead of 1461, because the graph protos no longer carry the weights; sharing initializers between
the two sessions with ``SessionOptions.add_initializer`` made it 1290 MiB, as each session still
prepacks its own copy; ``session.disable_prepacking`` brought it to 315 MiB but doubled the decoder
step's time).
A prepacked-weights container shared by the sessions is ONNX Runtime C API only.  The export's verification,
which runs a few cases, takes the unpacked way (``runners/backends/ort_mapped.py``): its sessions read one
mapping of this file; the runtime keeps prepacking (greedy decoding 1.4x slower without it).

Layout: tensors start at a multiple of 64 bytes, those of a page (4096 bytes) or more at a page
boundary, so that each can be mapped on its own; the gaps are zeros.  Equal digests (BLAKE2b) are
confirmed byte for byte before a tensor is pointed at stored bytes.  Smaller tensors (shape
constants, scalars, small biases) stay inside their graph.  Only initializers are moved (tensors
held in ``Constant`` node attributes stay where they are).
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import onnx
from onnx import TensorProto
from onnx.external_data_helper import ExternalDataInfo, load_external_data_for_tensor, uses_external_data

from elx.runners.manifest import Manifest

WEIGHTS_FILE = "weights.data"
MIN_BYTES = 1024  # onnx's own default threshold for external data
PAGE, LINE = 4096, 64


def graph_files(manifest: Manifest) -> list[str]:
    """The ONNX files of the folder's graphs, each once: every graph's ``file`` and ``tensorrt_file``."""
    files = []
    for spec in manifest.graphs.values():
        for key in ("file", "tensorrt_file"):
            if spec.get(key) and spec[key] not in files:
                files.append(spec[key])
    return files


SAMPLED_ABOVE = 1 << 22  # bytes: larger strings are keyed by samples of them
MOVE_BYTES = 1 << 24  # the bytes moved at once within weights.data (``_kept_in_place``)


def bytes_key(data: memoryview) -> bytes:
    """A key for equal bytes: a hash of all of ``data`` up to 4 MiB, beyond of its first and last MiB and 64 slices
    of 16 KiB between.  Equal strings get equal keys; a key that matches is confirmed byte for byte before a string
    is stored once (``ByteStore.place``), so unequal strings that share the samples are both written.  Hashing every
    byte of TinyLlama-1.1B's 4.4 GB took 5 s of its export."""
    length = len(data)
    if length <= SAMPLED_ABOVE:
        return hashlib.blake2b(data, digest_size=32).digest()
    digest = hashlib.blake2b(digest_size=32)
    digest.update(data[: 1 << 20])
    digest.update(data[length - (1 << 20):])
    stride = (length - (1 << 14)) // 64
    for i in range(64):
        digest.update(data[i * stride: i * stride + (1 << 14)])
    return digest.digest()


def alignment(length: int) -> int:
    return PAGE if length >= PAGE else LINE


@dataclass
class ByteStore:
    """``weights.data`` being written: distinct byte strings, each at one offset.  ``sources`` (None: not kept):
    where the bytes of a range of a data file went, for a store whose source files do not change while it is written
    (``store_weights_once``): the same range read again is the same bytes, placed without a read, a hash or a
    comparison (the real SmolLM2-135M's prefill and decoder read every weight twice); ``unkeyed``: ranges the file
    held before (``_kept_in_place``), length -> offsets, keyed the first time a string of that length is placed."""

    handle: object
    offsets: dict = field(default_factory=dict)  # (digest, length) -> offset
    sources: dict | None = None  # (folder, file, offset, length) -> offset
    unkeyed: dict = field(default_factory=dict)  # length -> [offset, ...]
    references: int = 0
    distinct: int = 0

    def place(self, data) -> int:
        """The offset of ``data`` (bytes or a byte buffer) in the file: where equal bytes already are, or appended."""
        data = memoryview(data).cast("B")
        key = (bytes_key(data), len(data))
        self.references += 1
        for earlier in self.unkeyed.pop(len(data), ()):
            self.offsets.setdefault((bytes_key(os.pread(self.handle.fileno(), len(data), earlier)), len(data)), earlier)
        offset = self.offsets.get(key)
        # bytes == bytes compares with memcmp; bytes == memoryview item by item (150 MB/s: 3.9 s of a 538 MB store)
        if offset is not None and os.pread(self.handle.fileno(), len(data), offset) == data.tobytes():
            return offset
        end = self.handle.seek(0, os.SEEK_END)
        offset = -(-end // alignment(len(data))) * alignment(len(data))
        self.handle.write(b"\0" * (offset - end))
        self.handle.write(data)
        self.offsets.setdefault(key, offset)
        self.distinct += 1
        return offset


def external_files(model: onnx.ModelProto) -> list[str]:
    """The external-data files ``model``'s initializers point at (relative to the graph's folder)."""
    files = []
    for each in (model.graph, *subgraphs(model.graph)):
        for tensor in each.initializer:
            if uses_external_data(tensor):
                location = next(e.value for e in tensor.external_data if e.key == "location")
                if location not in files:
                    files.append(location)
    return files


def subgraphs(graph: onnx.GraphProto):
    """Every graph nested in ``graph``'s node attributes (If and Loop bodies), depth first."""
    for node in graph.node:
        for attribute in node.attribute:
            for sub in ([attribute.g] if attribute.HasField("g") else []) + list(attribute.graphs):
                yield sub
                yield from subgraphs(sub)


class _Reader:
    """Reads external tensors of the graphs being rewritten, one tensor at a time (files opened once)."""

    def __init__(self, folder: Path):
        self.folder, self.handles = folder, {}

    def read(self, tensor: TensorProto) -> bytes:
        info = ExternalDataInfo(tensor)
        if info.location not in self.handles:
            self.handles[info.location] = open(self.folder / info.location, "rb")
        handle = self.handles[info.location]
        offset = info.offset or 0
        length = info.length if info.length is not None else os.fstat(handle.fileno()).st_size - offset
        data = os.pread(handle.fileno(), length, offset)
        if len(data) != length:
            raise ValueError(f"{info.location} ends before {tensor.name}'s {length} bytes at offset {offset}")
        return data

    def close(self) -> None:
        for handle in self.handles.values():
            handle.close()


def values(tensor: TensorProto, folder: Path | None):
    """``tensor``'s values as an array, read from its data file (relative to ``folder``) when it is stored outside
    its graph; ``tensor`` itself unchanged (``onnx.numpy_helper.to_array`` would load the bytes into it)."""
    import numpy as np
    from onnx import helper, numpy_helper

    if not uses_external_data(tensor):
        return numpy_helper.to_array(tensor)
    if folder is None:
        raise ValueError(f"{tensor.name} is stored outside the graph, and no folder was given to read it from")
    reader = _Reader(Path(folder))
    try:
        data = reader.read(tensor)
    finally:
        reader.close()
    return np.frombuffer(data, dtype=helper.tensor_dtype_to_np_dtype(tensor.data_type)).reshape(tuple(tensor.dims))


def store_tensor(tensor: TensorProto, reader: "_Reader", store: ByteStore, location: str = WEIGHTS_FILE) -> bool:
    """``tensor``'s bytes (read by ``reader`` when external) placed in ``store``, the file ``location`` names, when
    ``MIN_BYTES`` or more, ``tensor`` pointed at them; a smaller external one is put back inside its graph.  One
    tensor's bytes in memory at a time.  Returns whether it was stored."""
    external = uses_external_data(tensor)
    source = _source(tensor, reader.folder) if external and store.sources is not None else None
    if source is not None and source in store.sources:
        store.references += 1
        point_external(tensor, store.sources[source], source[3], location=location)
        return True
    data = reader.read(tensor) if external else tensor.raw_data
    if len(data) >= MIN_BYTES:
        offset = store.place(data)
        point_external(tensor, offset, len(data), location=location)
        if source is not None:
            store.sources[source] = offset
        return True
    if external:
        _inline(tensor, data)
    return False


def _source(tensor: TensorProto, folder) -> tuple | None:
    """(folder, file, offset, length) an external tensor reads, or None where its length is not written."""
    info = ExternalDataInfo(tensor)
    return None if info.length is None else (str(folder), info.location, info.offset or 0, info.length)


def point_external(tensor: TensorProto, offset: int, length: int, location: str = WEIGHTS_FILE) -> None:
    """Make ``tensor`` read ``length`` bytes at ``offset`` of ``location`` (its own values dropped)."""
    for field in ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
        tensor.ClearField(field)
    del tensor.external_data[:]
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", offset), ("length", length)):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, str(value)


def _inline(tensor: TensorProto, data: bytes) -> None:
    tensor.raw_data = data
    del tensor.external_data[:]
    tensor.data_location = TensorProto.DEFAULT


def _stored_once(folder: Path, manifest: Manifest) -> dict | None:
    """The ``weights`` record when the folder is already as ``store_weights_once`` leaves it (the stitched export
    writes ``weights.data`` so: ``exporter/capture``): every large initializer of every graph in ``weights.data``,
    the file exactly the distinct ranges they read, in order, aligned, nothing in between but padding.  None
    otherwise (a pass's new graph, a traced graph's own tensors, bytes no graph reads any more)."""
    target = folder / WEIGHTS_FILE
    if not target.is_file():
        return None
    ranges, references, external = set(), 0, {}
    for file in graph_files(manifest):
        model = onnx.load(str(folder / file), load_external_data=False)
        if any(True for _ in subgraphs(model.graph)):
            return None
        stored = False
        for tensor in model.graph.initializer:
            if uses_external_data(tensor):
                info = ExternalDataInfo(tensor)
                if info.location != WEIGHTS_FILE or info.length is None:
                    return None
                ranges.add((info.offset or 0, info.length))
                references += 1
                stored = True
            elif tensor.data_type != TensorProto.STRING and len(tensor.raw_data) >= MIN_BYTES:
                return None
        external[file] = stored
    end = 0
    for offset, length in sorted(ranges):
        if offset < end or offset - end >= alignment(length) or length < MIN_BYTES:
            return None
        end = offset + length
    if end != target.stat().st_size:
        return None
    for spec in manifest.graphs.values():
        files = [spec[key] for key in ("file", "tensorrt_file") if spec.get(key)]
        spec["external_data"] = [WEIGHTS_FILE] if any(external[f] for f in files) else []
    return {"file": WEIGHTS_FILE if end else None, "bytes": end, "distinct_tensors": len(ranges),
            "tensors": references, "min_bytes": MIN_BYTES}


def store_weights_once(folder, manifest: Manifest) -> dict:
    """Rewrite the graphs ``manifest`` lists in ``folder`` so that every weight is stored once, in
    ``weights.data``; each graph's ``external_data`` names it (or is empty when the graph has no large
    tensor).  Data files only the old graphs read are removed.  Returns the manifest's ``weights`` record:
    the file, its size, the distinct byte strings stored and the tensors that point at them.

    Streamed: one tensor's bytes at a time are in memory (read from the graph or its data file, placed in the
    new file), the graphs being rewritten hold none; the old ``weights.data`` is read while the new one is
    written beside it, and replaced when every graph is done.  A folder already so (``_stored_once``) is left as
    it is; one whose graphs read ranges of ``weights.data`` and a few tensors besides (after a pass) has the file
    brought to that in place (``_kept_in_place``)."""
    folder = Path(folder)
    already = _stored_once(folder, manifest)
    if already is None:
        already = _kept_in_place(folder, manifest)
    if already is not None:
        return already
    target, partial = folder / WEIGHTS_FILE, folder / f".{WEIGHTS_FILE}.{os.getpid()}.partial"
    rewritten, read_from = {}, set()
    reader = _Reader(folder)
    try:
        with open(partial, "w+b") as handle:
            store = ByteStore(handle, sources={})
            for file in graph_files(manifest):
                model = onnx.load(str(folder / file), load_external_data=False)
                read_from |= set(external_files(model))
                stored = False
                for tensor in model.graph.initializer:
                    external = uses_external_data(tensor)
                    if tensor.data_type == TensorProto.STRING:
                        if external:
                            load_external_data_for_tensor(tensor, str(folder))
                        continue
                    stored = store_tensor(tensor, reader, store) or stored
                for sub in subgraphs(model.graph):  # If/Loop bodies keep their tensors inside the graph
                    for tensor in sub.initializer:
                        if uses_external_data(tensor):
                            _inline(tensor, reader.read(tensor))
                rewritten[file] = (model, stored)
            size = handle.seek(0, os.SEEK_END)
        reader.close()
        if size:
            os.replace(partial, target)
        else:
            partial.unlink()
            target.unlink(missing_ok=True)
    except BaseException:
        reader.close()
        partial.unlink(missing_ok=True)
        raise
    for file, (model, _) in rewritten.items():
        onnx.save_model(model, str(folder / file))
    for spec in manifest.graphs.values():
        files = [spec[key] for key in ("file", "tensorrt_file") if spec.get(key)]
        spec["external_data"] = [WEIGHTS_FILE] if any(rewritten[f][1] for f in files) else []
    for name in read_from - {WEIGHTS_FILE}:
        if Path(name).name == name:  # a data file beside the graphs (elx writes no other kind)
            (folder / name).unlink(missing_ok=True)
    return {"file": WEIGHTS_FILE if size else None, "bytes": size, "distinct_tensors": store.distinct,
            "tensors": store.references, "min_bytes": MIN_BYTES}


def _kept_in_place(folder: Path, manifest: Manifest) -> dict | None:
    """The ``weights`` record after ``weights.data`` is brought to what the graphs read, in place: the ranges they
    read moved down over the bytes no graph reads any more (a graph a pass replaced), the file cut after the last,
    then the tensors that are not in it (inline or in another data file: a pass's new weights) placed: equal bytes
    pointed at (keyed by length, lazily), new ones appended.  A pass that keeps every weight (unpad, fused-norm)
    moves nothing (the real SmolLM2-135M's 538 MB were written anew in 5.7-9.5 s for 0.1 MB of new tensors).  The
    folder is a staged one (``exporter/atomic.py``): a failure midway leaves nothing.  None where the graphs are not
    simple enough to say so (nested graphs, a string tensor or a length not written outside a graph, ranges that
    overlap): the file is then written anew."""
    target = folder / WEIGHTS_FILE
    if not target.is_file():
        return None
    models, reads, rest = {}, [], []
    for file in graph_files(manifest):
        model = models[file] = onnx.load(str(folder / file), load_external_data=False)
        if any(True for _ in subgraphs(model.graph)):
            return None
        for tensor in model.graph.initializer:
            external = uses_external_data(tensor)
            source = _source(tensor, folder) if external else None
            if tensor.data_type == TensorProto.STRING or (external and source is None):
                if external:
                    return None
                continue
            if source is not None and source[1] == WEIGHTS_FILE:
                reads.append((file, tensor, source[2], source[3]))
            elif external or len(tensor.raw_data) >= MIN_BYTES:
                rest.append((file, tensor))
    ranges = sorted({(offset, length) for _, _, offset, length in reads})
    if any(later < offset + length for (offset, length), (later, _) in zip(ranges, ranges[1:])) or any(
            length < MIN_BYTES for _, length in ranges) or (ranges and sum(ranges[-1]) > target.stat().st_size):
        return None
    changed, read_from, reader = set(), set(), _Reader(folder)
    try:
        with open(target, "r+b") as handle:
            fd, end, moved = handle.fileno(), 0, {}
            for offset, length in ranges:
                new = -(-end // alignment(length)) * alignment(length)  # <= offset: only unread bytes go
                os.pwrite(fd, bytes(new - end), end)  # the gap: zeros
                for done in range(0, length if new != offset else 0, MOVE_BYTES):  # forward: new < offset
                    os.pwrite(fd, os.pread(fd, min(MOVE_BYTES, length - done), offset + done), new + done)
                moved[offset, length], end = new, new + length
            handle.truncate(end)
            for file, tensor, offset, length in reads:
                if moved[offset, length] != offset:
                    point_external(tensor, moved[offset, length], length)
                    changed.add(file)
            store = ByteStore(handle, sources={}, references=len(reads), distinct=len(ranges))
            for (_, length), offset in moved.items():
                store.unkeyed.setdefault(length, []).append(offset)
            for file, tensor in rest:
                if uses_external_data(tensor):
                    read_from.add(_source(tensor, folder)[1])
                store_tensor(tensor, reader, store)
                changed.add(file)
            size = handle.seek(0, os.SEEK_END)
    finally:
        reader.close()
    for file in changed:
        onnx.save_model(models[file], str(folder / file))
    for spec in manifest.graphs.values():
        files = [spec[key] for key in ("file", "tensorrt_file") if spec.get(key)]
        spec["external_data"] = [WEIGHTS_FILE] if any(external_files(models[f]) for f in files) else []
    for name in read_from - {WEIGHTS_FILE}:
        if Path(name).name == name:  # a data file beside the graphs (elx writes no other kind)
            (folder / name).unlink(missing_ok=True)
    if not size:
        target.unlink()
    return {"file": WEIGHTS_FILE if size else None, "bytes": size, "distinct_tensors": store.distinct,
            "tensors": store.references, "min_bytes": MIN_BYTES}


def folder_bytes(folder) -> int:
    """Bytes of the files under ``folder`` (what ``du -sb`` counts for the files themselves)."""
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file() and not p.is_symlink())
