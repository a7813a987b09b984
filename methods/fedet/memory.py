"""The Sample Memory Module: a few typical texts per seen class, bounded per client.

Bound (paper section 2 and 4.1.2): at most ``gamma`` times the number of examples observed
so far (store ratio), optionally capped by ``max_items`` (the device's storage), shared
equally among the classes seen so far (|S| / |M^A| each; the remainder goes to the classes
with the lowest ids).  "Typical" = closest in cosine to the class mean of the frozen
embeddings, so the kept exemplars are the ones nearest the selector's prototype.
"""

from __future__ import annotations

import math

import numpy as np

from fclbases.minilm.prototypes import normalize_rows
from fclcore.text import EncodedDocs

__all__ = ["SampleMemory"]


class SampleMemory:
    def __init__(self, gamma: float, max_items: int | None = None) -> None:
        if not 0.0 < gamma <= 1.0:
            raise ValueError(f"store ratio gamma must be in (0, 1], got {gamma}")
        if max_items is not None and max_items < 0:
            raise ValueError(f"max_items must be >= 0, got {max_items}")
        self.gamma, self.max_items = gamma, max_items
        self.observed = 0
        self._by_class: dict[int, EncodedDocs] = {}  # rows in "most typical first" order

    @property
    def bound(self) -> int:
        cap = math.floor(self.gamma * self.observed + 1e-9)
        return cap if self.max_items is None else min(cap, self.max_items)

    def __len__(self) -> int:
        return sum(len(d) for d in self._by_class.values())

    @property
    def classes(self) -> tuple[int, ...]:
        return tuple(sorted(self._by_class))

    def add(self, docs: EncodedDocs, embeddings: np.ndarray) -> None:
        """Observe a task's local data; keep its most typical rows per class, then rebalance."""
        if len(docs) != len(embeddings):
            raise ValueError(f"{len(docs)} docs but {len(embeddings)} embeddings")
        self.observed += len(docs)
        unit = normalize_rows(embeddings.astype(np.float64))
        for c in np.unique(docs.labels):
            rows = np.flatnonzero(docs.labels == c)
            score = unit[rows] @ normalize_rows(unit[rows].mean(0, keepdims=True))[0]
            self._by_class[int(c)] = docs.subset(rows[np.argsort(-score, kind="stable")])
        self._rebalance()

    def _rebalance(self) -> None:
        classes = self.classes
        if not classes:
            return
        base, extra = divmod(self.bound, len(classes))
        for i, c in enumerate(classes):
            keep = base + (1 if i < extra else 0)
            self._by_class[c] = self._by_class[c].subset(np.arange(min(keep, len(self._by_class[c]))))

    def docs(self, classes: tuple[int, ...] | None = None) -> EncodedDocs | None:
        """The stored rows of ``classes`` (all by default); None when there are none."""
        wanted = [c for c in self.classes if classes is None or c in classes]
        parts = [self._by_class[c] for c in wanted if len(self._by_class[c])]
        return EncodedDocs.concat(parts) if parts else None
