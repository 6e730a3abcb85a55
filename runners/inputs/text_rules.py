"""What an HF tokenizer does around the ``tokenizers`` pipeline, as ``elx export`` recorded it
(``tokenizer/elx_text.json``).

``tokenizer.json`` holds most of a tokenizer, but not all of what HF's ``tokenizer(text)`` and
``tokenizer.decode(ids, skip_special_tokens=True)`` do.  The export writes the rest here, and checks the whole
against HF's own answers on a few hundred strings before it keeps it (``exporter/tokenizer/export.py``):

* **Pieces and a vocabulary** (MarianMT, M2M100: HF's Python tokenizers, no fast class).  HF splits the text on
  its added tokens (``</s>``, ``<pad>``, ...), gives each piece between them to SentencePiece (Marian: the source
  model, after taking a leading ``>>deu<<`` language code off), and looks each piece's *string* up in
  ``vocab.json`` (unknown strings: ``<unk>``).  ``PieceEncoder`` does the same with the SentencePiece model as a
  ``tokenizers`` pipeline (``elx_source_tokenizer.json``) and the source vocabulary (``elx_source_vocab.json``);
  the ids HF adds around a text (``build_inputs_with_special_tokens``) are recorded as ``prefix`` / ``suffix``.
  ``tokenizer.json`` is then the *target* vocabulary and decoder, for decoding only.
* **Decoding steps** HF runs after the tokenizers decoder: ``strip`` (SentencePiece-based Python tokenizers strip
  the text), ``clean_up`` (HF's ``clean_up_tokenization``, whatever the model type), Whisper's
  ``drop_prompt`` (ids before the start token when a ``<|startofprev|>`` prompt leads) and ``remove_pattern``
  (its timestamp tokens' text).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from elx.runners.errors import ElxError

RULES_FILE = "elx_text.json"
PIECES_FILE = "elx_source_tokenizer.json"  # the SentencePiece model as a tokenizers pipeline (PieceEncoder)
SOURCE_VOCAB_FILE = "elx_source_vocab.json"  # piece string -> id, HF's convert_tokens_to_ids (PieceEncoder)
FILES = (RULES_FILE, PIECES_FILE, SOURCE_VOCAB_FILE)
FORMAT = 1
_CLEANUPS = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
             (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


def clean_up(text: str) -> str:
    """HF's ``clean_up_tokenization``."""
    for before, after in _CLEANUPS:
        text = text.replace(before, after)
    return text


@dataclass(frozen=True)
class DecodeRules:
    strip: bool = False
    clean_up: bool = False
    drop_prompt: tuple | None = None  # (prompt id, start id): Whisper's _strip_prompt
    remove_pattern: re.Pattern | None = None

    def ids(self, row: list[int]) -> list[int]:
        if self.drop_prompt and row and row[0] == self.drop_prompt[0] and self.drop_prompt[1] in row:
            return row[row.index(self.drop_prompt[1]):]
        return row

    def text(self, text: str) -> str:
        if self.strip:
            text = text.strip()
        if self.clean_up:
            text = clean_up(text)
        if self.remove_pattern is not None:
            text = self.remove_pattern.sub("", text)
        return text


class PieceEncoder:
    """HF's Python tokenizer on a SentencePiece model and a vocabulary of piece strings (see the module docstring)."""

    def __init__(self, pieces, piece_unk: int, vocab: dict, added: dict, unk_id: int, language_prefix: bool):
        self.pieces, self.piece_unk, self.vocab, self.added, self.unk_id = pieces, piece_unk, vocab, added, unk_id
        self.language_prefix = language_prefix
        names = sorted(added, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(re.escape(n) for n in names) + ")") if names else None

    def _id(self, piece: str) -> int:
        return self.vocab.get(piece, self.unk_id)

    def _chunk(self, text: str) -> list[int]:
        out = []
        if self.language_prefix and text.startswith(">>") and (end := text.find("<<")) != -1:
            out.append(self._id(text[:end + 2]))  # MarianTokenizer.remove_language_code
            text = text[end + 2:]
        normalized = self.pieces.normalizer.normalize_str(text) if self.pieces.normalizer else text
        splits = self.pieces.pre_tokenizer.pre_tokenize_str(normalized) if self.pieces.pre_tokenizer else [
            (normalized, None)]
        for split, _ in splits:
            raw = split.encode("utf-8")
            for token in self.pieces.model.tokenize(split):
                # SentencePiece names an unknown run by its text, and HF looks that text up in the vocabulary
                unknown = token.id == self.piece_unk
                piece = raw[token.offsets[0]:token.offsets[1]].decode("utf-8") if unknown else token.value
                out.append(self._id(piece))
        return out

    def encode(self, text: str) -> list[int]:
        chunks = self._split.split(text) if self._split is not None else [text]
        out = []
        for chunk in chunks:
            if not chunk:
                continue
            if chunk in self.added:
                out.append(self.added[chunk])
            else:
                out.extend(self._chunk(chunk))
        return out


@dataclass(frozen=True)
class TextRules:
    decode: DecodeRules
    encoder: PieceEncoder | None = None
    prefix: tuple = ()
    suffix: tuple = ()

    @classmethod
    def load(cls, path: Path) -> "TextRules | None":
        """``tokenizer/elx_text.json`` (None when the export has none: an older elx wrote it)."""
        file = path / RULES_FILE
        if not file.is_file():
            return None
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
            decode = data.get("decode", {})
            pattern = decode.get("remove_pattern")
            rules = DecodeRules(bool(decode.get("strip")), bool(decode.get("clean_up")),
                                tuple(decode["drop_prompt"]) if decode.get("drop_prompt") else None,
                                re.compile(pattern) if pattern else None)
            encoder = data.get("encoder")
            if not encoder:
                return cls(rules)
            from tokenizers import Tokenizer

            pieces = Tokenizer.from_file(str(path / encoder["pieces"]))
            vocab = json.loads((path / encoder["vocab"]).read_text(encoding="utf-8"))
            return cls(rules, PieceEncoder(pieces, int(encoder["piece_unk"]), vocab, dict(encoder["added"]),
                                           int(encoder["unk_id"]), bool(encoder.get("language_prefix"))),
                       tuple(encoder["prefix"]), tuple(encoder["suffix"]))
        except Exception as err:  # noqa: BLE001 - JSON, tokenizers and key errors alike: the folder is damaged
            detail = str(err).splitlines()[0][:120] if str(err) else type(err).__name__
            raise ElxError(f"cannot read {file} ({detail}); re-run 'elx export'")
