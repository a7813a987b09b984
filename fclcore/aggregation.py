"""Federated averaging and update templates as pure NumPy functions (no torch on the
aggregator's path); method strategies build on them.

Updates may be dense arrays or ``SparseTensor``s: each element of the global tensor is the
sample-weighted mean over the clients that sent that element, and elements nobody sent keep
their previous global value.  With dense updates from every client this is exactly
``np.average(stack, axis=0, weights=n_samples)``.

Two ways to get there: ``weighted_average`` over a list of updates (the batch path, which
holds every update until the round closes), and ``RunningSum``, which folds one update at a
time into float64 sums and holds O(model) memory however many updates arrive.
"""

from __future__ import annotations

import math
from typing import Callable, Mapping, Sequence

import numpy as np

from fclcore.codec import Frame, SparseTensor, Tensor

Update = tuple[Mapping[str, Tensor], float]  # (tensors, weight = number of local samples)


def weighted_average(updates: Sequence[Update], previous: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Sample-weighted FedAvg of ``updates`` over the tensors of ``previous``."""
    if not updates:
        raise ValueError("weighted_average: expected at least one update")
    weights = np.array([weight for _, weight in updates], dtype=np.float64)
    if not np.all(np.isfinite(weights) & (weights > 0)):
        raise ValueError(f"weighted_average: expected finite positive weights, got {weights.tolist()}")
    weights = weights / weights.max()  # the mean is scale-free; this keeps the sums finite
    out = {}
    for name, base in previous.items():
        total = np.zeros(base.size, dtype=np.float64)
        weight_sum = np.zeros(base.size, dtype=np.float64)
        for (tensors, _), weight in zip(updates, weights):
            tensor = tensors.get(name)
            if tensor is None:
                continue
            index, values = _flat(tensor, base.shape, name)
            weighted = np.multiply(values, weight, dtype=np.float64)
            if index is None:
                total += weighted
                weight_sum += weight
            else:  # indices are unique (the codec enforces strictly increasing)
                total[index] += weighted
                weight_sum[index] += weight
        merged = base.astype(np.float64).ravel().copy()
        sent = weight_sum > 0
        merged[sent] = total[sent] / weight_sum[sent]
        out[name] = merged.reshape(base.shape).astype(np.float32)
    return out


MAX_WEIGHT = float(2**53)  # w * |float32 value| stays far below float64's range for any sane count


class RunningSum:
    """Per-element float64 sums of weight * value and of weight, over the tensors of a model.

    ``add`` folds one update (dense arrays add everywhere, a ``SparseTensor`` only at its
    indices); ``result`` is the weighted mean where anyone sent an element and the previous
    value elsewhere, the same as ``weighted_average`` over the same updates to float32
    rounding; ``merge`` adds another partial sum over the same tensors (a site's sums, say).
    Memory: 8 bytes per element for the value sums, plus 8 per element of a tensor that has
    had a sparse contribution (dense contributions share one scalar weight per tensor).
    Float64 addition is not associative, so the fold order can move a sum in its last float64
    bits; that is far below float32 resolution, which is what the model is kept in.
    """

    def __init__(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        self.shapes = {name: tuple(int(d) for d in shape) for name, shape in shapes.items()}
        self.sums = {name: np.zeros(math.prod(shape), np.float64) for name, shape in self.shapes.items()}
        self.dense_weight = dict.fromkeys(self.shapes, 0.0)  # weight of the dense contributions per tensor
        self.sparse_weight: dict[str, np.ndarray] = {}  # per-element weight of the sparse ones, once any came
        self.count = 0  # updates folded (merged partial sums add theirs)
        self.total_weight = 0.0

    @classmethod
    def over(cls, model: Mapping[str, np.ndarray]) -> RunningSum:
        """An empty sum over the tensors (names and shapes) of ``model``."""
        return cls({name: np.shape(value) for name, value in model.items()})

    def add(self, tensors: Mapping[str, Tensor], weight: float) -> None:
        """Fold one update; checked whole before anything is added, so a bad one changes nothing."""
        weight = _check_weight(weight)
        flat = [(name, *self._check(name, tensor)) for name, tensor in tensors.items()]
        for name, index, values in flat:
            weighted = np.multiply(values, weight, dtype=np.float64)  # widens and scales in one pass
            if index is None:
                self.sums[name] += weighted
                self.dense_weight[name] += weight
                continue
            # Indices are unique, so a scatter-add is exact; numpy's add.at fast path (float64
            # values, int64 indices) beats ``sums[index] += weighted`` (a gather, then a scatter).
            np.add.at(self.sums[name], index, weighted)
            spread = self.sparse_weight.get(name)
            if spread is None:
                spread = self.sparse_weight[name] = np.zeros(self.sums[name].size, np.float64)
            np.add.at(spread, index, weight)  # a scalar: no per-element weight array
        self.count += 1
        self.total_weight += weight

    def merge(self, other: RunningSum) -> RunningSum:
        """Add ``other``'s sums into this one (same tensors and shapes); returns self."""
        if other.shapes != self.shapes:
            raise ValueError(f"RunningSum.merge: tensors {other.shapes} do not match {self.shapes}")
        for name, total in other.sums.items():
            self.sums[name] += total
            self.dense_weight[name] += other.dense_weight[name]
            if name in other.sparse_weight:
                mine = self.sparse_weight.setdefault(name, np.zeros(total.size, np.float64))
                mine += other.sparse_weight[name]
        self.count += other.count
        self.total_weight += other.total_weight
        return self

    def result(self, previous: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The weighted mean over the folded updates (float32), ``previous`` where nobody sent."""
        if self.count == 0:
            raise ValueError("RunningSum.result: expected at least one folded update")
        shapes = {name: tuple(np.shape(value)) for name, value in previous.items()}
        if shapes != self.shapes:
            raise ValueError(f"RunningSum.result: previous model has tensors {shapes}, the sums {self.shapes}")
        out = {}
        for name, base in previous.items():
            weight = self.weights(name)
            merged = np.asarray(base, np.float64).ravel().copy()
            sent = weight > 0
            merged[sent] = self.sums[name][sent] / weight[sent]
            out[name] = merged.reshape(self.shapes[name]).astype(np.float32)
        return out

    def weights(self, name: str) -> np.ndarray:
        """The per-element weight sum of tensor ``name`` (float64, flat)."""
        spread = self.sparse_weight.get(name)
        dense = self.dense_weight[name]
        if spread is None:
            return np.full(self.sums[name].size, dense)
        return spread + dense if dense else spread

    def _check(self, name: str, tensor: Tensor) -> tuple[np.ndarray | None, np.ndarray]:
        shape = self.shapes.get(name)
        if shape is None:
            raise ValueError(f"{name}: not a tensor of this sum (expected one of {sorted(self.shapes)[:5]})")
        index, values = _flat(tensor, shape, name)  # a SparseTensor's indices are strictly increasing (codec)
        if not np.isfinite(values).all():
            raise ValueError(f"{name}: NaN or infinite values")
        if index is not None and index.size and (index[0] < 0 or index[-1] >= self.sums[name].size):
            raise ValueError(f"{name}: indices outside [0, {self.sums[name].size})")
        return index, values


def _check_weight(weight: float) -> float:
    try:
        weight = float(weight)
    except (TypeError, ValueError):
        raise ValueError(f"RunningSum.add: expected a number as weight, got {weight!r}") from None
    if not (math.isfinite(weight) and 0 < weight <= MAX_WEIGHT):
        raise ValueError(f"RunningSum.add: expected a finite weight in (0, 2**53], got {weight!r}")
    return weight


def _flat(tensor: Tensor, shape: tuple[int, ...], name: str) -> tuple[np.ndarray | None, np.ndarray]:
    """(flat indices or None for dense, flat values as they are: callers widen while they scale)."""
    if isinstance(tensor, SparseTensor):
        if tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(tensor.shape)}")
        return tensor.indices, tensor.values
    if tensor.shape != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tensor.shape}")
    return None, np.ravel(tensor)


def template_check(template: Mapping[str, tuple[int, ...]]) -> Callable[[Frame], dict[str, Tensor]]:
    """A normaliser that accepts exactly the tensors of ``template`` with those shapes."""

    def normalize(frame: Frame) -> dict[str, Tensor]:
        names = set(frame.tensors)
        if names != set(template):
            missing, extra = sorted(set(template) - names), sorted(names - set(template))
            raise ValueError(f"tensors: missing {missing}, unexpected {extra}")
        for name, tensor in frame.tensors.items():
            shape = tuple(tensor.shape)
            if shape != tuple(template[name]):
                raise ValueError(f"{name}: expected shape {tuple(template[name])}, got {shape}")
        return dict(frame.tensors)

    return normalize
