"""Tasks that arrive on the device as folders in a local data directory.

Layout (``data_dir`` in the client config)::

    data_dir/
      000-cats/train.npy     task 0: (N, D) samples, values in [0, 1] (binarised at 0.5)
      000-cats/test.npy      optional held-out samples; without it the last 10% of train
      001-dogs/train.npy     task 1, and so on: folder names in sorted order are the task order
      .002-birds/            ignored while its name starts with "." (write, then rename)

A folder counts once its ``train.npy`` loads: a float or integer 2-D array with the
federation's input dimension and finite values in [0, 1]; ``.npy`` files are read with
``allow_pickle=False``.  A folder that is not valid stops the scan there (later folders
wait), and its problem is reported once, so a half-copied task never becomes a task.  The
daemon rescans while it waits for the data of the task the federation is on, and joins the
next round once the folder is there.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np

from fclcore.data import ClientTasks, Dataset

log = logging.getLogger(__name__)
HOLDOUT = 0.1  # share of train.npy held out when a task has no test.npy


class TaskDirectory:
    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self._cache: dict[str, tuple[float, Dataset, Dataset]] = {}  # name -> (mtime, train, test)
        self._reported: dict[str, str] = {}

    def scan(self, input_dim: int | None) -> ClientTasks:
        """The valid task folders in order, up to the first one that is not (yet) valid."""
        train, test = [], []
        names = (
            sorted(p.name for p in self.root.iterdir() if p.is_dir() and not p.name.startswith("."))
            if self.root.is_dir()
            else []
        )
        for name in names:
            try:
                pair = self._load(name, input_dim)
            except ValueError as exc:
                if self._reported.get(name) != str(exc):
                    log.warning("task folder %s is not usable yet: %s", self.root / name, exc)
                    self._reported[name] = str(exc)
                break
            input_dim = input_dim or pair[0].x.shape[1]
            train.append(pair[0])
            test.append(pair[1])
        return ClientTasks(tuple(train), tuple(test))

    def _load(self, name: str, input_dim: int | None) -> tuple[Dataset, Dataset]:
        folder = self.root / name
        path = folder / "train.npy"
        if not path.is_file():
            raise ValueError("no train.npy")
        stamp = max(p.stat().st_mtime for p in folder.glob("*.npy"))
        cached = self._cache.get(name)
        if cached is not None and cached[0] == stamp:
            return cached[1], cached[2]
        x = _samples(path, input_dim)
        test_path = folder / "test.npy"
        if test_path.is_file():
            test_x = _samples(test_path, x.shape[1])
        else:
            if len(x) < 2:
                raise ValueError("train.npy needs at least 2 rows when there is no test.npy")
            cut = len(x) - max(1, int(round(HOLDOUT * len(x))))
            x, test_x = x[:cut], x[cut:]
        pair = (_dataset(x), _dataset(test_x))
        self._cache[name] = (stamp, *pair)
        return pair


def _samples(path: Path, input_dim: int | None) -> np.ndarray:
    try:
        x = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        raise ValueError(f"{path.name}: not a readable .npy array ({exc})") from None
    if x.dtype.kind not in "fiub" or x.ndim != 2 or len(x) == 0:
        raise ValueError(f"{path.name}: expected a non-empty 2-D numeric array, got {x.dtype} {x.shape}")
    if input_dim is not None and x.shape[1] != input_dim:
        raise ValueError(f"{path.name}: expected {input_dim} columns (the model's input), got {x.shape[1]}")
    x = x.astype(np.float32)
    if not np.isfinite(x).all() or x.min() < 0 or x.max() > 1:
        raise ValueError(f"{path.name}: expected finite values in [0, 1]")
    return (x > 0.5).astype(np.float32)


def _dataset(x: np.ndarray) -> Dataset:
    return Dataset(x, np.zeros(len(x), np.int64))  # labels are not used by the density model
