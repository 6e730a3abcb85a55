"""Text in and out: the export's tokenizer (``tokenizer/tokenizer.json``) through the ``tokenizers`` library.

No transformers at run time: ``elx export`` saves the source's fast tokenizer, whose
``tokenizer.json`` holds the whole pipeline (normalizer, pre-tokenizer, model, post-processor
adding special tokens, decoder), so ``Tokenizer.encode`` gives what HF's ``tokenizer(text)``
gives.  Decoding skips special tokens and applies HF's ``clean_up_tokenization`` when the saved
``tokenizer_config.json`` asks for it (HF skips it for BPE models, and so does elx).  What else HF does around
the pipeline (Marian's and M2M100's SentencePiece pieces looked up in a vocabulary, a stripped or filtered
decoded text) the export records in ``tokenizer/elx_text.json`` (``runners/inputs/text_rules.py``).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from elx.runners.errors import ElxError
from elx.runners.inputs.text_rules import DecodeRules, TextRules
from elx.runners.inputs.validation import check_token_rows

TOKENIZER_DIR = "tokenizer"


class Text:
    """The tokenizer of one export folder, loaded once."""

    def __init__(self, tokenizer, clean_up: bool, rules: TextRules | None = None):
        self.tokenizer, self.clean_up = tokenizer, clean_up
        self.rules = rules or TextRules(DecodeRules(clean_up=clean_up))

    @classmethod
    def load(cls, folder) -> "Text | None":
        path = Path(folder) / TOKENIZER_DIR
        if not (path / "tokenizer.json").is_file():
            return None
        from tokenizers import Tokenizer

        try:
            tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as err:  # noqa: BLE001 - tokenizers raises its own exception type
            raise ElxError(f"cannot load {path / 'tokenizer.json'} ({str(err).splitlines()[0][:160]}); "
                           "re-run 'elx export'")
        config = {}
        if (path / "tokenizer_config.json").is_file():
            try:
                config = json.loads((path / "tokenizer_config.json").read_text())
            except (OSError, json.JSONDecodeError):
                config = {}
        rules = TextRules.load(path)
        if rules is not None:
            return cls(tokenizer, rules.decode.clean_up, rules)
        is_bpe = type(tokenizer.model).__name__ == "BPE"
        clean_up = bool(config.get("clean_up_tokenization_spaces")) and (
            not is_bpe or bool(config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output")))
        return cls(tokenizer, clean_up)

    def encode(self, texts: list[str], specials: tuple | None = None) -> list[list[int]]:
        """HF's ``tokenizer(text)["input_ids"]`` of each text; ``specials`` = (prefix ids, suffix ids) in place of
        the special tokens the tokenizer adds by itself (a source language's, ``runners/inputs/languages.py``)."""
        encoder = self.rules.encoder
        if encoder is not None:
            prefix, suffix = specials or (self.rules.prefix, self.rules.suffix)
            return [[*prefix, *encoder.encode(text), *suffix] for text in texts]
        if specials is None:
            return [encoding.ids for encoding in self.tokenizer.encode_batch(list(texts))]
        prefix, suffix = specials
        return [[*prefix, *encoding.ids, *suffix]
                for encoding in self.tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    def stop_tokenizer(self):
        """The ``tokenizers.Tokenizer`` stop strings are matched on (``runners/search/stop_strings.py``)."""
        if self.rules.encoder is not None:
            raise ElxError("stop_strings are not supported yet for this export's tokenizer (SentencePiece pieces "
                           "looked up in a vocabulary, as Marian's and M2M100's): drop stop_strings")
        return self.tokenizer

    def decode(self, rows) -> list[str]:
        rules = self.rules.decode
        return [rules.text(self.tokenizer.decode(rules.ids([int(t) for t in row]), skip_special_tokens=True))
                for row in rows]


def token_rows(text: str) -> list[list[int]]:
    """``"5 6 7; 8 9"`` → [[5, 6, 7], [8, 9]] (the CLI's ``--input-ids``)."""
    try:
        return [[int(t) for t in row.replace(",", " ").split()] for row in text.split(";") if row.strip()]
    except ValueError:
        raise ElxError(f"--input-ids must be integers separated by spaces, rows by ';' (got {text!r})")


def pad_rows(rows: list[list[int]], pad: int, side: str = "right") -> dict:
    """``input_ids`` and ``attention_mask`` for rows of different lengths, padded on ``side``
    (right for encoder inputs, left for decoder-only prompts)."""
    if not rows or not all(len(r) for r in rows):
        raise ElxError("no input tokens given (an empty row); pass token ids or text")
    check_token_rows(rows)  # runners/inputs/validation.py: ids that do not fit in int64
    width = max(len(r) for r in rows)
    ids = np.full((len(rows), width), pad, dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.int64)
    for i, row in enumerate(rows):
        at = slice(width - len(row), width) if side == "left" else slice(0, len(row))
        ids[i, at], mask[i, at] = row, 1
    return {"input_ids": ids, "attention_mask": mask}
