"""``elx generate --stream``: print one sequence's text while it is generated, through HF's streamer protocol.

``Generator.generate(streamer=...)`` calls ``streamer.put(tokens)`` with the decoder prompt ([rows, P]),
then once per step with that step's token of every row ([rows]), and ``streamer.end()`` at the end, as HF
``generate`` does (so HF's ``TextStreamer`` and ``TextIteratorStreamer`` work unchanged).  ``TextPrinter`` is
that protocol on the export's own tokenizer (no transformers at run time): it skips the prompt, decodes
the tokens so far, prints the text up to its last space (a word can still change while it grows; a
newline prints everything) and the rest at the end, with a newline.
"""
from __future__ import annotations

import sys

import numpy as np

from elx.runners.errors import ElxError


class TextPrinter:
    def __init__(self, text, out=None):
        self.text = text
        self.out = out or sys.stdout
        self.tokens: list[int] = []
        self.printed = 0
        self.prompt = True

    def _decoded(self) -> str:
        return self.text.decode([self.tokens])[0]

    def _write(self, piece: str) -> None:
        self.out.write(piece)
        self.out.flush()

    def put(self, value) -> None:
        value = np.asarray(value)
        if value.ndim > 1:
            if value.shape[0] > 1:
                raise ElxError("--stream prints one sequence: pass one input (and num_return_sequences 1)")
            value = value[0]
        if self.prompt:
            self.prompt = False
            return
        self.tokens.extend(int(t) for t in np.atleast_1d(value))
        decoded = self._decoded()
        stable = len(decoded) if decoded.endswith("\n") else decoded.rfind(" ") + 1
        if stable > self.printed:
            self._write(decoded[self.printed:stable])
            self.printed = stable

    def end(self) -> None:
        self._write(self._decoded()[self.printed:] + "\n")
        self.tokens, self.printed, self.prompt = [], 0, True
