"""Federated averaging and update templates as pure NumPy functions (no torch on the
aggregator's path); method strategies build on them.

Updates may be dense arrays or ``SparseTensor``s: each element of the global tensor is the
sample-weighted mean over the clients that sent that element, and elements nobody sent keep
their previous global value.  With dense updates from every client this is exactly
``np.average(stack, axis=0, weights=n_samples)``.
"""

from __future__ import annotations

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
            if index is None:
                total += weight * values
                weight_sum += weight
            else:  # indices are unique (the codec enforces strictly increasing)
                total[index] += weight * values
                weight_sum[index] += weight
        merged = base.astype(np.float64).ravel().copy()
        sent = weight_sum > 0
        merged[sent] = total[sent] / weight_sum[sent]
        out[name] = merged.reshape(base.shape).astype(np.float32)
    return out


def _flat(tensor: Tensor, shape: tuple[int, ...], name: str) -> tuple[np.ndarray | None, np.ndarray]:
    if isinstance(tensor, SparseTensor):
        if tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(tensor.shape)}")
        return tensor.indices, tensor.values.astype(np.float64)
    if tensor.shape != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tensor.shape}")
    return None, tensor.astype(np.float64).ravel()


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
