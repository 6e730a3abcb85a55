"""What ``elx bench`` prints and keeps: a conclusion in words, a table in units a reader knows, the details
apart, and each run in its own folder.

* ``conclusion_lines``: one line per elx system, from the run's own numbers ("elx el: 1.42× HF, 0.97×
  CTranslate2, tokens = HF on 32/32 rows; input state 12× smaller than elx baseline's (96 KB vs 1.13 MB)").
  ``N× X`` is that system's speed as a multiple of X's: X's median seconds over its own, both medians of the
  same run's rounds (interleaved unless ``--one-at-a-time``).
* ``summary_markdown``: those lines, the settings, the notes, and the table (ms/token, tokens/s, s, × HF,
  memory with its unit chosen per value: ``human_bytes``).  ``details_markdown``: the roofline, GFLOP/s,
  time / floor and every round's seconds.  ``report_markdown``: both (``bench.md``).
* ``new_results_folder``: ``results/<local time>/`` (``2026-11-28T10-31-05``, ``-2`` after it when two runs
  start in the same second), and ``results/latest`` pointing at it (a symbolic link, or a file holding the
  folder's name where links cannot be made); a rerun never overwrites an earlier run's results.
* ``save_bench``: ``bench.json``, ``bench.md`` and ``bench.png`` (whenever matplotlib is installed; one line
  saying so when it is not) into that folder; returns what to print.
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from elx.exporter.bench.bench import describe, peer_lead_note
from elx.exporter.bench.plots import plot_bench

HF_PREFIX = "HF generate"


def human_bytes(value) -> str:
    """Bytes with the unit chosen per value, three significant digits, so that nothing small rounds to 0:
    ``512 B``, ``96.0 KB``, ``1.13 MB``, ``2.40 GB`` (1 KB = 1024 bytes); ``-`` when not measured."""
    if value is None:
        return "-"
    value = int(value)
    if abs(value) < 1024:
        return f"{value} B"
    for unit in ("KB", "MB", "GB", "TB"):
        value /= 1024
        if abs(value) < 1024 or unit == "TB":
            return f"{_digits(value)} {unit}"


def _digits(x: float) -> str:
    """Three significant digits, trailing zeros kept, no exponent: 0.0123, 0.120, 1.23, 12.3, 123, 1234."""
    size = abs(x)
    if size == 0:
        return "0"
    return f"{x:.{max(0, 2 - math.floor(math.log10(size)))}f}"


def _times(ratio: float) -> str:
    """A ratio as ``1.42×``, ``12×`` from ten up."""
    return f"{ratio:.0f}×" if ratio >= 9.95 else f"{ratio:.2f}×"


def _short(system: str) -> str:
    return "HF" if system.startswith(HF_PREFIX) else system


def _is_elx(system: dict) -> bool:
    return system["system"].startswith("elx")


def _state_reference(systems: list) -> dict | None:
    """The system whose input state the others are compared with: ``elx baseline``, else the first elx
    baseline of another precision or prompt form (None when the run has none, or it was not measured)."""
    baselines = [s for s in systems if s["system"] == "elx baseline"] + \
                [s for s in systems if s["system"].startswith("elx baseline")]
    return next((s for s in baselines if s.get("state_bytes")), None)


def _state_clause(system: dict, reference: dict | None) -> str | None:
    state = system.get("state_bytes")
    if state is None:
        return None
    if reference is None or reference is system:
        return f"input state {human_bytes(state)}"
    base = reference["state_bytes"]
    if state == 0 or abs(state / base - 1) < 0.005:
        return f"input state {human_bytes(state)} ({reference['system']}'s: {human_bytes(base)})"
    against = f"{reference['system']}'s ({human_bytes(state)} vs {human_bytes(base)})"
    if state < base:
        return f"input state {_times(base / state)} smaller than {against}"
    return f"input state {_times(state / base)} larger than {against}"


def _tokens_clause(system: dict) -> str:
    rows = system.get("rows_equal_hf")
    if rows:
        text = f"tokens = HF on {rows[0]}/{rows[1]} rows"
    else:
        text = "tokens = HF" if system.get("tokens_equal_hf") else "tokens differ from HF's"
    if not system.get("tokens_equal_hf") and system.get("note"):
        text += f" ({system['note']})"
    return text


def conclusion_lines(report: dict) -> list[str]:
    """One line per elx system of ``report``: its speed as a multiple of HF's and of each peer's (medians of the
    same run), how many rows give HF's tokens, and its input state against the elx baseline's."""
    systems = report["systems"]
    others = [s for s in systems if not _is_elx(s)]  # HF first (the bench lists it first), then the peers
    reference = _state_reference(systems)
    smoke = report["settings"].get("smoke")
    lines = []
    for system in filter(_is_elx, systems):
        speed = ", ".join(f"{_times(other['median_s'] / system['median_s'])} {_short(other['system'])}"
                          for other in others)
        clauses = [c for c in (speed, _tokens_clause(system)) if c]
        line = f"{system['system']}: " + ", ".join(clauses)
        state = _state_clause(system, reference)
        lines.append(line + (f"; {state}" if state else "") + (" (smoke run, not a measurement)" if smoke else ""))
    return lines


def _rounds_phrase(report: dict) -> str:
    settings = report["settings"]
    rounds = f"{settings['repeats']} round" + ("s" if settings["repeats"] != 1 else "")
    how = "one system at a time" if settings.get("one_at_a_time") else "interleaved"
    return f"medians of this run's {rounds}, {how}"


def summary_markdown(report: dict) -> str:
    """The conclusion lines, the settings, the notes and the table with everyday units (no roofline jargon)."""
    settings = report["settings"]
    steps, batch = settings["new_tokens"], settings["batch_size"]
    lines = conclusion_lines(report)
    if report.get("hf_precision_note"):
        lines.append(report["hf_precision_note"])
    lines.append(f"{describe(report)}; N× X = N times X's speed ({_rounds_phrase(report)})")
    notes = [f"peer {name} skipped: {why}" for name, why in (report.get("skipped_peers") or {}).items()]
    note = peer_lead_note(report)
    if note:
        notes.append(note)
    if settings.get("one_at_a_time"):
        notes.append("systems ran one at a time (--one-at-a-time: each loaded, warmed up, timed and released before "
                     "the next), not interleaved")
    table = ["| system | ms/token | tokens/s | s | × HF | input state | self cache | peak RSS growth | tokens = HF |",
             "|---|---|---|---|---|---|---|---|---|"]
    for s in report["systems"]:
        equal = "yes" if s["tokens_equal_hf"] else ("no: " + s["note"] if s.get("note") else "NO")
        if not s["tokens_equal_hf"] and s.get("rows_equal_hf"):
            equal += " ({}/{} rows)".format(*s["rows_equal_hf"])
        table.append(f"| {s['system']} | {_digits(s['median_s'] / steps * 1e3)} | {_digits(s['tokens_per_s'])} | "
                     f"{_digits(s['median_s'])} | {_times(s['speedup_vs_hf'])} | {human_bytes(s.get('state_bytes'))} | "
                     f"{human_bytes(s.get('cache_bytes'))} | {human_bytes(s.get('peak_rss_growth_bytes'))} | {equal} |")
    legend = (f"ms/token: a generate's median time / its {steps} new tokens (each step gives each of the {batch} "
              f"inputs one); tokens/s: new tokens of all {batch} inputs per second; s: median seconds per generate; "
              "input state: the tensors an elx runner keeps for the inputs across steps (cross-attention K/V; "
              "with el, the encoder output); self cache: its self-attention cache, largest step; peak RSS growth: the process's resident memory growth during "
              "the warm-up run")
    out = "\n".join(lines) + "\n"
    if notes:
        out += "\n" + "\n".join(notes) + "\n"
    return out + "\n" + "\n".join(table) + "\n\n" + legend


def details_markdown(report: dict) -> str:
    """The machine's measured peaks, the roofline, GFLOP/s, time / floor and every round's seconds."""
    roof = report.get("roofline")
    head = (f"matmul peak {report['matmul_peak_gflops']:.0f} GFLOP/s, read bandwidth "
            f"{report.get('read_bandwidth_gb_s', 0):.1f} GB/s (measured when the bench started); "
            f"{report['flops_per_generate'] / 1e9:.3g} GFLOP")
    if roof:
        head += (f" and {roof['bytes'] / 1e9:.3g} GB moved per generate; floor {roof['floor_s']:.3g} s: the least "
                 f"time this shape can take here ({roof['layout']} cross-attention layout, {roof['memory_bound_phases']} "
                 f"of {roof['phases']} phases bound by memory reads rather than arithmetic; exporter/bench/bench.py's "
                 "docstring has the model)")
    else:
        head += " per generate; no byte floor (the byte model covers encoder-decoder generation)"
    lines = ["| system | median s | samples/s | GFLOP/s | time / floor | each round's s |", "|---|---|---|---|---|---|"]
    for s in report["systems"]:
        over = s.get("time_over_floor")
        rounds = ", ".join(f"{x:.3f}" for x in s.get("all_seconds", []))
        lines.append(f"| {s['system']} | {s['median_s']:.3f} | {s['samples_per_s']:.2f} | {s['gflops_per_s']:.1f} | "
                     f"{'-' if over is None else _times(over)} | {rounds or '-'} |")
    return head + "\n\n" + "\n".join(lines)


def report_markdown(report: dict) -> str:
    """``bench.md``: the summary, then the details under their own heading."""
    return summary_markdown(report) + "\n\n## Details\n\n" + details_markdown(report)


LATEST = "latest"


def new_results_folder(root: Path, now: float | None = None, point: bool = True) -> Path:
    """A new folder ``root/<local time>`` for one run (``-2``, ``-3``… after the name when it is taken), with
    ``root/latest`` pointing at it (``point=False``: left where it was; the CLI points it once the run's results
    are written, so that a failed run never becomes the latest); earlier runs' folders are left as they are."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%dT%H-%M-%S", time.localtime(now))
    for n in range(1, 1000):
        folder = root / (stamp if n == 1 else f"{stamp}-{n}")
        try:
            folder.mkdir()
        except FileExistsError:
            continue
        if point:
            point_latest(root, folder)
        return folder
    raise FileExistsError(f"{root} holds 999 runs named {stamp}")


def point_latest(root: Path, folder: Path) -> None:
    """``root/latest`` → ``folder``, replaced in one step (a relative symbolic link; where links cannot be made,
    a file holding the folder's name)."""
    link, temporary = root / LATEST, root / f".{LATEST}.{os.getpid()}"
    if temporary.is_symlink() or temporary.exists():
        temporary.unlink()
    try:
        os.symlink(folder.name, temporary, target_is_directory=True)
    except OSError:
        temporary.write_text(folder.name + "\n")
    os.replace(temporary, link)


def latest_folder(root: Path) -> Path | None:
    """The folder ``root/latest`` points at (None before the first run)."""
    link = Path(root) / LATEST
    if link.is_symlink():
        return Path(root) / os.readlink(link)
    if link.is_file():
        return Path(root) / link.read_text().strip()
    return None


def save_bench(report: dict, out: Path) -> str:
    """``bench.json``, ``bench.md`` (summary and details) and ``bench.png`` in ``out``; returns what to print: the
    summary, the plot's line (where it went, or why there is none) and where the details are."""
    out = Path(out)
    (out / "bench.json").write_text(json.dumps(report, indent=1))
    (out / "bench.md").write_text(report_markdown(report) + "\n")
    plotted = plot_bench(report, out / "bench.png")
    return (summary_markdown(report) + "\n\n" + plotted + "\n"
            + f"details (roofline, GFLOP/s, time / floor, each round's seconds): {out / 'bench.md'}")
