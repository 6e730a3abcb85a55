"""The plots of ``elx bench``: a plain run's bars (``plot_bench``), drawn whenever matplotlib is installed, and the
figure saving the sweeps share (``exporter/bench/sweeps.py``)."""
from __future__ import annotations

from pathlib import Path

from elx.exporter.bench.bench import SMOKE, describe


def require_matplotlib() -> None:
    """Refuse a sweep up front, in one line, when its plots cannot be drawn."""
    from elx.runners.errors import ElxError

    if not has_matplotlib():
        raise ElxError("--sweep draws plots with matplotlib, which is not installed; pip install 'elx[bench]' "
                       "(the bench extra)") from None


def has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot_bench(report: dict, path: Path) -> str:
    """Bars of one bench run (median seconds, speedup over HF) in ``path``; returns the line to print: where the
    plot went, or that matplotlib is missing."""
    if not has_matplotlib():
        return "no plot: matplotlib is not installed (pip install 'elx[bench]'; tools/setup.sh installs it)"
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["system"] for r in report["systems"]]
    steps = report["settings"]["new_tokens"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.barh(names, [r["median_s"] / steps * 1e3 for r in report["systems"]], color="tab:blue")
    left.set(xlabel=f"ms per new token (median generate / {steps} tokens; lower is faster)", title="time, same run")
    right.barh(names, [r["speedup_vs_hf"] for r in report["systems"]], color="tab:green")
    right.set(xlabel="speed as a multiple of HF generate's (×; higher is faster)", title="ratio, same run")
    right.axvline(1.0, color="grey", lw=0.8, ls="--")
    right.set_yticklabels([])
    for ax in (left, right):
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
    save_figure(fig, path, describe(report))
    return f"wrote {path}"


def save_figure(fig, path: Path, title: str) -> None:
    """The figure, titled with the model and settings (in red for a smoke run), as a PNG.

    The title is wrapped to the figure's width (about 0.55 em per character at 9 pt) and the saved image
    grows to hold everything drawn (``bbox_inches="tight"``): a long smoke-run title is never clipped."""
    import textwrap

    import matplotlib.pyplot as plt

    size = 9
    width = max(20, int(fig.get_figwidth() * 72 / (0.55 * size)))
    fig.suptitle(textwrap.fill(title, width), fontsize=size, color="red" if title.startswith(SMOKE) else "black")
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
