"""Optional compiled kernels for ``RunningSum``: fold several sparse updates in one pass.

``RunningSum.add`` folds a sparse update as ``sums[i] += float64(value) * weight`` and
``weight_sums[i] += weight`` at each position ``i`` the update carries.  In NumPy that costs
expanding the codec's position bitmap into an int64 index array, then two scatter-adds that
each stream the model's float64 sums (16 bytes per element) from memory.  The kernels here
walk the wire layout as it arrived (the bitmap, 64 positions per word, or the u16/u32
index list) and do both adds in one pass; ``RunningSum`` stages up to ``MAX_PENDING``
updates and folds them tile by tile, so each tile of the sums is loaded from memory once for
all of them instead of once per update.  Per element, the additions happen in the order
the updates were added, with the same float64 products as NumPy's, so the sums are bit for
bit those of the NumPy path (``tests/unit/test_fastfold.py``).

The kernels need numba (``pip install fcl-edge[fast]``); without it, or with
``FCL_EDGE_NUMBA=0`` in the environment, ``kernels()`` is None and ``RunningSum`` folds
with NumPy.  They are compiled on first use (a few seconds, then cached on disk by numba).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np

log = logging.getLogger(__name__)
MAX_PENDING = 16  # updates staged before a fold
STAGED_VALUES = 1.0  # values staged per tensor before a fold, in dense copies of the tensor (float32)
TILE_ELEMENTS = 16384  # elements per tile: 256 KiB of sums and weight sums, inside a core's L2
_kernels: Any = None
_loaded = False


def enabled() -> bool:
    """Whether the kernels may be used: numba importable and not switched off."""
    return kernels() is not None


def kernels() -> Any:
    """The compiled kernels (a namespace with ``fold_bitmaps`` and ``fold_indices``), or None."""
    global _kernels, _loaded
    if not _loaded:
        _loaded = True
        if os.environ.get("FCL_EDGE_NUMBA", "1") != "0":
            try:
                _kernels = _compile()
            except ImportError:  # numba is not installed: the NumPy fold
                _kernels = None
            except Exception as exc:  # noqa: BLE001  (an accelerator that fails to load must not stop a service)
                log.warning("compiled fold unavailable, folding with NumPy: %s", exc)
                _kernels = None
    return _kernels


def version() -> str | None:
    """numba's version when the kernels are in use, else None (what benchmarks record)."""
    if kernels() is None:
        return None
    import numba

    return str(numba.__version__)


def warm() -> bool:
    """Compile (or load from numba's cache) both kernels now, not in the first round's first
    fold; True when they are in use."""
    k = kernels()
    if k is None:
        return False
    sums, weight_sums, offsets, weights = np.zeros(64), np.zeros(64), np.zeros(2, np.int64), np.ones(1)
    values = np.zeros(1, np.float32)
    k.fold_bitmaps(sums, weight_sums, np.zeros((1, 1), np.uint64), values, offsets, weights, 1, TILE_ELEMENTS)
    for dtype in (np.int32, np.int64):
        k.fold_indices(sums, weight_sums, np.zeros(1, dtype), values, offsets, weights, 1, TILE_ELEMENTS)
    return True


def _compile() -> Any:
    import numba  # noqa: F401  (ImportError: no accelerator)

    from fclcore import _fastfold_kernels

    return _fastfold_kernels
