"""``elx import-gguf FILE --output HF_DIR``: a GGUF file written out as a normal HF folder.

The folder is what ``save_pretrained`` writes for the plain float32 model and the tokenizer transformers
rebuilds from the file (``load.py``): ``config.json`` (no ``quantization_config``), ``model.safetensors``,
``generation_config.json`` (BOS/EOS/PAD as transformers reads them from ``tokenizer.ggml.*_token_id``),
``tokenizer.json``, ``tokenizer_config.json`` and ``chat_template.jinja`` when the file has a chat template.
Beside them ``elx_import.json`` records where the folder came from (the GGUF file's name, SHA-256,
architecture and quantization) and the files the import wrote: ``--force`` replaces only a folder holding
that record and nothing else, never a model folder of the user's.

Every refusal that needs no PyTorch comes first (``header.py``, ``metadata.py``, ``support.py``, the output
folder); the folder is written into a temporary sibling renamed into place at the end
(``exporter/atomic.py``): nothing half-written stays on failure.
"""
from __future__ import annotations

import json
from pathlib import Path

from elx.exporter.atomic import check_output, staged_folder
from elx.exporter.gguf.metadata import GgufInfo, read_gguf
from elx.exporter.gguf.support import check_loadable
from elx.runners.errors import ElxError
from elx.runners.wording import arg

RECORD = "elx_import.json"
RECORD_FORMAT = "elx-gguf-import"


def _recorded_files(folder: Path) -> list[str] | None:
    try:
        data = json.loads((folder / RECORD).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or data.get("format") != RECORD_FORMAT or not isinstance(data.get("files"), list):
        return None
    return [name for name in data["files"] if isinstance(name, str)]


def check_replaceable_import(output: Path) -> None:
    """``--force`` replaces an earlier import: a folder with an ``elx_import.json`` and only the files it lists."""
    files = _recorded_files(output)
    if files is None:
        raise ElxError(f"output folder {output} was not written by 'elx import-gguf' (no {RECORD}); "
                       f"{arg('force', True)} replaces only an earlier import: choose another {arg('output')}")
    foreign = [entry.name for entry in sorted(output.iterdir()) if entry.name not in files or entry.is_dir()]
    if foreign:
        raise ElxError(f"output folder {output} holds {foreign[0]!r}, which 'elx import-gguf' did not write; "
                       f"{arg('force', True)} would delete it: move it out or choose another {arg('output')}")


def write_import(info: GgufInfo, model, tokenizer, folder: Path) -> None:
    """Save ``model`` and ``tokenizer`` into ``folder`` with the import's record."""
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    mode = folder.stat().st_mode & 0o666
    for path in folder.iterdir():  # safetensors creates its file owner-only: readable like the rest
        path.chmod(mode)
    files = sorted(path.name for path in folder.iterdir()) + [RECORD]
    record = {"format": RECORD_FORMAT, "version": 1, "source": info.record(), "files": files}
    (folder / RECORD).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


def import_gguf(file, output, force: bool = False) -> Path:
    """Convert the GGUF file ``file`` into an HF folder at ``output``; returns the folder's absolute path."""
    info = read_gguf(file)
    check_loadable(info)
    out = check_output(output, force, check_replaceable_import)  # before the long load
    from elx.exporter.gguf.load import load_model, load_tokenizer

    tokenizer = load_tokenizer(info)
    model = load_model(info)
    info.sha256()  # read the file before the staged folder exists
    with staged_folder(out, force, check_replaceable_import) as staging:
        write_import(info, model, tokenizer, staging)
    return out
