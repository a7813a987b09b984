"""Device budgets per shipped scenario: client memory, CPU per round, bytes per round and per day.

Runs each scenario with ``fcl simulate`` against a Mosquitto this script starts, shortened to
``--rounds-per-task`` rounds (per-round costs do not depend on how many rounds follow), and
reads what every client daemon measured about itself (``clients/<id>/wire.json``: CPU seconds
of each round's evaluate + train + upload in its own process, peak RSS) and the aggregator's
per-round byte counts (``metrics.jsonl``).  CPU seconds, unlike wall time, barely move when
other jobs share the machine.  Per-day bandwidth assumes ``--rounds-per-day`` rounds.

    python benchmarks/bench_device_budget.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fcl_edge.broker import MosquittoProcess  # noqa: E402

SCENARIOS = ["quickstart", "digits_continual", "seqmnist_confedmade", "seqmnist_fedcl_finetune"]


def measure(name: str, rounds_per_task: int, work: Path, broker_url: str) -> dict:
    out = work / name
    cmd = [
        sys.executable,
        "-m",
        "fcl_edge.cli",
        "simulate",
        str(ROOT / "configs/scenarios" / f"{name}.yaml"),
        "--out",
        str(out),
        "--broker",
        broker_url,
        "--set",
        f"federation.rounds_per_task={rounds_per_task}",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(
            f"{name}: fcl simulate exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        )
    wires = [json.loads(p.read_text()) for p in sorted((out / "clients").glob("*/wire.json"))]
    cpu = [s for w in wires for s in w["round_cpu_s"].values()]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["event"] == "round_client" and r["status"] == "accepted"]
    up, down = [r["bytes_up"] for r in rows], [r["bytes_down"] for r in rows]
    by_round: dict[str, float] = {}  # the largest peak RSS over devices after each round
    for w in wires:
        for rnd, (_, peak) in w.get("round_rss_mb", {}).items():
            by_round[rnd] = max(by_round.get(rnd, 0.0), peak)
    return {
        "clients": len(wires),
        "client_peak_rss_mb_by_round": {r: by_round[r] for r in sorted(by_round, key=int)},
        "rounds": len({r["round"] for r in rows}),
        "client_peak_rss_mb_max": max(w["max_rss_mb"] for w in wires),
        "client_cpu_s_per_round_median": round(float(np.median(cpu)), 3),
        "client_cpu_s_per_round_p90": round(float(np.percentile(cpu, 90)), 3),
        "bytes_up_per_round_median": int(np.median(up)),
        "bytes_down_per_round_median": int(np.median(down)),
        "bytes_down_per_round_max": int(max(down)),  # task starts carry knowledge-base entries
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", nargs="+", default=SCENARIOS)
    parser.add_argument("--rounds-per-task", type=int, default=2)
    parser.add_argument(
        "--rounds-per-day",
        type=int,
        default=144,
        help="for the per-day bandwidth (default: one round every 10 minutes)",
    )
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/device_budget.json"))
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        broker = MosquittoProcess(Path(tmp) / "broker").start()
        try:
            for name in args.scenarios:
                print(f"{name} ...", flush=True)
                r = measure(name, args.rounds_per_task, Path(tmp), broker.url)
                r["mb_up_per_day"] = round(r["bytes_up_per_round_median"] * args.rounds_per_day / 1e6, 2)
                r["mb_down_per_day"] = round(r["bytes_down_per_round_median"] * args.rounds_per_day / 1e6, 2)
                results[name] = r
                print(json.dumps(r), flush=True)
        finally:
            broker.stop()
    doc = {
        "scenarios": results,
        "rounds_per_day": args.rounds_per_day,
        "rounds_per_task": args.rounds_per_task,
        "machine": {
            "platform": platform.platform(),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "command": " ".join(["python", *sys.argv]),
    }
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    md = [
        "| scenario | client peak RSS | CPU s / round (median, p90) | up / round | down / round (max) "
        f"| MB / day up, down at {args.rounds_per_day} rounds |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        md.append(
            f"| {name} | {r['client_peak_rss_mb_max']} MB | {r['client_cpu_s_per_round_median']}, "
            f"{r['client_cpu_s_per_round_p90']} | {r['bytes_up_per_round_median']:,} B | "
            f"{r['bytes_down_per_round_median']:,} B ({r['bytes_down_per_round_max']:,}) | "
            f"{r['mb_up_per_day']}, {r['mb_down_per_day']} |"
        )
    Path(args.out).with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
