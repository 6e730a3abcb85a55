"""Host time per step of elx's default beam search (no graphs): what the search itself costs, before and after a change.

A stand-in model returns the same logits every step ([batch·beams, vocab] float32, t5-small's vocabulary by
default) and keeps no cache, so the time measured is the search's own host work: log-softmax, running scores,
top-k, candidate bookkeeping, processors (none by default), row gathers.  ``--min-new-tokens`` equal to
``--new-tokens`` keeps every item running to the end.

    PYTHONPATH=BEFORE_CHECKOUT python tools/measure_search_host.py --label before
    PYTHONPATH=. python tools/measure_search_host.py --label after

(run the two interleaved, more than once: the machine's load moves single runs).  ``--calls`` counts the Python
function calls per step instead (cProfile), which no load moves.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import numpy as np

from elx.runners.backends.base import DecoderCache, EncoderState
from elx.runners.search.processors import build_processors
from elx.runners.search.search import beam_search
from elx.runners.search.settings import GenerationSettings


class StandIn:
    """What ``beam_search`` drives, returning fixed logits (a fresh copy per step, as a graph would)."""

    needs_history = False
    returns_log_probs = False

    def __init__(self, logits: np.ndarray):
        self.logits = logits

    def empty_cache(self, rows: int) -> DecoderCache:
        return DecoderCache({}, rows, 0)

    def step(self, tokens, state, cache, history=None):
        return self.logits[: tokens.shape[0]].copy(), DecoderCache({}, tokens.shape[0], cache.length + tokens.shape[1])

    def reorder(self, cache, rows):
        return DecoderCache({}, int(rows.shape[0]), cache.length)

    def select(self, state, items):
        return EncoderState({}, int(items.shape[0]))

    def state_bytes(self, state):
        return 0

    def cache_bytes(self, cache):
        return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", default="")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--num-beams", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: this process's CPU time (less moved by other processes on a shared machine)")
    parser.add_argument("--calls", action="store_true", help="count Python function calls per step (cProfile)")
    args = parser.parse_args()
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    rows = args.batch_size * args.num_beams
    logits = (np.random.default_rng(0).standard_normal((rows, args.vocab)) * 4).astype(np.float32)
    settings = GenerationSettings(num_beams=args.num_beams, max_new_tokens=args.new_tokens,
                                  min_new_tokens=args.new_tokens, eos_token_id=[1], pad_token_id=0,
                                  decoder_start_token_id=0)
    model = StandIn(logits)
    if args.calls:
        beam_search(model, EncoderState({}, args.batch_size), settings, build_processors(settings, 1))
        profile = cProfile.Profile()
        profile.enable()
        result = beam_search(model, EncoderState({}, args.batch_size), settings, build_processors(settings, 1))
        profile.disable()
        calls = pstats.Stats(profile).total_calls
        label = args.label or "search"
        print(f"{label}: {calls} Python calls in {result.steps} steps: {calls / result.steps:.1f} per step")
        return
    times = []
    for _ in range(args.repeats + 1):  # the first run warms up (imports torch, faults in buffers)
        started = clock()
        result = beam_search(model, EncoderState({}, args.batch_size), settings, build_processors(settings, 1))
        times.append((clock() - started) / result.steps * 1e3)
    runs = times[1:]
    print(f"{args.label or 'search'}: batch {args.batch_size} x beams {args.num_beams}, vocab {args.vocab}: "
          f"host {args.clock} "
          f"{statistics.median(runs):.2f} ms/step (median of {len(runs)}; min {min(runs):.2f}, max {max(runs):.2f})")


if __name__ == "__main__":
    main()
