"""Where elx's CPU decoding time goes (graph vs host), and side-by-side runner variants.

    python tools/profile_cpu_step.py [--model t5-small] [--batch 4] [--beams 4] [--input 256] \
        [--new-tokens 32] [--repeats 5] [--work out/profile] [--variants default,spin,ort-io,threads2]

With elx's own runner on a random-init export (baseline graphs, cached in ``--work``):

1. one instrumented generate (after a warm-up): time in the encoder stages, in the decoder graph
   (``Backend.run`` of the step), in row gathers (``Backend.take``: beam reorder and dropped items) and
   in the rest of the host (the search: log-softmax, top-k, bookkeeping), per step;
2. ONNX Runtime's own profile of the decoder graph over one generate: time per op type, and the
   session overhead (a step's ``run`` minus its nodes);
3. variants of the runner timed in interleaved rounds (medians), each checked to give the same
   tokens as the default: ``spin`` (ORT intra-op threads spin between steps), ``ort-io`` (IOBinding
   on the CPU EP), ``threadsN`` (intra-op threads set to N, inter-op 1), ``basic`` (graph
   optimization level basic instead of all), ``copy-reorder`` (beam reorders gather every row into a
   new array instead of moving the changed rows in place).

Numbers on a shared machine are noisy: read the ratios of one run, and note ``uptime`` beside them.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def instrument(gen, settings) -> dict:
    """One generate with timers around the backend's graph runs and row gathers."""
    backend = gen.model.backend
    spent = collections.defaultdict(float)
    counts = collections.Counter()
    run, take = backend.run, backend.take

    def timed_run(graph, *args, **kwargs):
        seconds, out = _timed(lambda: run(graph, *args, **kwargs))
        spent[f"graph {graph}"] += seconds
        counts[graph] += 1
        return out

    def timed_take(*args):
        seconds, out = _timed(lambda: take(*args))
        spent["host row gathers (reorder)"] += seconds
        return out

    backend.run, backend.take = timed_run, timed_take
    try:
        total, out = _timed(lambda: gen.generate(settings["inputs"], **settings["options"]))
    finally:
        backend.run, backend.take = run, take
    spent["host search (the rest)"] = total - sum(spent.values())
    return {"total_s": total, "steps": out.steps, "spent": dict(spent), "runs": dict(counts)}


def ort_op_profile(gen, settings, folder: Path) -> dict:
    """Per op type: milliseconds in the decoder graph over one generate (ONNX Runtime's profiler)."""
    import onnxruntime as ort

    from elx.runners.backends.ort import session_options

    step = gen.manifest.step
    options = session_options()
    options.enable_profiling = True
    options.profile_file_prefix = str(folder / "ort_profile")
    backend = gen.model.backend
    plain = backend.sessions[step]
    backend.sessions[step] = ort.InferenceSession(str(gen.manifest.graph_path(step)), options,
                                                  providers=["CPUExecutionProvider"])
    try:
        gen.generate(settings["inputs"], **settings["options"])
        path = backend.sessions[step].end_profiling()
    finally:
        backend.sessions[step] = plain
    events = json.loads(Path(path).read_text())
    by_op, runs = collections.Counter(), 0.0
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            by_op[e["args"]["op_name"]] += e["dur"] / 1e3
        elif e.get("cat") == "Session" and e["name"] == "model_run":
            runs += e["dur"] / 1e3
    os.unlink(path)
    return {"model_run_ms": runs, "by_op_ms": dict(by_op.most_common())}


def variant(name: str, folder: Path):
    """A Generator for one runner variant (see the module doc)."""
    import onnxruntime as ort

    from elx.runners.backends import ort as ort_backend
    from elx.runners.generate import Generator

    if name == "default":
        return Generator.from_folder(folder)
    if name == "ort-io":
        return Generator.from_folder(folder, backend="ort-io")
    if name.startswith("threads"):
        return Generator.from_folder(folder, threads=int(name[len("threads"):]))
    if name == "copy-reorder":  # beam reorders gather every row into a new array (before Backend.permute_rows)
        gen = Generator.from_folder(folder)
        gen.model.backend.permute_rows = gen.model.backend.take
        return gen
    gen = Generator.from_folder(folder)
    for graph in list(gen.model.backend.sessions):
        options = ort_backend.session_options()
        if name == "spin":
            options.add_session_config_entry("session.intra_op.allow_spinning", "1")
        elif name == "basic":
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        else:
            raise SystemExit(f"unknown variant {name}")
        gen.model.backend.sessions[graph] = ort.InferenceSession(str(gen.manifest.graph_path(graph)), options,
                                                                 providers=["CPUExecutionProvider"])
    return gen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="t5-small")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--beams", type=int, default=4)
    parser.add_argument("--input", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--work", default="out/profile")
    parser.add_argument("--variants", default="default,spin,ort-io,threads2,basic")
    parser.add_argument("--skip-profile", action="store_true", help="only the variants")
    args = parser.parse_args()
    import onnxruntime as ort

    ort.set_default_logger_severity(3)

    from elx.exporter.bench.bench import ensure_exports
    from elx.runners.generate import Generator
    from elx.runners.inputs.random_inputs import random_inputs

    work = Path(args.work)
    folder = ensure_exports(args.model, True, [""], work / args.model)[0]
    gen = Generator.from_folder(folder)
    settings = {"inputs": random_inputs(gen.manifest, args.batch, args.input, np.random.default_rng(0)),
                "options": dict(num_beams=args.beams, max_new_tokens=args.new_tokens,
                                min_new_tokens=args.new_tokens)}
    print(f"{args.model} (random init), batch {args.batch}, beams {args.beams}, input {args.input}, "
          f"{args.new_tokens} forced new tokens; load: {open('/proc/loadavg').read().split()[:3]}")
    gen.generate(settings["inputs"], **settings["options"])  # warm-up
    if not args.skip_profile:
        profile_report(gen, settings, work)
    run_variants(folder, settings, [v for v in args.variants.split(",") if v], args.repeats)


def profile_report(gen, settings, work: Path) -> None:
    profile = instrument(gen, settings)
    steps = profile["steps"]
    print(f"\none instrumented generate: {profile['total_s']:.3f} s, {steps} steps")
    print("| where | s | per step ms | share |\n|---|---|---|---|")
    for where, seconds in sorted(profile["spent"].items(), key=lambda kv: -kv[1]):
        print(f"| {where} | {seconds:.3f} | {1e3 * seconds / steps:.2f} | {seconds / profile['total_s']:.0%} |")

    ops = ort_op_profile(gen, settings, work)
    total = sum(ops["by_op_ms"].values())
    print(f"\ndecoder graph, ONNX Runtime profile over one generate: model_run {ops['model_run_ms']:.0f} ms, "
          f"nodes {total:.0f} ms (the rest is session overhead between nodes)")
    print("| op type | ms | share of nodes |\n|---|---|---|")
    for op, ms in list(ops["by_op_ms"].items())[:10]:
        print(f"| {op} | {ms:.0f} | {ms / total:.0%} |")



def run_variants(folder: Path, settings: dict, names: list, repeats: int) -> None:
    gens = {name: variant(name, folder) for name in names}
    reference = None
    for name, g in gens.items():  # warm-up, and the tokens every variant must give
        tokens = g.generate(settings["inputs"], **settings["options"]).sequences
        reference = tokens if reference is None else reference
        if not np.array_equal(tokens, reference):
            raise SystemExit(f"variant {name} changed the tokens")
    times = {name: [] for name in names}
    for _ in range(repeats):
        for name, g in gens.items():
            times[name].append(_timed(lambda: g.generate(settings["inputs"], **settings["options"]))[0])
    base = statistics.median(times[names[0]])
    print(f"\nvariants, {repeats} interleaved rounds (tokens identical to {names[0]}'s); "
          f"load after: {open('/proc/loadavg').read().split()[:3]}")
    print(f"| variant | median s | vs {names[0]} | all s |\n|---|---|---|---|")
    for name in names:
        median = statistics.median(times[name])
        print(f"| {name} | {median:.3f} | {base / median:.3f}x | {' '.join(f'{t:.3f}' for t in times[name])} |")


if __name__ == "__main__":
    main()
