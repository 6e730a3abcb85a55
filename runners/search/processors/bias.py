"""HF's ``SequenceBiasLogitsProcessor`` and ``NoBadWordsLogitsProcessor`` (a -inf bias), on numpy arrays.

A bias applies to a sequence's last token when the row ends with the sequence's other tokens (always for
a one-token sequence).  HF first sums the biases that apply to each token, one-token biases first, then
the longer sequences grouped by length in the order they were given, and adds the sum to the scores
once: elx adds the same float32 sums in the same order, only at the tokens some sequence names (adding
HF's zero elsewhere changes no bit), so the result is HF's exactly.
"""
from __future__ import annotations

import numpy as np

from elx.runners.errors import ElxError


class SequenceBias:
    hf = "SequenceBiasLogitsProcessor"

    def __init__(self, pairs: list):
        """``pairs``: [[token ids], bias] in HF's order (later duplicates of a sequence replace earlier ones)."""
        biases = {tuple(int(t) for t in ids): float(bias) for ids, bias in pairs}
        self.max_token = max(max(ids) for ids in biases)
        self.columns = np.asarray(sorted({ids[-1] for ids in biases}), dtype=np.int64)
        where = {int(t): i for i, t in enumerate(self.columns)}
        self.single = np.zeros(self.columns.size, dtype=np.float32)  # HF's length-1 bias, at the columns
        groups: dict[int, list] = {}
        for ids, bias in biases.items():
            if len(ids) == 1:
                self.single[where[ids[0]]] = bias
            else:
                groups.setdefault(len(ids) - 1, []).append((ids, bias))
        # per prefix length: prefixes [g, p], their last tokens' columns [g], biases [g] (HF's float32 tensors)
        self.groups = [(np.asarray([ids[:-1] for ids, _ in group], dtype=np.int64),
                        np.asarray([where[ids[-1]] for ids, _ in group], dtype=np.int64),
                        np.asarray([bias for _, bias in group], dtype=np.float32)) for group in groups.values()]

    def __call__(self, tokens, scores, items=None):
        if self.max_token >= scores.shape[1]:
            raise ElxError(f"sequence_bias or bad_words_ids name token {self.max_token}, outside the model's "
                           f"vocabulary of {scores.shape[1]} tokens; fix the ids")
        bias = np.broadcast_to(self.single, (scores.shape[0], self.columns.size)).copy()
        for prefixes, columns, values in self.groups:
            length = prefixes.shape[1]
            if length > tokens.shape[1]:
                continue
            matching = (tokens[:, None, -length:] == prefixes[None]).all(axis=-1)  # [rows, g]
            np.add.at(bias, (slice(None), columns), np.where(matching, values, np.float32(0.0)))
        scores[:, self.columns] += bias
        return scores


class BadWords(SequenceBias):
    """HF's ``NoBadWordsLogitsProcessor``: a -inf bias on each sequence; one-token sequences equal to an EOS
    id are left out (HF's rule: EOS stays possible).  Where that leaves nothing, HF's processor bans nothing:
    ``build_processors`` then builds none (``banned`` is empty)."""

    hf = "NoBadWordsLogitsProcessor"

    @staticmethod
    def banned(bad_words_ids: list, eos: list) -> list:
        """The sequences HF bans: ``bad_words_ids`` less the one-token sequences equal to an EOS id."""
        return [list(ids) for ids in bad_words_ids if all(list(ids) != [e] for e in eos)]

    def __init__(self, bad_words_ids: list, eos: list):
        kept = self.banned(bad_words_ids, eos)
        if not kept:
            raise ElxError(f"bad_words_ids {bad_words_ids} only lists EOS tokens, which are never banned: there is "
                           "nothing to ban")
        super().__init__([[ids, float("-inf")] for ids in kept])
