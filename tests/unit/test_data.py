"""Tests for fclcore.data: IDX parsing, loaders, and the federated task/shard plan."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest

from fclcore.data import (
    ClientTasks,
    DataError,
    Dataset,
    client_task_split,
    default_mnist_dir,
    load_dataset,
    load_digits,
    load_mnist,
    random_client_tasks,
    read_idx,
    stratified_split,
)

_CODES = {
    np.dtype(np.uint8): 0x08,
    np.dtype(np.int8): 0x09,
    np.dtype(np.int16): 0x0B,
    np.dtype(np.int32): 0x0C,
    np.dtype(np.float32): 0x0D,
    np.dtype(np.float64): 0x0E,
}


def idx_bytes(arr: np.ndarray) -> bytes:
    header = struct.pack(">BBBB", 0, 0, _CODES[arr.dtype], arr.ndim)
    header += struct.pack(f">{arr.ndim}I", *arr.shape)
    return header + arr.astype(arr.dtype.newbyteorder(">")).tobytes()


def write_idx(path: Path, arr: np.ndarray) -> Path:
    data = idx_bytes(arr)
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
    return path


# ---------------------------------------------------------------- read_idx


@pytest.mark.parametrize("name", ["a.idx", "a.idx.gz"])
@pytest.mark.parametrize("shape", [(7,), (3, 4, 5)])
def test_read_idx_roundtrip_uint8(tmp_path, name, shape):
    arr = np.arange(np.prod(shape), dtype=np.uint8).reshape(shape)
    out = read_idx(write_idx(tmp_path / name, arr))
    assert out.dtype == np.uint8 and out.shape == shape
    np.testing.assert_array_equal(out, arr)


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.float32, np.float64])
def test_read_idx_other_types_big_endian(tmp_path, dtype):
    arr = (np.arange(12) - 5).astype(dtype).reshape(3, 4)
    out = read_idx(write_idx(tmp_path / "a.idx", arr))
    assert out.dtype == np.dtype(dtype) and out.dtype.isnative
    np.testing.assert_array_equal(out, arr)


def test_read_idx_rejects_bad_magic(tmp_path):
    data = bytearray(idx_bytes(np.zeros((2, 2), np.uint8)))
    data[0] = 0x01
    (tmp_path / "bad").write_bytes(bytes(data))
    with pytest.raises(DataError, match="magic"):
        read_idx(tmp_path / "bad")


def test_read_idx_rejects_unknown_type(tmp_path):
    data = bytearray(idx_bytes(np.zeros((2, 2), np.uint8)))
    data[2] = 0x07
    (tmp_path / "bad").write_bytes(bytes(data))
    with pytest.raises(DataError, match="type code"):
        read_idx(tmp_path / "bad")


@pytest.mark.parametrize("gz", [False, True])
def test_read_idx_rejects_truncated_body(tmp_path, gz):
    data = idx_bytes(np.zeros((4, 5), np.uint8))[:-3]
    p = tmp_path / ("t.gz" if gz else "t")
    p.write_bytes(gzip.compress(data) if gz else data)
    with pytest.raises(DataError, match="truncated") as exc:
        read_idx(p)
    assert str(p) in str(exc.value)


def test_read_idx_rejects_truncated_gzip_stream(tmp_path):
    comp = gzip.compress(idx_bytes(np.arange(100, dtype=np.uint8)))
    (tmp_path / "t.gz").write_bytes(comp[: len(comp) // 2])
    with pytest.raises(DataError):
        read_idx(tmp_path / "t.gz")


def test_read_idx_rejects_wrong_dims(tmp_path):
    data = bytearray(idx_bytes(np.zeros((4, 5), np.uint8)))
    data[4:8] = struct.pack(">I", 3)  # header claims 3x5 but body holds 4x5 -> size mismatch
    (tmp_path / "w").write_bytes(bytes(data))
    with pytest.raises(DataError, match="need 15"):
        read_idx(tmp_path / "w")
    (tmp_path / "h").write_bytes(b"\x00\x00\x08\x03\x00\x00")  # header shorter than its dims
    with pytest.raises(DataError):
        read_idx(tmp_path / "h")


def test_read_idx_missing_file(tmp_path):
    with pytest.raises(DataError, match="nope"):
        read_idx(tmp_path / "nope.gz")


# ---------------------------------------------------------------- MNIST


@pytest.fixture(scope="module")
def mnist():
    return load_mnist()


def test_default_mnist_dir_has_files():
    d = default_mnist_dir()
    for stem in (
        "train-images-idx3-ubyte",
        "train-labels-idx1-ubyte",
        "t10k-images-idx3-ubyte",
        "t10k-labels-idx1-ubyte",
    ):
        assert (d / f"{stem}.gz").is_file()


def test_load_mnist_packaged(mnist):
    train, test = mnist
    assert train.x.shape == (60000, 784) and test.x.shape == (10000, 784)
    assert train.x.dtype == np.float32 and train.y.dtype == np.int64
    assert set(np.unique(train.x)) == {0.0, 1.0}
    assert set(train.y.tolist()) == set(range(10)) == set(test.y.tolist())
    d = default_mnist_dir()
    raw = read_idx(d / "t10k-images-idx3-ubyte.gz")
    np.testing.assert_array_equal(test.x, (raw.reshape(10000, 784) > 127).astype(np.float32))
    np.testing.assert_array_equal(test.y, read_idx(d / "t10k-labels-idx1-ubyte.gz"))
    np.testing.assert_array_equal(train.y, read_idx(d / "train-labels-idx1-ubyte.gz"))


def _write_small_mnist(d: Path, plain_test: bool = False) -> dict:
    rng = np.random.default_rng(0)
    arrays = {}
    for prefix, n in (("train", 6), ("t10k", 4)):
        img = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        lbl = rng.integers(0, 10, size=n, dtype=np.uint8)
        ext = "" if (plain_test and prefix == "t10k") else ".gz"
        write_idx(d / f"{prefix}-images-idx3-ubyte{ext}", img)
        write_idx(d / f"{prefix}-labels-idx1-ubyte{ext}", lbl)
        arrays[prefix] = (img, lbl)
    return arrays


def test_load_mnist_user_path(tmp_path):
    arrays = _write_small_mnist(tmp_path, plain_test=True)
    train, test = load_mnist(tmp_path, threshold=200)
    for ds, (img, lbl) in ((train, arrays["train"]), (test, arrays["t10k"])):
        np.testing.assert_array_equal(ds.x, (img.reshape(len(img), -1) > 200).astype(np.float32))
        np.testing.assert_array_equal(ds.y, lbl.astype(np.int64))
    assert load_dataset("mnist", path=str(tmp_path))[0].x.shape == (6, 784)


def test_load_mnist_missing_file_names_path(tmp_path):
    _write_small_mnist(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DataError, match="t10k-labels-idx1-ubyte") as exc:
        load_mnist(tmp_path)
    assert str(tmp_path) in str(exc.value)
    with pytest.raises(DataError, match="not found"):
        load_mnist(tmp_path / "missing_dir")


def test_load_mnist_count_mismatch(tmp_path):
    _write_small_mnist(tmp_path)
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", np.zeros(5, np.uint8))
    with pytest.raises(DataError, match="train-images"):
        load_mnist(tmp_path)


# ---------------------------------------------------------------- digits


def test_load_digits_shapes_binary_deterministic():
    train, test = load_digits(seed=3)
    assert len(train) + len(test) == 1797 and train.x.shape[1] == 64
    assert abs(len(test) - 0.2 * 1797) <= 10
    assert set(np.unique(train.x)) <= {0.0, 1.0} and train.y.dtype == np.int64
    assert set(train.y.tolist()) == set(test.y.tolist()) == set(range(10))
    again = load_digits(seed=3)
    np.testing.assert_array_equal(train.x, again[0].x)
    np.testing.assert_array_equal(test.y, again[1].y)
    other = load_digits(seed=4)
    assert not np.array_equal(test.x, other[1].x)


def test_digits_split_disjoint_stratified_and_matches_loader():
    from sklearn.datasets import load_digits as sk

    y = sk().target
    tr, te = stratified_split(y, 0.2, seed=0)
    assert len(np.intersect1d(tr, te)) == 0 and len(tr) + len(te) == len(y)
    np.testing.assert_array_equal(np.sort(np.concatenate([tr, te])), np.arange(len(y)))
    for c in range(10):
        n = int((y == c).sum())
        assert int((y[te] == c).sum()) == round(n * 0.2)
    train, test = load_digits(seed=0)
    np.testing.assert_array_equal(train.y, y[tr])
    np.testing.assert_array_equal(test.x, (sk().data[te] > 7.0).astype(np.float32))


def test_load_dataset_names():
    assert load_dataset("digits", seed=1)[0].x.shape[1] == 64
    with pytest.raises(DataError, match="digits, mnist"):
        load_dataset("cifar")
    with pytest.raises(DataError, match="no path"):
        load_dataset("digits", path="/tmp")
    with pytest.raises(DataError):
        stratified_split(np.zeros(4, int), 1.0, 0)


# ---------------------------------------------------------------- client split


def indexed(y: np.ndarray) -> Dataset:
    """Dataset whose single feature is the row index, so shard identity is checkable."""
    return Dataset(np.arange(len(y), dtype=np.float32)[:, None], np.asarray(y, np.int64))


@pytest.fixture
def toy():
    rng = np.random.default_rng(1)
    return indexed(rng.integers(0, 6, size=601)), indexed(rng.integers(0, 6, size=200))


PLAN = [[[0, 1], [2, 3]], [[2, 0], [4]], [[5], [0, 3]]]  # class 0 used by all 3 clients


def rows(ds: Dataset) -> np.ndarray:
    return ds.x[:, 0].astype(int)


def test_client_split_partitions_each_class(toy):
    train, test = toy
    shards = [client_task_split(train, test, PLAN, ci, seed=5) for ci in range(3)]
    assert all(isinstance(s, ClientTasks) and len(s.train) == 2 for s in shards)
    users = {c: sorted({ci for ci, ts in enumerate(PLAN) for t in ts if c in t}) for c in range(6)}
    for c in range(6):
        per_client = [np.unique(np.concatenate([rows(d)[d.y == c] for d in shards[ci].train])) for ci in users[c]]
        got = np.concatenate(per_client)
        assert len(got) == len(np.unique(got)), f"class {c} rows shared between clients"
        np.testing.assert_array_equal(np.sort(got), np.flatnonzero(train.y == c))
        sizes = [len(p) for p in per_client]
        assert max(sizes) - min(sizes) <= 1
    all_rows = [np.unique(np.concatenate([rows(d) for d in s.train])) for s in shards]
    for a in range(3):
        for b in range(a + 1, 3):
            assert len(np.intersect1d(all_rows[a], all_rows[b])) == 0
    for s, tasks in zip(shards, PLAN):
        for d_tr, d_te, classes in zip(s.train, s.test, tasks):
            assert set(d_tr.y.tolist()) == set(classes)
            np.testing.assert_array_equal(rows(d_te), np.flatnonzero(np.isin(test.y, classes)))
            np.testing.assert_array_equal(train.y[rows(d_tr)], d_tr.y)


def test_client_split_repeated_class_gets_same_part(toy):
    train, test = toy
    plan = [[[0, 1], [0, 2]], [[0], [3]]]  # client 0 lists class 0 twice, client 1 once
    s = client_task_split(train, test, plan, 0, seed=5)
    np.testing.assert_array_equal(rows(s.train[0])[s.train[0].y == 0], rows(s.train[1])[s.train[1].y == 0])
    n0 = int((train.y == 0).sum())
    assert abs(int((s.train[0].y == 0).sum()) - n0 / 2) <= 0.5


def test_client_split_deterministic_and_seeded(toy):
    train, test = toy
    a = client_task_split(train, test, PLAN, 1, seed=5)
    b = client_task_split(train, test, PLAN, 1, seed=5)
    c = client_task_split(train, test, PLAN, 1, seed=6)
    for x, y in zip(a.train, b.train):
        np.testing.assert_array_equal(rows(x), rows(y))
    assert any(not np.array_equal(rows(x), rows(y)) for x, y in zip(a.train, c.train))


def test_client_split_errors(toy):
    train, test = toy
    with pytest.raises(DataError, match="class 9"):
        client_task_split(train, test, [[[0, 9]]], 0, seed=0)
    with pytest.raises(DataError, match="client_index 3"):
        client_task_split(train, test, PLAN, 3, seed=0)
    with pytest.raises(DataError, match="client_index -1"):
        client_task_split(train, test, PLAN, -1, seed=0)
    with pytest.raises(DataError, match="task 1"):
        client_task_split(train, test, [[[0], []]], 0, seed=0)
    with pytest.raises(DataError, match="no tasks"):
        client_task_split(train, test, [[[0]], []], 0, seed=0)
    with pytest.raises(DataError):
        Dataset(np.zeros((3, 2), np.float32), np.zeros(2, np.int64))


def test_client_split_on_digits_plan():
    train, test = load_digits()
    plan = random_client_tasks(4, 5, range(10), 2, seed=0)
    tasks = [client_task_split(train, test, plan, ci, seed=0) for ci in range(4)]
    assert all(len(t.train) == 5 and all(len(d) > 0 for d in t.train) for t in tasks)


# ---------------------------------------------------------------- random_client_tasks


def test_random_client_tasks():
    plan = random_client_tasks(5, 3, range(10), 2, seed=7)
    assert plan == random_client_tasks(5, 3, range(10), 2, seed=7)
    assert len(plan) == 5 and all(len(c) == 3 and all(len(t) == 2 for t in c) for c in plan)
    for client in plan:
        flat = [c for t in client for c in t]
        assert len(set(flat)) == len(flat) and set(flat) <= set(range(10))
        assert all(isinstance(c, int) for c in flat)
    assert len({str(c) for c in plan}) > 1
    assert random_client_tasks(3, 3, range(10), 2, seed=7) == plan[:3]  # independent of client count
    assert plan != random_client_tasks(5, 3, range(10), 2, seed=8)
    with pytest.raises(DataError, match="exceeds"):
        random_client_tasks(2, 6, range(10), 2, seed=0)
    with pytest.raises(DataError):
        random_client_tasks(2, 2, [1, 1, 2, 3], 1, seed=0)
