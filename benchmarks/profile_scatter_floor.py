#!/usr/bin/env python
"""The floor under the streaming fold's kernel on this machine: a bare scatter-add.

``RunningSum``'s compiled kernels (``fclcore/_fastfold_kernels.py``) decode an update's
positions from its wire layout and, at each, add ``float64(value) * weight`` to the value sum
and ``weight`` to the weight sum, tile by tile over ``MAX_PENDING`` staged updates.  This
script times that inner loop on positions already expanded to an int32 index list (no
bitmap to walk, no checks, no staging), in the kernels' tile order, for three layouts of the
sums:

* ``separate``: float64 value sums and float64 weight sums in two arrays (what the
  aggregator keeps: exact to float32 rounding, 16 bytes per element), folded by the
  service's own index-list kernel (``fold_indices``);
* ``interleaved``: the same sums, value and weight side by side in one (n, 2) array;
* ``float32``: float32 value and weight sums (8 bytes per element; not exact: shown as
  the price of exactness, not as an option).

The figure is nanoseconds per value folded, the best of ``--repeat`` passes (CPU time).
What the kernel of ``profile_fold.py`` costs above ``separate`` is its position decoding
and loop bookkeeping; what ``separate`` costs is the floor for exact sums in scalar code.
Needs numba.  Prints one JSON object.

    python benchmarks/profile_scatter_floor.py
    python benchmarks/profile_scatter_floor.py --tile 4096 --density 0.05
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def kernels():
    import numba

    from fclcore._fastfold_kernels import fold_indices  # the service's own index-list kernel

    @numba.njit(nogil=True)
    def interleaved(both, index, values, offsets, weights, count, tile):
        n = both.shape[0]
        cursor = offsets[:count].copy()
        for first in range(0, n, tile):
            last = min(n, first + tile)
            for u in range(count):
                w, k, end = weights[u], cursor[u], offsets[u + 1]
                while k < end and index[k] < last:
                    i = index[k]
                    both[i, 0] += np.float64(values[k]) * w
                    both[i, 1] += w
                    k += 1
                cursor[u] = k

    @numba.njit(nogil=True)
    def single(sums, weight_sums, index, values, offsets, weights, count, tile):
        n = sums.size
        cursor = offsets[:count].copy()
        for first in range(0, n, tile):
            last = min(n, first + tile)
            for u in range(count):
                w, k, end = np.float32(weights[u]), cursor[u], offsets[u + 1]
                while k < end and index[k] < last:
                    i = index[k]
                    sums[i] += values[k] * w
                    weight_sums[i] += w
                    k += 1
                cursor[u] = k

    return fold_indices, interleaved, single


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, default=250_000, help="elements of the tensor (bench_aggregate's: 250,000)")
    ap.add_argument("--density", type=float, default=0.1, help="share of the tensor an update carries")
    ap.add_argument("--staged", type=int, default=16, help="updates folded together (fastfold.MAX_PENDING)")
    ap.add_argument("--tile", type=int, default=16384, help="elements per tile (fastfold.TILE_ELEMENTS)")
    ap.add_argument("--repeat", type=int, default=5, help="passes; the best is kept")
    args = ap.parse_args(argv)
    separate, interleaved, single = kernels()
    rng = np.random.default_rng(0)
    lists = [np.flatnonzero(rng.random(args.numel) < args.density).astype(np.int32) for _ in range(args.staged)]
    offsets = np.zeros(args.staged + 1, np.int64)
    offsets[1:] = np.cumsum([x.size for x in lists])
    index = np.concatenate(lists)
    values = rng.standard_normal(index.size).astype(np.float32)
    weights = rng.integers(1, 1000, args.staged).astype(np.float64)
    layouts = {
        "separate": (separate, lambda: (np.zeros(args.numel), np.zeros(args.numel))),
        "interleaved": (interleaved, lambda: (np.zeros((args.numel, 2)),)),
        "float32": (single, lambda: (np.zeros(args.numel, np.float32), np.zeros(args.numel, np.float32))),
    }
    out = {"numel": args.numel, "density": args.density, "staged": args.staged, "tile": args.tile}
    for name, (kernel, make) in layouts.items():
        sums = make()
        kernel(*sums, index, values, offsets, weights, args.staged, args.tile)  # compiled, pages in
        best = float("inf")
        for _ in range(args.repeat):
            c0 = time.process_time()
            kernel(*sums, index, values, offsets, weights, args.staged, args.tile)
            best = min(best, time.process_time() - c0)
        out[f"{name}_ns_per_value"] = round(best * 1e9 / index.size, 3)
    per_update = out["separate_ns_per_value"] * args.numel * args.density * 4 / 1e6  # 4 tensors: 1M parameters
    out["separate_ms_per_1m_update"] = round(per_update, 4)
    out["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    out["command"] = " ".join(["python", "benchmarks/profile_scatter_floor.py", *sys.argv[1:]])
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
