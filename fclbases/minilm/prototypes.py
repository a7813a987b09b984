"""The Enhancer Select Module: nearest class prototype -> class -> the group that owns it.

The paper uses a frozen pre-trained classifier (text-RCNN for NLP).  Here the classifier is
the frozen backbone itself: a class prototype is the mean of the L2-normalised, mean-pooled
backbone embeddings of that class's training texts, pooled over all clients (each uploads
per-class sums and counts once per task, the server adds them up), and an input goes to the
class whose prototype has the highest cosine similarity.  It costs one frozen forward per
input (the same embedding also serves the sample memory), needs no training, and every
device routes identically because the prototypes are global.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

__all__ = ["normalize_rows", "class_sums", "PrototypeSelector"]


def normalize_rows(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def class_sums(embeddings: np.ndarray, labels: np.ndarray) -> dict[int, tuple[np.ndarray, int]]:
    """Per class: (sum of normalised embeddings (D,), count) -- what a client uploads."""
    unit = normalize_rows(embeddings.astype(np.float64))
    return {int(c): (unit[labels == c].sum(0).astype(np.float32), int((labels == c).sum())) for c in np.unique(labels)}


class PrototypeSelector:
    def __init__(self) -> None:
        self.classes = np.zeros(0, dtype=np.int64)
        self.prototypes = np.zeros((0, 0), dtype=np.float32)  # (K, D) unit rows
        self.group_of: dict[int, int] = {}

    def update(self, prototypes: Mapping[int, np.ndarray], group_of: Mapping[int, int]) -> None:
        """Install global prototypes (any scale; normalised here) and the class -> group map."""
        missing = sorted(set(prototypes) - set(group_of))
        if missing:
            raise ValueError(f"classes {missing} have a prototype but no group")
        self.classes = np.array(sorted(prototypes), dtype=np.int64)
        self.prototypes = normalize_rows(np.stack([np.asarray(prototypes[c], np.float32) for c in self.classes]))
        self.group_of = {int(c): int(g) for c, g in group_of.items()}

    def nearest_class(self, embeddings: np.ndarray) -> np.ndarray:
        """(N, D) frozen embeddings -> (N,) class ids of the most similar prototype."""
        if len(self.classes) == 0:
            raise ValueError("the selector has no prototypes yet")
        return self.classes[np.argmax(normalize_rows(embeddings) @ self.prototypes.T, axis=1)]

    def route(self, embeddings: np.ndarray) -> np.ndarray:
        """(N, D) -> (N,) group index for each input."""
        return np.array([self.group_of[int(c)] for c in self.nearest_class(embeddings)], dtype=np.int64)
