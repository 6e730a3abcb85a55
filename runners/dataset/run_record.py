"""Which run wrote a dataset output: the run record beside OUT, and what ``--resume`` and ``--force`` may do with OUT.

``elx generate DIR --input-file IN --output-file OUT`` keeps a small JSON file beside OUT,
``.OUT.elx-run.json`` (hidden, like the ``.OUT.lock`` of the run in progress), written before the
first line and saved again after each batch's lines (``dataset_io.OutputFile``)::

    {"format": "elx-dataset-run", "version": 1,
     "run": {"export": "<sha256 of DIR/manifest.json and DIR/tokenizer/*>", "settings": {<resolved generation
             settings>}, "backend": "ort", "device": "cpu", "log_softmax": "torch" | "numpy" | null, "lines": 1},
     "input": "IN as given",
     "states": [{"bytes": N, "sha256": "<sha256 of OUT's first N bytes>", "inputs": "<digest of their records>"},
                ...]}

``--resume`` continues OUT, and ``--force`` replaces it, only when OUT is provably elx's (``owned_output``):
the record is there, OUT's first ``bytes`` bytes hash to one of its ``states``, and whatever follows is
complete elx result lines and at most one torn last line.  The states: what OUT held at its last fsync
and what it held after the last batch was written (saved without an fsync: after a kill the page cache
keeps it, after a power loss the fsync'd state still matches), and, while the finished file is put in
order, the sorted file.  ``--resume`` keeps the longest matching state's bytes and generates the
inputs of the lines after it (at most the batch the kill interrupted) again.  So a file elx did not write
(a user's notes, a copy of IN, an elx output overwritten by something else even with the record left
beside it) is never truncated, replaced or taken for finished results.  ``--resume`` also needs the
same run (``run`` equal: the same export and tokenizer, generation settings, backend and log-softmax
kernel, which all change the lines' bytes) and the same records for the inputs already done:
``inputs`` is an order-free digest (the sum of SHA-256 values modulo 2^256) of ``(id, kind, value)``
of the records whose lines are in the hashed bytes, recomputed from IN at resume.  Records not yet
done may change (fixing a bad line and resuming is the documented way on), and IN may be moved.

Why a record beside OUT and not a header line in it: OUT stays exactly what the README promises,
one JSON result per input line and nothing else, for every JSONL reader; a header would have to
be skipped by every consumer or stripped at the end (and then a finished file could not be told
from a user's).  Binding the record to OUT's bytes by hash gives the same certainty a header would.
The cost: the record must travel with OUT to resume elsewhere (without it ``--resume`` refuses).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from elx.runners.errors import ElxError
from elx.runners.wording import arg
from elx.runners.output_lock import signals_deferred, temp_sibling

FORMAT = "elx-dataset-run"
VERSION = 1
LINE_FORMAT = 1  # the layout of result lines (dataset_io.result_line); bump it when that changes
_MODULUS = 1 << 256


def record_path(output: Path) -> Path:
    return output.parent / f".{output.name}.elx-run.json"


def export_identity(folder: Path) -> str:
    """SHA-256 of the export's manifest and the files of its ``tokenizer/`` folder (names and bytes)."""
    digest = hashlib.sha256()
    files = [folder / "manifest.json"]
    tokenizer = folder / "tokenizer"
    if tokenizer.is_dir():
        files += sorted(p for p in tokenizer.rglob("*") if p.is_file())
    for path in files:
        digest.update(str(path.relative_to(folder)).encode() + b"\0")
        digest.update(path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()


def run_identity(folder: Path, settings, backend: str, device: str, log_softmax: str | None) -> dict:
    """What makes the bytes of a result line: two runs with the same identity write the same line for an input."""
    return {"export": export_identity(folder), "settings": json.loads(json.dumps(dataclasses.asdict(settings))),
            "backend": backend, "device": device, "log_softmax": log_softmax, "lines": LINE_FORMAT}


def record_fingerprint(record) -> int:
    """A record's content as a number, summed into the ``inputs`` digest: ``(id, kind, value)`` as IN gives it (for
    a record IN's structure already makes bad, its error); never what preparing it added (tokens, a later error)."""
    content = record.value if record.kind is not None else record.error
    data = json.dumps([record.id, record.kind, content], ensure_ascii=False).encode()
    return int.from_bytes(hashlib.sha256(data).digest(), "big")


def add_fingerprint(digest: int, fingerprint: int) -> int:
    """The ``inputs`` digest with one more record: an order-free sum, so lines may finish in any order."""
    return (digest + fingerprint) % _MODULUS


@dataclass(frozen=True)
class State:
    """OUT's first ``bytes`` bytes hash to ``sha256``; ``inputs``: the digest of the records of their lines."""

    bytes: int
    sha256: str
    inputs: int

    def as_json(self) -> dict:
        return {"bytes": self.bytes, "sha256": self.sha256, "inputs": f"{self.inputs:064x}"}


@dataclass
class RunRecord:
    output: Path
    run: dict
    input: str
    states: list = field(default_factory=list)

    @property
    def path(self) -> Path:
        return record_path(self.output)

    def save(self, *states: State, durable: bool = True) -> None:
        """Replace the record on disk (a temporary sibling, renamed over it; removed when that fails); ``durable``:
        fsync'd first (a power loss keeps the old record or this one, never a torn one)."""
        self.states = list(dict.fromkeys(states))
        data = {"format": FORMAT, "version": VERSION, "run": self.run, "input": self.input,
                "states": [s.as_json() for s in self.states]}
        tmp = temp_sibling(self.output, "run")
        try:
            with open(tmp, "w") as f:
                f.write(json.dumps(data, indent=1) + "\n")
                if durable:
                    f.flush()
                    os.fsync(f.fileno())
            with signals_deferred():
                os.replace(tmp, self.path)
        finally:
            try:
                tmp.unlink()
            except FileNotFoundError:
                pass


def load_record(output: Path) -> RunRecord | None:
    """The run record beside ``output``; None when there is none or it is not one (then OUT is not provably elx's)."""
    try:
        data = json.loads(record_path(output).read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None
    try:
        if data["format"] != FORMAT or data["version"] != VERSION or not isinstance(data["run"], dict):
            return None
        states = [State(int(s["bytes"]), str(s["sha256"]), int(s["inputs"], 16)) for s in data["states"]]
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    return RunRecord(output, data["run"], str(data.get("input", "")), states)


@dataclass
class OwnedOutput:
    """An existing OUT that elx wrote, as ``--resume`` continues it: the prefix its run record vouches for."""

    record: RunRecord
    state: State  # the longest recorded state OUT's bytes match: its first ``state.bytes`` bytes are kept
    ids: list  # ids of the lines within them, in file order
    sha256: object  # a hashlib object over those bytes, to go on appending
    file_size: int

    @property
    def size(self) -> int:
        return self.state.bytes


def _not_elx(output: Path, why: str, force: bool) -> ElxError:
    action = (f"{arg('force', True)} replaces only an output elx wrote" if force
              else f"{arg('resume', True)} continues only an output elx wrote")
    return ElxError(f"{output} {why}; {action}: pass another {arg('output_file')} (or move the file away yourself)")


def owned_output(output: Path, *, force: bool) -> OwnedOutput:
    """Prove that the existing, non-empty ``output`` is an elx dataset output, or refuse (ElxError, file untouched).

    Its first bytes must hash as one of the record's states (the longest that does is kept: its lines' records
    are in its ``inputs`` digest); what follows must be elx result lines (written after that state was saved: at
    most the batch in flight when the run was killed) and at most one torn last line.  That tail is not vouched
    for by the record: ``--resume`` cuts it off and generates those inputs again."""
    record = load_record(output)
    if record is None:
        raise _not_elx(output, f"has no elx run record ({record_path(output).name} beside it): elx did not write it, "
                       "or wrote it elsewhere", force)
    digest, size, matched, offset = hashlib.sha256(), output.stat().st_size, None, 0
    with open(output, "rb") as f:
        for state in sorted(record.states, key=lambda s: s.bytes):  # hash up to each state's length in turn
            if state.bytes > size:
                break
            digest.update(f.read(state.bytes - offset))
            offset = state.bytes
            if digest.hexdigest() == state.sha256:
                matched = (state, digest.copy())
        if matched is None:
            raise _not_elx(output, "is not the file its elx run record describes (changed since elx wrote it)", force)
        state, kept = matched
        f.seek(0)
        ids, offset = [], 0
        for number, raw in enumerate(f, 1):
            if not raw.endswith(b"\n"):  # a torn last line: the write a kill interrupted
                break
            rid = _result_id(raw)
            if rid is _NOT_A_RESULT:
                raise _not_elx(output, f"line {number} is not an elx result line", force)
            offset += len(raw)
            if offset <= state.bytes:
                ids.append(rid)
    return OwnedOutput(record, state, ids, kept, size)


_NOT_A_RESULT = object()


def _result_id(raw: bytes):
    """The id of an elx result line (``id`` and ``tokens``, or ``id``, ``line`` and ``error``), else _NOT_A_RESULT."""
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):
        return _NOT_A_RESULT
    if not isinstance(obj, dict) or not ("tokens" in obj or {"line", "error"} <= obj.keys()):
        return _NOT_A_RESULT
    rid = obj.get("id", _NOT_A_RESULT)
    return rid if isinstance(rid, (str, int)) and not isinstance(rid, bool) else _NOT_A_RESULT


def first_difference(old: dict, new: dict, prefix: str = "") -> str | None:
    """The first key whose value differs between two run identities, as ``key: old → new`` (None: equal)."""
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            found = first_difference(a, b, f"{prefix}{key}.")
            if found:
                return found
        elif a != b:
            return f"{prefix}{key} {_short(a)} then, {_short(b)} now"
    return None


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:16] + "…"
