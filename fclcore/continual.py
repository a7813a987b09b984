"""Continual-learning metrics over the loss matrix n[t][i] (docs/metrics.md, "Learning metrics").

n[t][i] is the test NLL of task i measured after training task t (nan where i > t).
Lower is better, so forgetting is how far a task's loss rose above its best earlier value.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np


def loss_matrix(rows: Sequence[Sequence[float]]) -> np.ndarray:
    """A square float matrix from ragged rows (row t has t + 1 entries), nan-padded."""
    size = len(rows)
    out = np.full((size, size), np.nan)
    for t, row in enumerate(rows):
        out[t, : len(row)] = row
    return out


def continual_metrics(n: np.ndarray) -> dict:
    """avg_nll, forgetting, base_nll and new_nll (per task) of one client's matrix."""
    n = np.asarray(n, dtype=float)
    last = n.shape[0] - 1
    forgetting = [n[last, i] - np.nanmin(n[i:last, i]) for i in range(last)]
    return {
        "avg_nll": _num(np.nanmean(n[last, : last + 1])),
        "avg_nll_per_task": [_num(np.nanmean(n[t, : t + 1])) for t in range(last + 1)],
        "forgetting": _num(np.mean(forgetting)) if forgetting else 0.0,
        "base_nll": [_num(n[t, 0]) for t in range(last + 1)],
        "new_nll": [_num(n[t, t]) for t in range(last + 1)],
    }


def accuracy_metrics(a: np.ndarray) -> dict:
    """The same for an accuracy matrix a[t][i] (higher is better): avg_accuracy after the last
    task, avg_incremental_accuracy (the mean over t of the mean accuracy on tasks <= t, i.e.
    task-averaged), forgetting (best earlier accuracy minus final), base/new accuracy."""
    a = np.asarray(a, dtype=float)
    last = a.shape[0] - 1
    per_task = [_num(np.nanmean(a[t, : t + 1])) for t in range(last + 1)]
    forgetting = [np.nanmax(a[i:last, i]) - a[last, i] for i in range(last)]
    return {
        "avg_accuracy": per_task[-1],
        "avg_incremental_accuracy": _num(np.mean([v for v in per_task if v is not None])),
        "accuracy_per_task": per_task,
        "forgetting": _num(np.mean(forgetting)) if forgetting else 0.0,
        "base_accuracy": [_num(a[t, 0]) for t in range(last + 1)],
        "new_accuracy": [_num(a[t, t]) for t in range(last + 1)],
    }


def mean_metrics(per_client: dict[str, dict]) -> dict:
    """Average each metric (and each per-task list entry) over clients."""
    clients = list(per_client.values())
    if not clients:
        return {}
    out = {}
    for key, value in clients[0].items():
        if key.endswith("_matrix"):
            continue
        if isinstance(value, list):
            out[key] = [
                _num(np.mean([x for x in v if x is not None])) if any(x is not None for x in v) else None
                for v in zip(*(c[key] for c in clients))
            ]
        elif value is not None:
            out[key] = _num(np.mean([c[key] for c in clients if c[key] is not None]))
    return out


def _num(value: float) -> float | None:
    value = float(value)
    return None if math.isnan(value) else round(value, 4)
