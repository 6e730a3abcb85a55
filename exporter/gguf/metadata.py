"""What a GGUF file holds, read with the ``gguf`` package (numpy only): architecture, metadata, tensor types.

``read_gguf`` parses the header, the metadata and the tensor table (the tensor data stays on disk: the
reader memory-maps the file) and keeps a plain summary, ``GgufInfo``; a file that the reader cannot parse
(truncated, damaged) or whose tensors reach past its end is refused in one line.  The summary is cached per
file (path, size, modification time): the command line's early checks and the export read a file once.

``GgufInfo.record`` is what the manifest's ``source.gguf`` records: the file name, its SHA-256 (computed
once, on demand), the architecture, the quantization (the tensor type holding most of the weights, as the
gguf package names it, e.g. ``Q4_1``, and ``general.file_type``, e.g. ``MOSTLY_Q4_1``) and the tensor count
per type.
"""
from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from elx.exporter.gguf.header import check_gguf_file
from elx.runners.errors import ElxError

SHORT_ARRAY = 4096  # metadata arrays kept in the summary (per-layer sizes); vocabularies and merges are not


@dataclass(frozen=True)
class GgufInfo:
    path: Path
    size: int
    architecture: str  # general.architecture, as the file spells it (llama, qwen2, ...)
    metadata: dict  # scalars and short arrays by key (general.*, <arch>.*, tokenizer.ggml.*_id, ...)
    tensor_types: dict  # tensor type name -> number of tensors of that type
    type_elements: dict  # tensor type name -> number of values stored in that type
    tensor_names: tuple = ()
    _digest: list = field(default_factory=list, compare=False, repr=False)

    @property
    def name(self) -> str | None:
        return self.metadata.get("general.name")

    @property
    def elements(self) -> int:
        return sum(self.type_elements.values())

    @property
    def float32_bytes(self) -> int:
        """The weights' size once dequantized to float32, as transformers loads them."""
        return 4 * self.elements

    @property
    def quantization(self) -> str:
        """The tensor type holding most of the values (``Q4_1`` for a Q4_1 file whose norms are F32)."""
        return max(sorted(self.type_elements), key=lambda t: self.type_elements[t]) if self.type_elements else "none"

    @property
    def file_type(self) -> str | None:
        """``general.file_type`` as llama.cpp names it (``MOSTLY_Q4_1``), or its number when unnamed."""
        value = self.metadata.get("general.file_type")
        if value is None:
            return None
        from gguf import LlamaFileType

        try:
            return LlamaFileType(int(value)).name
        except ValueError:
            return str(value)

    def sha256(self) -> str:
        if not self._digest:
            self._digest.append(file_sha256(self.path))
        return self._digest[0]

    def record(self) -> dict:
        return {"file": self.path.name, "sha256": self.sha256(), "architecture": self.architecture,
                "quantization": self.quantization, "file_type": self.file_type,
                "tensor_types": dict(sorted(self.tensor_types.items()))}


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_gguf(path) -> GgufInfo:
    """The summary of the GGUF file at ``path`` (refused in one line when it is not a whole GGUF file)."""
    path = check_gguf_file(path)
    stat = path.stat()
    return _read(path, stat.st_size, stat.st_mtime_ns)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0][:200]}" if text else type(err).__name__


@lru_cache(maxsize=8)
def _read(path: Path, size: int, mtime_ns: int) -> GgufInfo:
    from gguf import GGUFReader, GGUFValueType

    try:
        reader = GGUFReader(path)
        metadata = {}
        for key, value in reader.fields.items():
            if key.startswith("GGUF."):  # the reader's own entries: version, counts
                continue
            if value.types and value.types[0] == GGUFValueType.ARRAY and len(value.data) > SHORT_ARRAY:
                continue
            metadata[key] = value.contents()
        tensors = [(t.name, t.tensor_type.name, int(t.n_elements), int(t.data_offset) + int(t.n_bytes))
                   for t in reader.tensors]
    except MemoryError:
        raise
    except Exception as err:  # noqa: BLE001 - the reader raises ValueError, IndexError, KeyError, ... on bad bytes
        raise ElxError(f"{path} is not a readable GGUF file: it is truncated or damaged ({_first_line(err)}); "
                       "download or convert it again") from None
    finally:
        reader = None  # drop the memory map
    end = max((t[3] for t in tensors), default=0)
    if end > size:
        raise ElxError(f"{path} is truncated: its tensors need {end} bytes, the file has {size}; download or "
                       "convert it again")
    architecture = metadata.get("general.architecture")
    if not isinstance(architecture, str) or not architecture:
        raise ElxError(f"{path} names no architecture (general.architecture); convert it again with llama.cpp")
    counts, elements = Counter(), Counter()
    for _, kind, n, _ in tensors:
        counts[kind] += 1
        elements[kind] += n
    return GgufInfo(path=path, size=size, architecture=architecture, metadata=metadata, tensor_types=dict(counts),
                    type_elements=dict(elements), tensor_names=tuple(t[0] for t in tensors))
