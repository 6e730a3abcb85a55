"""Host milliseconds per step of each logits processor, elx (numpy / PyTorch kernels) beside HF's classes.

One beam-search step's arrays at t5-small's dimensions by default: batch 32 × 4 beams = 128 rows × 32128
tokens of float32 log-probs, a 24-token history per row, 256 encoder input ids per item.  Each processor runs
on a fresh copy of the same scores (made before the clock starts); HF's processor gets torch tensors of the
same arrays, as HF's search hands them over.  The sampling rows time the candidate draw of
beam sampling (``torch.multinomial`` over [batch, beams·vocab], then the sort) against the top-k of plain
beam search.  One table, side by side:

    python tools/measure_processors.py [--batch-size 32 --num-beams 4 --vocab 32128 --repeats 15]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from transformers.generation import logits_process as hf

from elx.runners.search.processors import bias
from elx.runners.search.processors import masks
from elx.runners.search.processors import penalties
from elx.runners.search.processors import warpers
from elx.runners.search.sampling import Sampler
from elx.runners.search.topk import topk


def _timed(fn, repeats: int, make=lambda: None) -> float:
    """Median milliseconds of ``fn(make())`` (``make``'s own time not counted), after one warm-up call."""
    fn(make())
    runs = []
    for _ in range(repeats):
        argument = make()
        started = time.perf_counter()
        fn(argument)
        runs.append(time.perf_counter() - started)
    return statistics.median(runs) * 1e3


def cases(vocab: int, encoder: np.ndarray, beams: int, min_keep: int) -> list:
    """(name, elx processor, HF processor) at the same settings."""
    enc = torch.from_numpy(encoder)
    words = [[vocab - 1], [5, 6], [7, 8, 9]]
    biases = [[[11], 1.5], [[12, 13], -2.0], [[14, 15, 16], 0.5]]
    return [
        ("repetition_penalty 1.2", penalties.RepetitionPenalty(1.2), hf.RepetitionPenaltyLogitsProcessor(1.2)),
        ("encoder_repetition_penalty 1.2", penalties.EncoderRepetitionPenalty(1.2, encoder),
         hf.EncoderRepetitionPenaltyLogitsProcessor(1.2, enc)),
        ("no_repeat_ngram_size 3", masks.NoRepeatNGram(3), hf.NoRepeatNGramLogitsProcessor(3)),
        ("encoder_no_repeat_ngram_size 3", masks.EncoderNoRepeatNGram(3, encoder),
         hf.EncoderNoRepeatNGramLogitsProcessor(3, enc)),
        ("bad_words_ids (3 words)", bias.BadWords(words, [1]), hf.NoBadWordsLogitsProcessor(words, [1])),
        ("sequence_bias (3 sequences)", bias.SequenceBias(biases), hf.SequenceBiasLogitsProcessor(biases)),
        ("min_new_tokens (ban EOS)", masks.BanUntilLength([1], 10**6), hf.MinLengthLogitsProcessor(10**6, [1])),
        ("exponential_decay_length_penalty", penalties.ExponentialDecayLengthPenalty(2, 1.5, [1], 1),
         hf.ExponentialDecayLengthPenalty((2, 1.5), [1], 1)),
        ("remove_invalid_values", penalties.RemoveInvalidValues(), hf.InfNanRemoveLogitsProcessor()),
        ("renormalize_logits", penalties.Renormalize(), hf.LogitNormalization()),
        ("temperature 0.7", warpers.Temperature(0.7), hf.TemperatureLogitsWarper(0.7)),
        ("top_k 50", warpers.TopK(50, min_keep), hf.TopKLogitsWarper(50, min_tokens_to_keep=min_keep)),
        ("top_p 0.9", warpers.TopP(0.9, min_keep), hf.TopPLogitsWarper(0.9, min_tokens_to_keep=min_keep)),
        ("min_p 0.05", warpers.MinP(0.05, min_keep), hf.MinPLogitsWarper(0.05, min_tokens_to_keep=min_keep)),
        ("typical_p 0.9", warpers.Typical(0.9, min_keep), hf.TypicalLogitsWarper(0.9, min_tokens_to_keep=min_keep)),
        ("epsilon_cutoff 3e-4", warpers.Epsilon(3e-4, min_keep),
         hf.EpsilonLogitsWarper(3e-4, min_tokens_to_keep=min_keep)),
        ("eta_cutoff 3e-4", warpers.Eta(3e-4, min_keep), hf.EtaLogitsWarper(3e-4, min_tokens_to_keep=min_keep)),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--num-beams", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32128)
    parser.add_argument("--history", type=int, default=24)
    parser.add_argument("--input-length", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    rows, vocab = args.batch_size * args.num_beams, args.vocab
    logits = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)
    scores = torch.log_softmax(torch.from_numpy(logits), dim=-1).numpy()
    history = rng.integers(2, 200, size=(rows, args.history))  # a small alphabet: n-grams repeat
    encoder = rng.integers(2, vocab, size=(args.batch_size, args.input_length))
    items = np.repeat(np.arange(args.batch_size), args.num_beams)
    torch_history = torch.from_numpy(history)

    print(f"batch {args.batch_size} x beams {args.num_beams} = {rows} rows x {vocab} tokens, history {args.history}, "
          f"torch threads {torch.get_num_threads()}; host ms per step (median of {args.repeats})")
    print(f"| {'processor':<34} | {'elx ms':>8} | {'HF ms':>8} | {'HF / elx':>8} |")
    print(f"|{'-' * 36}|{'-' * 10}|{'-' * 10}|{'-' * 10}|")
    for name, ours, theirs in cases(vocab, encoder, args.num_beams, 2):
        elx_ms = _timed(lambda fresh: ours(history, fresh, items), args.repeats, scores.copy)
        hf_ms = _timed(lambda fresh: theirs(torch_history, fresh), args.repeats,
                       lambda: torch.from_numpy(scores.copy()))
        print(f"| {name:<34} | {elx_ms:8.2f} | {hf_ms:8.2f} | {hf_ms / max(elx_ms, 1e-3):8.2f} |")

    accumulated = scores.reshape(args.batch_size, -1)  # [batch, beams·vocab], as both searches rank candidates
    keep = 2 * args.num_beams
    active = np.arange(args.batch_size)
    sampler = Sampler(0, args.batch_size)
    elx_ms = _timed(lambda _: sampler.candidates(accumulated, active, keep), args.repeats)
    generator = torch.Generator().manual_seed(0)
    tensor = torch.from_numpy(accumulated)

    def hf_draw(_):
        drawn = torch.multinomial(torch.nn.functional.softmax(tensor, dim=-1), num_samples=keep, generator=generator)
        torch.gather(tensor, 1, drawn).sort(dim=-1, descending=True)

    print(f"| {'beam sampling: draw ' + str(keep) + ' candidates':<34} | {elx_ms:8.2f} | "
          f"{_timed(hf_draw, args.repeats):8.2f} | {'':>8} |")
    elx_top = _timed(lambda _: topk(accumulated, keep), args.repeats)
    print(f"| {'beam search: top-' + str(keep) + ' candidates':<34} | {elx_top:8.2f} | "
          f"{_timed(lambda _: torch.topk(tensor, keep), args.repeats):8.2f} | {'':>8} |")


if __name__ == "__main__":
    main()
