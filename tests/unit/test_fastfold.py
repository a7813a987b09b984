"""The compiled fold (fclcore.fastfold) gives the NumPy fold's sums bit for bit.

Every case folds the same updates into a ``RunningSum(fast=True)`` and a
``RunningSum(fast=False)`` and compares the float64 sums and weight sums exactly (not to a
tolerance): the kernels must add the same products in the same order per element.
"""

from __future__ import annotations

import numpy as np
import pytest

from fclcore import fastfold
from fclcore.aggregation import RunningSum, weighted_average
from fclcore.codec import Frame, Header, Kind, PackedSparse, SparseTensor, ValueCoding, decode, encode

pytest.importorskip("numba")
pytestmark = pytest.mark.skipif(not fastfold.enabled(), reason="FCL_EDGE_NUMBA=0: the kernels are switched off")

SHAPES = {"w": (37, 29), "b": (29,), "big": (300, 300)}  # "big" > 65,536 elements: u32 index lists


def _sparse(rng, shape, density) -> SparseTensor:
    size = int(np.prod(shape))
    index = np.flatnonzero(rng.random(size) < density)
    scale = 10 ** rng.uniform(-3, 3, index.size)  # magnitudes far apart: the order of the additions shows
    return SparseTensor(shape, index, (rng.standard_normal(index.size) * scale).astype(np.float32))


def _wire(tensors, i, coding="float32"):
    """``tensors`` as the aggregator gets them: encoded by a device, decoded from the frame."""
    header = Header(Kind.UPDATE, "fed", 1, 0, f"c{i}", i + 1)
    return decode(encode(Frame(header, {}, tensors), coding)).tensors


def _both(updates):
    fast, slow = RunningSum(SHAPES, fast=True), RunningSum(SHAPES, fast=False)
    for make, weight in updates:
        fast.add(make(), weight)  # each its own decode: the fast path may keep a tensor staged
        slow.add(make(), weight)
    return fast, slow


def _assert_identical(fast: RunningSum, slow: RunningSum) -> None:
    assert fast.fast and not slow.fast
    assert set(fast.sparse_weight) == set(slow.sparse_weight)
    for name in SHAPES:
        assert np.array_equal(fast.sums[name], slow.sums[name]), name
        assert np.array_equal(fast.weights(name), slow.weights(name)), name
        assert fast.dense_weight[name] == slow.dense_weight[name]
    assert (fast.count, fast.total_weight) == (slow.count, slow.total_weight)
    previous = {name: np.full(shape, 0.5, np.float32) for name, shape in SHAPES.items()}
    for name, value in fast.result(previous).items():
        assert np.array_equal(value, slow.result(previous)[name])


DENSITY = {"sparse": 0.1, "index": 0.01, "dense-ish": 0.7, "overlap": 0.25}


def _updates(kind: str, n: int, seed: int = 0):
    """``n`` (make, weight) pairs of one kind of update; make() decodes a fresh copy."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        density = DENSITY.get(kind, rng.choice([0.01, 0.1, 0.5]))
        tensors = {name: _sparse(rng, shape, density) for name, shape in SHAPES.items()}
        if kind == "dense":
            tensors = {name: t.to_dense() for name, t in tensors.items()}
        elif kind == "mixed" and i % 3 == 0:
            tensors["b"] = tensors["b"].to_dense()  # a dense tensor between sparse ones
        elif kind == "missing":
            del tensors[["w", "b", "big"][i % 3]]
        coding = {"int8": ValueCoding("int8", block=16), "float16": "float16"}.get(kind, "float32")
        out.append((lambda t=tensors, i=i, c=coding: _wire(t, i, c), float(rng.integers(1, 500))))
    return out


@pytest.mark.parametrize(
    "kind", ["sparse", "overlap", "index", "dense-ish", "dense", "mixed", "missing", "int8", "float16", "any-density"]
)
def test_fast_fold_equals_numpy_fold_bit_for_bit(kind):
    # 40 updates: more than MAX_PENDING, so several flushes happen in between; at density 0.25
    # four updates are staged at a time and overlap, so a kernel that adds them out of order fails
    _assert_identical(*_both(_updates(kind, 40, seed=len(kind))))


def test_decoded_tensors_stay_packed_and_the_kernels_take_them():
    tensors = _updates("sparse", 1)[0][0]()
    assert all(isinstance(tensors[n], PackedSparse) and tensors[n].bitmap is not None for n in ("w", "big"))
    small = _updates("index", 1)[0][0]()
    assert isinstance(small["w"], PackedSparse) and small["w"].index is not None
    running = RunningSum(SHAPES, fast=True)
    running.add(tensors, 2.0)
    assert all(t._indices is None for t in tensors.values())  # folded without expanding the positions
    assert running._staged["w"].mode == "bitmap" and running._staged["w"].count == 1


def test_plain_and_expanded_sparse_tensors_fold_alike():
    """Tensors built in memory (int64 indices, float16 values too) and decoded ones whose
    positions something already expanded go through the index kernel."""
    rng = np.random.default_rng(5)
    plain = [{n: _sparse(rng, s, 0.2) for n, s in SHAPES.items()} for _ in range(20)]
    plain[3] = {n: SparseTensor(t.shape, t.indices, t.values.astype(np.float16)) for n, t in plain[3].items()}

    def expanded(t):
        decoded = _wire(t, 0)
        for tensor in decoded.values():
            assert tensor.indices.size == tensor.nnz  # expands them
        return decoded

    updates = [(lambda t=t: dict(t), 1.0 + i) for i, t in enumerate(plain)]
    updates += [(lambda t=t: expanded(t), 2.0 + i) for i, t in enumerate(plain)]
    _assert_identical(*_both(updates))


def test_a_rejected_update_changes_nothing_with_updates_staged():
    good = _updates("sparse", 5)
    fast, slow = _both(good)
    bad = good[0][0]()
    bad["w"] = np.zeros((2, 2), np.float32)  # wrong shape, after tensors that would be staged
    for running in (fast, slow):
        with pytest.raises(ValueError, match="w: expected shape"):
            running.add(bad, 1.0)
        with pytest.raises(ValueError, match="NaN"):
            running.add({"b": np.full(29, np.nan, np.float32)}, 1.0)
    _assert_identical(fast, slow)


def test_merge_and_weighted_average_agree_with_the_numpy_path():
    updates = _updates("any-density", 30, seed=9)
    fast_a, slow_a = _both(updates[:17])
    fast_b, slow_b = _both(updates[17:])
    _assert_identical(fast_a.merge(fast_b), slow_a.merge(slow_b))
    previous = {name: np.zeros(shape, np.float32) for name, shape in SHAPES.items()}
    batch = weighted_average([(make(), w) for make, w in updates], previous)
    for name, value in fast_a.result(previous).items():
        np.testing.assert_allclose(value, batch[name], rtol=1e-6, atol=1e-7)


def test_staging_is_bounded_by_one_dense_copy_of_the_values():
    running = RunningSum(SHAPES, fast=True)
    for make, weight in _updates("dense-ish", 3):
        running.add(make(), weight)
        stage = running._staged["big"]
        assert stage.filled <= stage.numel and stage.count <= fastfold.MAX_PENDING
    assert running._staged["big"].count == 1  # a 70% update does not fit beside another one


def test_numba_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("FCL_EDGE_NUMBA", "0")
    monkeypatch.setattr(fastfold, "_loaded", False)
    monkeypatch.setattr(fastfold, "_kernels", None)
    assert not fastfold.enabled() and not RunningSum(SHAPES).fast
    with pytest.raises(ValueError, match="need numba"):
        RunningSum(SHAPES, fast=True)
    monkeypatch.setattr(fastfold, "_loaded", False)  # the next test sees the kernels again


def test_packed_sparse_is_a_sparse_tensor():
    rng = np.random.default_rng(2)
    for density in (0.01, 0.3):  # index list, bitmap
        sent = _sparse(rng, (300, 300), density)
        got = _wire({"t": sent}, 0)["t"]
        assert isinstance(got, PackedSparse) and got.nnz == sent.nnz
        assert got == sent and np.array_equal(got.to_dense(), sent.to_dense())
        assert got.indices.dtype == np.int64 and got.nnz == sent.nnz
        assert decode(encode(Frame(Header(Kind.UPDATE, "f", 1, 0, "c", 1), {}, {"t": got}))).tensors["t"] == sent


def test_the_kernels_compile_where_numba_cannot_cache_them():
    """A read-only install without NUMBA_CACHE_DIR: numba refuses cache=True; compile anyway."""
    from fclcore._fastfold_kernels import _jit

    namespace: dict = {}
    exec("def plus_one(x):\n    return x + 1", namespace)  # no source file: numba has no cache locator for it
    assert _jit(namespace["plus_one"])(41) == 42
