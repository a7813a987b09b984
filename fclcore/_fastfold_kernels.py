"""The numba kernels behind ``fclcore.fastfold`` (imported only when numba is installed).

Both fold the first ``count`` staged updates into ``sums`` and ``weight_sums`` tile by tile:
for each tile of ``tile`` elements, every update's positions inside it, in the order the
updates were staged.  Update ``u``'s float32 values are ``values[offsets[u]:offsets[u + 1]]``
in position order.  No fastmath: each product and sum rounds as NumPy's does.
"""

from __future__ import annotations

import numba
import numpy as np
from numba.cpython.unsafe.numbers import trailing_zeros


def _jit(fn):
    """Compiled, and cached on disk when numba finds a writable cache directory (next to this
    file, ``NUMBA_CACHE_DIR``, or the user's cache); compiled at every start otherwise."""
    try:
        return numba.njit(cache=True, nogil=True)(fn)
    except RuntimeError:  # "cannot cache function ...: no locator available" (a read-only install)
        return numba.njit(nogil=True)(fn)


@_jit
def fold_bitmaps(sums, weight_sums, words, values, offsets, weights, count, tile):  # pragma: no cover (compiled)
    """``words``: (staged, ceil(numel / 64)) uint64, the codec's little-bit-order bitmaps."""
    nwords = words.shape[1]
    step = max(1, tile // 64)
    cursor = offsets[:count].copy()
    for first in range(0, nwords, step):
        last = min(nwords, first + step)
        for u in range(count):
            w = weights[u]
            k = cursor[u]
            for j in range(first, last):
                x = words[u, j]
                base = j * 64
                while x:
                    i = base + trailing_zeros(x)
                    sums[i] += np.float64(values[k]) * w
                    weight_sums[i] += w
                    k += 1
                    x &= x - np.uint64(1)
            cursor[u] = k


@_jit
def fold_indices(sums, weight_sums, indices, values, offsets, weights, count, tile):  # pragma: no cover (compiled)
    """``indices``: update ``u``'s strictly increasing flat positions at ``offsets[u]:offsets[u + 1]``."""
    n = sums.size
    cursor = offsets[:count].copy()
    for first in range(0, n, tile):
        last = min(n, first + tile)
        for u in range(count):
            w = weights[u]
            k = cursor[u]
            end = offsets[u + 1]
            while k < end and indices[k] < last:
                i = indices[k]
                sums[i] += np.float64(values[k]) * w
                weight_sums[i] += w
                k += 1
            cursor[u] = k
