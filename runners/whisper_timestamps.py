"""Whisper's timestamp tokens: HF's ``WhisperTimeStampLogitsProcessor`` on the host, and HF's segment cut.

Read from transformers 5.24 (``generation/logits_process.py`` and ``models/whisper/generation_whisper.py``).

Token ids above ``<|notimestamps|>`` are timestamps: id ``timestamp_begin + i`` means ``i · time_precision``
(0.02 s) into the 30 s window.  ``TimestampRules`` masks the scores as HF's processor does, per row, on the
tokens after ``begin_index`` (the decoder prompt's length):

* ``<|notimestamps|>`` is never generated;
* timestamps come in pairs: after a timestamp that follows a timestamp (or opens the output) a text token
  must come; after a single timestamp, no token below ``eos_token_id`` (the text tokens of a real vocabulary);
* timestamps never decrease, and ``<|0.00|>``-like repeats are avoided: below the last timestamp (+1 unless
  the last token is a single timestamp) every timestamp is banned;
* the first generated token is a timestamp, at most ``max_initial_timestamp_index`` steps in;
* where the summed probability of all timestamps exceeds that of the likeliest text token, only timestamps
  remain (float32 log-softmax, PyTorch's kernel where PyTorch imports, as everywhere the rounding decides).

``cut_segments`` is HF's ``_retrieve_segment``: a generated window is cut after every two consecutive
timestamps; a window ending on a single timestamp is finished (seek past the window), otherwise the text after
the last pair is dropped and the next window starts at that pair's timestamp.
"""
from __future__ import annotations

import numpy as np

from elx.runners.search.log_softmax import log_softmax, torch_module

NEG_INF = np.float32(-np.inf)


class TimestampRules:
    """HF's ``WhisperTimeStampLogitsProcessor`` (numpy in, numpy out: a caller-style logits processor)."""

    def __init__(self, no_timestamps_token_id: int, eos_token_id: int | None, begin_index: int,
                 max_initial_timestamp_index: int | None):
        """``eos_token_id``: HF's ``eos_token_id or bos_token_id`` (an EOS of 0 gives the BOS; None bans every
        token after a single timestamp, as HF's slice ``[:None]`` does)."""
        self.no_timestamps = int(no_timestamps_token_id)
        self.timestamp_begin = self.no_timestamps + 1
        self.eos = None if eos_token_id is None else int(eos_token_id)
        self.begin_index = int(begin_index)
        self.max_initial = None if max_initial_timestamp_index is None else int(max_initial_timestamp_index)

    def __call__(self, tokens: np.ndarray, scores: np.ndarray) -> np.ndarray:
        begin = self.timestamp_begin
        out = np.array(scores, dtype=np.float32, copy=True)
        out[:, self.no_timestamps] = NEG_INF
        floor = np.empty(out.shape[0], dtype=np.int64)
        for k, row in enumerate(np.asarray(tokens)[:, self.begin_index:]):
            last = row.size >= 1 and row[-1] >= begin
            penultimate = row.size < 2 or row[-2] >= begin
            if last:
                if penultimate:
                    out[k, begin:] = NEG_INF
                else:
                    out[k, : self.eos] = NEG_INF
            stamps = row[row >= begin]
            floor[k] = begin if not stamps.size else (stamps[-1] if last and not penultimate else stamps[-1] + 1)
        vocab = np.arange(out.shape[1])
        out[(vocab >= begin) & (vocab < floor[:, None])] = NEG_INF
        if tokens.shape[1] == self.begin_index:
            out[:, :begin] = NEG_INF
            if self.max_initial is not None:
                out[:, begin + self.max_initial + 1:] = NEG_INF
        logprobs = log_softmax(out.copy())
        torch = torch_module()
        if torch is not None:
            stamp_mass = torch.logsumexp(torch.from_numpy(np.ascontiguousarray(logprobs[:, begin:])), dim=-1).numpy()
        else:
            part = logprobs[:, begin:]
            top = part.max(axis=-1)
            with np.errstate(invalid="ignore"):
                stamp_mass = top + np.log(np.exp(part - top[:, None]).sum(axis=-1))
        text_best = logprobs[:, :begin].max(axis=-1)
        out[np.flatnonzero(stamp_mass > text_best), :begin] = NEG_INF
        return out


def cut_segments(tokens: np.ndarray, timestamp_begin: int, time_offset: float, window_frames: int,
                 prompt_len: int, time_precision: float = 0.02, time_precision_features: float = 0.01,
                 input_stride: int = 2) -> tuple[list[dict], int]:
    """HF's ``_retrieve_segment`` for one row's generated tokens (EOS removed): (segments, frames to seek on).

    Each segment: ``start`` / ``end`` in seconds (float64, ``time_offset`` added), its ``tokens`` and ``idxs``
    (its slice among the generate call's sequence, prompt counted)."""
    tokens = np.asarray(tokens, dtype=np.int64)
    is_stamp = (tokens >= timestamp_begin).tolist()
    single_ending = is_stamp[-2:] == [False, True]
    cuts = [i + 1 for i in range(len(is_stamp) - 1) if is_stamp[i] and is_stamp[i + 1]]

    def segment(start, end, piece, first, stop):
        return {"start": float(time_offset + np.float64(start) * time_precision),
                "end": float(time_offset + np.float64(end) * time_precision),
                "tokens": piece, "idxs": (prompt_len + first, prompt_len + stop)}

    if cuts:
        if single_ending:
            cuts.append(len(tokens))
        else:
            cuts[-1] += 1  # the last timestamp stays in the last segment: it was no single ending
        segments, last = [], 0
        for i, cut in enumerate(cuts):
            piece = tokens[last:cut]
            end_at = -1 if i < len(cuts) - 1 or single_ending else -2
            segments.append(segment(piece[0] - timestamp_begin, piece[end_at] - timestamp_begin, piece, last, cut))
            last = cut
        if single_ending:
            return segments, int(window_frames)
        return segments, int(tokens[last - 2] - timestamp_begin) * input_stride
    stamps = [i for i, flag in enumerate(is_stamp) if flag]
    end = int(window_frames * time_precision_features / time_precision)
    if stamps and tokens[stamps[-1]] != timestamp_begin:
        end = np.float64(tokens[stamps[-1]] - timestamp_begin)
    return [segment(0, end, tokens, 0, len(tokens))], int(window_frames)
