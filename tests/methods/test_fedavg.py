"""Tests for sample-weighted FedAvg over dense and sparse updates (fclcore.aggregation)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fclcore.aggregation import weighted_average
from fclcore.codec import SparseTensor

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def sparse_from(dense: np.ndarray, mask: np.ndarray) -> SparseTensor:
    return SparseTensor.from_dense(dense, mask)


# ----------------------------------------------------------------- dense


@st.composite
def dense_case(draw):
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=ndim, max_size=ndim)))
    clients = draw(st.integers(1, 5))
    seed = draw(st.integers(0, 2**32 - 1))
    weights = draw(
        st.lists(st.one_of(st.integers(1, 10_000), st.floats(0.01, 1e4)), min_size=clients, max_size=clients)
    )
    return shape, seed, weights


@FAST
@given(dense_case())
def test_dense_equals_np_average(case):
    shape, seed, weights = case
    rng = np.random.default_rng(seed)
    updates = [rng.normal(size=shape).astype(np.float32) for _ in weights]
    previous = {"w": rng.normal(size=shape).astype(np.float32)}
    out = weighted_average([({"w": u}, n) for u, n in zip(updates, weights)], previous)
    expected = np.average(np.stack([u.astype(np.float64) for u in updates]), axis=0, weights=weights)
    assert out["w"].shape == shape
    assert out["w"].dtype == np.float32
    np.testing.assert_allclose(out["w"], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seed", range(5))
def test_dense_several_tensors_seeded(seed):
    rng = np.random.default_rng(seed)
    shapes = {"w": (3, 4), "b": (4,), "s": ()}
    weights = rng.integers(1, 100, size=4).tolist()
    updates = [{k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()} for _ in weights]
    previous = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
    out = weighted_average(list(zip(updates, weights)), previous)
    assert set(out) == set(shapes)
    for name, shape in shapes.items():
        stack = np.stack([u[name] for u in updates])
        np.testing.assert_allclose(out[name], np.average(stack, axis=0, weights=weights), rtol=1e-5, atol=1e-6)
        assert out[name].shape == shape and out[name].dtype == np.float32


def test_dense_hand_computed():
    a = np.array([1.0, 2.0, 3.0], np.float32)
    b = np.array([3.0, 6.0, -3.0], np.float32)
    out = weighted_average([({"w": a}, 1), ({"w": b}, 3)], {"w": np.full(3, 100.0, np.float32)})
    # (1*1 + 3*3)/4 = 2.5, (1*2 + 3*6)/4 = 5, (1*3 + 3*-3)/4 = -1.5
    np.testing.assert_array_equal(out["w"], np.array([2.5, 5.0, -1.5], np.float32))


def test_single_client_returns_its_update():
    u = np.arange(6, dtype=np.float32).reshape(2, 3)
    out = weighted_average([({"w": u}, 7)], {"w": np.zeros((2, 3), np.float32)})
    np.testing.assert_array_equal(out["w"], u)


def test_tensor_nobody_sent_keeps_previous_value():
    prev = {"w": np.ones(3, np.float32), "b": np.array([5.0, 6.0], np.float32)}
    out = weighted_average([({"w": np.zeros(3, np.float32)}, 2)], prev)
    np.testing.assert_array_equal(out["b"], prev["b"])
    np.testing.assert_array_equal(out["w"], np.zeros(3))
    assert out["b"] is not prev["b"]  # a new array, not an alias of the old global model


# ---------------------------------------------------------------- sparse


def expected_by_loop(dense_updates, masks, weights, previous):
    """Per-element weighted mean over the clients whose mask covers it; else previous."""
    flat_prev = previous.astype(np.float64).ravel()
    out = np.empty_like(flat_prev)
    for j in range(flat_prev.size):
        num = den = 0.0
        for dense, mask, w in zip(dense_updates, masks, weights):
            if mask is None or mask.ravel()[j]:
                num += w * float(dense.ravel()[j])
                den += w
        out[j] = num / den if den > 0 else flat_prev[j]
    return out.reshape(previous.shape)


@st.composite
def sparse_case(draw):
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    clients = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**32 - 1))
    weights = draw(st.lists(st.integers(1, 1000), min_size=clients, max_size=clients))
    # per client: None = dense update, else the probability that an element is sent
    kinds = draw(st.lists(st.one_of(st.none(), st.floats(0.0, 1.0)), min_size=clients, max_size=clients))
    return shape, seed, weights, kinds


@FAST
@given(sparse_case())
def test_sparse_and_mixed_match_loop(case):
    shape, seed, weights, kinds = case
    rng = np.random.default_rng(seed)
    previous = rng.normal(size=shape).astype(np.float32)
    dense_updates = [rng.normal(size=shape).astype(np.float32) for _ in weights]
    masks = [None if p is None else rng.random(shape) < p for p in kinds]
    tensors = [d if m is None else sparse_from(d, m) for d, m in zip(dense_updates, masks)]
    out = weighted_average([({"w": t}, n) for t, n in zip(tensors, weights)], {"w": previous})
    expected = expected_by_loop(dense_updates, masks, weights, previous)
    assert out["w"].dtype == np.float32 and out["w"].shape == shape
    np.testing.assert_allclose(out["w"], expected, rtol=1e-5, atol=1e-6)


def test_sparse_hand_computed():
    prev = np.array([[10.0, 20.0], [30.0, 40.0]], np.float32)
    # client A (n=1) sends flat elements 0 and 1; client B (n=3) sends elements 1 and 2
    a = SparseTensor((2, 2), np.array([0, 1]), np.array([1.0, 2.0], np.float32))
    b = SparseTensor((2, 2), np.array([1, 2]), np.array([6.0, 4.0], np.float32))
    out = weighted_average([({"w": a}, 1), ({"w": b}, 3)], {"w": prev})
    # elem 0: only A -> 1; elem 1: (1*2 + 3*6)/4 = 5; elem 2: only B -> 4; elem 3: nobody -> 40
    np.testing.assert_array_equal(out["w"], np.array([[1.0, 5.0], [4.0, 40.0]], np.float32))


def test_mixed_dense_and_sparse_hand_computed():
    prev = np.array([7.0, 7.0, 7.0], np.float32)
    dense = np.array([0.0, 3.0, 6.0], np.float32)  # n=2, covers every element
    sparse = SparseTensor((3,), np.array([2]), np.array([12.0], np.float32))  # n=1, only element 2
    out = weighted_average([({"w": dense}, 2), ({"w": sparse}, 1)], {"w": prev})
    # elem 0, 1: dense only; elem 2: (2*6 + 1*12)/3 = 8
    np.testing.assert_array_equal(out["w"], np.array([0.0, 3.0, 8.0], np.float32))


def test_sparse_zero_values_are_sent_values():
    """An explicit sparse entry of 0.0 counts as sent (it is not 'nobody sent it')."""
    prev = np.array([5.0, 5.0], np.float32)
    sparse = SparseTensor((2,), np.array([0]), np.array([0.0], np.float32))
    out = weighted_average([({"w": sparse}, 4)], {"w": prev})
    np.testing.assert_array_equal(out["w"], np.array([0.0, 5.0], np.float32))


def test_empty_sparse_keeps_previous():
    prev = np.array([[1.5, -2.5]], np.float32)
    empty = SparseTensor((1, 2), np.array([], np.int64), np.array([], np.float32))
    out = weighted_average([({"w": empty}, 3)], {"w": prev})
    np.testing.assert_array_equal(out["w"], prev)


def test_float16_sparse_values():
    prev = np.zeros(4, np.float32)
    s = SparseTensor((4,), np.array([1, 3]), np.array([0.5, -1.25], np.float16))
    out = weighted_average([({"w": s}, 1)], {"w": prev})
    np.testing.assert_array_equal(out["w"], np.array([0.0, 0.5, 0.0, -1.25], np.float32))
    assert out["w"].dtype == np.float32


# ------------------------------------------------------------------ errors


def test_dense_shape_mismatch():
    prev = {"w": np.zeros((2, 3), np.float32)}
    with pytest.raises(ValueError, match="w: expected shape"):
        weighted_average([({"w": np.zeros((3, 2), np.float32)}, 1)], prev)
    with pytest.raises(ValueError):
        weighted_average([({"w": np.zeros(6, np.float32)}, 1)], prev)


def test_sparse_shape_mismatch():
    prev = {"w": np.zeros((2, 3), np.float32)}
    bad = SparseTensor((3, 2), np.array([0]), np.array([1.0], np.float32))
    with pytest.raises(ValueError, match="w: expected shape"):
        weighted_average([({"w": np.zeros((2, 3), np.float32)}, 1), ({"w": bad}, 1)], prev)


@pytest.mark.parametrize("weight", [0, 0.0, -1, -0.5, float("nan"), -math.inf])
def test_non_positive_weight(weight):
    prev = {"w": np.zeros(2, np.float32)}
    updates = [({"w": np.ones(2, np.float32)}, 3), ({"w": np.ones(2, np.float32)}, weight)]
    with pytest.raises(ValueError, match="positive weights"):
        weighted_average(updates, prev)


def test_empty_updates():
    with pytest.raises(ValueError, match="at least one update"):
        weighted_average([], {"w": np.zeros(2, np.float32)})


@pytest.mark.parametrize("weight", [math.inf, float("nan")])
def test_non_finite_weight_is_rejected(weight):
    prev = {"w": np.zeros(2, np.float32)}
    with pytest.raises(ValueError):
        weighted_average([({"w": np.ones(2, np.float32)}, weight)], prev)


def test_huge_finite_weights_still_average():
    """Weights reach here as float(n_samples); large ones must not overflow the sums to NaN."""
    prev = {"w": np.zeros(2, np.float32)}
    a, b = np.array([1.0, 2.0], np.float32), np.array([3.0, 4.0], np.float32)
    out = weighted_average([({"w": a}, 1e308), ({"w": b}, 1e308)], prev)
    np.testing.assert_allclose(out["w"], [2.0, 3.0])


# --------------------------------------------------------- dtype / purity


def test_output_float32_and_inputs_untouched():
    rng = np.random.default_rng(3)
    prev = {"w": rng.normal(size=(3, 3)).astype(np.float64), "b": np.arange(3, dtype=np.int32)}
    dense = rng.normal(size=(3, 3)).astype(np.float64)
    sparse = SparseTensor((3,), np.array([0, 2]), np.array([1.0, 2.0], np.float32))
    snapshots = ({k: v.copy() for k, v in prev.items()}, dense.copy(), sparse.indices.copy(), sparse.values.copy())
    out = weighted_average([({"w": dense, "b": sparse}, 2), ({"w": dense}, 5)], prev)
    assert all(v.dtype == np.float32 for v in out.values())
    for k in prev:
        np.testing.assert_array_equal(prev[k], snapshots[0][k])
        assert prev[k].dtype == snapshots[0][k].dtype
        assert not np.shares_memory(out[k], prev[k])
    np.testing.assert_array_equal(dense, snapshots[1])
    np.testing.assert_array_equal(sparse.indices, snapshots[2])
    np.testing.assert_array_equal(sparse.values, snapshots[3])
    np.testing.assert_allclose(out["b"], [1.0, 1.0, 2.0])  # element 1 nobody sent: previous int value


def test_update_tensor_not_in_previous_is_ignored():
    out = weighted_average(
        [({"w": np.ones(2, np.float32), "extra": np.ones(1, np.float32)}, 1)], {"w": np.zeros(2, np.float32)}
    )
    assert set(out) == {"w"}
