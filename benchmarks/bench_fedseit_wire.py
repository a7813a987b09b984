"""FedSeIT's bytes on the wire against accuracy: compression off, the default, and a sweep.

Every run is ``fcl simulate configs/scenarios/bbc_fedseit.yaml --in-process`` (the aggregator
service and one client daemon per device as threads of this process, over the in-process
transport) on a small configuration a shared 2-core machine affords (``SMALL``: 3 devices x 3
tasks of 3 BBC labels, 30 training texts per label, 16 filters, 32 wordpieces, 4 rounds per
task).  Bytes are the run's ``summary.json`` (MQTT PUBLISH packets, every round's update and
announcement and the knowledge frames) against its dense fp32 reference; accuracy is the
run's final average over (device, task).

    python benchmarks/bench_fedseit_wire.py                                  # off vs default, 3 seeds
    python benchmarks/bench_fedseit_wire.py --variants keep0.1-int8,keep0.3-int8 --seeds 1 --name fedseit_wire_sweep

Variants: ``off`` (keep_units 1, every entry of A, dense announcements: FedSeIT before issue
40), ``default`` (the method's defaults), ``-int8`` (+ ``wire.value_dtype: int8``), and the
sweep's ``keepK``, ``downD``, ``kbD`` (one setting moved from the default).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SCENARIO = ROOT / "configs" / "scenarios" / "bbc_fedseit.yaml"
SMALL = [
    "federation.options.filters=16",
    "federation.options.max_length=32",
    "data.per_class=30",
    "data.test_per_class=20",
    "tasks.pool.per_client=3",
]
OFF = ["federation.options.keep_units=1.0", "federation.options.kb_density=1.0", "federation.wire.down_sparsify=none"]
INT8 = ["federation.wire.value_dtype=int8"]
VARIANTS = {
    "off": OFF,
    "off-int8": OFF + INT8,
    "default": [],
    "default-int8": INT8,
    "default-float16": ["federation.wire.value_dtype=float16"],
    "keep0.1-int8": ["federation.options.keep_units=0.1", *INT8],
    "keep0.3-int8": ["federation.options.keep_units=0.3", *INT8],
    "keep0.5-int8": ["federation.options.keep_units=0.5", *INT8],
    "down0.02-int8": ["federation.wire.down_density=0.02", *INT8],
    "down0.1-int8": ["federation.wire.down_density=0.1", *INT8],
    "kb0.02-int8": ["federation.options.kb_density=0.02", *INT8],
    "kb0.2-int8": ["federation.options.kb_density=0.2", *INT8],
    "kb0.3-int8": ["federation.options.kb_density=0.3", *INT8],
    "kb1-int8": ["federation.options.kb_density=1.0", *INT8],
}


def measure(run: Path, wall: float) -> dict:
    summary = json.loads((run / "summary.json").read_text())
    b = summary["bytes"]
    dense = b["dense_fp32_up_total"] + b["dense_fp32_down_total"]
    return {
        "accuracy": summary["final"]["avg_accuracy"],
        "forgetting": summary["final"].get("forgetting"),
        "up_vs_dense": round(b["up_total"] / b["dense_fp32_up_total"], 4),
        "down_vs_dense": round(b["down_total"] / b["dense_fp32_down_total"], 4),
        "updown_vs_dense": round((b["up_total"] + b["down_total"]) / dense, 4),
        "up_total": b["up_total"],
        "down_total": b["down_total"],
        "down_by_kind": b.get("down_by_kind"),
        "syncs": b.get("syncs"),
        "minutes": round(wall / 60, 2),
    }


def run_one(job: tuple) -> tuple:
    args, variant, seed = job
    import torch

    from fcl_edge.simulate import simulate

    torch.set_num_threads(1)
    out = Path(args.work) / f"{variant}-s{seed}"
    if args.reuse and (out / "summary.json").is_file():
        return variant, seed, {**measure(out, 0.0), "reused": True}
    started = time.perf_counter()
    sets = [*SMALL, *VARIANTS[variant], f"federation.seed={seed}", f"federation.name=bbc-fedseit-{seed}"]
    code = simulate(str(SCENARIO), str(out), overrides=sets, timeout=args.timeout, in_process=True, force=True)
    if code != 0:
        raise SystemExit(f"{variant} seed {seed}: fcl simulate --in-process exited {code}; logs in {out / 'logs'}")
    return variant, seed, measure(out, time.perf_counter() - started)


KEYS = ("accuracy", "up_vs_dense", "down_vs_dense", "updown_vs_dense")


def write_markdown(path: Path, res: dict) -> None:
    lines = [
        "# FedSeIT: bytes on the wire against accuracy (BBC News, small configuration)",
        "",
        f"`{res['command']}` on {res['machine']['cpus']} CPUs ({res['machine']['platform']}), load average "
        f"{res['load']} at the start, {res['minutes']:.0f} min wall clock, {res['workers']} runs at a time, "
        f"seeds {res['seeds']}. Configuration: `{' '.join(SMALL)}` over `configs/scenarios/bbc_fedseit.yaml`.",
        "",
        "| variant | accuracy (mean) | per seed | up / dense | down / dense | up + down / dense |",
        "|---|---|---|---|---|---|",
    ]
    for name, m in res["variants"].items():
        seeds = ", ".join(f"{s}: {r['accuracy']:.4f}" for s, r in m["runs"].items())
        lines.append(
            f"| {name} | {m['accuracy']:.4f} | {seeds} | {m['up_vs_dense']:.1%} | {m['down_vs_dense']:.1%} "
            f"| {m['updown_vs_dense']:.1%} |"
        )
    lines += [
        "",
        "Bytes: MQTT PUBLISH packets over the run (summary.json) against dense fp32 FedAvg of the conv bases "
        "both ways. Accuracy: the final model's mean over (device, task) of the task's test accuracy.",
    ]
    path.write_text("\n".join(lines) + "\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--variants", default="off,default,default-int8", help="comma-separated of " + ", ".join(VARIANTS))
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--workers", type=int, default=2, help="runs at a time (one process each)")
    p.add_argument("--timeout", type=float, default=1800.0, help="per run, seconds")
    p.add_argument("--work", default="/tmp/fcl-bench-fedseit-wire", help="where the run directories go")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="results directory")
    p.add_argument("--name", default="fedseit_wire", help="results file stem")
    p.add_argument(
        "--reuse", action="store_true", help="read a finished run of the same variant and seed in --work instead"
    )
    args = p.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    args.seeds = [int(v) for v in args.seeds.split(",")]
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started, load = time.perf_counter(), os.getloadavg()
    jobs = [(args, v, s) for v in args.variants for s in args.seeds]
    runs: dict[str, dict] = {v: {} for v in args.variants}
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        for variant, seed, r in pool.map(run_one, jobs):
            runs[variant][str(seed)] = r
            print(
                f"{variant} seed {seed}: accuracy {r['accuracy']:.4f}, up+down {r['updown_vs_dense']:.1%}", flush=True
            )
    variants = {
        v: {**{k: round(float(np.mean([r[k] for r in per.values()])), 4) for k in KEYS}, "runs": per}
        for v, per in runs.items()
    }
    res = {
        "command": shlex.join(
            ["python", "benchmarks/bench_fedseit_wire.py", *(argv if argv is not None else sys.argv[1:])]
        ),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "load": " ".join(f"{x:.1f}" for x in load),
        "config": SMALL,
        "overrides": {v: VARIANTS[v] for v in args.variants},
        "seeds": args.seeds,
        "workers": args.workers,
        "minutes": round((time.perf_counter() - started) / 60, 1),
        "variants": variants,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(res, indent=2))
    write_markdown(out / f"{args.name}.md", res)
    print(f"wrote {out / (args.name + '.json')} and .md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
