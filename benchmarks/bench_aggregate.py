#!/usr/bin/env python
"""Benchmark aggregation of N sparse updates in one process: streaming, batch, and Flower.

* ``streaming``: each update is decoded from its wire frame and folded into a
  ``fclcore.aggregation.RunningSum`` as it "arrives"; the round then closes from the sums.
  Only one update is alive at a time (plus up to 16 staged in the compiled fold).  The fold
  is ``fclcore.fastfold``'s compiled kernels when numba is installed (``pip install
  fcl-edge[fast]``) and NumPy otherwise, or with ``--fold numpy``; ``fold`` in the run says
  which.
* ``batch``: each update is decoded as it arrives and kept; ``weighted_average`` over the list
  at the end (what the aggregator did before streaming).
* ``flwr``: the same updates in dense float32 form, serialised as Flower ``Parameters`` (what
  a Flower server holds per result); ``flwr.server.strategy.aggregate.aggregate_inplace`` over
  them, its deserialisation included.  Skipped when ``flwr`` is not importable (``pip install
  fcl-edge[bench]``).

``seconds`` is the aggregation time from decoded updates for ours (fold + close, or the
``weighted_average`` call) and from serialised parameters for Flower (as Flower's FedAvg path
runs); ``decode_seconds`` is our codec's decoding of the same frames (CRC, every validation).
Flower's time includes its deserialisation, so the headline ``ratio_streaming_vs_flwr_N`` is
ours from bytes to sums (decode + fold + close) over Flower's; the fold-only ratio
(``ratio_streaming_fold_only_vs_flwr_N``) leaves our decode out.  ``cpu_seconds`` is the
process CPU time of the same timed work (what wall time would be on an idle core), given
beside the wall times because the machine is shared; ``ratio_*_cpu`` use it.
The frame checks are timed apart as well, per update on the same frames: ``crc_seconds``
(the CRC32 the decoder checks, part of ``decode_seconds``; ISA-L's with the ``fast`` extra,
``machine.crc`` says which) and ``hmac_seconds`` (verifying a
device signature, what an aggregator with ``keys_dir`` adds before decoding; not in the
ratio, as the updates here are unsigned).
Each (impl, N) runs in a child process of its own, so ``peak_rss_mb`` (VmHWM) is that impl's.
Updates are drawn from ``--seed`` and the update's number, so every impl sees the same ones.
Writes ``benchmarks/results/aggregate.json`` and ``aggregate.md``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # allow `python benchmarks/bench_aggregate.py` without installing
    sys.path.insert(0, str(REPO))

from bench_codec import machine_info  # noqa: E402  (a sibling script: benchmarks/ is sys.path[0])

from fclcore import crc, fastfold  # noqa: E402
from fclcore.aggregation import RunningSum, weighted_average  # noqa: E402
from fclcore.codec import CodecLimits, Frame, Header, Kind, SparseTensor, decode, encode  # noqa: E402
from fclcore.procmem import peak_rss_mb, rss_mb  # noqa: E402
from fclcore.signing import sign, verify  # noqa: E402

IMPLS = ("streaming", "batch", "flwr")
RATIO_TARGET, FOLDS_TARGET = 0.25, 4000  # issue 18: vs Flower's dense FedAvg path; updates per second
LIMITS = CodecLimits(max_frame_bytes=256 * 2**20)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--ns", type=int, nargs="+", default=[100, 1000], help="updates per round")
    parser.add_argument("--params", type=int, default=1_000_000, help="model parameters")
    parser.add_argument("--tensors", type=int, default=4, help="tensors the parameters are split into")
    parser.add_argument("--density", type=float, default=0.1, help="fraction of each tensor an update carries")
    parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS, help="implementations to time")
    parser.add_argument("--seed", type=int, default=0, help="RNG seed of the updates")
    parser.add_argument(
        "--fold", choices=("auto", "numpy"), default="auto", help="streaming fold: compiled kernels if numba imports"
    )
    parser.add_argument(
        "--out", type=Path, default=REPO / "benchmarks" / "results" / "aggregate.json", help="JSON output path"
    )
    parser.add_argument("--child", nargs=2, metavar=("IMPL", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not 0 < args.density <= 1 or args.params < args.tensors or args.tensors < 1 or min(args.ns) < 1:
        parser.error("expected 0 < density <= 1, params >= tensors >= 1, N >= 1")
    return args


# -- the updates ---------------------------------------------------------------------------
def model_shapes(params: int, tensors: int) -> dict[str, tuple[int, int]]:
    """``tensors`` 2-D tensors of (rows, 1000) or so, about ``params`` elements in all."""
    per = params // tensors
    cols = min(1000, per)
    return {f"layer{i}.weight": (per // cols, cols) for i in range(tensors)}


def make_update(args: argparse.Namespace, shapes: dict, i: int) -> tuple[dict[str, SparseTensor], int]:
    """Update ``i``: each tensor sparse at ``density`` (random positions), and a sample count."""
    rng = np.random.default_rng((args.seed, i))
    tensors = {}
    for name, shape in shapes.items():
        size = shape[0] * shape[1]
        index = np.flatnonzero(rng.random(size, dtype=np.float32) < args.density)
        tensors[name] = SparseTensor(shape, index, rng.standard_normal(index.size, dtype=np.float32))
    return tensors, int(rng.integers(1, 1000))


def wire_frame(tensors: dict, n_samples: int, i: int) -> bytes:
    header = Header(Kind.UPDATE, "bench", 1, 0, f"client-{i}", i + 1)
    return encode(Frame(header, {"n_samples": n_samples}, tensors), "float32", LIMITS)


def dense(tensor: SparseTensor) -> np.ndarray:
    out = np.zeros(tensor.shape[0] * tensor.shape[1], np.float32)
    out[tensor.indices] = tensor.values
    return out.reshape(tensor.shape)


# -- one impl in a child process ----------------------------------------------------------
def run_child(args: argparse.Namespace, impl: str, n: int) -> dict:
    shapes = model_shapes(args.params, args.tensors)
    previous = {name: np.zeros(shape, np.float32) for name, shape in shapes.items()}
    baseline = rss_mb()
    out = {"impl": impl, "n": n}
    if impl == "flwr":
        out.update(_time_flwr(args, shapes, n))
    else:
        out.update(_time_ours(args, shapes, previous, impl, n))
    out.update(baseline_rss_mb=baseline, peak_rss_mb=peak_rss_mb())
    return out


def _time_ours(args, shapes, previous, impl: str, n: int) -> dict:
    decode_s = fold_s = decode_cpu = fold_cpu = crc_s = hmac_s = 0.0
    fast = impl == "streaming" and args.fold == "auto" and fastfold.warm()  # compiled before timing
    running = RunningSum.over(previous, fast=fast) if impl == "streaming" else None
    kept = []
    key = bytes(range(32))
    for i in range(n):
        payload = wire_frame(*make_update(args, shapes, i), i)  # untimed: the device's side
        if running is not None:
            signed = sign(payload, key)  # untimed: the device's side
            t0 = time.perf_counter()
            crc.crc32(memoryview(payload)[:-4])
            t1 = time.perf_counter()
            verify(signed, key)
            crc_s, hmac_s = crc_s + t1 - t0, hmac_s + time.perf_counter() - t1
            del signed
        c0, t0 = time.process_time(), time.perf_counter()
        frame = decode(payload, LIMITS)
        c1, t1 = time.process_time(), time.perf_counter()
        del payload
        if running is not None:
            running.add(frame.tensors, float(frame.meta["n_samples"]))
        else:
            kept.append((frame.tensors, float(frame.meta["n_samples"])))
        decode_s, decode_cpu = decode_s + t1 - t0, decode_cpu + c1 - c0
        fold_s, fold_cpu = fold_s + time.perf_counter() - t1, fold_cpu + time.process_time() - c1
        _progress(i, n)
    if running is not None:  # what is still staged is folded here, and counted as folding
        c0, t0 = time.process_time(), time.perf_counter()
        running.flush()
        fold_s, fold_cpu = fold_s + time.perf_counter() - t0, fold_cpu + time.process_time() - c0
    c0, t0 = time.process_time(), time.perf_counter()
    result = running.result(previous) if running is not None else weighted_average(kept, previous)
    close_s, close_cpu = time.perf_counter() - t0, time.process_time() - c0
    streaming = running is not None
    return {
        "seconds": round(fold_s + close_s if streaming else close_s, 4),
        "cpu_seconds": round(fold_cpu + close_cpu if streaming else close_cpu, 4),
        "decode_seconds": round(decode_s, 4),
        "decode_cpu_seconds": round(decode_cpu, 4),
        "close_seconds": round(close_s, 4),
        "folds_per_s": round(n / fold_s, 1) if streaming else None,  # RunningSum.add alone
        "folds_per_cpu_s": round(n / fold_cpu, 1) if streaming else None,  # the same per CPU-second (a busy machine)
        "decoded_folds_per_s": round(n / (decode_s + fold_s), 1) if streaming else None,  # bytes in, folded
        "fold": (f"numba {fastfold.version()}" if fast else "numpy") if streaming else None,
        "crc_seconds": round(crc_s, 4) if streaming else None,
        "hmac_seconds": round(hmac_s, 4) if streaming else None,
        "checksum": float(sum(np.sum(v, dtype=np.float64) for v in result.values())),
    }


def _time_flwr(args, shapes, n: int) -> dict:
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
    from flwr.server.strategy.aggregate import aggregate_inplace

    results = []
    for i in range(n):  # untimed: what a Flower server holds once every result came in
        tensors, n_samples = make_update(args, shapes, i)
        parameters = ndarrays_to_parameters([dense(t) for t in tensors.values()])
        results.append((None, FitRes(Status(Code.OK, ""), parameters, n_samples, {})))
        _progress(i, n)
    c0, t0 = time.process_time(), time.perf_counter()
    result = aggregate_inplace(results)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {
        "seconds": round(seconds, 4),
        "cpu_seconds": round(cpu, 4),
        "checksum": float(sum(np.sum(v, dtype=np.float64) for v in result)),
    }


def _progress(i: int, n: int) -> None:
    if (i + 1) % max(1, n // 4) == 0:
        print(f"    {i + 1}/{n} updates", file=sys.stderr, flush=True)


# -- the parent ----------------------------------------------------------------------------
def flwr_version() -> str | None:
    try:
        import flwr
    except ImportError:
        return None
    return str(flwr.__version__)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(run_child(args, args.child[0], int(args.child[1]))))
        return 0
    impls = [i for i in args.impls if i != "flwr" or flwr_version() is not None]
    if "flwr" in args.impls and "flwr" not in impls:
        print("flwr is not importable: skipping it (pip install fcl-edge[bench])", file=sys.stderr)
    load_before = os.getloadavg()
    runs = []
    jobs = [(impl, n) for n in args.ns for impl in impls]
    for k, (impl, n) in enumerate(jobs, 1):
        print(f"[{k}/{len(jobs)}] {impl} N={n}", file=sys.stderr, flush=True)
        child = [sys.executable, __file__, *_passthrough(argv), "--child", impl, str(n)]
        done = subprocess.run(child, stdout=subprocess.PIPE, text=True, check=True)
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        r = runs[-1]
        print(f"    {r['seconds']:.3f} s, peak RSS {r['peak_rss_mb']:.0f} MiB", file=sys.stderr, flush=True)
    report = summarise(args, runs, load_before)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    table = markdown(report)
    args.out.with_suffix(".md").write_text(table)
    print(table)
    return 0


def _passthrough(argv: list[str] | None) -> list[str]:
    """The parent's options minus --out (a child writes nothing)."""
    given = list(sys.argv[1:] if argv is None else argv)
    if "--out" in given:
        at = given.index("--out")
        del given[at : at + 2]
    return given


def summarise(args: argparse.Namespace, runs: list[dict], load_before: tuple) -> dict:
    by = {(r["impl"], r["n"]): r for r in runs}
    report: dict = {"benchmark": "aggregate", "runs": runs}
    top = max(args.ns)
    if ("streaming", top) in by and ("flwr", top) in by:
        s, f = by[("streaming", top)], by[("flwr", top)]  # Flower's time includes its deserialisation
        report[f"ratio_streaming_vs_flwr_{top}"] = round((s["seconds"] + s["decode_seconds"]) / f["seconds"], 4)
        report[f"ratio_streaming_fold_only_vs_flwr_{top}"] = round(s["seconds"] / f["seconds"], 4)
        report[f"ratio_streaming_vs_flwr_{top}_cpu"] = round(
            (s["cpu_seconds"] + s["decode_cpu_seconds"]) / f["cpu_seconds"], 4
        )
    if ("streaming", top) in by and by[("streaming", top)].get("crc_seconds") is not None:
        s = by[("streaming", top)]
        ours = s["seconds"] + s["decode_seconds"]  # bytes to sums, the CRC check included
        report[f"frame_checks_{top}"] = {
            "crc_ms_per_update": round(1e3 * s["crc_seconds"] / top, 4),
            "hmac_ms_per_update": round(1e3 * s["hmac_seconds"] / top, 4),
            "crc_share_of_streaming": round(s["crc_seconds"] / ours, 3),  # of decode + fold + close
            "hmac_share_if_signed": round(s["hmac_seconds"] / (ours + s["hmac_seconds"]), 3),
        }
    if ("batch", top) in by and ("flwr", top) in by:
        b, f = by[("batch", top)], by[("flwr", top)]
        report[f"ratio_batch_vs_flwr_{top}"] = round((b["seconds"] + b["decode_seconds"]) / f["seconds"], 4)
    for n in args.ns:  # streaming and batch fold the same updates: their models must agree
        if ("streaming", n) in by and ("batch", n) in by:
            a, b = by[("streaming", n)]["checksum"], by[("batch", n)]["checksum"]
            report.setdefault("streaming_equals_batch", {})[str(n)] = abs(a - b) <= 1e-6 * max(1.0, abs(b))
    report.update(
        timestamp=dt.datetime.now(dt.timezone.utc).isoformat(),
        command=shlex.join([Path(sys.executable).name, *sys.argv]),
        args={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "child"},
        model={"params": sum(a * b for a, b in model_shapes(args.params, args.tensors).values()), "dense_mb": None},
        machine={
            **machine_info(),
            "flwr": flwr_version(),
            "numba": fastfold.version(),
            "crc": crc.implementation(),
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        },
    )
    report["model"]["dense_mb"] = round(report["model"]["params"] * 4 / 2**20, 2)
    return report


def markdown(report: dict) -> str:
    lines = [
        "# Aggregation of N sparse updates in one process",
        "",
        f"Model: {report['model']['params']:,} float32 parameters ({report['model']['dense_mb']} MiB dense), "
        f"updates at density {report['args']['density']}, seed {report['args']['seed']}.  "
        f"Command: `{report['command']}`.  Machine: {report['machine']['cpu_count']} cores, "
        f"load average {report['machine']['loadavg_before'][0]} before, {report['machine']['loadavg_after'][0]} after.",
        "",
        "`seconds`: ours from decoded updates (fold + close, or `weighted_average`), Flower's from its "
        "serialised `Parameters` (deserialisation included).  `decode s`: our codec on the same frames "
        "(CRC and every validation).  The headline `ratio_streaming_vs_flwr_N` (and `ratio_batch_vs_flwr_N`) "
        "is ours from bytes to sums, decode included, over Flower's; `ratio_streaming_fold_only_vs_flwr_N` "
        "leaves our decode out.  `cpu s` and the `_cpu` ratio are process CPU time, for a shared machine.  "
        "`folds/s`: `RunningSum.add` alone (and the fold of what is still staged at the end); "
        "`decoded folds/s`: decode + add (both wall time; `folds_per_cpu_s` in the JSON is folds per "
        "CPU-second).  `fold`: the compiled kernels (numba) or NumPy.  `CRC s`: the "
        "decoder's checksum alone (inside `decode s`); `HMAC s`: verifying a device signature (not in the "
        "ratio: these updates are unsigned).",
        "",
        "| impl | fold | N | seconds | cpu s | decode s (ours) | decode cpu s | close s | folds/s | decoded folds/s "
        "| CRC s | HMAC s | peak RSS MiB | baseline RSS MiB |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["runs"]:
        cells = [r.get(k) for k in ("cpu_seconds", "decode_seconds", "decode_cpu_seconds", "close_seconds")]
        cells += [r.get(k) for k in ("folds_per_s", "decoded_folds_per_s", "crc_seconds", "hmac_seconds")]
        lines.append(
            f"| {r['impl']} | {_cell(r.get('fold'))} | {r['n']} | {r['seconds']:.3f} | "
            f"{' | '.join(map(_cell, cells))} | "
            f"{r['peak_rss_mb']:.0f} | {_cell(r.get('baseline_rss_mb'))} |"
        )
    lines.append("")
    for key, value in report.items():
        if key.startswith(("ratio_", "frame_checks_")) or key == "streaming_equals_batch":
            lines.append(f"- `{key}`: {value}")
    lines += ["", *targets(report)]
    return "\n".join(lines) + "\n"


def targets(report: dict) -> list[str]:
    """Issue 18's two aggregation targets, judged from this run (not timed tests)."""
    top = max(r["n"] for r in report["runs"])
    ratio = report.get(f"ratio_streaming_vs_flwr_{top}")
    run = next((r for r in report["runs"] if r["impl"] == "streaming" and r["n"] == top), {})
    folds, per_cpu = run.get("folds_per_s"), run.get("folds_per_cpu_s")
    out = []
    if ratio is not None:
        out.append(f"- target: ratio (decode included) <= {RATIO_TARGET} at N={top}: {_met(ratio <= RATIO_TARGET)}")
    if folds is not None:
        cpu = f"; {per_cpu:g} per CPU-second" if per_cpu is not None else ""
        out.append(f"- target: >= {FOLDS_TARGET:,} folds/s at N={top}: {_met(folds >= FOLDS_TARGET)} ({folds:g}{cpu})")
    return out


def _met(ok: bool) -> str:
    return "met" if ok else "**not met**"


def _cell(value) -> str:
    return "" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


if __name__ == "__main__":
    sys.exit(main())
