"""``fcl report``: plots of one run or of several runs side by side.

Given run directories (each with summary.json and metrics.jsonl) or a directory of them,
writes PNGs and a markdown summary:

* ``nll_per_task.png``: average, base (task 0) and new-task NLL after each task, one line
  per run (the ConFedMADE paper's Figure 3); ``accuracy_per_task.png`` the same for
  accuracy-scored runs (FedET);
* ``bytes_per_round.png``: bytes up and down per round, summed over clients, stacked by
  kind, with task boundaries and the dense fp32 FedAvg line (``fcl_edge.traffic``);
* ``cumulative_bytes.png``: up + down summed over rounds, every run on the same axes;
* ``attention_<run>.png``: the learned attention alpha of each (client, task) over the
  knowledge-base entries it received (the paper's Figure 4), for methods that have one;
* ``task_accuracy.png``: for runs whose ``summary.json`` has a ``fleet`` accuracy matrix
  (row t: the accuracy on each test task i <= t after task t, over every device that
  reported, so late-enrolled and retired devices count), one panel per run titled with its
  final mean accuracy: x is "after task t" (tasks from 0, as on every figure), one line per test task i starting at
  x = i, tasks nobody reported on are gaps; only written when some run has such a matrix;
* ``report.md``: the final numbers in a table, with a ``fleet acc`` column (the fleet
  matrix's ``avg_accuracy``) when some run has one, and a ``run-level`` column when some run
  has ``bytes.run_level`` (``fcl_edge.attribution``): the share of the devices' bytes no round
  row counts (statuses, EVAL, FINISH, re-sends, ...), with its up and down bytes; above it, a
  warning for every run that is not complete (``summary.json`` ``status``: interrupted or
  failed) or misses some devices' final evaluation (``run_warnings``, also printed on stderr
  by ``fcl report``).
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Sequence

import numpy as np

from fcl_edge.compare import headline
from fcl_edge.figures import finish, run_label, save, title_of
from fcl_edge.traffic import plot_bytes_per_round, plot_cumulative, round_bytes


def find_runs(paths: Sequence[str]) -> dict[str, Path]:
    """Run name -> directory, for run directories or directories that contain them."""
    runs = {}
    for raw in paths:
        path = Path(raw)
        if (path / "summary.json").exists():
            runs[path.name] = path
        else:
            runs.update({p.parent.name: p.parent for p in sorted(path.glob("*/summary.json"))})
    if not runs:
        raise FileNotFoundError(f"no summary.json in {', '.join(paths)} or their subdirectories")
    return runs


def load_run(path: Path) -> tuple[dict, list[dict]]:
    summary = json.loads((path / "summary.json").read_text())
    events = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return summary, events


def report(paths: Sequence[str], out: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    out_dir = Path(out)
    runs = {name: load_run(path) for name, path in find_runs(paths).items()}  # first: a failed report writes nothing
    out_dir.mkdir(parents=True, exist_ok=True)
    by_metric: dict[str, dict] = defaultdict(dict)
    for name, run in runs.items():
        by_metric[_metric(run[0])][name] = run
    written = [_per_task(group, metric, out_dir) for metric, group in sorted(by_metric.items())]
    written += _traffic(runs, out_dir)
    written += [p for name, (_, events) in runs.items() if (p := _attention(name, events, out_dir))]
    if fleets := {name: f for name, (s, _) in runs.items() if (f := _fleet_accuracy(s))}:
        written.append(_task_accuracy(fleets, out_dir))
    written.append(_table(runs, out_dir))
    for line in run_warnings(runs):
        print(f"fcl report: warning: {line}", file=sys.stderr)
    return written


KEYS = {
    "nll": ("avg_nll_per_task", "base_nll", "new_nll"),
    "accuracy": ("accuracy_per_task", "base_accuracy", "new_accuracy"),
}


def _metric(summary: dict) -> str:
    clients = summary.get("final", {}).get("per_client", {}).values()
    return "accuracy" if any("accuracy_matrix" in c for c in clients) or _fleet_accuracy(summary) else "nll"


def _per_task(runs: dict, metric: str, out_dir: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2), sharex=True, sharey=True)
    for name, (summary, _) in runs.items():
        final = _recomputed(summary) or summary.get("fleet") or {}  # no device reported at every task end
        for ax, key in zip(axes, KEYS[metric]):
            values = final.get(key) or []
            ax.plot(range(len(values)), values, marker="o", label=run_label(name, summary))
    for ax, title in zip(axes, ("average over tasks seen", "base task (task 0)", "newest task")):
        ax.set_title(title)
        ax.set_xlabel("after task")
    axes[0].set_ylabel("test NLL (nats; lower is better)" if metric == "nll" else "test accuracy (higher is better)")
    finish(fig, axes, title_of(s for s, _ in runs.values()))
    return save(fig, out_dir / f"{metric}_per_task.png")


def _traffic(runs: dict, out_dir: Path) -> list[Path]:
    data = {run_label(name, summary): round_bytes(events) for name, (summary, events) in runs.items()}
    title = title_of(s for s, _ in runs.values())
    return [
        plot_bytes_per_round(data, title, out_dir / "bytes_per_round.png"),
        plot_cumulative(data, title, out_dir / "cumulative_bytes.png"),
    ]


def _attention(name: str, events: list[dict], out_dir: Path) -> Path | None:
    rows = [e for e in events if e.get("event") == "attention" and e.get("entries")]
    if not rows:
        return None
    import matplotlib.pyplot as plt

    entries = sorted({x for e in rows for x in e["entries"]})
    labels = [f"{e['client']} t{e['task']}" for e in rows]
    grid = np.full((len(rows), len(entries)), np.nan)
    for i, e in enumerate(rows):
        for entry, a in zip(e["entries"], e["alpha"]):
            grid[i, entries.index(entry)] = a
    fig, ax = plt.subplots(figsize=(max(5.0, 1.5 + 0.45 * len(entries)), max(3.0, 1.5 + 0.3 * len(rows))))
    image = ax.imshow(grid, cmap="viridis", aspect="auto", vmin=0.0, vmax=1.0)  # weights: near-uniform looks so
    ax.set_xticks(range(len(entries)), entries, rotation=90, fontsize=7)
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.set_xlabel("knowledge-base entry (client/task)")
    ax.set_title(f"{name}: attention alpha", fontsize=10)
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    return save(fig, out_dir / f"attention_{name}.png")


def _fleet_accuracy(summary: dict) -> dict | None:
    """The run's ``fleet`` block if it holds an accuracy matrix (None for older or NLL runs)."""
    fleet = summary.get("fleet")
    return fleet if isinstance(fleet, dict) and fleet.get("accuracy_matrix") else None


def _task_accuracy(fleets: dict[str, dict], out_dir: Path) -> Path:
    """One panel per run: accuracy on each test task i after each task t >= i (the fleet's matrix)."""
    import matplotlib.pyplot as plt

    cols = min(3, len(fleets))
    rows = -(-len(fleets) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.6 * rows), squeeze=False)
    for ax, (name, fleet) in zip(axes.flat, fleets.items()):
        raw = fleet["accuracy_matrix"]
        size = max(len(raw), max(len(r or []) for r in raw))
        matrix = np.full((len(raw), size), np.nan)
        for t, row in enumerate(raw):
            for i, v in enumerate(row or []):
                matrix[t, i] = np.nan if v is None else v
        tasks = len(raw)
        colors = plt.get_cmap("viridis")(np.linspace(0, 0.9, max(tasks, 1)))
        for i in range(tasks):
            x = np.arange(i, tasks)  # tasks counted from 0, as on every other figure and in summary.json
            ax.plot(x, matrix[i:, i], marker="o", markersize=3, color=colors[i], label=f"task {i}")
        final = fleet.get("avg_accuracy")
        if final is None and not np.all(np.isnan(matrix[-1])):
            final = float(np.nanmean(matrix[-1]))
        ax.set_title(f"{name}: final mean acc " + ("n/a" if final is None else f"{final:.3f}"), fontsize=10)
        ax.set_xlabel("after task")
        ax.set_ylabel("test accuracy (higher is better)")
        ax.set_xlim(-0.5, tasks - 0.5)
        ax.set_ylim(0.0, 1.02)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
        if tasks <= 10:
            ax.legend(fontsize=7, title="test task", title_fontsize=7)
    for ax in list(axes.flat)[len(fleets) :]:
        ax.set_visible(False)
    fig.tight_layout()
    return save(fig, out_dir / "task_accuracy.png")


def run_warnings(runs: dict) -> list[str]:
    """One line per run whose numbers are not those of a finished run: its status is not
    ``complete``, or devices' final evaluations are missing (summaries written before runs had
    a status say nothing)."""
    out = []
    for name, (s, _) in runs.items():
        status, missing = s.get("status"), s.get("missing_final_evaluations") or []
        if status not in (None, "complete"):
            out.append(f"run {name} is {status}: its numbers are not those of a finished run")
        if missing:
            out.append(f"run {name}: no final evaluation from {', '.join(missing)}; its final metrics leave them out")
    return out


def _table(runs: dict, out_dir: Path) -> Path:
    fleet_col = any((s.get("fleet") or {}).get("avg_accuracy") is not None for s, _ in runs.values())
    run_col = any("run_level" in s["bytes"] for s, _ in runs.values())
    lines = [f"> **Warning**: {w}\n" for w in run_warnings(runs)] + [
        "| run | method | metric | value | forgetting | bytes up | bytes down "
        "| dense fp32 up | dense fp32 down |"
        + (" fleet acc |" if fleet_col else "")
        + (" run-level |" if run_col else ""),
        "|---|---|---|---:|---:|---:|---:|---:|---:|" + ("---:|" if fleet_col else "") + ("---:|" if run_col else ""),
    ]
    for name, (s, _) in runs.items():
        b, f = s["bytes"], s.get("final", {})
        name_, value, from_fleet = headline(s)
        score = f"{'fleet ' if from_fleet else ''}{name_} | {value}"
        fleet_acc = (s.get("fleet") or {}).get("avg_accuracy")
        lines.append(
            f"| {name} | {s['method']} | {score} | {f.get('forgetting')} | {b['up_total']:,} | "
            f"{b['down_total']:,} | {b['dense_fp32_up_total']:,} "
            f"| {b.get('dense_fp32_down_total', b['dense_fp32_up_total']):,} |"
            + (f" {'' if fleet_acc is None else fleet_acc} |" if fleet_col else "")
            + (f" {_run_level(b.get('run_level'))} |" if run_col else "")
        )
    path = out_dir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _run_level(block: dict | None) -> str:
    """The run-level cell: its share of the devices' bytes, and its bytes up / down."""
    if not block or block.get("share") is None:
        return ""
    return f"{block['share']:.1%} ({block['up_total']:,} up / {block['down_total']:,} down)"


def _recomputed(summary: dict) -> dict:
    """Client-averaged metrics recomputed from the stored n[t][i] matrices."""
    from fclcore.continual import accuracy_metrics, continual_metrics, mean_metrics

    per_client = {}
    for c, v in summary.get("final", {}).get("per_client", {}).items():
        if "accuracy_matrix" in v:
            per_client[c] = accuracy_metrics(np.array(v["accuracy_matrix"], dtype=float))
        else:
            per_client[c] = continual_metrics(np.array(v["nll_matrix"], dtype=float))
    return mean_metrics(per_client)
