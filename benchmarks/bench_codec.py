#!/usr/bin/env python
"""Benchmark the wire codec: encode/decode time and throughput for one large tensor.

For each value coding (float32, float16, int8 with nearest and with stochastic
rounding, --int8-block values per scale) and density (100%, 10%, 1% by default) a
single float32 tensor of --elements elements is put in a frame; density 100% is
sent as a dense np.ndarray, lower densities as a SparseTensor (the encoder then
picks the smallest layout).  Timings are the median over --repeats runs after
--warmup runs.  max_abs_error is the largest |decoded - sent| over the tensor
(values are standard normal).  Two throughputs are reported, both in MB/s with
MB = 10**6 bytes:

* wire:  frame bytes / time          (how fast bytes move through the codec)
* dense: elements * 4 bytes / time   (the float32 model data it stands for)

Prints a markdown table and writes JSON (results + machine info + command line).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # allow `python benchmarks/bench_codec.py` without installing
    sys.path.insert(0, str(REPO))

from fclcore.codec import Frame, Header, Kind, SparseTensor, ValueCoding, decode, encode  # noqa: E402

LAYOUT_NAMES = {0: "dense", 1: "index", 2: "bitmap"}
CODINGS = {  # benchmark name -> (dtype, rounding)
    "float32": ("float32", "nearest"),
    "float16": ("float16", "nearest"),
    "int8": ("int8", "nearest"),
    "int8-stochastic": ("int8", "stochastic"),
}
HEADER = Header(Kind.UPDATE, "bench", 1, 0, "client-0", 1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--elements", type=int, default=1_000_000, help="tensor size (elements)")
    parser.add_argument(
        "--densities",
        type=float,
        nargs="+",
        default=[1.0, 0.1, 0.01],
        help="fractions of non-zero entries; 1.0 is sent as a dense ndarray",
    )
    parser.add_argument("--dtypes", nargs="+", default=list(CODINGS), choices=list(CODINGS), help="wire value codings")
    parser.add_argument("--int8-block", type=int, default=64, help="int8: values per float32 scale")
    parser.add_argument("--repeats", type=int, default=20, help="timed runs per case")
    parser.add_argument("--warmup", type=int, default=3, help="untimed runs per case")
    parser.add_argument("--seed", type=int, default=0, help="RNG seed for the tensor")
    parser.add_argument(
        "--out", type=Path, default=REPO / "benchmarks" / "results" / "codec.json", help="JSON output path"
    )
    return parser.parse_args(argv)


def make_tensor(elements: int, density: float, rng: np.random.Generator) -> np.ndarray | SparseTensor:
    values = rng.standard_normal(elements).astype(np.float32)
    if density >= 1.0:
        return values
    nnz = int(round(elements * density))
    indices = np.sort(rng.choice(elements, size=nnz, replace=False))
    return SparseTensor((elements,), indices, values[:nnz])


def time_ms(fn: Callable[[], object], repeats: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return samples


def layout_of(data: bytes, meta: dict) -> str:
    """Layout byte of the single tensor 't': it follows the u16 count and the 2-byte name.

    A frame with the same header/meta and no tensors ends with count(2) + CRC(4), so
    its length minus 2 is where the layout byte sits in the one-tensor frame.
    """
    return LAYOUT_NAMES[data[len(encode(Frame(HEADER, meta))) - 2]]


def max_abs_error(sent, data: bytes) -> float:
    got = decode(data).tensors["t"]
    dense = [t.to_dense() if isinstance(t, SparseTensor) else t for t in (sent, got)]
    return float(np.abs(dense[0].astype(np.float64) - dense[1]).max())


def run_case(tensor, value_dtype: str, density: float, args: argparse.Namespace) -> dict:
    frame = Frame(HEADER, {"bench": True}, {"t": tensor})
    dtype, rounding = CODINGS[value_dtype]
    coding = ValueCoding(dtype, args.int8_block, rounding, seed=args.seed)
    data = encode(frame, coding)
    enc = time_ms(lambda: encode(frame, coding), args.repeats, args.warmup)
    dec = time_ms(lambda: decode(data), args.repeats, args.warmup)
    enc_ms, dec_ms = statistics.median(enc), statistics.median(dec)
    dense_bytes = args.elements * 4
    return {
        "value_dtype": value_dtype,
        "density": density,
        "layout": layout_of(data, frame.meta),
        "nnz": args.elements if isinstance(tensor, np.ndarray) else tensor.nnz,
        "frame_bytes": len(data),
        "max_abs_error": max_abs_error(tensor, data),
        "dense_float32_bytes": dense_bytes,
        "encode_ms_median": enc_ms,
        "encode_ms_min": min(enc),
        "decode_ms_median": dec_ms,
        "decode_ms_min": min(dec),
        "encode_wire_MBps": len(data) / enc_ms / 1e3,
        "decode_wire_MBps": len(data) / dec_ms / 1e3,
        "encode_dense_MBps": dense_bytes / enc_ms / 1e3,
        "decode_dense_MBps": dense_bytes / dec_ms / 1e3,
    }


def machine_info() -> dict:
    return {
        "processor": platform.processor(),
        "machine": platform.machine(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
    }


def markdown_table(results: list[dict]) -> str:
    lines = [
        "| dtype | density | layout | frame KB | max abs error | enc ms | enc MB/s wire | enc MB/s dense "
        "| dec ms | dec MB/s wire | dec MB/s dense |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['value_dtype']} | {r['density']:.0%} | {r['layout']} | {r['frame_bytes'] / 1e3:,.1f} "
            f"| {r['max_abs_error']:.2g} "
            f"| {r['encode_ms_median']:.2f} | {r['encode_wire_MBps']:,.0f} | {r['encode_dense_MBps']:,.0f} "
            f"| {r['decode_ms_median']:.2f} | {r['decode_wire_MBps']:,.0f} | {r['decode_dense_MBps']:,.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rng = np.random.default_rng(args.seed)
    tensors = {d: make_tensor(args.elements, d, rng) for d in args.densities}
    results = [run_case(tensors[d], vd, d, args) for vd in args.dtypes for d in args.densities]
    print(
        f"codec benchmark: {args.elements:,} elements, median of {args.repeats} runs "
        f"(MB = 10^6 bytes; 'dense' = elements x 4 bytes)\n"
    )
    print(markdown_table(results))
    report = {
        "benchmark": "codec",
        "timestamp": dt.datetime.now(dt.timezone.utc).isoformat(),
        "command": shlex.join([sys.executable, *sys.argv]),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": machine_info(),
        "load_average_1_5_15_min": os.getloadavg(),  # timings on a shared machine: how busy it was
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
