"""Host time per step of elx's beam search (no graphs): what the search itself costs, before and after a change.

A stand-in model returns the same logits every step ([batch·beams, vocab] float32, t5-small's vocabulary by
default) and keeps no cache, so the time measured is the search's own host work: log-softmax, running scores,
top-k, candidate bookkeeping, processors (none by default), row gathers.  ``--min-new-tokens`` equal to
``--new-tokens`` keeps every item running to the end.

    PYTHONPATH=BEFORE_CHECKOUT python tools/measure_search_host.py --label before
    PYTHONPATH=. python tools/measure_search_host.py --label after

(run the two interleaved, more than once: the machine's load moves single runs).  ``--calls`` counts the Python
function calls per step instead (cProfile), which no load moves.

``--path device`` runs the device search path (``runners/search/device.py``) with torch tensors on the CPU,
and splits each step's time into the device part (the scorer: log-softmax, processors, top-k, which a GPU
would run) and the host part (the bookkeeping that stays on the host whatever the device); ``--path both``
interleaves the two paths, ``--repeats`` rounds.  ``--device cuda`` holds the stand-in's logits on a CUDA
device as a device backend would: the host path copies each step's logits down, the device path runs the scorer
there and copies 2·beams candidates per item down (the GPU check runs this: ``tools/gpu_check.py``).
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import time

import numpy as np

from elx.runners.search import device as search_device
from elx.runners.backends.base import DecoderCache, EncoderState
from elx.runners.search.processors import build_processors
from elx.runners.search.search import beam_search
from elx.runners.search.settings import GenerationSettings


class ScorerClock:
    """Seconds spent in the device scorer's calls (torch on the CPU is synchronous: the call's time is its work)."""

    def __init__(self, clock):
        self.clock, self.seconds = clock, 0.0
        original = search_device.DeviceScorer

        outer = self

        class Timed(original):
            def beam_candidates(self, *args, **kwargs):
                started = outer.clock()
                try:
                    return super().beam_candidates(*args, **kwargs)
                finally:
                    outer.seconds += outer.clock() - started

        search_device.DeviceScorer = Timed


class StandIn:
    """What ``beam_search`` drives, returning fixed logits (a fresh copy per step, as a graph would)."""

    needs_history = False
    returns_log_probs = False

    def __init__(self, logits: np.ndarray, device: str | None = None):
        self.logits = logits
        if device is not None:  # the logits live on the device; the backend's transfers are torch's
            self.backend = search_device.TorchTensors(device)
            self.logits = self.backend.tensor_from_host(logits)

    def empty_cache(self, rows: int) -> DecoderCache:
        return DecoderCache({}, rows, 0)

    def step(self, tokens, state, cache, history=None, device=False):
        logits = self.logits[: tokens.shape[0]]
        if isinstance(logits, np.ndarray):
            logits = logits.copy()
        else:  # a fresh device tensor per step; the host path reads it copied down
            logits = logits.clone() if device else self.backend.tensor_to_host(logits)
        return logits, DecoderCache({}, tokens.shape[0], cache.length + tokens.shape[1])

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
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="PyTorch's intra-op threads (both paths' log-softmax; default 1: on a loaded machine "
                             "two threads wait for each other tens of ms per call)")
    parser.add_argument("--path", choices=("host", "device", "both"), default="host",
                        help="the search path (ELX_SEARCH); device: torch tensors on the CPU")
    parser.add_argument("--device", default=None,
                        help="a torch device for the stand-in's logits (cuda): a device backend's step")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.torch_threads)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    rows = args.batch_size * args.num_beams
    logits = (np.random.default_rng(0).standard_normal((rows, args.vocab)) * 4).astype(np.float32)
    settings = GenerationSettings(num_beams=args.num_beams, max_new_tokens=args.new_tokens,
                                  min_new_tokens=args.new_tokens, eos_token_id=[1], pad_token_id=0,
                                  decoder_start_token_id=0)
    model = StandIn(logits, args.device)
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
    paths = ("host", "device") if args.path == "both" else (args.path,)
    scorer = ScorerClock(clock)
    times = {p: [] for p in paths}
    device_part = []
    for _ in range(args.repeats + 1):  # the first round warms up (imports torch, faults in buffers)
        for path in paths:
            os.environ["ELX_SEARCH"] = path
            scorer.seconds = 0.0
            started = clock()
            result = beam_search(model, EncoderState({}, args.batch_size), settings, build_processors(settings, 1))
            times[path].append((clock() - started) / result.steps * 1e3)
            if path == "device":
                device_part.append(scorer.seconds / result.steps * 1e3)
    for path in paths:
        runs = times[path][1:]
        where = f", logits on {args.device}" if args.device else ""
        line = (f"{args.label or 'search'} [{path} path{where}]: batch {args.batch_size} x beams {args.num_beams}, vocab "
                f"{args.vocab}: {args.clock} {statistics.median(runs):.2f} ms/step (median of {len(runs)}; min "
                f"{min(runs):.2f}, max {max(runs):.2f})")
        if path == "device":
            dev = statistics.median(device_part[1:])
            host = statistics.median(t - d for t, d in zip(runs, device_part[1:]))
            line += f"; of which the scorer (device work) {dev:.2f} ms, host bookkeeping {host:.2f} ms"
        print(line)


if __name__ == "__main__":
    main()
