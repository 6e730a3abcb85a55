"""Turn a user's request (token ids, text or audio) into encoder inputs, and tokens back into text."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from runners.errors import ElxError

from .manifest import Manifest
from .validation import check_token_rows

TOKENIZER_DIR = "tokenizer"


def _token_rows(text: str) -> list[list[int]]:
    try:
        return [[int(t) for t in row.replace(",", " ").split()] for row in text.split(";") if row.strip()]
    except ValueError:
        raise ElxError(f"--input-ids must be integers separated by spaces, rows by ';' (got {text!r})")


def pad_rows(rows: list[list[int]], pad: int) -> dict:
    if not rows or not all(rows):
        raise ElxError("no input tokens given; pass --input-ids '1 2 3' or --text")
    check_token_rows(rows)  # runners/validation.py: ids that do not fit in int64
    width = max(len(r) for r in rows)
    ids = np.full((len(rows), width), pad, dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.int64)
    for i, row in enumerate(rows):
        ids[i, : len(row)], mask[i, : len(row)] = row, 1
    return {"input_ids": ids, "attention_mask": mask}


def load_tokenizer(folder):
    path = Path(folder) / TOKENIZER_DIR
    if not path.is_dir():
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception:  # noqa: BLE001 - a folder without a usable tokenizer
        return None


def encode_request(manifest: Manifest, folder, input_ids=None, text=None, audio=None) -> dict:
    roles = manifest.encoder_inputs()
    if audio:
        if "input_features" not in roles:
            raise ElxError("--audio needs a model whose encoder takes audio features (Whisper)")
        from .audio import features_from_files

        return features_from_files(folder, audio)
    if "input_ids" not in roles:
        raise ElxError(f"this model's encoder takes {', '.join(roles)}; pass --audio FILE.wav")
    pad = manifest.tokens.get("pad_token_id") or 0
    if text:
        tokenizer = load_tokenizer(folder)
        if tokenizer is None:
            raise ElxError(f"{folder} has no tokenizer; pass --input-ids instead of --text")
        return pad_rows([tokenizer(t)["input_ids"] for t in text], pad)
    if input_ids:
        return pad_rows(_token_rows(input_ids), pad)
    raise ElxError("nothing to generate from; pass --input-ids, --text or --audio")


def decode(manifest: Manifest, folder, tokens) -> str | None:
    tokenizer = load_tokenizer(folder)
    if tokenizer is None:
        return None
    return tokenizer.decode([int(t) for t in tokens], skip_special_tokens=True)
