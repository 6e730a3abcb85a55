"""``stop_strings``: HF's ``StopStringCriteria`` on the export's tokenizer (the ``tokenizers`` library).

Definition (HF's): a row stops when one of the strings appears in the text of its last tokens and
overlaps the final token: the final token's text begins with the string's last ``e > 0`` characters, the
tokens before it match the string's rest backwards, and the first matched token may run off the string's
start.  ``["st", "op"]``, ``["las", "topper"]`` and ``["s", "to", "pped"]`` stop on ``"stop"``; ``["stop", "at"]``
does not.  Token texts are HF's "clean" vocabulary: each token decoded after a fixed prefix
(``"abcdef"``) that is then cut, so that word-start markers (``Ġ``, ``▁``) become the spaces they decode to;
byte-level vocabularies (GPT-2's) and byte-fallback tokens (``<0x0A>``) match on UTF-8 bytes instead of
characters, as HF does.

HF packs the per-token tables into an embedding matrix to stay compilable; elx keeps the same tables as
dictionaries and walks back from the final token, which decides the same matches.
"""
from __future__ import annotations

import json

import numpy as np

from elx.runners.errors import ElxError

PREFIX = "abcdef"  # HF's static_prefix


def _byte_level_alphabet() -> dict:
    """GPT-2's byte-level alphabet (the ``ByteLevel`` pre-tokenizer's): printable bytes stand for themselves, the
    other 68 bytes for the code points 256, 257, ...; returns character → byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    return {c: b for b, c in chars.items()}


def _has_type(config, kind: str) -> bool:
    if isinstance(config, dict):
        return config.get("type") == kind or any(_has_type(v, kind) for v in config.values())
    if isinstance(config, list):
        return any(_has_type(v, kind) for v in config)
    return False


def matching_mode(tokenizer) -> str | None:
    """HF's rule: "byte_level" for a ByteLevel decoder, "byte_fallback" for a ByteFallback one, else None (text)."""
    decoder = tokenizer.decoder
    if decoder is None:
        return None
    if type(decoder).__name__ == "ByteLevel":
        return "byte_level"
    state = getattr(decoder, "__getstate__", lambda: None)()
    try:
        config = json.loads(state.encode() if isinstance(state, str) else state) if state else None
    except (json.JSONDecodeError, TypeError):
        config = None
    if _has_type(config, "ByteFallback"):
        return "byte_fallback"
    if _has_type(config, "ByteLevel"):
        return "byte_level"
    return None


def _token_bytes(token: str, mode: str | None, alphabet: dict | None) -> bytes | None:
    if mode == "byte_level":
        return bytes(alphabet[c] for c in token) if all(c in alphabet for c in token) else None
    if mode == "byte_fallback" and len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        digits = token[3:5]
        if all(c in "0123456789abcdefABCDEF" for c in digits):
            return bytes([int(digits, 16)])
    return None


def clean_vocabulary(tokenizer, mode: str | None) -> dict:
    """Token id → the text it yields (bytes in a byte mode), HF's ``clean_tokenizer_vocab``."""
    alphabet = _byte_level_alphabet() if mode == "byte_level" else None
    base = [tokenizer.id_to_token(i) for i in tokenizer.encode(PREFIX, add_special_tokens=False).ids]
    decoder = tokenizer.decoder
    out = {}
    for token, index in tokenizer.get_vocab(with_added_tokens=True).items():
        text = _token_bytes(token, mode, alphabet)
        if text is None:
            text = decoder.decode(base + [token]) if decoder is not None else " ".join(base + [token])
            if PREFIX not in text:
                raise ElxError(f"this tokenizer does not decode {PREFIX!r} back, which HF's stop-string matching needs "
                               "to find each token's text (HF fails too); stop_strings cannot be used with it")
            text = text[text.index(PREFIX) + len(PREFIX):]
            if mode is not None:
                text = text.encode("utf-8")
        out[int(index)] = text
    return out


def _tables(stop: str | bytes, vocabulary: dict) -> tuple[dict, dict]:
    """Per token id: the positions (from the string's end) where it can continue a match, and its end overlaps."""
    backwards = stop[::-1]
    positions, ends = {}, {}
    for index, token in vocabulary.items():
        token_backwards = token[::-1]
        found = [i for i in range(1, len(stop)) if token_backwards.startswith(backwards[i:i + len(token)])]
        if found:
            positions[index] = set(found)
        overlaps = []
        for i in range(len(token)):
            overlap = min(i + 1, len(stop))
            if token[i + 1 - overlap:i + 1] == stop[-overlap:]:
                overlaps.append(overlap)
        if overlaps:
            ends[index] = overlaps
    return positions, ends


class StopStrings:
    """``(sequences [rows, length]) -> stopped [rows]`` for ``strings`` on a ``tokenizers.Tokenizer``."""

    def __init__(self, strings: list[str], tokenizer):
        mode = matching_mode(tokenizer)
        self.strings = [s.encode("utf-8") if mode is not None else s for s in strings]
        self.vocabulary = clean_vocabulary(tokenizer, mode)
        self.tables = [_tables(s, self.vocabulary) for s in self.strings]
        if not any(ends for _, ends in self.tables):
            raise ElxError(f"no token of this tokenizer can end the stop strings {strings!r} (HF refuses them too); "
                           "check them")
        self.window = max(len(s) for s in self.strings)  # at most one token per character

    def _matches(self, tokens: list[int]) -> bool:
        last, before = tokens[-1], tokens[-2::-1]
        for stop, (positions, ends) in zip(self.strings, self.tables):
            for matched in ends.get(last, ()):
                if matched >= len(stop):
                    return True
                for token in before:
                    if matched not in positions.get(token, ()):
                        break
                    matched += len(self.vocabulary[token])
                    if matched >= len(stop):
                        return True
        return False

    def __call__(self, sequences: np.ndarray, scores=None) -> np.ndarray:
        window = np.asarray(sequences)[:, -self.window:].tolist()
        return np.fromiter((self._matches(row) for row in window), dtype=bool, count=len(window))
