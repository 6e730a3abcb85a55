"""Hold the runtime's tokenizer (``runners/inputs/text.py``) to HF's own answers before an export keeps it.

The export writes what the runtime reads (``exporter/tokenizer/export.py``) and then asks both sides the same
questions: for each of a few hundred strings, HF's ``tokenizer(text)["input_ids"]`` against ``Text.encode``, and
``tokenizer.decode(ids, skip_special_tokens=True)`` against ``Text.decode`` of those ids; then the decoding of
random id rows drawn from the whole vocabulary (special tokens, language codes and pieces no text would give
included: generation can emit any of them).  The strings are drawn, seeded, from what breaks tokenizers:
punctuation, digits, runs of spaces, tabs and newlines, accents composed and decomposed, compatibility forms
NFKC rewrites, CJK, emoji (ZWJ sequences and flags), the tokenizer's own special tokens and language codes
inside text, words of its vocabulary, and near-empty strings.

``check`` returns the counts the manifest records, and the first difference (None when there is none).
"""
from __future__ import annotations

import random

TEXTS = 300
ID_ROWS = 200
SEED = 0
FIXED = ("", " ", "  ", "\n", "\t", "Hello world.", "Hello  world", " leading space", "trailing space ",
         "a  b   c", "1,000.50 $ - 3/4 = 0.75", "Ça va? Très bien, merci!", "naïve café, Ångström, São Paulo",
         "Straße über Öl", "e\u0301 a\u0308 o\u0302", "日本語のテキストです。", "中文，标点！", "한국어 문장",
         "emoji 😀👍🏽 end", "👨\u200d👩\u200d👧 🇩🇪🇫🇷", "tab\tseparated\tvalues", "new\nline\n\nparagraph",
         "ﬁ ① Ⅸ ｆｕｌｌ ㍿", "\u00a0non-breaking\u3000ideographic", "quotes \"double\" 'single' «guillemets» „low“",
         "x" * 60, "...!!!???", "(a) [b] {c} <d> @e #f $g %h ^i &j *k", "ALL CAPS AND numbers 12345 67890",
         "mIxEd CaSe", "don't can't I'm you're we've it's", "a.b,c;d:e", "  multiple   spaces  inside  ")
ALPHABET = (list("abcdefghijklmnopqrstuvwxyzABCXYZ0123456789") + list(".,;:!?'\"()-–—…/\\@#$%&*+=<>[]{}|~^`_")
            + [" ", " ", " ", "  ", "   ", "\t", "\n", "\u00a0", "\u3000"] + list("éèêëàâäôöûüçñøåßÉÀ")
            + ["e\u0301", "a\u0308"] + list("日本語中文한국어のテ")
            + ["😀", "👍🏽", "👨\u200d👩\u200d👧", "🇩🇪", "ﬁ", "①", "Ⅸ", "ｆ", "\u200b"])


def sample_texts(vocabulary: list[str], specials: list[str], codes: list[str], n: int = TEXTS,
                 seed: int = SEED) -> list[str]:
    """``FIXED`` and ``n`` seeded strings mixing vocabulary words, special tokens and language codes with
    ``ALPHABET``'s characters; each language code also starts a text (Marian's ``>>deu<< text``)."""
    rng = random.Random(seed)
    words = sorted({w.replace("▁", "").replace("Ġ", "") for w in vocabulary} - {""})
    words = [w for w in words if w.isprintable()] or ["word"]
    out = list(FIXED)
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 12)):
            roll = rng.random()
            if roll < 0.45:
                parts.append(rng.choice(words))
            elif roll < 0.52 and (specials or codes):
                parts.append(rng.choice(specials + codes))
            else:
                parts.append("".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 4))))
            parts.append(rng.choice([" ", " ", " ", "", "  ", ", ", ". ", "\n"]))
        out.append("".join(parts))
    for code in codes[:20]:
        out.append(f"{code} {rng.choice(words)} {rng.choice(words)}.")
    return out


def id_rows(ids: list[int], n: int = ID_ROWS, seed: int = SEED) -> list[list[int]]:
    rng = random.Random(seed + 1)
    return [[rng.choice(ids) for _ in range(rng.randint(1, 24))] for _ in range(n)]


def check(hf, text, texts: list[str], rows: list[list[int]]) -> tuple[dict, str | None]:
    """Counts of identical answers (``texts``, ``encode_identical``, ``decode_identical``, ``id_rows``,
    ``id_rows_identical``) and the first difference, said in one line, or None."""
    first = None
    encoded = decoded = 0
    for string in texts:
        expected = list(hf(string)["input_ids"])
        got = text.encode([string])[0]
        if got == expected:
            encoded += 1
        elif first is None:
            first = f"encodes {string!r} as {_short(got)} where HF gives {_short(expected)}"
        want, have = hf.decode(expected, skip_special_tokens=True), text.decode([expected])[0]
        if want == have:
            decoded += 1
        elif first is None:
            first = f"decodes {_short(expected)} as {have!r} where HF gives {want!r}"
    same_rows = 0
    for row in rows:
        want, have = hf.decode(row, skip_special_tokens=True), text.decode([row])[0]
        if want == have:
            same_rows += 1
        elif first is None:
            first = f"decodes {_short(row)} as {have!r} where HF gives {want!r}"
    counts = {"texts": len(texts), "encode_identical": encoded, "decode_identical": decoded, "id_rows": len(rows),
              "id_rows_identical": same_rows}
    return counts, first


def _short(ids) -> str:
    ids = list(ids)
    return str(ids) if len(ids) <= 12 else f"[{', '.join(map(str, ids[:12]))}, ... ({len(ids)} ids)]"
