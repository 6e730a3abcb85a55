"""Dataset files for ``elx generate --input-file``: records in (txt, JSONL, Parquet), result lines out (JSONL).

Input records
-------------
* ``.txt``: one text per line; the id is the 1-based line number.  A blank line is a bad record.
* ``.jsonl`` (``.ndjson``): one JSON object per line with an optional ``id`` (string or integer; the
  1-based line number when absent) and exactly one of ``text`` (a string), ``input_ids`` (a list of
  token ids) or ``audio`` (a WAV path, relative to the input file's folder; Whisper exports).  Blank
  lines are not records (line numbers still count them).
* ``.parquet``: the same fields as columns (rows numbered from 1; null = absent); needs ``pyarrow``.

Ids must be unique: the output and ``--resume`` are keyed by them (a repeated id is always an error).

Output lines
------------
``OutputFile`` appends one complete JSON line per finished input with a single ``write`` of the whole
line, flushed at once and fsync'd at most every ``FSYNC_SECONDS`` and at the end, so a killed run
leaves complete lines and at most one torn last line, which ``--resume`` detects (no final newline)
and drops.  Lines are appended as they finish (length-sorted batches finish out of input order);
after a complete run the file is put into input order by writing a sorted copy next to it, fsyncing
it and renaming it over the original (atomic: a crash leaves the old file or the new one, whole).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from .errors import ElxError

FSYNC_SECONDS = 2.0
KINDS = ("text", "input_ids", "audio")
INPUT_SUFFIXES = {".txt": "txt", ".text": "txt", ".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet",
                  ".pq": "parquet"}


@dataclass
class Record:
    """One input: its position among the records (``index``), its line or row number, id, kind and value."""

    index: int
    line: int
    id: object
    kind: str | None = None  # "text" | "input_ids" | "audio"; None for a bad record
    value: object = None
    error: str | None = None
    tokens: list | None = None  # the encoder's token ids, once prepared
    features: object = None  # Whisper's log-mel features, once prepared (until batched)


@dataclass(frozen=True)
class InputRules:
    """What the model takes: token inputs or audio, a tokenizer or not, the vocabulary and position limits."""

    takes_audio: bool
    has_tokenizer: bool
    vocab_size: int | None
    max_positions: int | None  # a hard encoder position limit (learned position embeddings), else None


def input_format(path: Path) -> str:
    kind = INPUT_SUFFIXES.get(path.suffix.lower())
    if kind is None:
        raise ElxError(f"{path}: unknown input format {path.suffix or '(no suffix)'!r}; use .txt (one text per line), "
                       ".jsonl (objects with id and text, input_ids or audio) or .parquet")
    return kind


def unit(path: Path) -> str:
    """What a record's number counts: lines, or rows in Parquet."""
    return "row" if input_format(path) == "parquet" else "line"


def where(path: Path, line: int) -> str:
    """How the user finds a record: ``IN line 7`` (``IN row 7`` in Parquet)."""
    return f"{path} {unit(path)} {line}"


def read_records(path: Path, rules: InputRules):
    """The records of ``path`` in order, bad ones carrying ``error`` (structure only: no tokenizing, no audio decoding).

    Unique ids are checked by the caller (``scan_input``)."""
    kind = input_format(path)
    if kind == "txt":
        yield from _txt_records(path, rules)
    elif kind == "jsonl":
        yield from _jsonl_records(path, rules)
    else:
        yield from _parquet_records(path, rules)


def _open(path: Path):
    try:
        return open(path, "rb")
    except OSError as err:
        raise ElxError(f"cannot read {path} ({err.strerror or err})")


def _txt_records(path: Path, rules: InputRules):
    if rules.takes_audio:
        raise ElxError(f"{path}: this model takes audio; give a .jsonl or .parquet input with an 'audio' field per line")
    if not rules.has_tokenizer:
        raise ElxError(f"{path}: a .txt input is text, and this export has no tokenizer; give a .jsonl input with "
                       "'input_ids' per line")
    with _open(path) as f:
        for number, raw in enumerate(f, 1):
            index = number - 1
            try:
                text = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError:
                yield Record(index, number, number, error="not UTF-8 text")
                continue
            if number == 1:
                text = text.removeprefix("\ufeff")
            if not text.strip():
                yield Record(index, number, number, error="empty line (no text)")
            else:
                yield Record(index, number, number, "text", text)


def _jsonl_records(path: Path, rules: InputRules):
    index = 0
    with _open(path) as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw.decode("utf-8").removeprefix("\ufeff") if number == 1 else raw)
            except (UnicodeDecodeError, ValueError) as err:
                yield Record(index, number, number, error=f"not a JSON object ({str(err).splitlines()[0][:80]})")
            else:
                yield check_fields(obj, index, number, rules, path.parent)
            index += 1


def _parquet_records(path: Path, rules: InputRules):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ElxError(f"reading {path} needs pyarrow: pip install 'elx[parquet]' (or give .jsonl)")
    try:
        parquet = pq.ParquetFile(path)
    except Exception as err:  # noqa: BLE001 - pyarrow raises ArrowInvalid, OSError, ...
        raise ElxError(f"cannot read {path} as Parquet ({str(err).splitlines()[0][:160]})")
    names = set(parquet.schema_arrow.names)
    if not names & set(KINDS):
        raise ElxError(f"{path} has no 'text', 'input_ids' or 'audio' column (columns: {', '.join(sorted(names))})")
    columns = [c for c in ("id", *KINDS) if c in names]
    index = 0
    for batch in parquet.iter_batches(batch_size=1024, columns=columns):
        for row in batch.to_pylist():
            yield check_fields({k: v for k, v in row.items() if v is not None}, index, index + 1, rules, path.parent)
            index += 1


def check_fields(obj, index: int, line: int, rules: InputRules, base: Path) -> Record:
    """A JSON object (or Parquet row) → a Record, or a bad Record naming what is wrong."""
    if not isinstance(obj, dict):
        return Record(index, line, line, error=f"not a JSON object (a {type(obj).__name__})")
    rid = obj.get("id", line)
    if isinstance(rid, bool) or not isinstance(rid, (str, int)):
        return Record(index, line, line, error=f"'id' must be a string or an integer, not {rid!r}")
    given = [k for k in KINDS if k in obj]
    if len(given) != 1:
        found = f"got {', '.join(given)}" if given else "got none"
        return Record(index, line, rid, error=f"needs exactly one of 'text', 'input_ids', 'audio' ({found})")
    kind, value = given[0], obj[given[0]]
    bad = _check_value(kind, value, rules)
    if bad:
        return Record(index, line, rid, error=bad)
    if kind == "audio":
        value = str(base / value) if not os.path.isabs(value) else value
        if not os.path.isfile(value):
            return Record(index, line, rid, error=f"audio file {value} not found")
    if kind == "input_ids":
        value = [int(t) for t in value]
    return Record(index, line, rid, kind, value)


def _check_value(kind: str, value, rules: InputRules) -> str | None:
    if kind == "audio":
        if not rules.takes_audio:
            return "'audio' input needs a Whisper export; this model takes tokens"
        if not isinstance(value, str) or not value:
            return "'audio' must be a file path"
        return None
    if rules.takes_audio:
        return f"this model takes audio; give an 'audio' path instead of '{kind}'"
    if kind == "text":
        if not rules.has_tokenizer:
            return "'text' input needs a tokenizer and this export has none; give 'input_ids'"
        if not isinstance(value, str) or not value.strip():
            return "'text' must be a non-empty string"
        return None
    if not isinstance(value, list) or not value:
        return "'input_ids' must be a non-empty list of token ids"
    if any(isinstance(t, bool) or not isinstance(t, int) for t in value):
        return "'input_ids' must hold integers only"
    return check_tokens(value, rules)


def check_tokens(ids: list, rules: InputRules) -> str | None:
    if not ids:
        return "no input tokens"
    if rules.vocab_size is not None:
        low, high = min(ids), max(ids)
        if low < 0 or high >= rules.vocab_size:
            return f"token id {low if low < 0 else high} is outside the vocabulary [0, {rules.vocab_size})"
    if rules.max_positions is not None and len(ids) > rules.max_positions:
        return f"{len(ids)} input tokens; this model takes at most {rules.max_positions}"
    return None


# ----------------------------------------------------------------------------- the output file


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@dataclass
class ExistingOutput:
    ids: list  # the ids of the complete lines, in file order
    torn_at: int | None  # byte offset where a torn last line starts (to drop), else None


def read_output(path: Path) -> ExistingOutput:
    """The ids of an existing output's complete lines; a torn last line (no newline) is reported, not an error.

    A complete line that is not an elx result (not JSON, no id) is an ElxError: the file is not touched."""
    ids, offset, torn = [], 0, None
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if not raw.endswith(b"\n"):
                torn = offset
                break
            offset += len(raw)
            try:
                obj = json.loads(raw)
            except ValueError:
                obj = None
            if not isinstance(obj, dict) or "id" not in obj:
                raise ElxError(f"{path} line {number} is not an elx result line (JSON with an 'id'); is it the output "
                               "of 'elx generate --input-file'? Pass another --output-file, or --force to replace it")
            ids.append(obj["id"])
    return ExistingOutput(ids, torn)


class OutputFile:
    """Append-only JSONL results: one ``os.write`` per line, fsync at most every ``FSYNC_SECONDS`` and on close."""

    def __init__(self, path: Path, *, truncate_at: int | None = None):
        self.path = path
        if truncate_at is not None:
            with open(path, "r+b") as f:
                f.truncate(truncate_at)
                os.fsync(f.fileno())
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.synced = time.monotonic()
        self.lines = 0

    def write(self, line: str) -> None:
        data = (line + "\n").encode("utf-8")
        view = memoryview(data)
        while view:
            written = os.write(self.fd, view)
            view = view[written:]
        self.lines += 1
        now = time.monotonic()
        if now - self.synced >= FSYNC_SECONDS:
            os.fsync(self.fd)
            self.synced = now

    def close(self) -> None:
        if self.fd is not None:
            try:
                os.fsync(self.fd)
            finally:
                os.close(self.fd)
                self.fd = None


def put_in_order(path: Path, order: dict) -> bool:
    """Rewrite ``path`` with its lines sorted by ``order[id]`` (atomic: sorted copy, fsync, rename); False when
    it already was in order.  Reads lines by offset, so memory grows with the line count, not the file size."""
    spans, offset = [], 0
    with open(path, "rb") as f:
        for raw in f:
            spans.append((order[json.loads(raw)["id"]], offset, len(raw)))
            offset += len(raw)
        if all(a[0] <= b[0] for a, b in zip(spans, spans[1:])):
            return False
        spans.sort(key=lambda s: s[0])
        tmp = path.with_name(path.name + ".elx-sorting")
        with open(tmp, "wb") as out:
            for _, start, size in spans:
                f.seek(start)
                out.write(f.read(size))
            out.flush()
            os.fsync(out.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    return True


def result_line(record_id, rows: list, texts: list | None, scores: list | None, several: bool) -> str:
    """The JSON line of one input: ``tokens`` (HF ``generate``'s row), ``text``, ``score`` (beam search).

    With ``num_return_sequences`` > 1 (``several``) each field is a list, best first."""
    line = {"id": record_id, "tokens": rows if several else rows[0]}
    if texts is not None:
        line["text"] = texts if several else texts[0]
    if scores is not None:
        line["score"] = scores if several else scores[0]
    return json.dumps(line, ensure_ascii=False)


def error_line(record: Record) -> str:
    return json.dumps({"id": record.id, "line": record.line, "error": record.error}, ensure_ascii=False)
