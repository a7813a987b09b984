"""Bytes per round as ``fcl report`` draws them: up and down apart, stacked by kind (model,
knowledge, control), with task boundaries and the dense fp32 FedAvg reference.

``round_client`` records carry ``up_kinds`` / ``down_kinds`` (bytes per kind, summing to
``bytes_up`` / ``bytes_down``) in run logs that have them; older logs have only the totals,
drawn as one kind, "model".  The dense reference of a round is the sum of its records'
``dense_fp32_up``: dense FedAvg sends each device that model and receives it back.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from pathlib import Path

import numpy as np

from fcl_edge.figures import finish, save

KINDS = ("model", "knowledge", "control")
COLORS = {"model": "tab:blue", "knowledge": "tab:orange", "control": "tab:gray"}


@dataclasses.dataclass(frozen=True)
class RoundBytes:
    """One run's traffic, summed over its clients, one entry per round in ``rounds``."""

    rounds: list[int]
    up: dict[str, list[int]]  # kind -> bytes per round
    down: dict[str, list[int]]
    dense: list[int]  # dense fp32 FedAvg, one way, per round
    task_starts: list[int]  # the first round of every task after the first

    def total(self, direction: str) -> np.ndarray:
        by_kind = self.up if direction == "up" else self.down
        return np.sum([by_kind[k] for k in KINDS], axis=0) if self.rounds else np.zeros(0)


def round_bytes(events: list[dict]) -> RoundBytes:
    """Per-round sums of a run log's ``round_client`` records (the data of the plots)."""
    up: dict[int, dict[str, int]] = defaultdict(lambda: dict.fromkeys(KINDS, 0))
    down: dict[int, dict[str, int]] = defaultdict(lambda: dict.fromkeys(KINDS, 0))
    dense: dict[int, int] = defaultdict(int)
    task: dict[int, int] = {}
    for e in events:
        if e.get("event") != "round_client":
            continue
        r = e["round"]
        _add(up[r], e.get("up_kinds"), e["bytes_up"])
        _add(down[r], e.get("down_kinds"), e["bytes_down"])
        dense[r] += e.get("dense_fp32_up") or 0
        task[r] = e["task"]
    rounds = sorted(up)
    starts = [r for prev, r in zip(rounds, rounds[1:]) if task[r] != task[prev]]
    return RoundBytes(
        rounds=rounds,
        up={k: [up[r][k] for r in rounds] for k in KINDS},
        down={k: [down[r][k] for r in rounds] for k in KINDS},
        dense=[dense[r] for r in rounds],
        task_starts=starts,
    )


def _add(into: dict[str, int], kinds: dict | None, total: int) -> None:
    """Add one record's bytes by kind; a record without a split counts as model bytes."""
    if not kinds:
        into["model"] += total
        return
    for kind in KINDS:
        into[kind] += int(kinds.get(kind, 0))


def plot_bytes_per_round(runs: dict[str, RoundBytes], title: str, path: Path) -> Path:
    """One row per run, up and down side by side on one shared kB axis."""
    import matplotlib.pyplot as plt

    # up and down of one run share a y axis; runs do not (one method's bars can be 30x another's)
    fig, axes = plt.subplots(
        len(runs), 2, figsize=(12, 3.2 * len(runs) + 0.6), sharex=True, sharey="row", squeeze=False
    )
    for row, (name, data) in zip(axes, runs.items()):
        for ax, direction in zip(row, ("up", "down")):
            by_kind = data.up if direction == "up" else data.down
            bottom = np.zeros(len(data.rounds))
            for kind in KINDS:
                values = np.asarray(by_kind[kind], dtype=float) / 1e3
                if values.any():
                    ax.bar(data.rounds, values, bottom=bottom, color=COLORS[kind], label=kind, width=0.8)
                    bottom += values
            ax.plot(data.rounds, np.asarray(data.dense) / 1e3, "k--", lw=1, label="dense fp32 FedAvg")
            _mark_tasks(ax, data.task_starts)
            control = sum(by_kind["control"]) / max(1, sum(sum(v) for v in by_kind.values()))
            way = "uploaded" if direction == "up" else "downloaded"
            ax.set_title(f"{name}: {way} per round (all clients; control {control:.1%})", fontsize=10)
            ax.set_ylabel("kB (MQTT PUBLISH)")
    for ax in axes[-1]:
        ax.set_xlabel("round")
    finish(fig, axes.flat, title)
    return save(fig, path)


def plot_cumulative(runs: dict[str, RoundBytes], title: str, path: Path) -> Path:
    """Up + down summed over rounds, every run on the same axes, against dense FedAvg's."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, data in runs.items():
        ax.plot(data.rounds, np.cumsum(data.total("up") + data.total("down")) / 1e6, marker=".", label=name)
    reference = max(runs.values(), key=lambda d: len(d.rounds))
    ax.plot(reference.rounds, np.cumsum(2 * np.asarray(reference.dense)) / 1e6, "k--", lw=1, label="dense fp32 FedAvg")
    _mark_tasks(ax, reference.task_starts)
    ax.set_xlabel("round")
    ax.set_ylabel("MB up + down, cumulative (all clients)")
    finish(fig, [ax], title)
    return save(fig, path)


def _mark_tasks(ax, starts: list[int]) -> None:
    for i, r in enumerate(starts):
        ax.axvline(r - 0.5, color="tab:red", lw=0.8, ls=":", label="new task" if i == 0 else None)
