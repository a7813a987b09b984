"""Compact coding of a weight update restricted to a MADE mask and a set of kept units.

Both sides can derive the MADE mask of a round from the synchronised seed, so positions
inside it are never sent: the upload is the selected values in row-major order plus a
one-bit-per-unit map of the kept output units.  For a (out, in) weight that costs
``out / 8`` bytes of index information instead of 2-4 bytes per value.

On the wire, weight ``name`` travels as ``name`` (1-D values) and ``name#units`` (a sparse
0/1 vector over output units).
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from fclcore.codec import SparseTensor, Tensor

UNITS = "#units"
MIN_GATE = 0.05  # bound on 1/sigmoid(m) when merging G / sigmoid(m), so a nearly closed unit cannot blow up B


def top_units(gate: np.ndarray, share: float) -> np.ndarray:
    """The ``share`` of units with the largest gate sigmoid(m) (ranked by the gate, not raw m)."""
    keep = max(1, int(round(share * gate.size)))
    units = np.zeros(gate.size, dtype=bool)
    units[np.argsort(-gate, kind="stable")[:keep]] = True
    return units


def dense(t: Tensor) -> np.ndarray:
    """A received tensor as a dense float32 array."""
    return t.to_dense() if isinstance(t, SparseTensor) else np.asarray(t, dtype=np.float32)


def selection(made_mask: np.ndarray | None, units: np.ndarray) -> np.ndarray:
    """Boolean (out, in) selection: kept rows, inside the MADE mask if there is one."""
    rows = np.asarray(units, dtype=bool)[:, None]
    return rows & (made_mask > 0) if made_mask is not None else np.broadcast_to(rows, rows.shape)


def pack(name: str, values: np.ndarray, made_mask: np.ndarray | None, units: np.ndarray) -> dict[str, Tensor]:
    """``values`` (out, in) -> the tensors that carry its selected entries."""
    units = np.asarray(units, dtype=bool)
    sel = np.broadcast_to(selection(made_mask, units), values.shape)
    unit_map = SparseTensor(
        (units.size,), np.flatnonzero(units).astype(np.int64), np.ones(int(units.sum()), dtype=np.float32)
    )
    return {name: np.ascontiguousarray(values[sel], dtype=np.float32), name + UNITS: unit_map}


def unpack(
    name: str, tensors: Mapping[str, Tensor], shape: tuple[int, int], made_mask: np.ndarray | None
) -> SparseTensor:
    """Inverse of ``pack``; ValueError naming the tensor if anything does not fit."""
    if name not in tensors or name + UNITS not in tensors:
        raise ValueError(f"{name}: expected tensors {name!r} and {name + UNITS!r}")
    unit_map, values = tensors[name + UNITS], tensors[name]
    dense_units = unit_map.to_dense() if isinstance(unit_map, SparseTensor) else np.asarray(unit_map)
    if dense_units.shape != (shape[0],) or not np.isin(dense_units, (0.0, 1.0)).all():
        raise ValueError(f"{name + UNITS}: expected a 0/1 vector of {shape[0]} units")
    sel = np.broadcast_to(selection(made_mask, dense_units > 0), shape)
    if isinstance(values, SparseTensor) or values.ndim != 1 or values.size != int(sel.sum()):
        raise ValueError(
            f"{name}: expected {int(sel.sum())} values for the selected entries, "
            f"got shape {getattr(values, 'shape', None)}"
        )
    return SparseTensor(tuple(shape), np.flatnonzero(sel).astype(np.int64), values.astype(np.float32))
