"""Side-by-side seconds per generate: HF generate (PyTorch) vs elx runners, one process, interleaved.

    python tools/bench_quick.py DIR [DIR ...] --batch-size 4 --input-length 256 --num-beams 4 --new-tokens 32

Every folder must come from the same model (same manifest source); the first one's source is
rebuilt in PyTorch for HF generate.  Prints median seconds, the ratio to HF, and whether the
tokens equal HF's.  Absolute times on a shared 2-core VM mean little; read the ratios.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from exporter.sources import reload_model
from runners.generate import Generator
from runners.inputs import random_inputs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("folders", nargs="+")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--input-length", type=int, default=256)
    ap.add_argument("--num-beams", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--no-repeat-ngram-size", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gens = [Generator.from_folder(f, threads=args.threads) for f in args.folders]
    model = reload_model(gens[0].manifest.data["source"])
    inputs = random_inputs(gens[0].manifest, args.batch_size, args.input_length, np.random.default_rng(0))
    opts = dict(num_beams=args.num_beams, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                no_repeat_ngram_size=args.no_repeat_ngram_size)
    t_inputs = {k: torch.from_numpy(v) for k, v in inputs.items()}

    def hf():
        with torch.no_grad():
            return model.generate(**t_inputs, **opts).numpy()

    runs = {"HF generate": hf}
    for folder, gen in zip(args.folders, gens):
        name = "elx " + (",".join(gen.manifest.pass_names()) or "baseline")
        runs[name] = (lambda g=gen: g.generate(inputs, **opts).sequences)
    outputs = {name: fn() for name, fn in runs.items()}  # warm-up, and the tokens
    times = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["HF generate"])
    print(f"batch {args.batch_size}, input {args.input_length}, beams {args.num_beams}, "
          f"{args.new_tokens} forced new tokens, {args.repeats} repeats (median)")
    for name in runs:
        med = statistics.median(times[name])
        same = np.array_equal(outputs[name], outputs["HF generate"])
        print(f"{name:24s} {med:7.3f} s   speedup vs HF {base / med:5.2f}x   tokens identical: {same}")


if __name__ == "__main__":
    main()
