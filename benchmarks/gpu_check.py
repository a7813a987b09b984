#!/usr/bin/env python
"""The GPU check of issue 35: every registered method's smoke scenario on the CPU and on CUDA,
side by side in one process start, plus the served MADE model on the CPU provider and on the
first GPU provider this onnxruntime has.

For each method it runs the contract test's smoke federation (2 devices, 2 tasks, 2 rounds per
task, the method's ``smoke_overrides``) with ``fcl simulate --in-process`` (no Mosquitto, no
internet), first with ``device=cpu`` then with ``device=cuda``.  Per round: the mean of the
aggregator's round durations (``metrics.jsonl``).  ``max_abs_metric_diff``: the largest
difference between any number of the two runs' final metrics (``summary.json``).  Before the
CUDA run the learner is rebuilt from the CPU run's checkpoint and placed on torch's ``meta``
device: a method whose learner cannot leave the CPU is reported as such, not run.

Without CUDA the CPU half still runs: the CUDA fields are null, ``cuda`` says why, exit 0.

    python benchmarks/gpu_check.py                          # every method -> results/gpu_check.json
    python benchmarks/gpu_check.py --methods fedavg confedmade --out /tmp/gpu.json

Needs python3 with the toolkit's requirements (a CUDA build of torch for the CUDA half,
onnxruntime-gpu for the GPU provider), the data packages of the scenarios installed from
wheels.  Exit 1 when a run failed.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # allow `python benchmarks/gpu_check.py` without installing
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import methods  # noqa: E402,F401  (registers every method)
from fclcore.method import REGISTRY  # noqa: E402

# The contract test's smoke federation (tests/methods/test_method_contract.py).
SMOKE = [
    "clients=2",
    "federation.rounds_per_task=2",
    "federation.rounds.deadline_s=120",
    "federation.rounds.start_timeout_s=120",
]
GPU_PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider")
LATENCY_RUNS = 200


def cuda_reason() -> str | None:
    """None when torch has a CUDA device, else why not (one line)."""
    if torch.cuda.is_available():
        return None
    build = torch.version.cuda
    return f"unavailable: torch {torch.__version__} " + (
        f"(CUDA {build} build) sees no CUDA device" if build else "is a CPU-only build"
    )


def run(name: str, device: str, out: Path, timeout: float) -> dict[str, Any]:
    """One in-process smoke federation of ``name`` on ``device``: its timing and final metrics."""
    from fcl_edge.simulate import simulate

    spec = REGISTRY[name]
    overrides = [f"federation.method={name}", *SMOKE, *spec.smoke_overrides, f"device={device}"]
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):  # its round table: the run directory has it
        code = simulate(
            str(REPO / spec.example_scenario), str(out), overrides=overrides, timeout=timeout, in_process=True
        )
    wall = time.perf_counter() - start
    if code != 0:
        raise RuntimeError(f"{device} run exited {code}; see {out / 'logs' / 'in-process.log'}")
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    durations = [e["duration_s"] for e in events if e.get("event") == "round"]
    summary = json.loads((out / "summary.json").read_text())
    return {
        "s_per_round": statistics.mean(durations),
        "rounds": len(durations),
        "wall_s": wall,
        "final": summary["final"],
    }


def cannot_place(state_dir: Path) -> str | None:
    """None when the learner of this checkpoint leaves the CPU (placed on torch's ``meta``
    device, which holds no data), else the reason its ``place`` gives."""
    from edge_client.state import learner_from_state

    learner, _ = learner_from_state(state_dir)
    try:
        learner.place(torch.device("meta"), "off")
    except ValueError as exc:
        return str(exc)
    return None


def numbers(value: Any, path: str = "") -> Iterator[tuple[str, float]]:
    """Every number in a nested summary, keyed by its path (None entries skipped)."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from numbers(item, f"{path}/{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from numbers(item, f"{path}/{index}")
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield path, float(value)


def max_abs_diff(a: dict, b: dict) -> float:
    """The largest difference between two final-metric dicts; ValueError if they differ in shape."""
    left, right = dict(numbers(a)), dict(numbers(b))
    if left.keys() != right.keys():
        raise ValueError(f"final metrics differ in shape: {sorted(left.keys() ^ right.keys())[:5]}")
    return max((abs(left[k] - right[k]) for k in left), default=0.0)


def check_method(name: str, work: Path, timeout: float, has_cuda: bool) -> dict[str, Any]:
    """The CPU run, the placement probe, then (when it can) the CUDA run of one method."""
    cpu = run(name, "cpu", work / name / "cpu", timeout)
    row: dict[str, Any] = {
        "metric": REGISTRY[name].metric,
        "rounds": cpu["rounds"],
        "cpu_s_per_round": round(cpu["s_per_round"], 4),
        "cpu_wall_s": round(cpu["wall_s"], 2),
        "cpu_torch_threads": torch.get_num_threads(),  # the daemons' ``threads`` (client default 1)
        "cuda_s_per_round": None,
        "speedup": None,
        "max_abs_metric_diff": None,
        "peak_gpu_mb": None,
    }
    refusal = cannot_place(work / name / "cpu" / "clients" / "client-0" / "state")
    row["placeable"] = refusal is None
    if refusal is not None:
        row["cuda"] = f"cannot be placed: {refusal}"
        return row
    if not has_cuda:
        row["cuda"] = "not run: no CUDA device"
        return row
    torch.cuda.reset_peak_memory_stats()
    cuda = run(name, "cuda", work / name / "cuda", timeout)
    row.update(
        cuda="ran",
        cuda_s_per_round=round(cuda["s_per_round"], 4),
        cuda_wall_s=round(cuda["wall_s"], 2),
        speedup=round(cpu["s_per_round"] / cuda["s_per_round"], 2),
        max_abs_metric_diff=round(max_abs_diff(cpu["final"], cuda["final"]), 4),
        peak_gpu_mb=round(torch.cuda.max_memory_allocated() / 2**20, 1),
    )
    return row


def latency_us(runtime: Any, x: np.ndarray) -> float:
    """Median microseconds of one log-likelihood call at batch 1 (after 20 untimed calls)."""
    for _ in range(20):
        runtime.log_likelihood(x)
    times = []
    for _ in range(LATENCY_RUNS):
        start = time.perf_counter_ns()
        runtime.log_likelihood(x)
        times.append(time.perf_counter_ns() - start)
    return round(statistics.median(times) / 1000, 1)


def check_serving(model: Path | None) -> dict[str, Any]:
    """The served MADE model of a smoke run on the CPU provider and on the GPU provider list."""
    import onnxruntime as ort

    from export.runtime import MadeRuntime

    out: dict[str, Any] = {"providers_available": ort.get_available_providers(), "provider_used": None}
    out.update(cpu_latency_us=None, gpu_latency_us=None)
    if model is None or not model.exists():
        out["note"] = "no served MADE model: no MADE method was run"
        return out
    cpu = MadeRuntime.load(model)
    x = (np.random.default_rng(0).random((1, cpu.input_dim)) > 0.5).astype(np.float32)
    out["cpu_latency_us"] = latency_us(cpu, x)
    gpu = MadeRuntime.load(model, providers=GPU_PROVIDERS)
    out["provider_used"] = gpu.provider
    if gpu.provider != "CPUExecutionProvider":
        out["gpu_latency_us"] = latency_us(gpu, x)
    out["model"] = f"{model.parent.name}/{model.name} of the {model.parents[3].name} CPU smoke run (batch 1)"
    return out


def machine() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_average": [round(v, 2) for v in os.getloadavg()],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=sorted(REGISTRY), choices=sorted(REGISTRY), metavar="NAME")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "gpu_check.json"))
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    args = ap.parse_args(argv)
    reason = cuda_reason()
    print(f"CUDA {reason}: the CPU half only" if reason else f"CUDA: {torch.cuda.get_device_name(0)}", flush=True)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if reason is None else "none (CPU only)",
        "cuda": reason or "available",
        "torch": torch.__version__,
        "methods": {},
    }
    failed = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        for name in args.methods:
            try:
                row = check_method(name, Path(tmp), args.timeout, reason is None)
            except (RuntimeError, ValueError, OSError) as exc:  # one method's failure is reported; the others still run
                row = {"error": f"{type(exc).__name__}: {exc}"}
                failed.append(name)
            result["methods"][name] = row
            print(f"{name}: {json.dumps(row)}", flush=True)
        made = next((Path(tmp) / n for n in args.methods if REGISTRY[n].served_format == "made"), None)
        result["serving"] = check_serving(
            None if made is None else made / "cpu" / "clients" / "client-0" / "model.onnx"
        )
    result["machine"] = machine()
    result["command"] = "python benchmarks/gpu_check.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
