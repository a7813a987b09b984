#!/usr/bin/env python
"""Where the streaming aggregator's time goes per sparse update, part by part, in one process.

On ``bench_aggregate.py``'s updates (``--params`` parameters in ``--tensors`` tensors, random
positions at ``--density``, float32 values; ``--n`` of them, encoded before anything is timed):

* ``crc_ms``: the codec's CRC32 over one frame (``fclcore.crc``: ISA-L's with ``isal``
  installed) and ``crc_zlib_ms``: zlib's over the same bytes;
* ``decode_ms``: ``codec.decode`` of every frame, back to back (the frames are far larger than
  the caches, so each is read from memory, as a received one is), and ``decode_zlib_ms``: the
  same with the codec's CRC32 switched to zlib's;
* ``stage_ms``: copying an update's values and bitmaps into ``RunningSum``'s staging buffers;
* ``kernel_ms``: the compiled fold of staged updates alone (``fastfold``'s ``fold_bitmaps``),
  per update, and ``ns_per_value``: the same per value folded; ``--tile`` sets its tile size;
* ``add_ms``: ``RunningSum.add`` per update (checks, staging and folding together).

Each figure is the best of ``--repeat`` passes, in milliseconds per update (CPU time).  Needs
numba (``pip install fcl-edge[fast]``).  Prints one JSON object.

    python benchmarks/profile_fold.py
    python benchmarks/profile_fold.py --tile 2048
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import zlib
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import bench_aggregate as agg  # noqa: E402  (a sibling script: benchmarks/ is sys.path[0])

from fclcore import codec, crc, fastfold  # noqa: E402
from fclcore.aggregation import RunningSum, _Stage  # noqa: E402


def best(fn, repeat: int, count: int) -> float:
    """Best of ``repeat`` CPU-time passes of ``fn``, in ms per one of ``count`` items."""
    times = []
    for _ in range(repeat):
        c0 = time.process_time()
        fn()
        times.append(time.process_time() - c0)
    return round(min(times) * 1e3 / count, 4)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=100, help="updates")
    ap.add_argument("--params", type=int, default=1_000_000, help="model parameters")
    ap.add_argument("--tensors", type=int, default=4, help="tensors the parameters are split into")
    ap.add_argument("--density", type=float, default=0.1, help="share of each tensor an update carries")
    ap.add_argument("--tile", type=int, default=fastfold.TILE_ELEMENTS, help="elements per tile of the kernel")
    ap.add_argument("--repeat", type=int, default=5, help="passes; the best is kept")
    args = ap.parse_args(argv)
    if fastfold.kernels() is None:
        ap.error("the compiled fold needs numba (pip install fcl-edge[fast]) and FCL_EDGE_NUMBA unset")
    fastfold.warm()
    fastfold.TILE_ELEMENTS = args.tile
    bench_args = agg.parse_args(["--params", str(args.params), "--tensors", str(args.tensors)])
    bench_args.density = args.density
    shapes = agg.model_shapes(args.params, args.tensors)
    payloads = [agg.wire_frame(*agg.make_update(bench_args, shapes, i), i) for i in range(args.n)]
    frames = [codec.decode(p, agg.LIMITS) for p in payloads]
    previous = {name: np.zeros(shape, np.float32) for name, shape in shapes.items()}
    weights = [float(f.meta["n_samples"]) for f in frames]
    values = sum(t.nnz for f in frames for t in f.tensors.values())
    out = {"crc": crc.implementation(), "n": args.n, "params": args.params, "density": args.density}
    out["crc_ms"] = best(lambda: [crc.crc32(memoryview(p)[:-4]) for p in payloads], args.repeat, args.n)
    out["crc_zlib_ms"] = best(lambda: [zlib.crc32(memoryview(p)[:-4]) for p in payloads], args.repeat, args.n)
    out["decode_ms"] = best(lambda: [codec.decode(p, agg.LIMITS) for p in payloads], args.repeat, args.n)
    fast_crc, codec.crc32 = codec.crc32, zlib.crc32
    try:
        out["decode_zlib_ms"] = best(lambda: [codec.decode(p, agg.LIMITS) for p in payloads], args.repeat, args.n)
    finally:
        codec.crc32 = fast_crc

    groups: list[tuple[str, list]] = []  # (tensor, the updates' tensors one stage holds)
    pool = {name: _Stage(int(np.prod(shape))) for name, shape in shapes.items()}  # reused: no allocation timed
    sums = {name: (np.zeros(st.numel), np.zeros(st.numel)) for name, st in pool.items()}  # touched below
    for name, stage in pool.items():
        group: list = []
        for frame, weight in zip(frames, weights):
            if not stage.fits(frame.tensors[name]):
                groups.append((name, group))
                stage.count = stage.filled = 0
                group = []
            stage.put(frame.tensors[name], weight)
            group.append((frame.tensors[name], weight))
        groups.append((name, group))
        stage.fold(fastfold.kernels(), *sums[name])  # compiles nothing new; faults the sums' pages in
    kernels = fastfold.kernels()

    def stage_all() -> None:
        for name, group in groups:
            stage = pool[name]
            stage.count = stage.filled = 0
            for tensor, weight in group:
                stage.put(tensor, weight)

    def fold_only() -> float:  # CPU seconds of the kernel calls alone, every group staged first (untimed)
        spent = 0.0
        for name, group in groups:
            stage = pool[name]
            stage.count = stage.filled = 0
            for tensor, weight in group:
                stage.put(tensor, weight)
            c0 = time.process_time()
            stage.fold(kernels, *sums[name])
            spent += time.process_time() - c0
        return spent

    out["stage_ms"] = best(stage_all, args.repeat, args.n)
    out["kernel_ms"] = round(min(fold_only() for _ in range(args.repeat)) * 1e3 / args.n, 4)
    out["ns_per_value"] = round(out["kernel_ms"] * 1e6 * args.n / values, 3)

    def add_all() -> None:
        running = RunningSum.over(previous, fast=True)
        for frame, weight in zip(frames, weights):
            running.add(frame.tensors, weight)
        running.flush()

    out["add_ms"] = best(add_all, args.repeat, args.n)
    out.update(tile=args.tile, loadavg=[round(x, 2) for x in os.getloadavg()], numba=fastfold.version())
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
