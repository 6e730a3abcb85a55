"""Issue 3's measurement: baseline vs ``el`` on t5-small and t5-base dims (seeded random weights).

    python tools/measure_el.py [--models t5-small t5-base] [--beams 1 4 8] [--inputs 256 1024]
                               [--batch-size 1] [--new-tokens 32] [--repeats 2] [--hf]

One process; per configuration the systems run interleaved (``elx.exporter.bench.bench.run_bench``).
Prints seconds per generate, the el/baseline speed ratio, input-related state bytes and
self-attention cache bytes (peaks of the runner's live tensors), and whether tokens equal
HF generate's.  Results also go to out/measure_el/results.json.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from elx.exporter.bench.bench import BenchSettings, ensure_exports, run_bench


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["t5-small", "t5-base"])
    ap.add_argument("--beams", nargs="+", type=int, default=[1, 4, 8])
    ap.add_argument("--inputs", nargs="+", type=int, default=[256, 1024])
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--work", default="out/measure_el")
    args = ap.parse_args()
    rows = []
    print("| model | beams | input | baseline s | el s | el speed vs baseline | baseline state MB | el state MB |"
          " state ratio | self cache MB | tokens = HF |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for model in args.models:
        folders = ensure_exports(model, True, ["", "el"], Path(args.work) / model)
        for beams in args.beams:
            for length in args.inputs:
                settings = BenchSettings(batch_size=args.batch_size, input_length=length, num_beams=beams,
                                         new_tokens=args.new_tokens, repeats=args.repeats, threads=args.threads)
                report = run_bench(folders, settings)
                by = {s["system"]: s for s in report["systems"]}
                base, el = by["elx baseline"], by["elx el"]
                rows.append({"model": model, "beams": beams, "input": length, "report": report})
                mb = 2**20
                same = all(s["tokens_equal_hf"] for s in report["systems"])
                print(f"| {model} | {beams} | {length} | {base['median_s']:.3f} | {el['median_s']:.3f} | "
                      f"{base['median_s'] / el['median_s']:.2f}x | {base['state_bytes'] / mb:.2f} | "
                      f"{el['state_bytes'] / mb:.3f} | {base['state_bytes'] / el['state_bytes']:.1f}x | "
                      f"{el['cache_bytes'] / mb:.2f} | {same} |", flush=True)
    out = Path(args.work) / "results.json"
    out.write_text(json.dumps(rows, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
