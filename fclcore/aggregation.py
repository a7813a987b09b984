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

from fclcore import fastfold
from fclcore.codec import Frame, PackedSparse, SparseTensor, Tensor

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

    With the compiled kernels (``fclcore.fastfold``: numba installed; ``fast=None`` uses them
    when they are there, ``fast=False`` never), sparse tensors are staged and folded a few
    updates at a time, straight from the codec's wire layout; the sums are bit for bit those
    of the NumPy path.  Staging holds at most one dense float32 copy of each tensor's values
    plus 16 position bitmaps (about 1.5x the dense model), whatever the number of updates;
    ``sums``, ``sparse_weight``, ``weights``, ``result`` and ``merge`` fold what is staged first.
    """

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], fast: bool | None = None) -> None:
        self.shapes = {name: tuple(int(d) for d in shape) for name, shape in shapes.items()}
        self._sums = {name: np.zeros(math.prod(shape), np.float64) for name, shape in self.shapes.items()}
        self.dense_weight = dict.fromkeys(self.shapes, 0.0)  # weight of the dense contributions per tensor
        self._sparse_weight: dict[str, np.ndarray] = {}  # per-element weight of the sparse ones, once any came
        self.count = 0  # updates folded (merged partial sums add theirs)
        self.total_weight = 0.0
        self._kernels = None if fast is False else fastfold.kernels()
        if fast and self._kernels is None:
            raise ValueError("RunningSum(fast=True): the compiled kernels need numba (pip install fcl-edge[fast])")
        self._staged: dict[str, _Stage] = {}

    @classmethod
    def over(cls, model: Mapping[str, np.ndarray], fast: bool | None = None) -> RunningSum:
        """An empty sum over the tensors (names and shapes) of ``model``."""
        return cls({name: np.shape(value) for name, value in model.items()}, fast)

    @property
    def fast(self) -> bool:
        """Whether sparse updates are folded by the compiled kernels."""
        return self._kernels is not None

    @property
    def sums(self) -> dict[str, np.ndarray]:
        """Per tensor, the flat float64 sums of weight * value (staged updates folded first)."""
        self.flush()
        return self._sums

    @property
    def sparse_weight(self) -> dict[str, np.ndarray]:
        """Per tensor with a sparse contribution, the flat float64 weight sums of the sparse ones."""
        self.flush()
        return self._sparse_weight

    def add(self, tensors: Mapping[str, Tensor], weight: float) -> None:
        """Fold one update; checked whole before anything is added, so a bad one changes nothing."""
        weight = _check_weight(weight)
        checked = [(name, tensor, self._check(name, tensor)) for name, tensor in tensors.items()]
        for name, tensor, sparse in checked:
            if sparse and self._kernels is not None:
                self._stage(name, tensor, weight)
                continue
            self._flush(name)  # an element's additions stay in the order the updates came
            index, values = _flat(tensor, self.shapes[name], name)
            weighted = np.multiply(values, weight, dtype=np.float64)  # widens and scales in one pass
            if index is None:
                self._sums[name] += weighted
                self.dense_weight[name] += weight
                continue
            # Indices are unique, so a scatter-add is exact; numpy's add.at fast path (float64
            # values, int64 indices) beats ``sums[index] += weighted`` (a gather, then a scatter).
            np.add.at(self._sums[name], index, weighted)
            np.add.at(self._spread(name), index, weight)  # a scalar: no per-element weight array
        self.count += 1
        self.total_weight += weight

    def flush(self) -> None:
        """Fold every staged update into the sums (a no-op on the NumPy path)."""
        for name in self._staged:
            self._flush(name)

    def merge(self, other: RunningSum) -> RunningSum:
        """Add ``other``'s sums into this one (same tensors and shapes); returns self."""
        if other.shapes != self.shapes:
            raise ValueError(f"RunningSum.merge: tensors {other.shapes} do not match {self.shapes}")
        theirs, spread = other.sums, other.sparse_weight
        for name, total in self.sums.items():
            total += theirs[name]
            self.dense_weight[name] += other.dense_weight[name]
            if name in spread:
                self._spread(name)[:] += spread[name]
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
        sums = self.sums
        for name, base in previous.items():
            weight = self.weights(name)
            merged = np.asarray(base, np.float64).ravel().copy()
            np.divide(sums[name], weight, out=merged, where=weight > 0)  # no boolean gathers: O(model), one pass
            out[name] = merged.reshape(self.shapes[name]).astype(np.float32)
        return out

    def weights(self, name: str) -> np.ndarray:
        """The per-element weight sum of tensor ``name`` (float64, flat)."""
        spread = self.sparse_weight.get(name)
        dense = self.dense_weight[name]
        if spread is None:
            return np.full(self._sums[name].size, dense)
        return spread + dense if dense else spread

    def _spread(self, name: str) -> np.ndarray:
        spread = self._sparse_weight.get(name)
        if spread is None:
            spread = self._sparse_weight[name] = np.zeros(self._sums[name].size, np.float64)
        return spread

    def _check(self, name: str, tensor: Tensor) -> bool:
        """Raise ValueError if ``tensor`` does not fit tensor ``name``; True if it is sparse."""
        shape = self.shapes.get(name)
        if shape is None:
            raise ValueError(f"{name}: not a tensor of this sum (expected one of {sorted(self.shapes)[:5]})")
        if not isinstance(tensor, SparseTensor):
            index, values = _flat(tensor, shape, name)
        elif tuple(tensor.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape}, got {tuple(tensor.shape)}")
        elif _packed(tensor):  # the decoder checked its positions and values (finite) and copied them
            return True
        else:
            index, values = tensor.indices, tensor.values
        if not np.isfinite(values).all():
            raise ValueError(f"{name}: NaN or infinite values")
        # a SparseTensor's indices are strictly increasing (its constructor, the codec): the ends bound them
        if index is not None and index.size and (index[0] < 0 or index[-1] >= self._sums[name].size):
            raise ValueError(f"{name}: indices outside [0, {self._sums[name].size})")
        return isinstance(tensor, SparseTensor)

    def _stage(self, name: str, tensor: SparseTensor, weight: float) -> None:
        self._spread(name)
        stage = self._staged.get(name)
        if stage is None:
            stage = self._staged[name] = _Stage(self._sums[name].size)
        if not stage.fits(tensor):
            self._flush(name)
        stage.put(tensor, weight)

    def _flush(self, name: str) -> None:
        stage = self._staged.get(name)
        if stage is not None and stage.count:
            stage.fold(self._kernels, self._sums[name], self._sparse_weight[name])


class _Stage:
    """Sparse updates of one tensor waiting for a kernel: their weights, their float32 values
    back to back, and their positions as bitmaps (64 per word) or as flat indices."""

    def __init__(self, numel: int) -> None:
        self.numel, self.count, self.filled = numel, 0, 0
        self.capacity = max(numel, int(numel * fastfold.STAGED_VALUES))  # values that may wait
        self.mode = ""  # "bitmap" or "index": what is staged now (one kind at a time)
        self.values = np.empty(self.capacity, np.float32)
        self.offsets = np.zeros(fastfold.MAX_PENDING + 1, np.int64)
        self.weights = np.zeros(fastfold.MAX_PENDING, np.float64)
        self.words: np.ndarray | None = None  # (MAX_PENDING, ceil(numel / 64)) uint64, allocated on first use
        self.index: np.ndarray | None = None  # numel int32 (int64 past 2**31 elements), allocated on first use

    def fits(self, tensor: SparseTensor) -> bool:
        mode = "bitmap" if _packed(tensor) and tensor.bitmap is not None else "index"
        return not self.count or (
            self.mode == mode and self.count < fastfold.MAX_PENDING and self.filled + tensor.nnz <= self.capacity
        )

    def put(self, tensor: SparseTensor, weight: float) -> None:
        u, start, end = self.count, self.filled, self.filled + tensor.nnz
        if _packed(tensor) and tensor.bitmap is not None:
            self.mode = "bitmap"
            if self.words is None:
                self.words = np.zeros((fastfold.MAX_PENDING, -(-self.numel // 64)), np.uint64)
            self.words[u].view(np.uint8)[: tensor.bitmap.size] = tensor.bitmap  # the padding bytes stay 0
        else:
            self.mode = "index"
            if self.index is None:
                self.index = np.empty(self.capacity, np.int32 if self.numel < 2**31 else np.int64)
            self.index[start:end] = tensor.index if _packed(tensor) and tensor.index is not None else tensor.indices
        self.values[start:end] = tensor.values  # float32, or float16 widened exactly (as NumPy's multiply does)
        self.weights[u], self.offsets[u + 1] = weight, end
        self.count, self.filled = u + 1, end

    def fold(self, kernels, sums: np.ndarray, weight_sums: np.ndarray) -> None:
        fold = kernels.fold_bitmaps if self.mode == "bitmap" else kernels.fold_indices
        positions = self.words if self.mode == "bitmap" else self.index
        fold(sums, weight_sums, positions, self.values, self.offsets, self.weights, self.count, fastfold.TILE_ELEMENTS)
        self.count = self.filled = 0


def _packed(tensor: SparseTensor) -> bool:
    """A decoded tensor whose positions are still in their wire layout."""
    return isinstance(tensor, PackedSparse) and tensor._indices is None


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
