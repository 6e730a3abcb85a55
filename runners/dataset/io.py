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
and drops.  After each fsync the run record beside OUT (``runners/dataset/run_record.py``) is saved with the
length and hash of what OUT holds, so that ``--resume`` and ``--force`` touch only files elx wrote (and
after each batch without the fsync, so that a resumed run redoes at most the batch a kill interrupted).  A
write that fails (a full disk) cuts OUT back to its last complete line.  Lines are appended as they
finish (length-sorted batches finish out of input order); after a complete run the file is put into
input order by writing a sorted copy next to it, fsyncing it and renaming it over the original
(atomic: a crash or a full disk leaves the old file or the new one, whole, and no copy).
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from elx.runners.dataset.run_record import OwnedOutput, RunRecord, State, add_fingerprint
from elx.runners.errors import ElxError
from elx.runners.wording import arg
from elx.runners.inputs.user_files import MAX_BYTES, open_user_file, read_lines
from elx.runners.manifest import FORMAT as MANIFEST_FORMAT
from elx.runners.output_lock import signals_deferred, temp_sibling, write_failure

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
    """IN, a regular file (no FIFO, device or folder, checked on the open descriptor too), read line by line."""
    return open_user_file(path, arg('input_file'), limit=None)


LONG_LINE = f"longer than {MAX_BYTES >> 20} MiB (elx reads lines up to that)"


def _txt_records(path: Path, rules: InputRules):
    if rules.takes_audio:
        raise ElxError(f"{path}: this model takes audio; give a .jsonl or .parquet input with an 'audio' field per line")
    if not rules.has_tokenizer:
        raise ElxError(f"{path}: a .txt input is text, and this export has no tokenizer; give a .jsonl input with "
                       "'input_ids' per line")
    with _open(path) as f:
        for number, raw in enumerate(read_lines(f), 1):
            index = number - 1
            if raw is None:
                yield Record(index, number, number, error=f"a line {LONG_LINE}")
                continue
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
        for number, raw in enumerate(read_lines(f), 1):
            if raw is None:
                yield Record(index, number, number, error=f"a line {LONG_LINE}")
                index += 1
                continue
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw.decode("utf-8").removeprefix("\ufeff") if number == 1 else raw)
            except (UnicodeDecodeError, ValueError) as err:
                yield Record(index, number, number, error=f"not a JSON object ({str(err).splitlines()[0][:80]})")
            except RecursionError:
                yield Record(index, number, number, error="JSON nested too deeply to read (more levels than Python's "
                                                          "recursion limit)")
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


def export_folder_holding(path: Path) -> Path | None:
    """The elx export folder ``path`` lies in (at any depth; symbolic links followed), else None."""
    for folder in Path(os.path.realpath(path)).parents:
        try:
            data = json.loads((folder / "manifest.json").read_bytes())
        except (OSError, ValueError, RecursionError):
            continue
        if isinstance(data, dict) and data.get("format") == MANIFEST_FORMAT:
            return folder
    return None


def check_output_path(target: Path, source: Path, folder: Path) -> None:
    """Refuse an OUT that writing (or ``--force``) could destroy something through, or that is not a file.

    Refused: the input file under any name (a hard or symbolic link, another spelling), a file inside an export
    folder (its manifest, its graphs, a new file there: ``elx export --force`` and the runners own that folder),
    a symbolic link (the finished file is renamed into place, which would replace the link by a file and leave
    its target a stale copy: pass the file it points to), a file with other hard links (the same), a folder, and
    what is not a regular file (a FIFO would block the run, a device swallow it)."""
    if target.is_symlink():
        raise ElxError(f"{arg('output_file')} {target} is a symbolic link (to {os.path.realpath(target)}); elx "
                       "renames the "
                       "finished file into place, which would replace the link: pass the file it points to")
    try:
        st = os.stat(target)
    except FileNotFoundError:
        st = None
    if st is not None:
        if stat.S_ISDIR(st.st_mode):
            raise ElxError(f"{arg('output_file')} {target} is a folder; name a file")
        if not stat.S_ISREG(st.st_mode):
            raise ElxError(f"{arg('output_file')} {target} is not a regular file (a FIFO, device or socket); name "
                           "a file")
        if os.path.samefile(target, source):
            raise ElxError(f"{arg('output_file')} {target} is the input file {source}; write the results to "
                           "another file")
        if st.st_nlink > 1:
            raise ElxError(f"{arg('output_file')} {target} has {st.st_nlink - 1} other hard link(s); elx renames the "
                           "finished file into place, which would leave them a stale copy: name a file of its own")
    if not target.parent.is_dir():
        raise ElxError(f"the folder of {arg('output_file')} {target} does not exist")
    real = Path(os.path.realpath(target))
    export = export_folder_holding(target)
    if export is None and Path(os.path.realpath(folder)) in real.parents:
        export = folder
    if export is not None:
        raise ElxError(f"{arg('output_file')} {target} lies inside the export folder {export}; write the "
                       "results outside "
                       "it (elx owns that folder's files, and elx export --force deletes what it did not write)")


def _write_failed(err: OSError, path: Path, doing: str, then: str) -> ElxError | OSError:
    """A failed write as one line (disk full, quota, read-only, ...); other OS errors stay as they are."""
    what = write_failure(err)
    return err if what is None else ElxError(f"{doing} {path} failed: {what}; {then}")


class OutputFile:
    """Append-only JSONL results: one ``os.write`` per line, fsync at most every ``FSYNC_SECONDS`` and on close.

    The run record (``runners/dataset/run_record.py``) holds what OUT provably holds (its length, the SHA-256 of its
    bytes, the digest of the records of its lines): saved after each batch (``checkpoint``; fsync'd, with OUT
    fsync'd first, at most every ``FSYNC_SECONDS``, and on close), so a resumed run redoes at most the batch a
    kill interrupted.  ``start``: the existing lines to go on after (what follows them is cut off first); None:
    a new file, or one that ``--force`` replaces (cut to nothing).  A write that fails (a full disk) cuts the
    file back to its last complete line and raises a one-line ElxError."""

    def __init__(self, path: Path, record: RunRecord, start: OwnedOutput | None = None):
        self.path, self.record = path, record
        self.size = start.size if start is not None else 0
        self.sha256 = start.sha256 if start is not None else hashlib.sha256()
        self.inputs = 0  # the caller sets it: the digest of the records of the existing lines
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            if os.fstat(self.fd).st_size != self.size:  # lines the record does not vouch for, or a replaced output
                os.ftruncate(self.fd, self.size)
        except BaseException:
            os.close(self.fd)
            raise
        self.durable = None  # the state of the last fsync
        self.synced = time.monotonic()
        self.lines = 0

    def state(self) -> State:
        return State(self.size, self.sha256.hexdigest(), self.inputs)

    def write(self, line: str, fingerprint: int) -> None:
        data = (line + "\n").encode("utf-8")
        view = memoryview(data)
        try:
            while view:
                written = os.write(self.fd, view)
                view = view[written:]
        except OSError as err:
            try:
                os.ftruncate(self.fd, self.size)  # no torn line left behind
            except OSError:
                pass
            raise self._failed(err) from err
        self.size += len(data)
        self.sha256.update(data)
        self.inputs = add_fingerprint(self.inputs, fingerprint)
        self.lines += 1

    def checkpoint(self) -> None:
        """After a batch's lines: record what OUT holds (with an fsync of both every ``FSYNC_SECONDS``)."""
        if time.monotonic() - self.synced >= FSYNC_SECONDS or self.durable is None:
            self.sync()
            return
        try:
            self.record.save(self.durable, self.state(), durable=False)
        except OSError as err:
            raise self._failed(err) from err

    def sync(self) -> None:
        """fsync OUT, then record what it holds (never more than what is on the disk)."""
        try:
            os.fsync(self.fd)
            state = self.state()
            self.record.save(state)
        except OSError as err:
            raise self._failed(err) from err
        self.durable, self.synced = state, time.monotonic()

    def _failed(self, err: OSError):
        return _write_failed(err, self.path, "writing", "the finished lines are kept: free space, then rerun with "
                             f"{arg('resume', True)}")

    def close(self, sync: bool = True) -> None:
        """fsync and record what OUT holds (``sync``), then close it."""
        if self.fd is not None:
            try:
                if sync:
                    self.sync()
            finally:
                os.close(self.fd)
                self.fd = None


def put_in_order(path: Path, order: dict, record: RunRecord, state: State) -> bool:
    """Rewrite ``path`` with its lines sorted by ``order[id]``; False when it already was in order.

    Atomic: a sorted copy (a temporary sibling), fsync'd, the run record told both states (the file before and
    after), the copy renamed over ``path``, then the record left with the sorted state only.  Any failure (a full
    disk) removes the copy and leaves ``path`` as it was, whole; a failed write is a one-line ElxError.  Reads
    lines by offset, so memory grows with the line count, not the file size."""
    spans, offset = [], 0
    with open(path, "rb") as f:
        for raw in f:
            spans.append((order[json.loads(raw)["id"]], offset, len(raw)))
            offset += len(raw)
        if all(a[0] <= b[0] for a, b in zip(spans, spans[1:])):
            return False
        spans.sort(key=lambda s: s[0])
        tmp = temp_sibling(path, "sorting")
        try:
            digest = hashlib.sha256()
            with open(tmp, "wb") as out:
                for _, start, size in spans:
                    f.seek(start)
                    data = f.read(size)
                    digest.update(data)
                    out.write(data)
                out.flush()
                os.fsync(out.fileno())
            done = State(offset, digest.hexdigest(), state.inputs)
            record.save(state, done)
            with signals_deferred():
                os.replace(tmp, path)
        except OSError as err:
            raise _write_failed(err, path, "putting in input order", "its lines are complete (in the order they "
                                f"finished): free space, then rerun with {arg('resume', True)} to sort them") from err
        finally:
            try:
                tmp.unlink()
            except FileNotFoundError:
                pass
    _fsync_dir(path.parent)
    try:
        record.save(done)
    except OSError:  # the record still holds both states: both describe a whole file
        pass
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
