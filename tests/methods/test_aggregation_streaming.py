"""Streaming aggregation (fclcore.aggregation.RunningSum) against the batch path
(``weighted_average``), and the streaming strategies' fold/close against their batch result."""

from __future__ import annotations

import numpy as np
import pytest

import methods  # noqa: F401  (registers every method)
from fclcore.aggregation import RunningSum, weighted_average
from fclcore.codec import SparseTensor
from fclcore.method import REGISTRY
from fclcore.strategy import Strategy

# ----------------------------------------------------------------- helpers


def random_case(seed: int):
    """A model of 1-3 tensors of random shapes and 1-6 updates, each tensor of each update dense,
    sparse at a random density (possibly empty), or missing; weights ints or floats."""
    rng = np.random.default_rng(seed)
    shapes = {f"t{i}": tuple(rng.integers(1, 7, size=rng.integers(0, 4))) for i in range(rng.integers(1, 4))}
    previous = {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}
    updates = []
    for _ in range(rng.integers(1, 7)):
        tensors = {}
        for name, shape in shapes.items():
            form = rng.choice(["dense", "sparse", "missing"])
            values = (rng.normal(size=shape) * 10 ** rng.uniform(-3, 3)).astype(np.float32)
            if form == "dense":
                tensors[name] = values
            elif form == "sparse":
                tensors[name] = SparseTensor.from_dense(values, rng.random(shape) < rng.uniform(0, 1))
        weight = float(rng.integers(1, 10_000)) if rng.random() < 0.5 else float(rng.uniform(0.01, 1e4))
        updates.append((tensors, weight))
    return previous, updates


def streamed(previous, updates, order=None) -> dict[str, np.ndarray]:
    running = RunningSum.over(previous)
    for i in order if order is not None else range(len(updates)):
        running.add(*updates[i])
    return running.result(previous)


def assert_float32_equal(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for name in want:
        assert got[name].dtype == np.float32 and got[name].shape == want[name].shape
        np.testing.assert_array_max_ulp(got[name], want[name], maxulp=1)


# ----------------------------------------------------------------- RunningSum vs weighted_average


@pytest.mark.parametrize("seed", range(60))
def test_streaming_equals_batch_over_random_shapes_and_densities(seed):
    previous, updates = random_case(seed)
    order = np.random.default_rng(seed + 1000).permutation(len(updates))  # any arrival order
    assert_float32_equal(streamed(previous, updates, order), weighted_average(updates, previous))


def test_dense_sparse_and_mixed_by_hand():
    previous = {"w": np.array([10.0, 20.0, 30.0, 40.0], np.float32)}
    dense = ({"w": np.array([1.0, 2.0, 3.0, 4.0], np.float32)}, 1.0)
    sparse = ({"w": SparseTensor((4,), np.array([0, 2]), np.array([3.0, 5.0], np.float32))}, 3.0)
    only_dense = streamed(previous, [dense])["w"]
    np.testing.assert_array_equal(only_dense, [1.0, 2.0, 3.0, 4.0])
    only_sparse = streamed(previous, [sparse])["w"]
    np.testing.assert_array_equal(only_sparse, [3.0, 20.0, 5.0, 40.0])  # unsent elements keep the previous value
    mixed = streamed(previous, [dense, sparse])["w"]
    np.testing.assert_array_equal(mixed, [(1 + 9) / 4, 2.0, (3 + 15) / 4, 4.0])


def test_elements_and_tensors_nobody_sent_keep_the_previous_value_exactly():
    rng = np.random.default_rng(3)
    previous = {"a": rng.normal(size=(5, 5)).astype(np.float32), "b": rng.normal(size=7).astype(np.float32)}
    mask = np.zeros((5, 5), bool)
    mask[1, 2] = mask[4, 0] = True
    updates = [({"a": SparseTensor.from_dense(np.ones((5, 5), np.float32), mask)}, 2.0)] * 3
    out = streamed(previous, updates)
    np.testing.assert_array_equal(out["b"], previous["b"])
    np.testing.assert_array_equal(out["a"][~mask], previous["a"][~mask])
    np.testing.assert_array_equal(out["a"][mask], [1.0, 1.0])


def test_weights_are_scale_free_and_large_counts_stay_finite():
    previous, updates = random_case(11)
    scaled = [(t, w * 1e6) for t, w in updates]
    assert_float32_equal(streamed(previous, scaled), streamed(previous, updates))
    big = np.float32(3e38)  # near float32's largest, with the largest sample count the inbox allows
    heavy = [({"w": np.full(3, big)}, 2**31 - 1), ({"w": np.full(3, -big)}, 1.0)]
    out = streamed({"w": np.zeros(3, np.float32)}, heavy)
    assert np.isfinite(out["w"]).all()
    assert_float32_equal(out, weighted_average(heavy, {"w": np.zeros(3, np.float32)}))


@pytest.mark.parametrize("seed", range(10))
def test_merged_partial_sums_equal_one_sum(seed):
    previous, updates = random_case(seed)
    cut = len(updates) // 2
    left, right = RunningSum.over(previous), RunningSum.over(previous)
    for tensors, weight in updates[:cut]:
        left.add(tensors, weight)
    for tensors, weight in updates[cut:]:
        right.add(tensors, weight)
    merged = left.merge(right)
    assert merged.count == len(updates)
    assert merged.total_weight == pytest.approx(sum(w for _, w in updates))
    assert_float32_equal(merged.result(previous), weighted_average(updates, previous))


def test_merge_refuses_other_tensors():
    with pytest.raises(ValueError, match="do not match"):
        RunningSum({"w": (3,)}).merge(RunningSum({"w": (4,)}))


# ----------------------------------------------------------------- bad input changes nothing


@pytest.mark.parametrize(
    ("tensors", "weight", "message"),
    [
        ({"w": np.ones(3, np.float32), "b": np.ones(3, np.float32)}, 1.0, "expected shape"),
        ({"w": np.ones(3, np.float32), "x": np.ones(2, np.float32)}, 1.0, "not a tensor of this sum"),
        ({"w": np.ones(3, np.float32), "b": np.array([1.0, np.nan], np.float32)}, 1.0, "NaN or infinite"),
        ({"w": SparseTensor((3,), [0], [np.inf]), "b": np.ones(2, np.float32)}, 1.0, "NaN or infinite"),
        ({"w": SparseTensor((4,), [3], [1.0])}, 1.0, "expected shape"),
        ({"w": np.ones(3, np.float32)}, 0.0, "finite weight"),
        ({"w": np.ones(3, np.float32)}, -2.0, "finite weight"),
        ({"w": np.ones(3, np.float32)}, float("nan"), "finite weight"),
        ({"w": np.ones(3, np.float32)}, float("inf"), "finite weight"),
        ({"w": np.ones(3, np.float32)}, 2.0**60, "finite weight"),
        ({"w": np.ones(3, np.float32)}, "ten", "expected a number"),
    ],
)
def test_a_bad_update_is_refused_whole(tensors, weight, message):
    previous = {"w": np.zeros(3, np.float32), "b": np.zeros(2, np.float32)}
    good = ({"w": np.array([1.0, 2.0, 3.0], np.float32), "b": np.array([4.0, 5.0], np.float32)}, 2.0)
    running = RunningSum.over(previous)
    running.add(*good)
    with pytest.raises(ValueError, match=message):
        running.add(tensors, weight)
    assert running.count == 1 and running.total_weight == 2.0
    assert_float32_equal(running.result(previous), weighted_average([good], previous))


def test_a_result_needs_updates_and_the_same_tensors():
    running = RunningSum({"w": (2,)})
    with pytest.raises(ValueError, match="at least one"):
        running.result({"w": np.zeros(2, np.float32)})
    running.add({"w": np.ones(2, np.float32)}, 1.0)
    with pytest.raises(ValueError, match="previous model"):
        running.result({"w": np.zeros(3, np.float32)})


# ----------------------------------------------------------------- which methods stream


def test_the_methods_that_stream_are_the_sum_shaped_ones():
    """Every registered method, read from the registry: one streams exactly when its server step
    is a weighted sum; server distillation (FedET) and server-side training (FIL-VER), the
    methods whose strategy declares ``server_torch``, need every update: batch.  A streaming
    strategy implements ``fold``; a batch one its own ``aggregate``."""
    streams = {name for name, spec in REGISTRY.items() if spec.strategy_class().streams}
    assert streams == {name for name, spec in REGISTRY.items() if not spec.server_torch}, sorted(streams)
    assert {"fedavg", "confedmade", "fedseit", "ngfl"} <= streams  # one of each package's sums
    assert not {"fedet", "fedet-finetune", "filver", "filver-nosst"} & streams
    for name, spec in REGISTRY.items():
        cls = spec.strategy_class()
        if name in streams:
            assert cls.fold is not Strategy.fold, f"{name} streams without a fold"
        else:
            assert cls.aggregate is not Strategy.aggregate, f"{name} neither streams nor aggregates"


# ----------------------------------------------------------------- a streaming strategy


def _decomposed_round(seed: int, rnd: int):
    """A fedweit-made-star strategy and four updates as its ``normalize`` returns them: the base
    (weights sparse at random densities, biases dense) plus, at a task end, ``kb:`` tensors."""
    from fclcore.codec import Frame, Header, Kind
    from fclcore.schema import FederationSpec, ModelSpec, TrainSpec
    from fclcore.strategy import Update
    from methods import strategy_for
    from methods.confedmade.wire import KB_PREFIX

    fed = FederationSpec(
        name="t",
        method="fedweit-made-star",
        num_tasks=2,
        rounds_per_task=2,
        model=ModelSpec(hidden_sizes=[24], num_orders=3, mask_seed=3),
        train=TrainSpec(batch_size=8, lr=0.01),
        options={"order_per": "round", "keep_units": 0.5},
    )
    strategy = strategy_for(fed, 10)
    rng = np.random.default_rng(seed)
    updates = []
    for i in range(4):
        tensors = {}
        for name, shape in strategy.shapes.items():
            values = rng.normal(size=shape).astype(np.float32)
            if name.endswith(".bias"):
                tensors[name] = values
                continue
            tensors[name] = SparseTensor.from_dense(values, rng.random(shape) < rng.uniform(0.05, 0.9))
            if strategy.carries_knowledge(rnd):
                tensors[KB_PREFIX + name] = SparseTensor.from_dense(values, rng.random(shape) < 0.2)
        frame = Frame(Header(Kind.UPDATE, "t", rnd, 0, f"c{i}", 1), {"n_samples": int(rng.integers(1, 500))}, {})
        updates.append(Update(f"c{i}", frame, frame.meta["n_samples"], 0, 0, tensors))
    return strategy, updates


@pytest.mark.parametrize("rnd", [0, 1])  # round 1 ends task 0: the knowledge base grows
def test_a_strategy_folding_in_arrival_order_equals_the_batch_formula(rnd):
    from methods.confedmade.wire import KB_PREFIX

    strategy, updates = _decomposed_round(seed=rnd, rnd=rnd)
    current = strategy.initial_model()
    running = strategy.running_sum(current)
    kept = {u.client: strategy.fold(running, u) for u in reversed(updates)}  # arrival order: reversed
    for u in kept.values():  # the round holds metadata and knowledge-base uploads, never the base
        assert not u.frame.tensors and all(k.startswith(KB_PREFIX) for k in u.tensors)
        assert bool(u.tensors) is strategy.carries_knowledge(rnd)
    out = strategy.close(running, [kept[c] for c in sorted(kept)], current)
    base = [({k: v for k, v in u.tensors.items() if not k.startswith(KB_PREFIX)}, u.n_samples) for u in updates]
    assert_float32_equal(out, weighted_average(base, current))
    entries = [(e.client, e.task, sorted(e.tensors)) for e in strategy.knowledge]
    expected = sorted(strategy.weights) if strategy.carries_knowledge(rnd) else None
    assert entries == ([(f"c{i}", 0, expected) for i in range(4)] if expected else [])
