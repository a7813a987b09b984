#!/usr/bin/env python
"""Benchmark on-device inference of an exported MADE: onnxruntime vs torch eager, RSS, int8.

Trains a MADE (784 -> 500 -> 784, direct connection) on binarised MNIST (pixel > 127) with
Adam on the CPU, exports it with ``export.onnx_made.export_served_model`` (fp32 + int8, parity
checked on 1000 test images), then measures

* latency (median over --runs timed calls after --warmup untimed ones) of one forward pass
  (logits) at batch 1 and batch 64: torch eager ``MADE`` under ``torch.no_grad()`` vs an
  onnxruntime session of the exported file, both ways the runtime can be configured;
* peak RSS (``VmHWM`` from ``/proc/self/status``, read inside the child) of a separate
  process that imports only the torch-free ``export.runtime``, loads the model and computes
  log-likelihoods of --rss-samples test images, for several onnxruntime session options;
* fp32 vs int8 file size and mean test NLL (nats per image, all 10,000 test images).

Targets checked (reported as measured): ORT batch-1 latency <= 0.5x torch eager; inference
RSS <= 80 MB; int8 file <= 0.3x fp32 with |mean NLL change| <= 0.5 nats.

Writes benchmarks/results/inference.json and inference.md (machine info + command line).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # allow `python benchmarks/bench_inference.py` without installing
    sys.path.insert(0, str(REPO))

TARGETS = {"latency_ratio_b1": 0.5, "rss_mb": 80.0, "int8_size_ratio": 0.3, "int8_nll_delta": 0.5}

# A small launcher runs each RSS child so that getrusage(RUSAGE_CHILDREN) sees only that child
# (a child forked straight from this big process would inherit its RSS high-water mark).
LAUNCHER = r"""
import resource, subprocess, sys
proc = subprocess.run(sys.argv[1:], capture_output=True, text=True)
sys.stderr.write(proc.stderr)
print(proc.stdout.strip())
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
sys.exit(proc.returncode)
"""

# Child process for the RSS measurement: imports only the torch-free runtime.
RSS_CHILD = r"""
import json, sys
kind, model, inputs, kwargs = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
out = {}
if kind == "numpy":
    import numpy
elif kind == "onnxruntime":
    import numpy, onnxruntime
else:
    import export.runtime
    from export.runtime import MadeRuntime, load_inputs
    export.runtime.CHUNK_ROWS = kwargs.pop("chunk_rows", export.runtime.CHUNK_ROWS)
    rt = MadeRuntime.load(model, **kwargs)
    x = load_inputs(inputs, rt.input_dim)
    ll = rt.log_likelihood(x)
    out["mean_nll"] = float(-ll.mean())
    out["rows"] = int(x.shape[0])
status = dict(l.split(":", 1) for l in open("/proc/self/status") if ":" in l)
out["vmhwm_kb"] = int(status["VmHWM"].split()[0])
out["vmrss_kb"] = int(status["VmRSS"].split()[0])
out["heavy_modules"] = sorted(m for m in ("torch", "onnx", "yaml", "paho", "sklearn") if m in sys.modules)
print(json.dumps(out))
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--epochs", type=int, default=2, help="training epochs over the 60,000 MNIST images")
    p.add_argument(
        "--train-budget",
        type=float,
        default=180.0,
        help="stop training after this many seconds even mid-epoch (the report says where it stopped)",
    )
    p.add_argument("--batch-size", type=int, default=100, help="training mini-batch size")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
    p.add_argument("--hidden", type=int, default=500, help="hidden units (one layer)")
    p.add_argument("--seed", type=int, default=0, help="torch / mask seed")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads (training and eager)")
    p.add_argument(
        "--runs",
        type=int,
        default=1000,
        help="timed forward passes per latency case at batch 1 (a quarter of that at batch 64)",
    )
    p.add_argument("--warmup", type=int, default=100, help="untimed forward passes before timing")
    p.add_argument("--parity-rows", type=int, default=1000, help="test images for the export parity check")
    p.add_argument("--rss-samples", type=int, default=1000, help="test images scored by the RSS child process")
    p.add_argument("--workdir", type=Path, default=None, help="where model files go (default: a temp dir)")
    p.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results", help="results directory")
    return p.parse_args(argv)


def machine_info() -> dict[str, Any]:
    import onnx
    import onnxruntime
    import torch

    cpu = ""
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = ""
    try:
        mem = next(ln.split(":", 1)[1].strip() for ln in open("/proc/meminfo") if ln.startswith("MemTotal"))
    except (OSError, StopIteration):
        pass
    return {
        "cpu": cpu or platform.processor(),
        "machine": platform.machine(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "mem_total": mem,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": torch.__version__,
        "onnx": onnx.__version__,
        "onnxruntime": onnxruntime.__version__,
        "load_average_1_5_15min": [round(v, 2) for v in os.getloadavg()],
    }


def train(args: argparse.Namespace, train_x: np.ndarray, test_x: np.ndarray) -> tuple[Any, dict[str, Any]]:
    import torch

    from fclcore.made_spec import MadeConfig
    from fclcore.models.made import MADE

    torch.manual_seed(args.seed)
    cfg = MadeConfig(train_x.shape[1], (args.hidden,), direct=True, natural_order=True, mask_seed=args.seed)
    net = MADE(cfg)
    opt = torch.optim.Adam(net.parameters(), lr=args.lr)
    xt = torch.from_numpy(train_x)
    rng = np.random.default_rng(args.seed)
    log = []
    t0 = time.perf_counter()
    out_of_time = False
    for epoch in range(args.epochs):
        net.train()
        perm = torch.from_numpy(rng.permutation(len(xt)))
        total, seen = 0.0, 0
        for i in range(0, len(xt), args.batch_size):
            xb = xt[perm[i : i + args.batch_size]]
            loss = net.nll(xb).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(xb)
            seen += len(xb)
            if time.perf_counter() - t0 > args.train_budget:
                out_of_time = True
                break
        net.eval()
        with torch.no_grad():
            test_nll = float(net.nll(torch.from_numpy(test_x)).mean())
        log.append(
            {
                "epoch": epoch + 1,
                "images": seen,
                "train_nll": total / seen,
                "test_nll": test_nll,
                "elapsed_s": time.perf_counter() - t0,
            }
        )
        print(
            f"epoch {epoch + 1}: {seen} images, train NLL {total / seen:.2f}  test NLL {test_nll:.2f}  "
            f"({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
        if out_of_time:
            print(f"training budget of {args.train_budget:.0f} s reached", flush=True)
            break
    return net, {
        "config": {"input_dim": cfg.input_dim, "hidden_sizes": list(cfg.hidden_sizes), "direct": cfg.direct},
        "epochs": log,
        "train_seconds": time.perf_counter() - t0,
    }


def _stats(samples: list[float]) -> dict[str, float]:
    samples = sorted(samples)
    return {
        "median_us": statistics.median(samples),
        "p10_us": samples[len(samples) // 10],
        "p90_us": samples[(len(samples) * 9) // 10],
        "runs": len(samples),
    }


def interleaved_us(
    cases: dict[str, Callable[[], object]],
    runs: int,
    warmup: int,
    rounds: int = 10,
    before: dict[str, Callable[[], None]] | None = None,
) -> dict[str, dict[str, float]]:
    """Time every case in ``rounds`` alternating blocks so load changes on the machine hit all cases alike."""
    samples: dict[str, list[float]] = {name: [] for name in cases}
    per_round = max(1, runs // rounds)
    for r in range(rounds):
        for name, fn in cases.items():
            if before and name in before:
                before[name]()
            for _ in range(warmup if r == 0 else max(1, warmup // 10)):
                fn()
            for _ in range(per_round):
                t = time.perf_counter_ns()
                fn()
                samples[name].append((time.perf_counter_ns() - t) / 1e3)
    return {name: _stats(v) for name, v in samples.items()}


def latency(args: argparse.Namespace, net: Any, fp32: Path, test_x: np.ndarray) -> list[dict[str, Any]]:
    import torch

    from export.runtime import MadeRuntime

    thread_counts = sorted({1, args.threads})
    runtimes = {t: MadeRuntime.load(fp32, intra_op_threads=t) for t in thread_counts}
    rows = []
    for batch in (1, 64):
        xb = np.ascontiguousarray(test_x[:batch])
        xt = torch.from_numpy(xb)
        cases: dict[str, Callable[[], object]] = {}
        before: dict[str, Callable[[], None]] = {}
        meta: dict[str, tuple[str, int]] = {}
        for t in thread_counts:
            name = f"torch/{t}"
            cases[name] = lambda: net(xt)
            before[name] = lambda t=t: torch.set_num_threads(t)
            meta[name] = ("torch eager", t)
        for t, rt in runtimes.items():
            sess = rt._session
            cases[f"ort/{t}"] = lambda sess=sess: sess.run(None, {"x": xb})
            meta[f"ort/{t}"] = ("onnxruntime session.run", t)
            cases[f"api/{t}"] = lambda rt=rt: rt.logits(xb)
            meta[f"api/{t}"] = ("MadeRuntime.logits", t)
        with torch.no_grad():
            res = interleaved_us(
                cases, args.runs if batch == 1 else max(10, args.runs // 4), args.warmup, before=before
            )
        torch.set_num_threads(args.threads)
        for name, r in res.items():
            rows.append({"engine": meta[name][0], "threads": meta[name][1], "batch": batch, **r})
        print(
            f"latency batch {batch}: "
            + ", ".join(f"{r['engine']}/{r['threads']}t {r['median_us']:.0f} us" for r in rows if r["batch"] == batch),
            flush=True,
        )
    return rows


def rss(args: argparse.Namespace, fp32: Path, int8: Path, inputs: Path) -> list[dict[str, Any]]:
    variants = [
        ("python + numpy (import only)", "numpy", fp32, {}),
        ("python + numpy + onnxruntime (import only)", "onnxruntime", fp32, {}),
        ("runtime defaults: 1 thread, arena off, mem pattern off", "runtime", fp32, {}),
        (
            "onnxruntime defaults: all cores, arena on, mem pattern on",
            "runtime",
            fp32,
            {"intra_op_threads": None, "cpu_mem_arena": True, "mem_pattern": True},
        ),
        ("1 thread, arena on, mem pattern on", "runtime", fp32, {"cpu_mem_arena": True, "mem_pattern": True}),
        ("1 thread, arena on, mem pattern off", "runtime", fp32, {"cpu_mem_arena": True}),
        ("1 thread, arena off, mem pattern on", "runtime", fp32, {"mem_pattern": True}),
        ("all cores, arena off, mem pattern off", "runtime", fp32, {"intra_op_threads": None}),
        (
            "runtime defaults, but all rows in one onnxruntime call (no 32-row chunks)",
            "runtime",
            fp32,
            {"chunk_rows": 1_000_000},
        ),
        ("int8 model, runtime defaults", "runtime", int8, {}),
    ]
    rows = []
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for name, kind, model, kwargs in variants:
        proc = subprocess.run(
            [
                sys.executable,
                "-c",
                LAUNCHER,
                sys.executable,
                "-c",
                RSS_CHILD,
                kind,
                str(model),
                str(inputs),
                json.dumps(kwargs),
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"RSS child {name!r} failed: {proc.stderr.strip()}")
        lines = proc.stdout.strip().splitlines()
        out = json.loads(lines[-2])
        rows.append(
            {
                "variant": name,
                "model": model.name if kind == "runtime" else None,
                "options": kwargs,
                "peak_rss_mb": out["vmhwm_kb"] / 1024,
                "end_rss_mb": out["vmrss_kb"] / 1024,
                "ru_maxrss_mb": int(lines[-1]) / 1024,
                "heavy_modules": out["heavy_modules"],
                "mean_nll": out.get("mean_nll"),
                "rows": out.get("rows"),
            }
        )
        row = rows[-1]
        print(f"RSS {name}: peak {row['peak_rss_mb']:.1f} MB", flush=True)
    return rows


def markdown(report: dict[str, Any]) -> str:
    s = report["summary"]
    t = TARGETS
    ok = lambda b: "met" if b else "**missed**"  # noqa: E731
    lines = [
        "# Inference benchmark: exported MADE on binarised MNIST",
        "",
        f"Command: `{report['command']}`  ",
        f"Date: {report['timestamp']}  ",
        "Machine: " + ", ".join(f"{k} {v}" for k, v in report["machine"].items()),
        "",
        f"Model: MADE 784 -> {report['training']['config']['hidden_sizes']} -> 784, direct connection, natural "
        f"order; trained on {sum(e['images'] for e in report['training']['epochs']):,} images "
        f"({len(report['training']['epochs'])} epoch(s) of 60,000, batch {report['args']['batch_size']}) with Adam "
        f"in {report['training']['train_seconds']:.0f} s; torch test NLL "
        f"{report['training']['epochs'][-1]['test_nll']:.2f} nats. Export parity (max |onnx - torch| logit, "
        f"{report['export']['parity_rows']} test images): {report['export']['max_abs_err']:.2e}.",
        "",
        "## Targets",
        "",
        "| target | measured | goal | status |",
        "|---|---:|---:|---|",
        f"| ORT batch-1 latency (1 thread) / fastest torch eager ({s['torch_threads']} thread(s)) | "
        f"{s['latency_ratio_b1']:.3f}x ({s['ort_b1_us']:.0f} us vs {s['torch_b1_us']:.0f} us) | "
        f"<= {t['latency_ratio_b1']}x | {ok(s['latency_ratio_b1'] <= t['latency_ratio_b1'])} |",
        f"| (info) best ORT batch-64 / fastest torch eager batch-64 | {s['latency_ratio_b64']:.3f}x | - | - |",
        f"| peak RSS of the inference process (runtime defaults) | {s['rss_mb']:.1f} MB | <= {t['rss_mb']:.0f} MB | "
        f"{ok(s['rss_mb'] <= t['rss_mb'])} |",
        f"| int8 file / fp32 file | {s['int8_size_ratio']:.3f}x ({s['int8_bytes']:,} / {s['fp32_bytes']:,} B) | "
        f"<= {t['int8_size_ratio']}x | {ok(s['int8_size_ratio'] <= t['int8_size_ratio'])} |",
        f"| int8 mean test NLL change | {s['int8_nll_delta']:+.3f} nats ({s['int8_nll']:.3f} vs {s['fp32_nll']:.3f}) "
        f"| abs <= {t['int8_nll_delta']} | {ok(abs(s['int8_nll_delta']) <= t['int8_nll_delta'])} |",
        "",
        "## Latency of one forward pass (logits)",
        "",
        f"Median over {report['args']['runs']} timed runs per row after {report['args']['warmup']} warm-up runs; "
        "all rows of a batch size are timed in 10 interleaved blocks so that load from other processes affects "
        "them alike. Load average at start / end: "
        f"{report['machine']['load_average_1_5_15min']} / {report['load_average_end']}. "
        "`MadeRuntime.logits` adds input validation (shape, finiteness) to `session.run`.",
        "",
        "| batch | engine | threads | median us | p10 - p90 us |",
        "|---:|---|---:|---:|---:|",
    ]
    for r in report["latency"]:
        lines.append(
            f"| {r['batch']} | {r['engine']} | {r['threads']} | {r['median_us']:.0f} | "
            f"{r['p10_us']:.0f} - {r['p90_us']:.0f} |"
        )
    lines += [
        "",
        "## Peak RSS of a separate inference process",
        "",
        f"Each row is a fresh `python -c` process that imports only `export.runtime` (numpy + onnxruntime), loads "
        f"the model (validation + hashes), loads {report['args']['rss_samples']} test images from a .npy file and "
        "computes their log-likelihoods with one `log_likelihood` call (which runs onnxruntime on 32-row chunks "
        "unless stated); peak = `VmHWM` read inside the child. The first two rows are import-only baselines.",
        "",
        "| variant | model | peak RSS MB (VmHWM) | ru_maxrss MB (launcher) | heavy modules loaded |",
        "|---|---|---:|---:|---|",
    ]
    for r in report["rss"]:
        lines.append(
            f"| {r['variant']} | {r['model'] or '-'} | {r['peak_rss_mb']:.1f} | {r['ru_maxrss_mb']:.1f} | "
            f"{', '.join(r['heavy_modules']) or 'none'} |"
        )
    lines.append(
        "\n`ru_maxrss` is `getrusage(RUSAGE_CHILDREN)` in a small launcher process whose only child is "
        "the measured process (MB = 2^20 bytes throughout)."
    )
    lines += [
        "",
        "## Model files",
        "",
        "| file | bytes | mean test NLL (nats, 10,000 images) |",
        "|---|---:|---:|",
        f"| fp32 | {s['fp32_bytes']:,} | {s['fp32_nll']:.4f} |",
        f"| int8 (dynamic, int8 weights) | {s['int8_bytes']:,} | {s['int8_nll']:.4f} |",
        "",
        "The int8 model quantises activations with one scale per tensor, so the runtime evaluates it one row at a "
        "time (a row's result must not depend on the rest of the batch).",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    machine = machine_info()  # includes the load average before anything runs
    import torch

    from export.onnx_made import ServedModel, export_served_model
    from export.runtime import MadeRuntime
    from fclcore.data import load_mnist

    torch.set_num_threads(args.threads)
    train_set, test_set = load_mnist()
    net, training = train(args, train_set.x, test_set.x)

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="fcl-bench-inference-"))
    workdir.mkdir(parents=True, exist_ok=True)
    fp32 = workdir / "mnist_made.onnx"
    served = ServedModel(net.cfg, net.get_params(), 0, "bench", 0, "pixel>127")
    t = time.perf_counter()
    exp = export_served_model(served, fp32, parity_inputs=test_set.x[: args.parity_rows], int8=True)
    exp["export_seconds"] = time.perf_counter() - t
    int8 = Path(exp["int8_path"])
    print(
        f"exported {fp32} ({exp['bytes']:,} B, parity {exp['max_abs_err']:.2e}) and {int8} ({exp['int8_bytes']:,} B)",
        flush=True,
    )

    lat = latency(args, net, fp32, test_set.x)

    inputs = workdir / "rss_inputs.npy"
    np.save(inputs, test_set.x[: args.rss_samples])
    rss_rows = rss(args, fp32, int8, inputs)

    rt32, rt8 = MadeRuntime.load(fp32), MadeRuntime.load(int8)
    nll32 = float(-rt32.log_likelihood(test_set.x).mean())
    nll8 = float(-rt8.log_likelihood(test_set.x).mean())
    with torch.no_grad():
        nll_torch = float(net.nll(torch.from_numpy(test_set.x)).mean())

    def lat_of(engine: str, threads: int, batch: int) -> float:
        return next(r["median_us"] for r in lat if (r["engine"], r["threads"], r["batch"]) == (engine, threads, batch))

    # Compare against the fastest torch eager configuration measured (1 thread or --threads), not a slow one.
    torch_threads = min(sorted({1, args.threads}), key=lambda t: lat_of("torch eager", t, 1))
    torch_b1 = lat_of("torch eager", torch_threads, 1)
    ort_b1 = lat_of("onnxruntime session.run", 1, 1)
    torch_b64 = min(lat_of("torch eager", t, 64) for t in sorted({1, args.threads}))
    summary = {
        "torch_threads": torch_threads,
        "torch_b1_us": torch_b1,
        "ort_b1_us": ort_b1,
        "latency_ratio_b1": ort_b1 / torch_b1,
        "latency_ratio_b1_runtime_api": lat_of("MadeRuntime.logits", 1, 1) / torch_b1,
        "latency_ratio_b1_vs_torch_all_threads": ort_b1 / lat_of("torch eager", args.threads, 1),
        "latency_ratio_b64": min(lat_of("onnxruntime session.run", t, 64) for t in sorted({1, args.threads}))
        / torch_b64,
        "rss_mb": rss_rows[2]["peak_rss_mb"],
        "fp32_bytes": exp["bytes"],
        "int8_bytes": exp["int8_bytes"],
        "int8_size_ratio": exp["int8_size_ratio"],
        "fp32_nll": nll32,
        "int8_nll": nll8,
        "torch_nll": nll_torch,
        "int8_nll_delta": nll8 - nll32,
    }
    summary["targets_met"] = {
        "latency_ratio_b1": summary["latency_ratio_b1"] <= TARGETS["latency_ratio_b1"],
        "rss_mb": summary["rss_mb"] <= TARGETS["rss_mb"],
        "int8_size_ratio": summary["int8_size_ratio"] <= TARGETS["int8_size_ratio"],
        "int8_nll_delta": abs(summary["int8_nll_delta"]) <= TARGETS["int8_nll_delta"],
    }
    report = {
        "benchmark": "inference",
        "timestamp": dt.datetime.now(dt.timezone.utc).isoformat(),
        "command": shlex.join([sys.executable, *sys.argv]),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": machine,
        "targets": TARGETS,
        "summary": summary,
        "training": training,
        "export": exp,
        "latency": lat,
        "rss": rss_rows,
        "load_average_end": [round(v, 2) for v in os.getloadavg()],
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "inference.json").write_text(json.dumps(report, indent=2) + "\n")
    md = markdown(report)
    (args.out_dir / "inference.md").write_text(md)
    print("\n" + md)
    print(f"wrote {args.out_dir / 'inference.json'} and {args.out_dir / 'inference.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
