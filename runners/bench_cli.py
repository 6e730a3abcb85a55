"""``elx bench`` arguments and entry point (kept beside the bench so the CLI module stays small)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

QUICK = dict(model="t5-tiny", batch_size=2, input_length=32, num_beams=2, new_tokens=8, repeats=1)


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="side-by-side speed/memory: HF generate, elx pass sets, CTranslate2")
    p.add_argument("--model", help="preset (with --random-init) or local HF folder (default t5-small)")
    p.add_argument("--random-init", action="store_true")
    p.add_argument("--pass-sets", default="baseline|el",
                   help="pass sets separated by spaces or '|', e.g. 'baseline|el|slim|el,slim'")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--input-length", type=int, default=256)
    p.add_argument("--num-beams", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=32, help="forced: min = max new tokens")
    p.add_argument("--no-repeat-ngram-size", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: HF on PyTorch CUDA, elx on ONNX Runtime's CUDA EP with IOBinding (needs onnxruntime-gpu)")
    p.add_argument("--ct2", action="store_true", help="add CTranslate2 as a peer (pip install ctranslate2)")
    p.add_argument("--sweep", choices=["none", "input", "beam", "budget", "all"], default="none")
    p.add_argument("--budget-mb", type=float, default=64.0, help="memory budget of the budget sweep")
    p.add_argument("--work", default="out/bench", help="where exports are cached and results written")
    p.add_argument("--quick", action="store_true", help="a ~1 minute smoke run (t5-tiny, small shapes)")
    p.set_defaults(run=cmd_bench)


def _pass_sets(text: str) -> list[str]:
    items = [t for t in text.replace("|", " ").split() if t]
    return ["" if t in ("baseline", "base", "none") else t for t in items]


def cmd_bench(args) -> int:
    from .bench import BenchSettings, ensure_exports, markdown_table, run_bench
    from .bench_sweeps import sweep_beam, sweep_budget, sweep_input

    if args.quick:
        for key, value in QUICK.items():
            if key == "model" and args.model:
                continue
            setattr(args, key, value)
        args.random_init = args.random_init or not Path(args.model).is_dir()
    model = args.model or "t5-small"
    random_init = args.random_init or (args.model is None)
    work = Path(args.work) / Path(model).name
    settings = BenchSettings(batch_size=args.batch_size, input_length=args.input_length, num_beams=args.num_beams,
                             new_tokens=args.new_tokens, no_repeat_ngram_size=args.no_repeat_ngram_size,
                             repeats=args.repeats, threads=args.threads, device=args.device)
    folders = ensure_exports(model, random_init, _pass_sets(args.pass_sets), work / "exports")
    out = work / "results"
    out.mkdir(parents=True, exist_ok=True)
    if args.sweep in ("none", "all"):
        report = run_bench(folders, settings, ct2=args.ct2, work=work)
        table = markdown_table(report)
        (out / "bench.json").write_text(json.dumps(report, indent=1))
        (out / "bench.md").write_text(table + "\n")
        print(table)
    if args.sweep in ("input", "all"):
        print(f"wrote {sweep_input(folders, settings, out, ct2=args.ct2)}")
    if args.sweep in ("beam", "all"):
        print(f"wrote {sweep_beam(folders, settings, out, ct2=args.ct2)}")
    if args.sweep in ("budget", "all"):
        print(f"wrote {sweep_budget(folders, settings, out, args.budget_mb)}")
    print(f"results in {out}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="elx")
    sub = parser.add_subparsers(dest="command", required=True)
    add_bench_parser(sub)
    from exporter.cli import run

    return run(argv, parser)
