#!/usr/bin/env python3
"""CPU speed of the search paths on one export, interleaved in one run (issue 26, item 2).

    python tools/measure_search_paths.py [--model t5-small] [--folder EXPORT] [--batch-sizes 4 32] [--num-beams 4]
                                         [--new-tokens 16] [--input-length 32] [--rounds 3] [--threads N] [--json FILE]

Exports ``--model`` with random weights into ``--work`` (reused; ``--folder`` takes an existing export) and times
``Generator.generate`` (beam search, EOS suppressed until ``--new-tokens`` so every item runs every step) three
ways on the CPU:

* ``ort/host``: the ``ort`` backend (host arrays) with the host search: the CPU default;
* ``ort-io/host``: the ``ort-io`` backend on the CPU EP with ``ELX_SEARCH=host``: the logits come down each step;
* ``ort-io/device``: the same backend with the device search path (the default for ort-io): torch on the
  CPU, the candidates come down.

Each round runs every (batch, way) once, in a shuffled order (seeded), after one warm-up call per way; the
table gives each way's median seconds per generate and its ratio to ``ort/host`` and to ``ort-io/host`` per
batch size, and checks that the three ways return the same sequences and scores.  The machine may be loaded:
read the ratios, not the seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from elx.runners.generate import Generator  # noqa: E402
from tools.measure_step_bytes import export_folder  # noqa: E402

WAYS = (("ort", "host"), ("ort-io", "host"), ("ort-io", "device"))


def _name(way) -> str:
    return f"{way[0]}/{way[1]}"


def measure(folder: Path, batches: list[int], beams: int, new_tokens: int, input_length: int, rounds: int,
            threads: int | None, seed: int = 0) -> dict:
    generators = {backend: Generator.from_folder(folder, backend=backend, device="cpu", threads=threads)
                  for backend in {w[0] for w in WAYS}}
    vocab = int(generators["ort"].manifest.dims["vocab_size"])
    rng = np.random.default_rng(0)
    inputs = {b: rng.integers(3, min(1000, vocab), size=(b, input_length)) for b in batches}
    options = dict(num_beams=beams, max_new_tokens=new_tokens, min_new_tokens=new_tokens, decode=False)

    def run(way, batch):
        os.environ["ELX_SEARCH"] = way[1]
        ids = inputs[batch]
        started = time.perf_counter()
        out = generators[way[0]].generate({"input_ids": ids, "attention_mask": np.ones_like(ids)}, **options)
        return time.perf_counter() - started, out

    times = {(w, b): [] for w in WAYS for b in batches}
    for b in batches:  # warm-up (imports, arenas) and the check that the ways agree
        outs = {w: run(w, b)[1] for w in WAYS}
        for w in WAYS[1:]:
            if not (np.array_equal(outs[w].sequences, outs[WAYS[0]].sequences)
                    and np.array_equal(outs[w].scores, outs[WAYS[0]].scores)):
                raise SystemExit(f"{_name(w)} returned other sequences or scores than {_name(WAYS[0])} at batch {b}")
    order = [(w, b) for w in WAYS for b in batches]
    shuffle = random.Random(seed)
    for _ in range(rounds):
        shuffle.shuffle(order)
        for w, b in order:
            times[(w, b)].append(run(w, b)[0])
    return {"folder": str(folder), "beams": beams, "new_tokens": new_tokens, "input_length": input_length,
            "rounds": rounds, "threads": threads, "vocab": vocab,
            "seconds": {f"{_name(w)}@{b}": t for (w, b), t in times.items()}}


def table(result: dict, batches: list[int]) -> str:
    lines = [f"{Path(result['folder']).name}: beams {result['beams']}, {result['new_tokens']} new tokens, input "
             f"{result['input_length']}, vocab {result['vocab']}, {result['rounds']} interleaved rounds, threads "
             f"{result['threads']}; median seconds per generate",
             "", "| batch | way | median s | min s | max s | vs ort/host | vs ort-io/host |", "|---:|---|---:|---:|---:|---:|---:|"]
    for b in batches:
        med = {w: statistics.median(result["seconds"][f"{_name(w)}@{b}"]) for w in WAYS}
        for w in WAYS:
            t = result["seconds"][f"{_name(w)}@{b}"]
            lines.append(f"| {b} | {_name(w)} | {med[w]:.3f} | {min(t):.3f} | {max(t):.3f} | "
                         f"{med[w] / med[WAYS[0]]:.2f} | {med[w] / med[WAYS[1]]:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="t5-small", help="preset (random weights) or local HF folder")
    ap.add_argument("--folder", help="an existing export folder (skips the export)")
    ap.add_argument("--work", default="out/step_bytes", help="where the export is cached")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[4, 32])
    ap.add_argument("--num-beams", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--input-length", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="PyTorch's intra-op threads (default 1: on a loaded machine two threads wait for each other)")
    ap.add_argument("--json", help="also write the timings as JSON here")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.torch_threads)
    folder = Path(args.folder) if args.folder else export_folder(args.model, Path(args.work))
    result = measure(folder, args.batch_sizes, args.num_beams, args.new_tokens, args.input_length, args.rounds,
                     args.threads)
    print(table(result, args.batch_sizes))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
