"""FedSeIT's task protocol (``tasks.pool``): a pool of label sets whose documents are split
disjointly among the pool tasks, each client taking ``per_client`` of them by the seed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from edge_client.data import load_client_data
from fcl_edge.simulate import plan, write_configs
from fclcore.config import ConfigError, load_config
from fclcore.data import DataError, Dataset, client_task_split, load_dataset, pool_task_split
from fclcore.schema import ClientConfig, PoolTasks, TasksSpec

# 12 tasks of 3 digits; [0, 1, 2] and [3, 4, 5] repeat (their documents do not)
POOL = [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 0, 1], [2, 3, 4], [5, 6, 7]]
POOL += [[8, 9, 0], [1, 2, 3], [0, 1, 2], [4, 5, 6], [7, 8, 9], [3, 4, 5]]


@pytest.fixture(scope="module")
def digits() -> tuple[Dataset, Dataset]:
    """Digits labels with the row index as the only feature, so documents are identifiable."""
    train, test = load_dataset("digits", seed=0)
    return indexed(train.y), indexed(test.y)


def indexed(y: np.ndarray) -> Dataset:
    return Dataset(np.arange(len(y), dtype=np.float32)[:, None], np.asarray(y, np.int64))


def rows(ds: Dataset) -> np.ndarray:
    return ds.x[:, 0].astype(int)


def scenario(tmp_path: Path, clients: int = 4, per_client: int = 3, **data) -> Path:
    raw = {
        "federation": {"name": "pool", "method": "fedavg", "seed": 3, "rounds_per_task": 2},
        "clients": clients,
        "tasks": {"pool": {"tasks": POOL, "per_client": per_client}},
        "data": {"dataset": "digits", **data},
    }
    path = tmp_path / "pool.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return path


def same_data(a, b) -> None:
    assert len(a.train) == len(b.train) and len(a.test) == len(b.test)
    for x, y in zip(a.train + a.test, b.train + b.test):
        np.testing.assert_array_equal(x.x, y.x)
        np.testing.assert_array_equal(x.y, y.y)


# ------------------------------------------------------------------ pool_task_split


def test_parts_partition_each_label_across_the_pool(digits):
    train, test = digits
    whole = pool_task_split(train, test, POOL, range(len(POOL)), seed=5)
    for c in range(10):
        parts = [rows(d)[d.y == c] for d, task in zip(whole.train, POOL) if c in task]
        assert len(parts) == sum(c in task for task in POOL)
        got = np.concatenate(parts)
        assert len(got) == len(np.unique(got)), f"label {c}: a document in two pool tasks"
        np.testing.assert_array_equal(np.sort(got), np.flatnonzero(train.y == c))
        sizes = [len(p) for p in parts]
        assert max(sizes) - min(sizes) <= 1, sizes
        # part j of the seeded shuffle goes to the j-th pool task holding the label
        shuffled = np.random.default_rng((5, c)).permutation(np.flatnonzero(train.y == c))
        for part, expected in zip(parts, np.array_split(shuffled, len(parts))):
            np.testing.assert_array_equal(part, np.sort(expected))


def test_client_tasks_follow_pool_ids(digits):
    train, test = digits
    whole = pool_task_split(train, test, POOL, range(len(POOL)), seed=5)
    ids = [7, 2, 10]
    own = pool_task_split(train, test, POOL, ids, seed=5)
    assert len(own.train) == len(own.test) == 3
    for t, pid in enumerate(ids):
        assert set(own.train[t].y.tolist()) == set(POOL[pid])
        np.testing.assert_array_equal(rows(own.train[t]), rows(whole.train[pid]))  # a task's data: its pool id alone
        np.testing.assert_array_equal(rows(own.test[t]), np.flatnonzero(np.isin(test.y, POOL[pid])))
        np.testing.assert_array_equal(train.y[rows(own.train[t])], own.train[t].y)


def test_per_class_caps_each_task_label_part(digits):
    train, test = digits
    full = pool_task_split(train, test, POOL, [0, 8], seed=5)
    capped = pool_task_split(train, test, POOL, [0, 8], seed=5, per_class=4, test_per_class=6)
    for f, c in zip(full.train, capped.train):
        for label in np.unique(f.y):
            kept = rows(c)[c.y == label]
            assert len(kept) == 4 and set(kept) <= set(rows(f)[f.y == label])
    reference = client_task_split(train, test, [[POOL[0], POOL[8]]], 0, seed=5, test_per_class=6)
    for c, ref in zip(capped.test, reference.test):  # the same seeded test choice as client_task_split
        np.testing.assert_array_equal(rows(c), rows(ref))
        assert np.bincount(c.y).max() == 6


@pytest.mark.parametrize(
    "pool,ids,match",
    [
        (POOL, [0, 12], r"ids in \[0, 12\)"),
        (POOL, [-1], r"ids in \[0, 12\)"),
        (POOL, [], r"ids in \[0, 12\)"),
        (POOL, [3, 5, 3], "distinct pool tasks"),
        ([], [0], "at least one pool task"),
        ([[0, 11]], [0], "label 11"),
        ([[0, 0]], [0], "distinct labels"),
        ([[0]] * 200, [0], "label 0 has 142 train rows for 200 pool tasks"),
    ],
)
def test_pool_split_errors(digits, pool, ids, match):
    train, test = digits
    with pytest.raises(DataError, match=match):
        pool_task_split(train, test, pool, ids, seed=0)


# ----------------------------------------------------------------------- schema


def test_tasks_spec_exactly_one_kind():
    pool = PoolTasks(tasks=[[0, 1]], per_client=1)
    assert TasksSpec(pool=pool).pool is pool
    with pytest.raises(
        ValueError,
        match="exactly one of shared, per_client, random, sizes, pool, domains, incremental; got .'shared', 'pool'",
    ):
        TasksSpec(shared=[[0]], pool=pool)
    with pytest.raises(ValueError, match="exactly one of .* pool, domains, incremental; got none"):
        TasksSpec()
    for bad, match in [({"tasks": []}, "at least one task"), ({"tasks": [[1, 1]]}, "distinct labels")]:
        with pytest.raises(ValueError, match=match):
            PoolTasks(**{"per_client": 1, **bad})
    with pytest.raises(ValueError, match="per_client: expected >= 1"):
        PoolTasks(tasks=[[0]], per_client=0)


def test_scenario_file_with_two_kinds_is_one_line(tmp_path):
    path = scenario(tmp_path)
    raw = yaml.safe_load(path.read_text())
    raw["tasks"]["shared"] = [[0]]
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match="tasks: expected exactly one of .*got .'shared', 'pool'"):
        plan(str(path))


# ------------------------------------------------------------------------- plan


def test_plan_allocates_a_seeded_permutation(tmp_path):
    p = plan(str(scenario(tmp_path)))
    perm = np.random.default_rng(3).permutation(len(POOL))
    assert p.pool_ids == [perm[c * 3 : (c + 1) * 3].tolist() for c in range(4)]
    assert p.client_tasks == [[POOL[i] for i in ids] for ids in p.pool_ids]
    assert p.scenario.federation.num_tasks == 3 and p.split_seed == 3
    assert len({i for ids in p.pool_ids for i in ids}) == 12  # distinct pool tasks


def test_plan_needs_enough_pool_tasks(tmp_path):
    with pytest.raises(ConfigError, match="5 clients x per_client 3 = 15 distinct tasks needed, the pool has 12"):
        plan(str(scenario(tmp_path, clients=5)))
    with pytest.raises(ConfigError, match="data.class_fraction: expected 1 with tasks.pool"):
        plan(str(scenario(tmp_path, class_fraction=0.5)))


def test_clients_never_share_a_document(tmp_path):
    p = plan(str(scenario(tmp_path)))
    train, test = load_dataset("digits", seed=p.split_seed)
    train = indexed(train.y)
    shards = [pool_task_split(train, indexed(test.y), POOL, ids, p.split_seed) for ids in p.pool_ids]
    docs = [np.concatenate([rows(d) for d in s.train]) for s in shards]
    assert all(len(d) == len(np.unique(d)) for d in docs)  # nor does a client see one twice
    for a in range(len(docs)):
        for b in range(a + 1, len(docs)):
            assert len(np.intersect1d(docs[a], docs[b])) == 0


def test_device_computes_the_plans_data(tmp_path):
    p = plan(str(scenario(tmp_path, per_class=20, test_per_class=15, split_seed=7)))
    configs = write_configs(p, tmp_path, "mqtt://127.0.0.1:1")
    train, test = load_dataset("digits", seed=7)
    for index, cid in enumerate(p.client_ids):
        cfg = load_config(ClientConfig, configs[cid][1])
        assert cfg.data.pool_tasks == POOL and cfg.data.pool_ids == p.pool_ids[index]
        assert cfg.data.split_seed == 7 and cfg.data.seed == 3
        expected = pool_task_split(train, test, POOL, p.pool_ids[index], 7, per_class=20, test_per_class=15)
        same_data(load_client_data(cfg), expected)


def test_split_seed_changes_the_split_not_the_allocation(tmp_path):
    default = plan(str(scenario(tmp_path)))
    seeded = plan(str(scenario(tmp_path, split_seed=11)))
    assert seeded.pool_ids == default.pool_ids and seeded.split_seed == 11
    a, b = load_dataset("digits", seed=default.split_seed), load_dataset("digits", seed=11)
    assert not np.array_equal(a[0].y, b[0].y)  # another train/test split
    whole = range(len(POOL))
    parts = pool_task_split(indexed(a[0].y), indexed(a[1].y), POOL, whole, 3)
    reparts = pool_task_split(indexed(a[0].y), indexed(a[1].y), POOL, whole, 11)
    assert any(not np.array_equal(rows(x), rows(y)) for x, y in zip(parts.train, reparts.train))


def test_no_split_seed_keeps_todays_configs(tmp_path):
    """Without data.split_seed a device splits with the federation seed, as before the field."""
    path = scenario(tmp_path)
    raw = yaml.safe_load(path.read_text())
    raw["tasks"] = {"shared": [[0, 1], [2, 3]]}
    path.write_text(yaml.safe_dump(raw))
    p = plan(str(path))
    assert p.pool_ids is None
    configs = write_configs(p, tmp_path, "mqtt://127.0.0.1:1")
    train, test = load_dataset("digits", seed=3)
    for index, cid in enumerate(p.client_ids):
        cfg = load_config(ClientConfig, configs[cid][1])
        assert cfg.data.split_seed is None and cfg.data.pool_ids is None and cfg.data.data_seed == 3
        same_data(load_client_data(cfg), client_task_split(train, test, p.client_tasks, index, 3))


# -------------------------------------------------------------------------- BBC

BBC_POOL = [[0, 1, 2], [0, 1, 3], [0, 1, 4], [0, 2, 3], [0, 2, 4], [0, 3, 4], [1, 2, 3], [1, 2, 4], [1, 3, 4]]
BBC_POOL += [[2, 3, 4], [0, 1, 2], [1, 2, 3], [2, 3, 4], [0, 3, 4], [0, 1, 4]]  # the notes' fixed order


def test_bbc_pool_of_fifteen_tasks():
    """The FedSeIT recipe's pool on BBC News: each label in 9 tasks, documents split evenly."""
    train, test = load_dataset("bbc", seed=42, max_length=16)
    assert all(sum(c in t for t in BBC_POOL) == 9 for c in range(5))
    whole = pool_task_split(train, test, BBC_POOL, range(15), seed=42)
    for c in range(5):
        sizes = [int((d.y == c).sum()) for d, t in zip(whole.train, BBC_POOL) if c in t]
        assert sum(sizes) == int((train.y == c).sum()) and max(sizes) - min(sizes) <= 1, (c, sizes)
    for d, task in zip(whole.test, BBC_POOL):
        assert len(d) == int(np.isin(test.y, task).sum())
