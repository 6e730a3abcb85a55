"""Measure what the slim passes buy: cache bytes and seconds per ``generate``, baseline vs rewritten.

For each model (``--random-init`` presets by default: t5-small and t5-base dims) the baseline is
exported once, then each variant's passes are applied to a copy of it (as ``elx export --pass``
would, verification included).  Every variant generates the same seeded batch (beam 4, 256 input
tokens, 64 forced new tokens: ``min_new_tokens = max_new_tokens``) through the runner with
``track_memory``; reported per variant:

* ``self_cache_bytes``: the self-attention cache at the last step (its peak; rows = batch·beam);
* ``step_ms``: best of ``--step-trials`` single decoder steps (rows = batch·beam, past = new tokens),
  interleaved: less sensitive to other jobs on the machine than whole ``generate`` calls, and its
  process CPU time ``step_cpu_ms`` (with ``--threads 1`` the least sensitive to a shared machine);
* ``state_bytes``: the per-input state the decoder reads (cross K/V or encoder output, mask);
* ``seconds``: best of ``--repeats`` timed ``generate`` calls after one warm-up (encoder included),
  the variants taking turns (a busy machine slows them alike; the 1-minute load average is kept);
* the ratios to the baseline from the same run, token identity with the baseline, and the pass
  records' max abs logits diff, cond(W_K) range and skipped layers.

    python tools/measure_slim.py --models t5-small --batch 4 --json slim_t5_small.json
    python tools/measure_slim.py --models t5-base --batch 2 --variants baseline,slim,el,el+slim

The slim passes are applied with ``=skip-bad``: a layer that a plain ``--pass slim`` would refuse
(e.g. beyond the 1e-4 logits tolerance) keeps K and V and is listed as skipped; a pass that
refuses altogether (or is missing from this build) is reported with its one-line reason.
"""
from __future__ import annotations

import argparse
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

from elx.runners.errors import ElxError  # noqa: E402
from elx.exporter.export import export_model  # noqa: E402
from elx.exporter.passes import parse_passes  # noqa: E402
from elx.runners.backends.base import DecoderCache  # noqa: E402
from elx.runners.generate import Generator  # noqa: E402
from elx.runners.manifest import Manifest  # noqa: E402

VARIANTS = {"baseline": "", "slim": "slim", "slim-cross": "slim-cross", "slim+slim-cross": "slim,slim-cross",
            "el": "el", "el+slim": "el,slim"}


def random_batch(manifest: Manifest, batch: int, length: int, seed: int) -> dict:
    """Token ids with right padding on later rows (elx.runners.inputs.random_inputs when available)."""
    rng = np.random.default_rng(seed)
    try:
        from elx.runners.inputs.random_inputs import random_inputs

        return random_inputs(manifest, batch, length, rng)
    except ImportError:
        vocab = manifest.dims["vocab_size"]
        ids = rng.integers(3, vocab, size=(batch, length), dtype=np.int64)
        lengths = [length] + [int(rng.integers(length // 2, length + 1)) for _ in range(batch - 1)]
        mask = (np.arange(length)[None, :] < np.asarray(lengths)[:, None]).astype(np.int64)
        ids[mask == 0] = manifest.tokens.get("pad_token_id") or 0
        return {"input_ids": ids, "attention_mask": mask}


def apply_passes(source: Path, target: Path, passes: str) -> tuple[Path, list[dict], float]:
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(source, target)
    manifest = Manifest.load(target)
    started = time.perf_counter()
    for request in parse_passes(passes):
        record = request.module.apply(target, manifest, request.argument)
        manifest.data["passes"].append(record)
    manifest.save(target)
    return target, manifest.passes, time.perf_counter() - started


def build_variant(baseline: Path, work: Path, name: str, passes: str, reuse: bool = False) -> dict:
    if not passes:
        return {"folder": baseline, "passes": "", "records": [], "apply_s": 0.0}
    wanted = [request.name for request in parse_passes(passes)]
    if reuse and (work / name / "manifest.json").is_file() and Manifest.load(work / name).pass_names() == wanted:
        manifest = Manifest.load(work / name)
        return {"folder": work / name, "passes": ",".join(p["name"] + (f"={p['argument']}" if p.get("argument") else "")
                                                          for p in manifest.passes),
                "records": manifest.passes, "apply_s": 0.0}
    attempt = ",".join(p + "=skip-bad" if p.startswith("slim") else p for p in passes.split(","))
    try:  # skip-bad: one application; layers a plain --pass slim would refuse are listed as skipped
        folder, records, seconds = apply_passes(baseline, work / name, attempt)
        return {"folder": folder, "passes": attempt, "records": records, "apply_s": seconds}
    except ElxError as err:
        return {"error": str(err), "passes": attempt}


def summarize_records(records: list[dict]) -> dict:
    out = {}
    for rec in records:
        conds = [s["cond_W_K"] for s in rec.get("per_layer", {}).values() if isinstance(s.get("cond_W_K"), float)]
        recon = [s["reconstruction_max_abs"] for s in rec.get("per_layer", {}).values()
                 if "reconstruction_max_abs" in s]
        entry = {"max_abs_logits_diff": rec["max_abs_logits_diff"], "skipped": rec.get("skipped", {})}
        if conds:
            entry["cond_W_K_range"] = [min(conds), max(conds)]
        if recon:
            entry["recon_fp32_rel_max"] = max(r["fp32"] / r["v_max_abs"] for r in recon if isinstance(r["fp32"], float))
            entry["recon_fp16_cache_rel_max"] = max(r["fp16_cache"] / r["v_max_abs"] for r in recon
                                                    if isinstance(r["fp16_cache"], float))
        out[rec["name"]] = entry
    return out


def generate_options(args) -> dict:
    return dict(num_beams=args.beams, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens)


def time_interleaved(generators: dict, inputs: dict, args) -> dict:
    """name → (best seconds, last result); variants take turns so that a busy machine hurts them alike."""
    options = generate_options(args)
    for generator in generators.values():
        generator.generate(inputs, **options)  # warm-up
    best = {name: (float("inf"), None) for name in generators}
    for _ in range(args.repeats):
        for name, generator in generators.items():
            started = time.perf_counter()
            result = generator.generate(inputs, track_memory=True, **options)
            seconds = time.perf_counter() - started
            best[name] = (min(best[name][0], seconds), result)
    return best


def step_times(generators: dict, inputs: dict, args) -> dict:
    """name → best ms of one decoder step (rows = batch·beam, t = 1, past = new tokens), interleaved.

    A single step is short, so the minimum over many turns is robust to other jobs' bursts."""
    rng = np.random.default_rng(args.seed)
    setups = {}
    for name, generator in generators.items():
        model = generator.model
        rows = args.batch * args.beams
        state = model.encode(inputs)
        cache = {}
        for entry in model.manifest.cache_entries:
            shape = [rows if d == "rows" else (args.new_tokens if i == entry["seq_axis"] else d)
                     for i, d in enumerate(entry["shape"])]
            cache[entry["input"]] = rng.standard_normal(shape).astype(np.float32)
        tokens = np.full((rows, 1), 5, dtype=np.int64)
        setups[name] = (model, state, DecoderCache(cache, rows), tokens)
    best = {name: [float("inf"), float("inf")] for name in generators}
    for _ in range(args.step_trials):
        for name, (model, state, cache, tokens) in setups.items():
            started, cpu = time.perf_counter(), time.process_time()
            model.step(tokens, state, cache)
            wall, cpu = (time.perf_counter() - started) * 1e3, (time.process_time() - cpu) * 1e3
            best[name] = [min(best[name][0], wall), min(best[name][1], cpu)]
    return best


def measure_model(model: str, args, work: Path) -> dict:
    baseline = work / "baseline"
    started = time.perf_counter()
    if not (args.reuse and (baseline / "manifest.json").is_file()):
        export_model(model, baseline, random_init=args.random_init, seed=args.seed, force=True, quiet=True)
    export_s = time.perf_counter() - started
    print(f"{model}: exported in {export_s:.0f} s", file=sys.stderr)
    manifest = Manifest.load(baseline)
    inputs = random_batch(manifest, args.batch, args.input_len, args.seed)
    built, rows = {}, {}
    for name in args.variants:
        variant = build_variant(baseline, work, name, VARIANTS[name], args.reuse)
        if "error" in variant:
            rows[name] = {"variant": name, "passes": variant["passes"], "error": variant["error"]}
            print(f"  {name}: {variant['error']}", file=sys.stderr)
        else:
            built[name] = variant
    generators = {name: Generator.from_folder(v["folder"], threads=args.threads) for name, v in built.items()}
    steps = step_times(generators, inputs, args)
    timed = time_interleaved(generators, inputs, args)
    base_tokens = timed["baseline"][1].sequences if "baseline" in timed else None
    for name, variant in built.items():
        seconds, result = timed[name]
        last = result.memory[-1]
        rows[name] = {"variant": name, "passes": variant["passes"], "apply_s": round(variant["apply_s"], 2),
                      "seconds": seconds, "step_ms": steps[name][0], "step_cpu_ms": steps[name][1], "steps": result.steps, "rows": last["rows"],
                      "self_cache_bytes": last["cache_bytes"], "state_bytes": last["state_bytes"],
                      "records": summarize_records(variant["records"])}
        if base_tokens is not None:
            rows[name]["tokens_equal_baseline"] = bool(np.array_equal(result.sequences, base_tokens))
        print(f"  {name}: {seconds:.2f} s, self cache {last['cache_bytes'] / 2**20:.2f} MiB, "
              f"state {last['state_bytes'] / 2**20:.2f} MiB", file=sys.stderr)
    rows = [rows[name] for name in args.variants]
    base = next((r for r in rows if r["variant"] == "baseline" and "error" not in r), None)
    if base:
        for row in rows:
            if "error" not in row:
                row["self_cache_ratio"] = row["self_cache_bytes"] / base["self_cache_bytes"]
                row["state_ratio"] = row["state_bytes"] / base["state_bytes"]
                row["speed_ratio"] = base["seconds"] / row["seconds"]
                row["step_speed_ratio"] = base["step_ms"] / row["step_ms"]
                row["step_cpu_ratio"] = base["step_cpu_ms"] / row["step_cpu_ms"]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {"model": model, "random_init": args.random_init, "export_s": round(export_s, 1), "batch": args.batch,
            "beams": args.beams, "input_len": args.input_len, "new_tokens": args.new_tokens,
            "repeats": args.repeats, "load_average_1min": load, "variants": rows}


def markdown(result: dict) -> str:
    lines = [f"### {result['model']} (batch {result['batch']}, beam {result['beams']}, input {result['input_len']}, "
             f"{result['new_tokens']} forced new tokens; best of {result['repeats']}, "
             f"load average {result['load_average_1min']})", "",
             "| variant | s / generate | × | ms / step | × | CPU ms / step | × | self cache MiB | × | state MiB | × "
             "| same tokens | max logits diff |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["variants"]:
        if "error" in r:
            lines.append(f"| {r['variant']} | refused: {r['error']} |||||||||||")
            continue
        diffs = ", ".join(f"{k} {v['max_abs_logits_diff']:.1e}" + (f" (skipped {sorted(v['skipped'])})" if v["skipped"]
                                                                    else "") for k, v in r["records"].items())
        lines.append(f"| {r['variant']} | {r['seconds']:.2f} | {r.get('speed_ratio', 1):.2f} | "
                     f"{r['step_ms']:.1f} | {r.get('step_speed_ratio', 1):.2f} | "
                     f"{r['step_cpu_ms']:.1f} | {r.get('step_cpu_ratio', 1):.2f} | "
                     f"{r['self_cache_bytes'] / 2**20:.2f} | {r.get('self_cache_ratio', 1):.3f} | "
                     f"{r['state_bytes'] / 2**20:.2f} | {r.get('state_ratio', 1):.3f} | "
                     f"{r.get('tokens_equal_baseline', '')} | {diffs or '-'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="t5-small,t5-base", help="comma-separated presets or HF folders")
    parser.add_argument("--variants", default="baseline,slim,slim-cross,slim+slim-cross,el,el+slim",
                        help=f"comma-separated, from {', '.join(VARIANTS)}")
    parser.add_argument("--no-random-init", dest="random_init", action="store_false",
                        help="load real weights instead of seeded random ones")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--beams", type=int, default=4)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--step-trials", type=int, default=30, help="turns of the single-step timing")
    parser.add_argument("--reuse", action="store_true", help="reuse exports and variants already in --workdir")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default=None, help="where exports go (default: a temporary folder)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    if "baseline" not in args.variants:
        args.variants.insert(0, "baseline")
    results = []
    root = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="measure_slim."))
    try:
        for model in (m.strip() for m in args.models.split(",") if m.strip()):
            work = root / model.replace("/", "_")
            work.mkdir(parents=True, exist_ok=True)
            result = measure_model(model, args, work)
            results.append(result)
            print(markdown(result) + "\n", flush=True)
    finally:
        if not args.workdir:
            shutil.rmtree(root, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
