"""The rows ``elx generate`` prints: which input and hypothesis each returned sequence is, its score, its tokens
and text, as a line for people or a JSON object for scripts (``--format jsonl``); Whisper's segments (start and
end in seconds, text) under each row, in its JSON object, or as SubRip / WebVTT subtitles (``--format srt|vtt``).

A row is what HF ``generate`` returns for it, less the left padding of a decoder-only prompt: GPT-2's
returned rows begin with the prompt as the batch was padded (``padding_side="left"``, pad = EOS), so a
short prompt batched with a longer one starts with pad tokens that are no part of its input.  Those
leading positions (where the prompt's attention mask is 0) are dropped from the tokens shown, and the
text is decoded from the tokens shown.  Everything else is HF's: the start token of encoder-decoder
rows, the generated tokens, and the pad tokens that fill a row that finished early.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class OutputRow:
    input: int  # the input's index in the batch
    hypothesis: int  # the row's rank among its input's returned sequences (0: the best)
    score: float | None  # HF's sequences_scores (beam search: length-penalized log-probability); None without
    tokens: list[int]
    text: str | None  # None: the export has no tokenizer


def left_padding(inputs: dict, prompt_in_sequences: bool) -> list[int]:
    """Per input, the pad positions a returned row begins with: the leading zeros of a decoder-only prompt's
    attention mask (``prompt_in_sequences``), none for encoder-decoder rows (their prompt is the encoder's)."""
    batch = int(next(iter(inputs.values())).shape[0])
    mask = inputs.get("attention_mask")
    if not prompt_in_sequences or mask is None:
        return [0] * batch
    mask = np.asarray(mask)
    return [int(np.argmax(row != 0)) if row.any() else int(row.shape[0]) for row in mask]


def output_rows(out, rows_per_input: int, padding: list[int], decode=None) -> list[OutputRow]:
    """The rows of ``out`` (a ``GenerationOutput``); ``decode(rows) -> texts`` decodes rows whose padding was
    dropped (the export's tokenizer; None: ``out.text`` as it is)."""
    rows = []
    for r, sequence in enumerate(out.sequences):
        i, j = divmod(r, rows_per_input)
        tokens = [int(t) for t in sequence[padding[i]:]]
        text = out.text[r] if out.text is not None else None
        if text is not None and padding[i] and decode is not None:
            text = decode([tokens])[0]
        score = None if out.sequences_scores is None else float(out.sequences_scores[r])
        rows.append(OutputRow(i, j, score, tokens, text))
    return rows


def human_line(row: OutputRow, with_text: bool = True) -> str:
    """``input 0, hypothesis 1, score -0.7310: 0 5 6 7`` and the text on the next line, indented."""
    score = "" if row.score is None else f", score {row.score:.4f}"
    line = f"input {row.input}, hypothesis {row.hypothesis}{score}: {' '.join(map(str, row.tokens))}"
    return line + (f"\n    {row.text}" if with_text and row.text is not None else "")


def json_line(row: OutputRow, segments: list | None = None) -> str:
    """One JSON object: input, hypothesis, score (null without one), tokens, text (null without a tokenizer); with
    ``segments`` (Whisper with timestamps) also ``segments``: [{"start", "end", "text"}, ...]."""
    data = asdict(row)
    if segments is not None:
        data["segments"] = [asdict(segment) for segment in segments]
    return json.dumps(data, ensure_ascii=False)


@dataclass(frozen=True)
class Segment:
    start: float  # seconds from the start of the audio
    end: float
    text: str | None  # None: the export has no tokenizer


def row_segments(segments: list, decode=None) -> list[Segment]:
    """HF's segments of one row (``out.segments[i]``: start, end, tokens) with their text: the tokens decoded as
    HF's ``batch_decode(..., skip_special_tokens=True)`` decodes them (timestamp tokens dropped), stripped."""
    out = []
    for segment in segments:
        text = decode(np.asarray(segment["tokens"])[None])[0].strip() if decode is not None else None
        out.append(Segment(round(float(segment["start"]), 3), round(float(segment["end"]), 3), text))
    return out


def segment_line(segment: Segment) -> str:
    """``  [0.00 -> 3.80] The quick brown fox.`` (human format, under the row)."""
    words = f" {segment.text}" if segment.text else ""
    return f"  [{segment.start:.2f} -> {segment.end:.2f}]{words}"


def _clock(seconds: float, separator: str) -> str:
    milliseconds = int(round(max(seconds, 0.0) * 1000))
    hours, rest = divmod(milliseconds, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    return f"{hours:02d}:{minutes:02d}:{rest // 1000:02d}{separator}{rest % 1000:03d}"


def subtitles(segments: list[Segment], form: str) -> str:
    """The segments as a SubRip (``srt``: numbered cues, ``HH:MM:SS,mmm``) or WebVTT (``vtt``: a ``WEBVTT`` header,
    ``HH:MM:SS.mmm``) file; segments without text are left out."""
    separator = "," if form == "srt" else "."
    cues = []
    for segment in segments:
        if not segment.text:
            continue
        timing = f"{_clock(segment.start, separator)} --> {_clock(segment.end, separator)}"
        cues.append(f"{len(cues) + 1}\n{timing}\n{segment.text}\n" if form == "srt" else f"{timing}\n{segment.text}\n")
    body = "\n".join(cues)
    return body if form == "srt" else "WEBVTT\n\n" + body
