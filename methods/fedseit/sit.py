"""Selective Inter-client Transfer (FedSeIT sec. 2.3, eq. 6; notes G8-G9), NumPy only.

The device summarises a task's documents by ``Q_eff = min(Q, n // 5)`` k-means centres of
their mean word embeddings (true centroids, k-means++ seeding, a few restarts, seeded); the
aggregator keeps them as the key of that (client, task) knowledge entry and scores stored
entries against a device's new task by the mean pairwise cosine of their centres.  Both
halves use this module: the device clusters, the aggregator scores and ranks.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

DOCS_PER_CENTRE = 5  # each centre averages several documents (notes G8: Q_eff = min(Q, n // 5))


def centre_count(n_docs: int, q: int) -> int:
    """Q_eff: at most ``q`` centres, at least one, about five documents per centre."""
    return max(1, min(q, n_docs // DOCS_PER_CENTRE))


def kmeans(points: np.ndarray, k: int, seed: int | Sequence[int], inits: int = 3, iters: int = 100) -> np.ndarray:
    """``k`` centroids of ``points`` (N, D): Lloyd's algorithm from k-means++ seeds, the best
    of ``inits`` restarts by inertia; empty clusters are dropped, so fewer than ``k`` rows may
    come back.  Deterministic for a given ``seed``."""
    x = np.asarray(points, dtype=np.float64)
    if x.ndim != 2 or len(x) == 0 or not np.isfinite(x).all():
        raise ValueError(f"kmeans: expected finite points (N >= 1, D), got shape {x.shape}")
    k = max(1, min(int(k), len(x)))
    rng = np.random.default_rng(seed)
    best, best_inertia = None, np.inf
    for _ in range(inits):
        centres = _plus_plus(x, k, rng)
        for _ in range(iters):
            assign = _nearest(x, centres)
            moved = np.stack([x[assign == j].mean(0) if (assign == j).any() else centres[j] for j in range(k)])
            if np.allclose(moved, centres):
                break
            centres = moved
        assign = _nearest(x, centres)
        inertia = float(((x - centres[assign]) ** 2).sum())
        if inertia < best_inertia:
            used = np.unique(assign)
            best, best_inertia = np.stack([x[assign == j].mean(0) for j in used]), inertia
    return best.astype(np.float32)


def _nearest(x: np.ndarray, centres: np.ndarray) -> np.ndarray:
    d = (x**2).sum(1)[:, None] - 2 * x @ centres.T + (centres**2).sum(1)[None, :]
    return np.argmin(d, axis=1)


def _plus_plus(x: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    centres = [x[rng.integers(len(x))]]
    for _ in range(1, k):
        d = np.min(((x[:, None, :] - np.stack(centres)[None]) ** 2).sum(-1), axis=1)
        total = d.sum()
        centres.append(x[rng.choice(len(x), p=d / total)] if total > 0 else x[rng.integers(len(x))])
    return np.stack(centres)


def score(query: np.ndarray, key: np.ndarray, tau: float = 0.0) -> float:
    """Mean cosine over every (query centre, key centre) pair; with ``tau`` > 0 a pair whose
    cosine is at most ``tau`` counts 0 (the reference code's rectification)."""
    q, k = _unit(query), _unit(key)
    cos = q @ k.T
    if tau > 0:
        cos = np.where(cos > tau, cos, 0.0)
    return float(cos.mean())


def _unit(rows: np.ndarray) -> np.ndarray:
    rows = np.asarray(rows, dtype=np.float64)
    norm = np.linalg.norm(rows, axis=1, keepdims=True)
    return rows / np.maximum(norm, 1e-12)


def top_k(query: np.ndarray, keys: dict[tuple[str, int], np.ndarray], k: int, tau: float = 0.0):
    """The ``k`` best-scoring entries as [((client, task), score)], best first; ties go to the
    smaller (client, task).  Fewer than ``k`` entries: all of them."""
    scored = [(entry, score(query, key, tau)) for entry, key in keys.items()]
    scored.sort(key=lambda es: (-es[1], es[0]))
    return scored[: max(0, int(k))]
