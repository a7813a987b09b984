"""Tasks that arrive on the device as folders in a local data directory.

Layout (``data_dir`` in the client config)::

    data_dir/
      000-cats/train.npy          task 0: (N, D) samples, values in [0, 1] (binarised at 0.5)
      000-cats/train_labels.npy   optional (N,) integer class of each row of train.npy
      000-cats/test.npy           optional held-out samples; without it the last 10% of train
      000-cats/test_labels.npy    the class of each row of test.npy (needed when the task has labels)
      000-cats/classes.json       optional: the class names, ["cat", "lynx"]; label i names classes[i]
      001-dogs/train.npy          task 1, and so on: folder names in sorted order are the task order
      .002-birds/                 ignored while its name starts with "." (write, then rename)

A folder counts once its ``train.npy`` loads: a float or integer 2-D array with the
federation's input dimension and finite values in [0, 1]; ``.npy`` files are read with
``allow_pickle=False``.  Labels are optional: without ``train_labels.npy`` every row has label
0 (the density models do not use labels).  With it, each labels file is a 1-D integer array of
non-negative values, one per row of its samples file; ``test_labels.npy`` comes with
``test.npy`` (without ``test.npy`` the held-out rows keep their own labels, so shuffle the rows
of a task whose ``train.npy`` is sorted by class).  ``classes.json`` (only with labels) is a
JSON list of distinct names, 1-64 printable characters each, at most 1024, and every label
value must index it; without it a label's name is its number (``Dataset.label_names``).

A folder that is not valid stops the scan there (later folders wait), and its problem is
reported once, so a half-copied task never becomes a task.  The daemon rescans while it waits
for the data of the task the federation is on, and joins the next round once the folder is
there; a device on its own task clock rescans every round.
"""

from __future__ import annotations

import json
import logging
import os
import unicodedata
from pathlib import Path

import numpy as np

from fclcore.data import ClientTasks, Dataset

log = logging.getLogger(__name__)
HOLDOUT = 0.1  # share of train.npy held out when a task has no test.npy
MAX_CLASSES = 1024  # names in classes.json at most
MAX_CLASS_CHARS = 64
FILES = ("train.npy", "train_labels.npy", "test.npy", "test_labels.npy", "classes.json")


class TaskDirectory:
    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self._cache: dict[str, tuple[tuple, Dataset, Dataset]] = {}  # name -> (files' stamp, train, test)
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
        present = {f: folder / f for f in FILES if (folder / f).is_file()}
        stamp = tuple((f, p.stat().st_mtime_ns, p.stat().st_size) for f, p in present.items())
        cached = self._cache.get(name)
        if cached is not None and cached[0] == stamp:
            return cached[1], cached[2]
        labelled = "train_labels.npy" in present
        for extra in ("test_labels.npy", "classes.json"):
            if extra in present and not labelled:
                raise ValueError(f"{extra} without train_labels.npy")
        if "test_labels.npy" in present and "test.npy" not in present:
            raise ValueError("test_labels.npy without test.npy")
        if labelled and "test.npy" in present and "test_labels.npy" not in present:
            raise ValueError("test.npy without test_labels.npy (the task has labels)")
        classes = _classes(present["classes.json"]) if "classes.json" in present else None
        x = _samples(path, input_dim)
        y = _labels(present["train_labels.npy"], len(x), classes) if labelled else np.zeros(len(x), np.int64)
        if "test.npy" in present:
            test_x = _samples(present["test.npy"], x.shape[1])
            test_y = (
                _labels(present["test_labels.npy"], len(test_x), classes)
                if labelled
                else np.zeros(len(test_x), np.int64)
            )
        else:
            if len(x) < 2:
                raise ValueError("train.npy needs at least 2 rows when there is no test.npy")
            cut = len(x) - max(1, int(round(HOLDOUT * len(x))))
            x, test_x, y, test_y = x[:cut], x[cut:], y[:cut], y[cut:]  # rows and labels cut alike
        pair = (Dataset(x, y, classes), Dataset(test_x, test_y, classes))
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


def _labels(path: Path, rows: int, classes: tuple[str, ...] | None) -> np.ndarray:
    """A labels file: one non-negative integer per row, each naming one of ``classes`` if given."""
    try:
        y = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        raise ValueError(f"{path.name}: not a readable .npy array ({exc})") from None
    if y.dtype.kind not in "iu" or y.ndim != 1:
        raise ValueError(f"{path.name}: expected a 1-D integer array, got {y.dtype} {y.shape}")
    if len(y) != rows:
        raise ValueError(f"{path.name}: {len(y)} labels for {rows} rows")
    if y.dtype.kind == "i" and len(y) and y.min() < 0:
        raise ValueError(f"{path.name}: negative label {int(y.min())}")
    if classes is not None and len(y) and int(y.max()) >= len(classes):
        raise ValueError(f"{path.name}: label {int(y.max())} but classes.json names {len(classes)} classes")
    if len(y) and int(y.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"{path.name}: label {int(y.max())} does not fit int64")
    return y.astype(np.int64)


def _classes(path: Path) -> tuple[str, ...]:
    """classes.json: a list of distinct class names (NFC), 1-64 printable characters each."""
    try:
        names = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"classes.json: not readable JSON ({exc})"[:200]) from None
    if not isinstance(names, list) or not 1 <= len(names) <= MAX_CLASSES:
        raise ValueError(f"classes.json: expected a list of 1-{MAX_CLASSES} class names")
    out = []
    for value in names:
        name = unicodedata.normalize("NFC", value) if isinstance(value, str) else None
        if name is None or not 1 <= len(name) <= MAX_CLASS_CHARS or not name.isprintable():
            raise ValueError(
                f"classes.json: expected names of 1-{MAX_CLASS_CHARS} printable characters, got {value!r}"[:200]
            )
        out.append(name)
    if len(set(out)) != len(out):
        raise ValueError(f"classes.json: duplicate names {sorted({n for n in out if out.count(n) > 1})[:3]}")
    return tuple(out)
