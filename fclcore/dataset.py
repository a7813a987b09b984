"""The basic data types every loader shares: a labelled ``Dataset``, ``DataError`` and a
seeded stratified split (numpy only).  ``fclcore.data`` (images, task streams) and
``fclcore.text`` (text corpora) both build on this module."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fclcore.errors import BadInput

__all__ = ["DataError", "Dataset", "stratified_split"]


class DataError(BadInput):
    """Bad data file, path or argument; the message names the culprit."""


@dataclass(frozen=True, eq=False)  # eq=False: element-wise array == is not a bool
class Dataset:
    """Samples ``x`` (N, D) and int64 labels ``y``: float32 pixels binarised by the image
    loaders, or int64 token ids (padding id 0) for text.  ``classes``: the name of each label
    value (``y`` indexes it), when the data names its classes (a task folder's classes.json);
    None: a label's name is its number."""

    x: np.ndarray
    y: np.ndarray
    classes: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.x.ndim != 2 or self.y.ndim != 1 or len(self.x) != len(self.y):
            raise DataError(f"Dataset needs x (N, D) and y (N,), got {self.x.shape} and {self.y.shape}")

    def __len__(self) -> int:
        return len(self.y)

    def label_names(self) -> np.ndarray:
        """The class name of every row (strings)."""
        if self.classes is None:
            return np.array([str(int(v)) for v in self.y], dtype=object)
        return np.array(self.classes, dtype=object)[self.y]


def stratified_split(y: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted (train_idx, test_idx): per class, a seeded shuffle puts round(n*fraction) rows in test.

    Own numpy implementation so the split cannot change with scikit-learn versions.
    Every class keeps at least one row on each side (classes need >= 2 rows).
    """
    if not 0.0 < test_fraction < 1.0:
        raise DataError(f"test_fraction must be in (0, 1), got {test_fraction}")
    rng = np.random.default_rng(seed)
    train, test = [], []
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))
        if len(idx) < 2:
            raise DataError(f"class {c} has {len(idx)} sample(s); a stratified split needs >= 2")
        n_test = min(max(int(round(len(idx) * test_fraction)), 1), len(idx) - 1)
        test.append(idx[:n_test])
        train.append(idx[n_test:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))
