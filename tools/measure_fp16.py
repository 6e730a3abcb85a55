"""fp16 exports against HF PyTorch fp32: verification numbers, token agreement, first divergence, cache bytes.

For each model (random-init presets such as ``t5-small`` / ``bart-base``, a local HF folder, or
``tiny-t5`` / ``tiny-bart`` / ``tiny-whisper``, the test suite's configs), exports fp32 and fp16
(cached in ``--workdir``), then over ``--seeds`` (one batch of ``--batch-size`` random inputs each)
runs greedy and beam search (``--beams``) with HF ``generate`` in PyTorch fp32 and with

* ``fp32``: the fp32 export (control: identical tokens expected),
* ``fp16 runtime``: the fp16 export as ONNX Runtime's CPU EP runs it (fp16 weights and stored state,
  fp32 activations: the CPU EP has no fp16 MatMul),
* ``fp16 arithmetic``: the fp16 export's twin with every fp16 MatMul rounding inputs and result (what a
  GPU computes; ``exporter/precision/fp16_check.py``),

and prints, per system: rows identical to HF / rows, first-divergence step statistics (generated step,
0-based, over the differing rows), the largest teacher-forced logits difference, the verification
numbers from the manifest, and the self-attention cache bytes of one step (fp16 / fp32).

``--speech N`` (Whisper): instead of random features, one batch of N English sentences synthesized with
espeak-ng (``tools/speech.py``), features from the export's feature extractor.

Usage: ``python tools/measure_fp16.py --model t5-small [--pass el] [--seeds 0,1,2,3] [--batch-size 4]
[--input-length 32] [--max-new-tokens 32] [--beams 1,4] [--speech N] [--workdir out/fp16] [--json OUT]``
(a name that is not a local folder is a ``--random-init`` preset).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

TINY = ("tiny-t5", "tiny-bart", "tiny-whisper")
SENTENCES = (
    "The quick brown fox jumps over the lazy dog, and then it runs back into the quiet forest.",
    "Please call Stella and ask her to bring these things with her from the store on her way home.",
    "Today the weather is sunny and warm, so we will walk to the park and have lunch by the lake.",
    "The meeting starts at ten in the morning, and everyone should bring a copy of the new report.",
    "She sells sea shells by the sea shore, and the shells she sells are surely sea shells.",
    "A large rainbow appeared over the hills after the storm had finally passed in the evening.",
    "He forgot his keys at the office, so he had to wait outside until his sister came home.",
    "Reading a good book on a rainy afternoon is one of the simplest pleasures in life.",
)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def model_source(name: str, workdir: Path) -> tuple[str, bool]:
    """(model argument for export, random_init): the tests' tiny configs are saved as local folders."""
    if name in TINY:
        from tests.conftest import make_model_folder

        folder = workdir / "models" / f"{name.split('-')[1]}-0"
        if not folder.is_dir():
            make_model_folder(workdir / "models", name.split("-")[1])
        return str(folder), False
    return name, not Path(name).is_dir()


def ensure_export(model: str, random_init: bool, passes: str | None, precision: str, target: Path) -> Path:
    from elx.exporter.export import export_model

    if (target / "manifest.json").is_file():
        return target
    started = time.perf_counter()
    export_model(model, target, random_init=random_init, passes=passes, precision=precision, force=True, quiet=True)
    log(f"  exported {target.name} in {time.perf_counter() - started:.0f} s")
    return target


def cache_bytes(folder: Path, beams: int, input_length: int) -> int:
    """Self-attention cache bytes after one step (batch 1, ``beams`` rows)."""
    import numpy as np

    from elx.runners.generate import Generator
    from elx.runners.inputs.random_inputs import random_inputs

    generator = Generator.from_folder(folder)
    inputs = random_inputs(generator.manifest, 1, input_length, np.random.default_rng(0))
    out = generator.generate(inputs, num_beams=beams, max_new_tokens=1, min_new_tokens=1, track_memory=True)
    return out.memory[0]["cache_bytes"]


def speech_inputs(folder: Path, count: int, workdir: Path) -> dict:
    """Log-mel features of ``count`` synthesized sentences (one batch)."""
    import importlib.util

    from elx.runners.inputs.audio import features_from_files

    spec = importlib.util.spec_from_file_location("elx_tools_speech", Path(__file__).with_name("speech.py"))
    speech = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(speech)
    files = []
    for i, text in enumerate((SENTENCES * (count // len(SENTENCES) + 1))[:count]):
        files.append(workdir / f"clip{i}.wav")
        if not files[-1].is_file():
            speech.synthesize(text, files[-1])
    return features_from_files(folder, files)


def verification(folder: Path) -> dict:
    from elx.runners.manifest import Manifest

    data = Manifest.load(folder).data
    fp16 = data["verification"].get("fp16") or {}
    out = {mode: {k: r[k] for k in ("max_abs_logits_diff", "relative_diff", "relative_tolerance", "fp16_depth")}
           for mode, r in fp16.items()}
    for record in data["passes"]:
        for mode, r in (record.get("fp16") or {}).get("vs_fp16_baseline", {}).items():
            out[f"pass {record['name']} vs fp16 baseline ({mode})"] = {
                k: r[k] for k in ("max_abs_logits_diff", "relative_diff", "relative_tolerance")}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", required=True, help="repeatable")
    parser.add_argument("--pass", dest="passes", default=None)
    parser.add_argument("--seeds", default="0,1,2,3")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--input-length", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--beams", default="1,4")
    parser.add_argument("--systems", default="fp32,runtime,fp16", help="fp32, runtime (fp16 export on the CPU EP), "
                                                                        "fp16 (fp16-arithmetic twin)")
    parser.add_argument("--speech", type=int, default=0, help="Whisper: N synthesized sentences as the inputs")
    parser.add_argument("--workdir", default="out/fp16")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    from elx.exporter.verification.agreement import token_agreement

    workdir = Path(args.workdir)
    seeds = [int(s) for s in args.seeds.split(",")]
    systems = args.systems.split(",")
    results = []
    for name in args.model:
        model, random_init = model_source(name, workdir)
        tag = Path(name).name + (f"-{args.passes.replace(',', '_').replace('=', '')}" if args.passes else "")
        log(f"{name}: exports in {workdir}")
        folders = {p: ensure_export(model, random_init, args.passes, p, workdir / f"{tag}-{p}") for p in ("fp32", "fp16")}
        entry = {"model": name, "passes": args.passes, "verification": verification(folders["fp16"]),
                 "cache_bytes_one_step_beam4": {p: cache_bytes(f, 4, args.input_length) for p, f in folders.items()},
                 "runs": []}
        inputs = speech_inputs(folders["fp16"], args.speech, workdir) if args.speech else None
        for beams in (int(b) for b in args.beams.split(",")):
            options = dict(num_beams=beams, max_new_tokens=args.max_new_tokens)
            for system in systems:
                folder = folders["fp32" if system == "fp32" else "fp16"]
                arithmetic = "fp16" if system == "fp16" else "runtime"
                started = time.perf_counter()
                found = token_agreement(folder, seeds, args.batch_size, args.input_length, arithmetic, inputs,
                                        **options)
                found.update(system=system, beams=beams, seconds=round(time.perf_counter() - started, 1))
                entry["runs"].append(found)
                d = found["first_divergence"]
                median = "-" if d["median"] is None else f"{d['median']:g}"
                mean = "-" if d["mean"] is None else f"{d['mean']:.1f}"
                log(f"  beams {beams} {system:8s}: {found['rows_identical']}/{found['rows']} rows identical "
                    f"({found['agreement']:.0%}); first divergence mean {mean} median {median} "
                    f"min {d['min'] if d['min'] is not None else '-'}; max step logits diff "
                    f"{found['max_step_logits_diff']:.2e}")
        results.append(entry)
        print(json.dumps({k: v for k, v in entry.items() if k != "runs"}, indent=1))
        print(format_table(entry))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


def format_table(entry: dict) -> str:
    lines = [f"### {entry['model']}" + (f" --pass {entry['passes']}" if entry["passes"] else ""), "",
             "| beams | system | rows identical | agreement | first divergence mean / median / min | max step logits diff |",
             "|---|---|---|---|---|---|"]
    for run in entry["runs"]:
        d = run["first_divergence"]
        stats = " / ".join("-" if d[k] is None else f"{d[k]:.3g}" for k in ("mean", "median", "min"))
        lines.append(f"| {run['beams']} | {run['system']} | {run['rows_identical']}/{run['rows']} | "
                     f"{run['agreement']:.0%} | {stats} | {run['max_step_logits_diff']:.2e} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
