"""Domain-incremental task streams (``tasks.domains``, FIL-VER's rotated / permuted MNIST):
image transforms, the per-client split, grayscale loading, and the simulate plan."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from edge_client.data import load_client_data
from fcl_edge.simulate import plan, write_configs
from fclcore.config import ConfigError, load_config
from fclcore.data import (
    DataError,
    Dataset,
    domain_task_split,
    load_dataset,
    load_mnist,
    permute_images,
    rotate_images,
)
from fclcore.schema import ClientConfig, ClientDataSpec, DomainTasks, TasksSpec

SIDE = 5  # odd: the centre pixel maps onto itself exactly at any angle
CENTRE = (SIDE * SIDE) // 2


def blob(side: int = 28, row: float = 13.5, col: float = 13.5, sr: float = 2.0, sc: float = 4.0) -> np.ndarray:
    """One flattened image: an elongated Gaussian blob (so rotations are visible)."""
    r, c = np.mgrid[0:side, 0:side]
    return np.exp(-(((r - row) / sr) ** 2 + ((c - col) / sc) ** 2) / 2).astype(np.float32).reshape(1, -1)


def centroid(x: np.ndarray, side: int = 28) -> tuple[float, float]:
    img = x.reshape(side, side)
    r, c = np.mgrid[0:side, 0:side]
    return float((img * r).sum() / img.sum()), float((img * c).sum() / img.sum())


# ------------------------------------------------------------------------ rotate_images


def test_rotate_zero_is_an_equal_copy():
    x = np.random.default_rng(0).random((6, 28 * 28)).astype(np.float32)
    out = rotate_images(x, 0)
    assert out.dtype == np.float32 and out.shape == x.shape and out is not x
    np.testing.assert_array_equal(out, x)


@pytest.mark.parametrize("side", [7, 28])
@pytest.mark.parametrize("degrees,k", [(90, 1), (180, 2), (270, 3), (-90, -1), (360, 0)])
def test_rotate_right_angles_equal_rot90(side, degrees, k):
    x = np.random.default_rng(side).random((4, side * side)).astype(np.float32)
    expected = np.rot90(x.reshape(-1, side, side), k, axes=(1, 2)).reshape(len(x), -1)
    np.testing.assert_allclose(rotate_images(x, degrees), expected, atol=1e-6)


def test_rotate_is_counter_clockwise_as_displayed():
    right_of_centre = blob(row=13.5, col=22.0, sr=1.5, sc=1.5)  # row 0 is the top
    r, c = centroid(rotate_images(right_of_centre, 90))
    assert r == pytest.approx(13.5 - 8.5, abs=0.05) and c == pytest.approx(13.5, abs=0.05)  # now above


def test_rotated_centre_blob_stays_centred_and_keeps_its_mass():
    x = blob()
    for degrees in (10, 20, 37, 60):
        out = rotate_images(x, degrees)
        r, c = centroid(out)
        assert r == pytest.approx(13.5, abs=0.05) and c == pytest.approx(13.5, abs=0.05)
        assert out.sum() == pytest.approx(x.sum(), rel=0.02)
    assert not np.allclose(rotate_images(x, 20), x, atol=0.05)  # it did move


def test_rotate_small_angle_roughly_keeps_a_digits_ink():
    x = np.zeros((1, 28 * 28), np.float32)
    x[0, [28 * r + c for r in range(8, 20) for c in range(12, 16)]] = 1.0  # a vertical bar
    out = rotate_images(x, 15)
    assert out.sum() == pytest.approx(x.sum(), rel=0.05) and 0 <= out.min() and out.max() <= 1 + 1e-6


def test_rotate_rejects_non_square_images():
    with pytest.raises(DataError, match="not a square image"):
        rotate_images(np.zeros((2, 10), np.float32), 20)
    with pytest.raises(DataError, match="flattened square images"):
        rotate_images(np.zeros((2, 5, 5), np.float32), 20)


# ----------------------------------------------------------------------- permute_images


def test_permute_task_zero_is_identity_and_others_permute_pixels():
    x = np.random.default_rng(1).random((3, 49)).astype(np.float32)
    np.testing.assert_array_equal(permute_images(x, seed=5, task=0), x)
    outs = [permute_images(x, seed=5, task=t) for t in (1, 2)]
    for t, out in zip((1, 2), outs):
        perm = np.random.default_rng((5, 7, t)).permutation(49)
        np.testing.assert_array_equal(out, x[:, perm])
        np.testing.assert_array_equal(np.sort(out, axis=1), np.sort(x, axis=1))  # the same pixel values
        assert not np.array_equal(out, x)
    assert not np.array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(permute_images(x, seed=5, task=1), outs[0])  # deterministic
    with pytest.raises(DataError, match="seed"):
        permute_images(x, seed=-1, task=1)


# -------------------------------------------------------------------- domain_task_split


@pytest.fixture(scope="module")
def indexed() -> tuple[Dataset, Dataset]:
    """10 classes of SIDExSIDE images whose every pixel is the row index (test rows offset by
    1000): the centre pixel survives any rotation exactly, so used rows can be recovered."""

    def make(n: int, offset: int) -> Dataset:
        ids = np.arange(n, dtype=np.float32) + offset
        y = np.random.default_rng(n).permutation(np.arange(n) % 10).astype(np.int64)
        return Dataset(np.repeat(ids[:, None], SIDE * SIDE, axis=1), y)

    return make(400, 0), make(120, 1000)


def ids(ds: Dataset) -> np.ndarray:
    return ds.x[:, CENTRE].astype(np.int64)


@pytest.mark.parametrize("transform", ["rotate", "permute"])
def test_split_partitions_rows_across_tasks_and_clients(indexed, transform):
    train, test = indexed
    domains = DomainTasks(tasks=4, transform=transform, step_deg=20.0)
    shards = [domain_task_split(train, test, domains, i, 3, seed=2, per_class=3, test_per_class=2) for i in range(3)]
    used = []
    for shard in shards:
        assert len(shard.train) == len(shard.test) == 4
        for t, ds in enumerate(shard.train):
            rows = ids(ds)
            assert len(ds) == 3 * 10 and np.bincount(ds.y).tolist() == [3] * 10
            np.testing.assert_array_equal(ds.y, train.y[rows])  # labels kept: one shared head
            if t == 0:  # task 0 is untransformed
                np.testing.assert_array_equal(ds.x, train.x[rows])
            used.append(rows)
    all_rows = np.concatenate(used)
    assert len(all_rows) == len(np.unique(all_rows)) == 3 * 4 * 30  # disjoint across tasks and clients
    tests = [ids(ds) - 1000 for ds in shards[0].test]
    assert [len(r) for r in tests] == [20] * 4
    assert len(np.unique(np.concatenate(tests))) == 80  # disjoint across tasks
    for shard in shards[1:]:  # the same test sets on every client
        for a, b in zip(shard.test, shards[0].test):
            np.testing.assert_array_equal(a.x, b.x)
            np.testing.assert_array_equal(a.y, b.y)
    for t, ds in enumerate(shards[0].test):
        np.testing.assert_array_equal(ds.y, test.y[tests[t]])


def test_split_follows_the_documented_recipe(indexed):
    train, test = indexed
    domains = DomainTasks(tasks=2, step_deg=30.0, classes=[3, 7])
    shard = domain_task_split(train, test, domains, client_index=1, num_clients=2, seed=9)
    for t in range(2):
        rows, te_rows = [], []
        for c in (3, 7):
            part = np.array_split(np.random.default_rng((9, c)).permutation(np.flatnonzero(train.y == c)), 2)[t]
            rows.append(np.array_split(part, 2)[1])
            te = np.random.default_rng((9, 11, c)).permutation(np.flatnonzero(test.y == c))
            te_rows.append(np.array_split(te, 2)[t])
        rows, te_rows = np.sort(np.concatenate(rows)), np.sort(np.concatenate(te_rows))
        np.testing.assert_array_equal(ids(shard.train[t]), rows)
        np.testing.assert_array_equal(shard.train[t].x, rotate_images(train.x[rows], 30.0 * t))
        np.testing.assert_array_equal(shard.test[t].x, rotate_images(test.x[te_rows], 30.0 * t))


def test_split_is_deterministic_for_a_seed(indexed):
    train, test = indexed
    domains = DomainTasks(tasks=4)
    a, b = (domain_task_split(train, test, domains, 0, 2, seed=4, per_class=2) for _ in range(2))
    other = domain_task_split(train, test, domains, 0, 2, seed=5, per_class=2)
    for x, y in zip(a.train + a.test, b.train + b.test):
        np.testing.assert_array_equal(x.x, y.x)
    assert not np.array_equal(ids(a.train[0]), ids(other.train[0]))


def test_split_rotates_each_task_by_its_angle():
    train = Dataset(np.repeat(blob(sr=1.5, sc=5.0), 20, axis=0), np.arange(20, dtype=np.int64) % 2)
    shard = domain_task_split(train, train, DomainTasks(tasks=4, classes=[0, 1]), 0, 1, seed=0, per_class=1)
    for t, ds in enumerate(shard.train):
        np.testing.assert_allclose(ds.x, rotate_images(train.x[:2], 20.0 * t), atol=1e-6)
    assert not np.allclose(shard.train[1].x, shard.train[0].x, atol=0.05)


@pytest.mark.parametrize(
    "domains,index,clients,match",
    [
        (DomainTasks(tasks=2, classes=[0, 11]), 0, 2, "class 11 has 0 train"),
        (DomainTasks(tasks=2), 2, 2, "client_index 2 out of range for 2 clients"),
        (DomainTasks(tasks=2), -1, 2, "client_index -1 out of range"),
        (DomainTasks(tasks=2), 0, 0, "num_clients must be >= 1"),
        (DomainTasks(tasks=20), 0, 3, "need >= 60 train"),
        (DomainTasks(tasks=13), 0, 1, "need >= 13 train and >= 13 test rows"),
    ],
)
def test_split_errors(indexed, domains, index, clients, match):
    train, test = indexed
    with pytest.raises(DataError, match=match):
        domain_task_split(train, test, domains, index, clients, seed=0)


def test_split_rejects_non_square_images_for_rotation():
    ds = Dataset(np.zeros((20, 10), np.float32), np.arange(20, dtype=np.int64) % 2)
    with pytest.raises(DataError, match="not a square image"):
        domain_task_split(ds, ds, DomainTasks(tasks=2, classes=[0, 1]), 0, 1, seed=0)
    assert len(domain_task_split(ds, ds, DomainTasks(tasks=2, transform="permute", classes=[0, 1]), 0, 1, 0).train)


# --------------------------------------------------------------------------- grayscale


def test_mnist_grayscale_in_unit_range():
    train, test = load_mnist(threshold=None)
    assert train.x.shape == (60000, 784) and test.x.shape == (10000, 784)
    for ds in (train, test):
        assert ds.x.dtype == np.float32 and ds.x.min() == 0.0 and ds.x.max() == 1.0
    inner = (test.x > 0) & (test.x < 1)
    assert inner.mean() > 0.02  # grayscale, not binary
    _, binary = load_dataset("mnist")
    np.testing.assert_array_equal(binary.x, (np.round(test.x * 255) > 127).astype(np.float32))


def test_digits_grayscale_and_gray_only_for_images():
    (gray, _), (binary, _) = load_dataset("digits", gray=True), load_dataset("digits")
    assert gray.x.min() == 0.0 and gray.x.max() == 1.0 and ((gray.x > 0) & (gray.x < 1)).any()
    np.testing.assert_array_equal(binary.x, (gray.x * 16 > 7).astype(np.float32))
    with pytest.raises(DataError, match="only the image datasets"):
        load_dataset("bbc", gray=True)


# -------------------------------------------------------------------------- schema


def test_domain_tasks_schema():
    d = DomainTasks(tasks=4)
    assert (d.transform, d.step_deg, d.classes) == ("rotate", 20.0, list(range(10)))
    assert TasksSpec(domains=d).domains is d
    with pytest.raises(ValueError, match="exactly one of .*, pool, domains, incremental; got .'shared', 'domains'"):
        TasksSpec(shared=[[0]], domains=d)
    for bad, match in [
        ({"tasks": 0}, "domains.tasks: expected an int >= 1"),
        ({"tasks": 2, "transform": "flip"}, "domains.transform"),
        ({"tasks": 2, "step_deg": float("nan")}, "finite angle"),
        ({"tasks": 2, "classes": [1, 1]}, "distinct classes"),
        ({"tasks": 2, "classes": []}, "distinct classes"),
        ({"tasks": 2, "classes": [-1]}, "non-negative int labels"),
    ]:
        with pytest.raises(ValueError, match=match):
            DomainTasks(**bad)
    with pytest.raises(ValueError, match="domains, pool_ids"):
        ClientDataSpec(domains=d, pool_tasks=[[0]], pool_ids=[0])


# ---------------------------------------------------------------------------- plan


def scenario(tmp_path: Path, tasks: dict | None = None, clients: int = 3, **data) -> Path:
    repo = Path(__file__).resolve().parents[2]
    raw = yaml.safe_load((repo / "configs" / "scenarios" / "quickstart.yaml").read_text())
    raw["federation"].update(name="domains", rounds_per_task=2)
    raw["clients"] = clients
    raw["tasks"] = {"domains": tasks or {"tasks": 4}}
    raw["data"] = {"dataset": "mnist", "per_class": 10, "test_per_class": 5, **data}
    path = tmp_path / "domains.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return path


def test_plan_of_rotated_mnist(tmp_path):
    p = plan(str(scenario(tmp_path)))
    assert p.scenario.federation.num_tasks == 4 and p.input_dim == 784
    assert p.client_tasks == [[list(range(10))] * 4] * 3
    assert p.scenario.tasks.domains == DomainTasks(tasks=4)
    configs = write_configs(p, tmp_path, "mqtt://127.0.0.1:1")
    for index, cid in enumerate(p.client_ids):
        cfg = load_config(ClientConfig, configs[cid][1])
        assert cfg.data.domains == DomainTasks(tasks=4) and cfg.data.client_index == index
        assert cfg.data.dataset == "mnist" and cfg.data.per_class == 10


def test_device_computes_the_plans_domain_data(tmp_path):
    tasks = {"tasks": 3, "transform": "permute", "classes": [0, 1, 2, 3]}
    p = plan(str(scenario(tmp_path, tasks, clients=2, dataset="digits", split_seed=6)))
    assert p.client_tasks == [[[0, 1, 2, 3]] * 3] * 2 and p.input_dim == 64
    configs = write_configs(p, tmp_path, "mqtt://127.0.0.1:1")
    train, test = load_dataset("digits", seed=6, gray=True)
    for index, cid in enumerate(p.client_ids):
        cfg = load_config(ClientConfig, configs[cid][1])
        got = load_client_data(cfg)
        expected = domain_task_split(train, test, cfg.data.domains, index, 2, 6, per_class=10, test_per_class=5)
        for a, b in zip(got.train + got.test, expected.train + expected.test):
            np.testing.assert_array_equal(a.x, b.x)
            np.testing.assert_array_equal(a.y, b.y)
        assert ((got.train[0].x > 0) & (got.train[0].x < 1)).any()  # grayscale on the device too


@pytest.mark.parametrize(
    "data,match",
    [
        ({"dataset": "bbc"}, "tasks.domains: expected data.dataset mnist or digits"),
        ({"dataset": "digits", "class_fraction": 0.5}, "data.class_fraction 1"),
    ],
)
def test_plan_rejects_bad_domain_combinations(tmp_path, data, match):
    with pytest.raises(ConfigError, match=match):
        plan(str(scenario(tmp_path, **data)))


def test_plan_rejects_a_domain_split_the_data_cannot_fill(tmp_path):
    with pytest.raises(ConfigError, match="data: class 11 has 0 train"):
        plan(str(scenario(tmp_path, {"tasks": 2, "classes": [0, 11]}, dataset="digits")))
