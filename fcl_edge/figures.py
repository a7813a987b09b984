"""What every ``fcl report`` figure shares: plain tick labels, whole rounds or tasks on x, one
legend for the whole figure, a title naming the scenario and the methods, and saving."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable


def finish(fig, axes: Iterable, title: str) -> None:
    """Plain numbers on y (no offset such as ``1e-5+2.49e-1``), integer x ticks, one legend."""
    from matplotlib.ticker import MaxNLocator

    axes = list(axes)
    handles: dict = {}
    for ax in axes:
        ax.ticklabel_format(axis="y", style="plain", useOffset=False)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    fig.suptitle(title)
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=min(6, len(handles)), fontsize=8)
    fig.tight_layout(rect=(0, 0.08, 1, 0.95))


def title_of(summaries: Iterable[dict]) -> str:
    """``scenario: method, method`` from the runs' summary.json (each name once, in order)."""
    summaries = list(summaries)
    scenarios = dict.fromkeys(str(s.get("federation", "?")) for s in summaries)
    names = dict.fromkeys(str(s.get("method", "?")) for s in summaries)
    return f"{', '.join(scenarios)}: {', '.join(names)}"


def save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_label(name: str, summary: dict) -> str:
    """A run as a legend names it: its method, and its directory when that says something else."""
    method = str(summary.get("method", name))
    return method if name == method else f"{method} ({name})"
