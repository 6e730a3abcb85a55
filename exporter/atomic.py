"""Write a folder completely or not at all, and never over anything elx did not write.

``staged_folder(output, force)`` yields a temporary sibling ``.NAME.PID-XXXXXXXX.partial`` and
renames it into place when the block succeeds; on any error (Ctrl-C and SIGTERM included: the
CLI turns SIGTERM into an exception) the temporary folder is removed.  While it runs it holds an
exclusive lock on ``.NAME.lock`` beside the output, so a second elx process writing the same
output is refused at once instead of silently replacing the first one's result.  Under that lock
it also removes what killed runs (SIGKILL, power loss) left of the same output: the partial
folders whose process (the PID in their name) is gone.

What may be replaced (``check_output``): nothing that exists, without ``force``; with ``force``,
an empty folder or a folder elx wrote (an elx ``manifest.json`` and only the files it lists, and the
``config.json`` / ``generation_config.json`` ``elx.hf`` writes beside them; inside
``tokenizer/`` only the files HF's ``save_pretrained`` writes for a tokenizer or feature extractor,
inside ``engines/`` only those the manifest's engines section names).  Anything else there, in a
sub-folder too, makes ``--force`` refuse, naming it: it is the user's, and a replaced folder is deleted.
Never the current folder, one of its parents, the home folder, a file or a symbolic link.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path

from elx.runners.errors import ElxError
from elx.runners.inputs.text_rules import FILES as TEXT_RULE_FILES
from elx.runners.manifest import FILENAME, FORMAT
from elx.runners.wording import arg, on_command_line
from elx.runners.output_lock import dead_siblings, output_lock, signals_deferred, temp_sibling, write_failure

TOKENIZER_DIR = "tokenizer"  # runners/inputs/text.py reads the tokenizer from there
# the source model's transformers configs, which elx.hf (from_pretrained's cached exports, save_pretrained) writes
# beside the graphs for the drop-in's ``config`` / ``generation_config``
HF_CONFIG_FILES = ("config.json", "generation_config.json")


# -- what may be written ---------------------------------------------------------------------------

def output_path(output) -> Path:
    """``output`` as an absolute path (``~`` expanded, ``..`` folded); an empty name is refused."""
    if output is None or not str(output).strip():
        raise ElxError(f"{arg('output')} is empty; name the folder to write, e.g. {_example('my-export')}")
    path = Path(os.path.abspath(Path(str(output)).expanduser()))
    if path == path.parent:
        raise ElxError(f"output {path} is the root of the file system; name a new folder to write")
    return path


def _example(folder) -> str:
    """An example output, as the user would write it."""
    return f"--output {folder}" if on_command_line() else f"output={str(folder)!r}"


def _real(path: Path) -> Path:
    return Path(os.path.realpath(path))


def _protected_reason(output: Path) -> str | None:
    """Why ``output`` may never be replaced: the current folder, one of its parents, or the home folder."""
    real = _real(output)
    try:
        cwd = _real(Path.cwd())
    except OSError:  # the current folder was deleted
        cwd = None
    if cwd is not None and real == cwd:
        return "is the current folder"
    if cwd is not None and real in cwd.parents:
        return "holds the current folder"
    if real == _real(Path.home()):
        return "is the home folder"
    return None


# What HF's ``save_pretrained`` writes for the tokenizers, processors and feature extractors of the families elx
# exports (``exporter/export.py``'s ``copy_tokenizer`` saves them into ``tokenizer/``): the common files
# (``tokenization_utils_base``, ``utils``) and each tokenizer class's ``vocab_files_names``.
TOKENIZER_FILES = frozenset({
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
    "chat_template.json", "vocab.json", "vocab.txt", "merges.txt", "spiece.model", "sentencepiece.bpe.model",
    "source.spm", "target.spm", "target_vocab.json", "normalizer.json", "preprocessor_config.json",
    "processor_config.json", *TEXT_RULE_FILES})  # and what exporter/tokenizer/export.py adds for the runtime


def _engine_files(section: dict) -> set[str]:
    """The files ``elx build-engine`` writes into its folder, as its manifest section names them."""
    folder = section["folder"]
    files = {f"{folder}/build.json"}  # runners/backends/tensorrt_engines.py's BUILD_FILE
    graphs = section.get("graphs")
    for graph in graphs.values() if isinstance(graphs, dict) else ():
        if isinstance(graph, dict) and isinstance(graph.get("file"), str):
            files.add(graph["file"])
    ngram = section.get("ngram")
    if isinstance(ngram, dict) and isinstance(ngram.get("library"), str):
        files.add(ngram["library"])
    return {Path(f).as_posix() for f in files}


def elx_files(folder: Path) -> set[str] | None:
    """The paths (relative to ``folder``, ``/``-separated) elx writes there according to its manifest: the top-level
    files and folders, and the files inside ``tokenizer/`` and the engines folder; None when ``folder`` holds no
    elx manifest."""
    try:
        data = json.loads((folder / FILENAME).read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        return None
    names = {FILENAME, TOKENIZER_DIR, *HF_CONFIG_FILES, *(f"{TOKENIZER_DIR}/{name}" for name in TOKENIZER_FILES)}
    for section in data.values():  # folders a section of the manifest names (build-engine's "engines")
        if isinstance(section, dict) and isinstance(section.get("folder"), str) and "/" not in section["folder"]:
            names.add(section["folder"])
            names.update(_engine_files(section))
    graphs = data.get("graphs")
    for graph in graphs.values() if isinstance(graphs, dict) else ():
        if isinstance(graph, dict):
            extra = graph.get("external_data")
            files = [graph.get("file"), graph.get("tensorrt_file"), *(extra if isinstance(extra, list) else [])]
            names.update(Path(f).name for f in files if isinstance(f, str))
    return names


# what a killed ``elx build-engine`` leaves inside an export folder (exporter/tensorrt/build.py): its staging
# folder ``.engines.PID-XXXXXXXX.partial`` (before: ``.engines.XXXXXXXX.partial``), the replaced engines
# ``.engines.PID-XXXXXXXX.old`` (before: ``.engines.old-PID``) and the new manifest ``.manifest.json.PID-XXXXXXXX.tmp``
# (before: ``.manifest.json.PID.tmp``).  Only elx writes these names; build-engine holds the export's lock while
# they exist, so under that lock they are a dead build's.
ENGINE_LEFTOVERS = re.compile(r"^\.(engines\.(\d+-[0-9a-f]+\.(partial|old)|[A-Za-z0-9_]+\.partial|old-\d+)"
                              rf"|{re.escape(FILENAME)}\.(\d+-[0-9a-f]+|\d+)\.tmp)$")


def build_leftovers(folder: Path) -> list[Path]:
    """The entries of ``folder`` (an export) that a killed ``elx build-engine`` left there."""
    try:
        entries = sorted(folder.iterdir())
    except OSError:
        return []
    return [entry for entry in entries if ENGINE_LEFTOVERS.match(entry.name) and not entry.is_symlink()]


def foreign_files(folder: Path, owned: set[str]) -> list[str]:
    """What ``folder`` holds that elx did not write: top-level entries not in ``owned`` (a killed build-engine's
    leftovers are elx's), and inside the folders elx writes (``tokenizer/``, ``engines/``), every entry not in
    ``owned`` (sub-folders of those included)."""
    foreign = []
    leftovers = {entry.name for entry in build_leftovers(folder)}
    for entry in sorted(folder.iterdir()):
        if entry.name in leftovers:
            continue
        if entry.name not in owned:
            foreign.append(entry.name)
        elif entry.is_dir() and not entry.is_symlink():
            foreign.extend(f"{entry.name}/{child.name}" for child in sorted(entry.iterdir())
                           if f"{entry.name}/{child.name}" not in owned or child.is_dir())
    return foreign


def _check_replaceable(output: Path) -> None:
    """``--force`` replaces only what elx wrote: a folder with an elx manifest and nothing else of the user's,
    also inside the folders elx writes (``tokenizer/``, ``engines/``)."""
    owned = elx_files(output)
    if owned is None:
        raise ElxError(f"output folder {output} was not written by elx (no elx manifest.json); {arg('force', True)} "
                       f"replaces only elx export folders: choose another {arg('output')}")
    foreign = foreign_files(output, owned)
    if foreign:
        raise ElxError(f"output folder {output} holds {foreign[0]!r}, which elx did not write; {arg('force', True)} "
                       f"would delete it: move it out or choose another {arg('output')}")


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _check_parent(output: Path) -> None:
    """The nearest existing ancestor of ``output`` must be a folder this process may write in."""
    existing = _nearest_existing(output.parent)
    if not existing.is_dir():
        raise ElxError(f"cannot create {output}: {existing} is a file; choose another {arg('output')}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ElxError(f"cannot write in {existing} (permission denied); choose a writable {arg('output')}")


def _make_parents(folder: Path) -> list[Path]:
    """Create ``folder`` and its missing parents; returns the created ones, deepest first."""
    missing = []
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    for path in reversed(missing):
        try:
            path.mkdir(exist_ok=True)
        except OSError as err:
            _remove_if_empty(missing)
            raise ElxError(f"cannot create {path} ({err.strerror}); choose a writable {arg('output')}") from None
    return missing


def _remove_if_empty(folders: list[Path]) -> None:
    """Remove the folders (deepest first) that are still empty; stop at the first one that is not."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


def check_output(output, force: bool = False, replaceable=None) -> Path:
    """The absolute output path, after refusing anything that writing (and ``force``) could destroy.
    ``replaceable(output)`` refuses a folder ``force`` may not replace (default: anything but an elx export)."""
    output = output_path(output)
    if output.is_symlink():
        raise ElxError(f"output {output} is a symbolic link; pass the folder it points to or another {arg('output')}")
    reason = _protected_reason(output)
    if reason:
        raise ElxError(f"output {output} {reason}; name a new folder to write, e.g. {_example(output / 'elx-export')}")
    if output.exists() and not output.is_dir():
        raise ElxError(f"output {output} exists and is not a folder; choose another {arg('output')}")
    if output.is_dir() and any(output.iterdir()):
        if not force:
            raise ElxError(f"output folder {output} already exists and is not empty; choose another {arg('output')} "
                           f"({arg('force', True)} replaces an earlier elx export, nothing else)")
        (replaceable or _check_replaceable)(output)
    _check_parent(output)
    return output


# -- what killed writers left ----------------------------------------------------------------------

_LEFTOVER_KINDS = ("partial", "old")


def clean_stale_leftovers(output: Path) -> list[Path]:
    """Remove the ``.partial`` folders of ``output`` whose writer is dead (call it holding the lock).

    A dead writer's ``.old`` folder is the previous export it was replacing: put back when the
    output is missing (it died between the two renames), removed otherwise.
    """
    removed = []
    for entry, kind in dead_siblings(output, _LEFTOVER_KINDS):
        if not entry.is_dir():
            continue
        if kind == "old" and not output.exists():
            entry.rename(output)
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    return removed


# -- writing -----------------------------------------------------------------------------------------

def _make_partial(output: Path) -> Path:
    """A new empty sibling ``.NAME.PID-XXXXXXXX.partial`` (with the usual umask permissions, unlike mkdtemp)."""
    while True:
        path = temp_sibling(output, "partial")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue


def _move_into_place(partial: Path, output: Path) -> None:
    """Rename ``partial`` to ``output``; a replaced (empty or elx) folder is removed only after that succeeded."""
    old = None
    if output.exists():
        old = partial.with_name(partial.name[: -len(".partial")] + ".old")
        output.rename(old)
    try:
        partial.rename(output)
    except BaseException:
        if old is not None:
            old.rename(output)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_error(err: OSError, output: Path) -> ElxError | None:
    """A one-line error for a failed write (disk full, read-only, ...); None for other OS errors."""
    what = write_failure(err)
    if what is None:
        return None
    return ElxError(f"writing {output} failed: {what}; nothing was written (free space or choose another "
                    f"{arg('output')})")


@contextmanager
def staged_folder(output, force: bool = False, replaceable=None):
    """Yield a temporary folder next to ``output``; on success it becomes ``output``, on error it vanishes
    (with the parent folders it had to create).  ``replaceable``: see ``check_output``."""
    output = check_output(output, force, replaceable)
    created = []
    try:
        with signals_deferred():  # a signal lands after ``created`` is set, inside the try
            created = _make_parents(output.parent)
        with output_lock(output):
            clean_stale_leftovers(output)
            output = check_output(output, force, replaceable)  # again, under the lock
            with _partial_folder(output) as partial:
                yield partial
                with signals_deferred():
                    check_output(output, force, replaceable)  # something may have appeared there meanwhile
                    _move_into_place(partial, output)
    except BaseException as err:
        _remove_if_empty(created)
        converted = write_error(err, output) if isinstance(err, OSError) else None
        if converted is not None:
            raise converted from err
        raise


@contextmanager
def _partial_folder(output: Path):
    """A new ``.NAME.PID-XXXXXXXX.partial`` beside ``output``, removed again if the block fails."""
    partial = None
    try:
        with signals_deferred():  # a signal lands after ``partial`` is set, inside the try
            partial = _make_partial(output)
        yield partial
    except BaseException:
        if partial is not None:
            with signals_deferred():
                shutil.rmtree(partial, ignore_errors=True)
        raise
