"""Issue 13's measurement: generation over a dataset file, items/s per way of running it.

    python tools/measure_datasets.py [--items 200] [--min-length 16] [--max-length 512] [--num-beams 4]
                                     [--max-new-tokens 32] [--batch-size 16] [--ray-actors 2] [--no-ray]

A random-init t5-small export (``elx export --model t5-small --random-init --output
out/measure_datasets/t5-small``, made once), ``--items`` inputs of seeded random token ids with
lengths uniform in [min, max], beam search; one run each of

* ``input order``: batches cut in input order, stages one after the other (a plain loop);
* ``bucketed``: length-sorted batches, stages one after the other (``pipeline=False``);
* ``bucketed + async``: length-sorted batches, the three-thread pipeline (the default), with ONNX Runtime on
  every core and on one thread;
* ``ray``: Ray Data, ``--ray-actors`` actors of one ONNX Runtime thread each, on a local Ray
  instance started before the clock starts (its start-up is printed apart); the one-process
  runs use every core.

Each run writes its own output and is timed end to end (model loading included); all outputs
must be identical.  Prints a Markdown table and writes it, a JSON file and a PNG bar chart to
``docs/measurements/`` (``datasets.md``, ``datasets.json``, ``datasets.png``).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from elx.runners.dataset.pipeline import generate_file  # noqa: E402


def make_inputs(path: Path, items: int, low: int, high: int, vocab: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(low, high + 1, size=items)
    with open(path, "w") as f:
        for i, n in enumerate(lengths):
            ids = rng.integers(3, vocab, size=int(n)).tolist()
            f.write(json.dumps({"id": i, "input_ids": ids}) + "\n")
    return lengths.tolist()


def padding_share(lengths: list[int], batch: int, sort: bool) -> float:
    """Padded positions / all positions of the encoder batches."""
    order = sorted(lengths, reverse=True) if sort else list(lengths)
    padded = sum(max(order[i:i + batch]) * len(order[i:i + batch]) for i in range(0, len(order), batch))
    return 1.0 - sum(lengths) / padded


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--items", type=int, default=200)
    ap.add_argument("--min-length", type=int, default=16)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--num-beams", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--ray-actors", type=int, default=2)
    ap.add_argument("--no-ray", action="store_true")
    ap.add_argument("--work", default="out/measure_datasets")
    ap.add_argument("--docs", default="docs/measurements")
    args = ap.parse_args()

    load_start = os.getloadavg()[0]
    work = ROOT / args.work
    work.mkdir(parents=True, exist_ok=True)
    folder = work / "t5-small"
    if not (folder / "manifest.json").is_file():
        subprocess.run([sys.executable, "-m", "elx.cli", "export", "--model", "t5-small", "--random-init",
                        "--output", str(folder), "--force", "--quiet"], check=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    vocab = json.loads((folder / "manifest.json").read_text())["dims"]["vocab_size"]
    source = work / "inputs.jsonl"
    lengths = make_inputs(source, args.items, args.min_length, args.max_length, vocab)
    options = dict(num_beams=args.num_beams, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                   progress="none", force=True)

    runs = [("input order", dict(sort=False, pipeline=False)),
            ("bucketed", dict(sort=True, pipeline=False)),
            ("bucketed + async", dict(sort=True, pipeline=True)),
            ("bucketed + async, 1 thread", dict(sort=True, pipeline=True, threads=1))]
    results = []
    outputs = {}
    for name, extra in runs:
        out = work / f"out-{name.replace(' ', '').replace('+', '-')}.jsonl"
        summary = generate_file(folder, source, out, **options, **extra)
        outputs[name] = out.read_bytes()
        workers = "1 process, 1 ONNX Runtime thread" if extra.get("threads") == 1 else "1 process, all cores"
        results.append(dict(name=name, seconds=summary.seconds, items_per_s=summary.items_per_second,
                            tokens_per_s=summary.tokens_per_second, workers=workers))
        print(f"{name}: {summary.seconds:.1f} s, {summary.items_per_second:.2f} items/s", flush=True)

    ray_start = None
    if not args.no_ray:
        import logging

        import ray

        import elx.runners

        started = time.monotonic()
        ray.init(include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False,
                 runtime_env={"py_modules": [runners]})
        ray_start = time.monotonic() - started
        name = f"ray, {args.ray_actors} actors"
        out = work / "out-ray.jsonl"
        summary = generate_file(folder, source, out, **options, ray=True, ray_actors=args.ray_actors, threads=1)
        ray.shutdown()
        outputs[name] = out.read_bytes()
        results.append(dict(name=name, seconds=summary.seconds, items_per_s=summary.items_per_second,
                            tokens_per_s=summary.tokens_per_second,
                            workers=f"{args.ray_actors} actors × 1 thread (Ray start {ray_start:.1f} s not counted)"))
        print(f"{name}: {summary.seconds:.1f} s, {summary.items_per_second:.2f} items/s", flush=True)

    identical = len(set(outputs.values())) == 1
    share_input = padding_share(lengths, args.batch_size, False)
    share_sorted = padding_share(lengths, args.batch_size, True)
    base = results[0]["items_per_s"]
    command = "python tools/measure_datasets.py " + " ".join(sys.argv[1:])
    lines = [
        f"# Generation over a dataset: {args.items} inputs, lengths {args.min_length}–{args.max_length}, "
        f"t5-small (random init), beam {args.num_beams}, {args.max_new_tokens} new tokens, batch {args.batch_size}",
        "",
        f"`{command.strip()}` on {platform.machine()} with {os.cpu_count()} cores (shared with other work); "
        "one run each, end to end (model loading included).",
        f"Encoder padding: {share_input:.0%} of positions in input-order batches, {share_sorted:.1%} in "
        "length-sorted ones.",
        "",
        "| run | workers | seconds | items/s | generated tokens/s | vs input order |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(f"| {r['name']} | {r['workers']} | {r['seconds']:.1f} | {r['items_per_s']:.2f} | "
                     f"{r['tokens_per_s']:.0f} | {r['items_per_s'] / base:.2f}× |")
    lines += ["", f"All outputs identical: {'yes' if identical else 'NO'}.", "",
              f"Load average (1 min) at the start and the end: {load_start:.1f}, {os.getloadavg()[0]:.1f}. One run "
              "each: on a machine shared with other work, differences of ~20% are within its noise. Ray's actors are "
              "separate processes; where the cores are oversubscribed they also win a larger share of them than one "
              "process does, so compare the Ray row with the one-thread row and read it with that in mind."]
    table = "\n".join(lines) + "\n"
    print(table)
    docs = ROOT / args.docs
    docs.mkdir(parents=True, exist_ok=True)
    (docs / "datasets.md").write_text(table)
    (docs / "datasets.json").write_text(json.dumps(dict(args=vars(args), results=results, identical=identical,
                                                        ray_start_seconds=ray_start, padding_input_order=share_input,
                                                        padding_sorted=share_sorted), indent=1) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    names = [r["name"] for r in results]
    values = [r["items_per_s"] for r in results]
    colors = ["#888", "#4a90d9", "#1f5fa8", "#163f70", "#d9822b"][:len(names)]
    bars = ax.barh(names[::-1], values[::-1], color=colors[::-1])
    for bar, value in zip(bars, values[::-1]):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {value:.2f}", va="center")
    ax.set_xlabel("items/s (higher is better)")
    ax.set_title(f"{args.items} inputs of {args.min_length}–{args.max_length} tokens, t5-small, beam {args.num_beams}",
                 fontsize=10)
    ax.set_xlim(0, max(values) * 1.2)
    fig.tight_layout()
    fig.savefig(docs / "datasets.png", dpi=120)
    print(f"wrote {docs / 'datasets.md'}, {docs / 'datasets.png'}")
    if not identical:
        sys.exit(1)


if __name__ == "__main__":
    main()
