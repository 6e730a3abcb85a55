"""Sweeps of ``elx bench`` that reproduce the shape of the EL-attention paper's Figure 4 and Table 3.

* ``input``: input length 64 → 1024 at beam 4 (Figure 4, left): seconds per generate and speedup
  over HF for every system.
* ``beam``: beams 1, 2, 4, 8 at a long input (Figure 4, right).
* ``budget``: for each elx pass set, the largest batch whose live generation state (input-related
  state + self-attention cache at the last step, measured from the runner's tensors at batch 1,
  which grows linearly with the batch) fits a memory budget, and the throughput reached at that
  batch (Table 3).

Each sweep writes JSON, a Markdown table and a PNG plot into the output folder; plot titles name the
model and the fixed settings (wrapped to the figure's width), and say so when the run is a ``--quick``
smoke run.  The plots need matplotlib (``pip install 'elx[bench]'``): ``require_matplotlib`` says so in
one line before anything runs.  A plain bench run (``plot_bench``) is plotted whenever matplotlib is
installed, and says where the plot went or why there is none.
"""
from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from elx.exporter.bench.bench import BenchSettings, describe, generator_for, run_bench
from elx.exporter.bench.plots import has_matplotlib, plot_bench, require_matplotlib, save_figure  # noqa: F401 (the CLI's)
from elx.exporter.bench.results import human_bytes, report_markdown
from elx.exporter.progress import Progress
from elx.runners.generate import Generator
from elx.runners.inputs.random_inputs import random_inputs

INPUT_LENGTHS = (64, 128, 256, 512, 1024)
BEAMS = (1, 2, 4, 8)


def _series(reports: list, key: str) -> dict:
    out = {}
    for report in reports:
        for system in report["systems"]:
            out.setdefault(system["system"], []).append(system[key])
    return out


def _plot(path: Path, xs, reports: list, xlabel: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, values in _series(reports, "median_s").items():
        left.plot(xs, values, marker="o", label=name)
    for name, values in _series(reports, "speedup_vs_hf").items():
        right.plot(xs, values, marker="o", label=name)
    left.set(xlabel=xlabel, ylabel="seconds per generate (median)", title="seconds, same run")
    right.set(xlabel=xlabel, ylabel="speedup over HF generate (x)", title="ratio, same run")
    right.axhline(1.0, color="grey", lw=0.8, ls="--")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(xs))
        ax.set_xticklabels([str(x) for x in xs])
        ax.grid(alpha=0.3)
    left.legend(fontsize=8)
    save_figure(fig, path, title)


def _write(out: Path, name: str, payload, tables: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(payload, indent=1))
    (out / f"{name}.md").write_text(tables + "\n")


def _work_of(out: Path) -> Path:
    """The bench's ``--work``/<model> folder of a results folder (``results/<time>``), where peers' conversions
    are cached across runs; ``out`` itself for a folder laid out otherwise."""
    return out.parent.parent if out.parent.name == "results" else out


def _sweep(folders, settings: BenchSettings, out: Path, field: str, values, name: str, label: str, xlabel: str,
           peers, log, progress=None) -> Path:
    """Run the bench once per value of one setting; write JSON, Markdown and a plot named ``name``."""
    reports = []
    for value in values:
        log(f"sweep {name}: {label} {value}")
        reports.append(run_bench(folders, replace(settings, **{field: value}), peer_names=peers, work=_work_of(out),
                                 progress=progress))
    title = describe(reports[0], without=field)
    tables = "\n\n".join(f"### {label} {v}\n\n{report_markdown(r)}" for v, r in zip(values, reports))
    _write(out, name, {"x": list(values), "reports": reports}, tables)
    _plot(out / f"{name}.png", values, reports, xlabel, title)
    return out / f"{name}.png"


def sweep_input(folders, settings: BenchSettings, out: Path, lengths=INPUT_LENGTHS, peers=(), log=print,
                progress=None) -> Path:
    return _sweep(folders, settings, out, "input_length", lengths, "sweep_input", "input", "input length (tokens)",
                  peers, log, progress)


def sweep_beam(folders, settings: BenchSettings, out: Path, beams=BEAMS, peers=(), log=print, progress=None) -> Path:
    return _sweep(folders, settings, out, "num_beams", beams, "sweep_beam", "beams", "beams", peers, log, progress)


def _bytes_per_item(gen: Generator, settings: BenchSettings) -> int:
    inputs = random_inputs(gen.manifest, 1, settings.input_length, np.random.default_rng(settings.seed))
    memory = gen.generate(inputs, track_memory=True, **settings.generation()).memory
    return max(m["state_bytes"] + m["cache_bytes"] for m in memory)


def sweep_budget(folders, settings: BenchSettings, out: Path, budget_mb: float, log=print, progress=None) -> Path:
    import time

    rows, source = [], None
    with Progress("elx bench", len(folders) * (2 + settings.repeats), progress) as report:
        for folder in folders:
            steps = 2 + settings.repeats
            with report.stage(f"budget sweep of {folder.name}", steps, steps=steps) as stage:
                gen = generator_for(folder, settings)
                source = gen.manifest.data["source"]
                per_item = _bytes_per_item(gen, settings)
                batch = max(1, int(budget_mb * 2**20 // per_item))
                log(f"sweep budget: {folder.name}: {human_bytes(per_item)} per input → batch {batch}")
                inputs = random_inputs(gen.manifest, batch, settings.input_length, np.random.default_rng(settings.seed))
                stage.step("warm-up")
                gen.generate(inputs, **settings.generation())  # warm-up
                stage.step("timed runs")
                times = []
                for _ in range(settings.repeats):
                    start = time.perf_counter()
                    gen.generate(inputs, **settings.generation())
                    times.append(time.perf_counter() - start)
                    stage.step()
                stage.detail = f"batch {batch}, median {float(np.median(times)):.2f} s"
            median = float(np.median(times))
            rows.append({"system": "elx " + ("+".join(gen.manifest.pass_names()) or "baseline"),
                         "bytes_per_input": per_item, "max_batch": batch, "median_s": median,
                         "samples_per_s": batch / median})
    base = rows[0]
    title = describe({"settings": asdict(settings), "model": source}, without="batch_size")
    lines = [f"memory budget {budget_mb:.0f} MB for live generation state (input-related state + self cache); "
             f"{title}\n",
             "| system | state per input | max batch | median s | samples/s | throughput vs baseline |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['system']} | {human_bytes(r['bytes_per_input'])} | {r['max_batch']} | {r['median_s']:.2f} | "
                     f"{r['samples_per_s']:.2f} | {r['samples_per_s'] / base['samples_per_s']:.2f}x |")
    _write(out, "sweep_budget", {"budget_mb": budget_mb, "rows": rows}, "\n".join(lines))
    _plot_budget(out / "sweep_budget.png", rows, budget_mb, title)
    return out / "sweep_budget.png"


def _plot_budget(path: Path, rows: list, budget_mb: float, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["system"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.bar(names, [r["max_batch"] for r in rows], color="tab:blue")
    left.set(ylabel="largest batch", title=f"fits {budget_mb:.0f} MB of live state")
    right.bar(names, [r["samples_per_s"] for r in rows], color="tab:green")
    right.set(ylabel="samples / s", title="throughput at that batch")
    for ax in (left, right):
        ax.tick_params(axis="x", rotation=20)
        ax.grid(axis="y", alpha=0.3)
    save_figure(fig, path, title)
