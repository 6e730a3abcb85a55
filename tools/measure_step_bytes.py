#!/usr/bin/env python3
"""Bytes moved between host and device per decoder step of a generate (issue 26's "before" number).

    python tools/measure_step_bytes.py [--model t5-small] [--batch-size 32] [--num-beams 4] [--new-tokens 8]
                                       [--input-length 32] [--folder EXPORT] [--work out/step_bytes] [--json FILE]

Exports ``--model`` with random weights into ``--work`` (reused when already there; ``--folder`` takes an
existing export instead), then runs one beam search on the ort-io backend on the CPU execution provider:
the device code path, with every crossing of the backend seam counted by ``tests/counting_backend.py``.
EOS is suppressed until ``--new-tokens`` (min = max new tokens), so every step has batch · beams rows.
Prints, per step, the bytes device→host (the logits [rows, vocab] float32) and host→device (token ids,
the parent rows of each cache entry's reorder), and the same for the encoding before the first step.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from elx.runners.generate import Generator  # noqa: E402
from tests.counting_backend import D2H, H2D, count_crossings  # noqa: E402


def export_folder(model: str, work: Path) -> Path:
    from elx.exporter.export import export_model

    folder = work / Path(model).name
    if (folder / "manifest.json").is_file():
        return folder
    return export_model(model, folder, random_init=not Path(model).is_dir(), force=True, quiet=True)


def measure(folder: Path, batch: int, beams: int, new_tokens: int, input_length: int, threads: int | None) -> dict:
    generator = Generator.from_folder(folder, backend="ort-io", device="cpu", threads=threads)
    counting = count_crossings(generator)
    vocab = int(generator.manifest.dims["vocab_size"])
    rng = np.random.default_rng(0)
    ids = rng.integers(3, min(1000, vocab), size=(batch, input_length))
    out = generator.generate({"input_ids": ids, "attention_mask": np.ones_like(ids)}, num_beams=beams,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, track_memory=True, decode=False)
    steps = []
    for i, (phase, memory) in enumerate(zip(counting.steps, out.memory), 1):
        steps.append({"step": i, "rows": memory["rows"], "d2h": phase.bytes(D2H), "h2d": phase.bytes(H2D),
                      "d2h_items": [(c.what, c.nbytes) for c in phase.of(D2H)],
                      "h2d_items": [(c.what, c.nbytes) for c in phase.of(H2D)]})
    encode = counting.phases[0]
    return {"folder": str(folder), "batch": batch, "beams": beams, "new_tokens": new_tokens,
            "input_length": input_length, "vocab": vocab, "cache_entries": len(generator.model.plan.cache),
            "encode": {"d2h": encode.bytes(D2H), "h2d": encode.bytes(H2D)}, "steps": steps}


def _b(n: int) -> str:
    return f"{n:,}"


def table(result: dict) -> str:
    lines = [f"{Path(result['folder']).name}: batch {result['batch']}, beams {result['beams']}, input "
             f"{result['input_length']}, {result['new_tokens']} new tokens, vocab {result['vocab']}, "
             f"{result['cache_entries']} cache entries; ort-io on the CPU EP (the device path)",
             "", "| step | rows | device→host bytes | host→device bytes | total bytes | device→host per row |",
             "|---:|---:|---:|---:|---:|---:|",
             f"| encode | | {_b(result['encode']['d2h'])} | {_b(result['encode']['h2d'])} | "
             f"{_b(result['encode']['d2h'] + result['encode']['h2d'])} | |"]
    for s in result["steps"]:
        lines.append(f"| {s['step']} | {s['rows']} | {_b(s['d2h'])} | {_b(s['h2d'])} | {_b(s['d2h'] + s['h2d'])} "
                     f"| {s['d2h'] // s['rows']} |")
    rows = result["batch"] * result["beams"]
    lines += ["", f"logits per step: rows · vocab · 4 = {rows} · {result['vocab']} · 4 = "
                  f"{rows * result['vocab'] * 4:,} bytes; host→device: rows · 8 (token ids) + {result['cache_entries']} · rows · 8 (parent rows "
                  f"of each cache entry) after a step that reorders = {rows * 8 * (1 + result['cache_entries']):,} "
                  f"bytes"]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="t5-small", help="preset (random weights) or local HF folder")
    ap.add_argument("--folder", help="an existing export folder (skips the export)")
    ap.add_argument("--work", default="out/step_bytes", help="where the export is cached")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--num-beams", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--input-length", type=int, default=32)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--json", help="also write the measurement as JSON here")
    args = ap.parse_args(argv)
    folder = Path(args.folder) if args.folder else export_folder(args.model, Path(args.work))
    result = measure(folder, args.batch_size, args.num_beams, args.new_tokens, args.input_length, args.threads)
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
