"""FedET through the real harness: ``fcl simulate configs/scenarios/bbc_fedet.yaml`` with a
Mosquitto broker this script starts, one OS process per device and one aggregator.

Writes ``benchmarks/results/fedet_daemon.json`` and ``.md``: average incremental accuracy
(per task and overall), forgetting, upload bytes per device and round (class-sum rounds and
training rounds apart) against the full fine-tuned model in float32, the devices' CPU
seconds per training round, and wall-clock minutes.

    python benchmarks/bench_fedet_daemon.py                      # the scenario as shipped
    python benchmarks/bench_fedet_daemon.py --set federation.seed=1
    python benchmarks/bench_fedet_daemon.py --from-run DIR      # re-measure a finished run
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
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fcl_edge.broker import MosquittoProcess  # noqa: E402

SCENARIO = ROOT / "configs" / "scenarios" / "bbc_fedet.yaml"


def measure(run: Path) -> dict:
    summary = json.loads((run / "summary.json").read_text())
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [e for e in events if e["event"] == "round_client" and e["status"] == "accepted"]
    per_task = summary["rounds_per_task"]
    sums = [e["bytes_up"] for e in rows if e["round"] % per_task == 0]
    train = [e for e in rows if e["round"] % per_task and e["n_samples"]]
    cpu, rss = [], []
    for wire in sorted((run / "clients").glob("*/wire.json")):
        device = json.loads(wire.read_text())
        cpu += [s for r, s in device["round_cpu_s"].items() if int(r) % per_task]
        rss.append(device["max_rss_mb"])
    final = summary["final"]
    scenario = yaml.safe_load((run / "scenario.yaml").read_text())  # as the run resolved it
    return {
        "fedet_settings": scenario["federation"]["fedet"],
        "data": scenario["data"],
        "avg_incremental_accuracy": final["avg_incremental_accuracy"],
        "accuracy_after_task": final["accuracy_per_task"],
        "forgetting": final["forgetting"],
        "upload_bytes_per_sums_round_per_device": float(np.mean(sums)),
        "upload_bytes_per_train_round_per_device": float(np.mean([e["bytes_up"] for e in train])),
        "upload_ratio_vs_full_fp32": float(max(e["bytes_up"] / e["dense_fp32_up"] for e in train)),
        "full_fp32_bytes": max(e["dense_fp32_up"] for e in train),
        "device_cpu_s_per_train_round": float(np.median(cpu)),
        "device_peak_rss_mb": max(rss),
        "bytes_up_total": summary["bytes"]["up_total"],
        "bytes_down_total": summary["bytes"]["down_total"],
        "minutes": round(summary["duration_s"] / 60, 2),  # the aggregator's run, start to summary
    }


def run_scenario(overrides: list[str], runs: Path, tmp: Path) -> subprocess.CompletedProcess:
    broker = MosquittoProcess(tmp).start()
    try:
        cmd = [
            sys.executable,
            "-m",
            "fcl_edge.cli",
            "simulate",
            str(SCENARIO),
            "--out",
            str(runs),
            "--broker",
            broker.url,
            "--force",  # a re-run replaces the earlier run
        ]
        for item in overrides:
            cmd += ["--set", item]
        return subprocess.run(cmd, capture_output=True, text=True)
    finally:
        broker.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="scenario override")
    parser.add_argument("--runs", default=None, help="run directory (default: a temporary one)")
    parser.add_argument(
        "--from-run",
        default=None,
        metavar="DIR",
        help="measure an existing run directory instead of running the scenario",
    )
    parser.add_argument(
        "--out", default=str(ROOT / "benchmarks" / "results" / "fedet_daemon"), help="results path without extension"
    )
    args = parser.parse_args(argv)
    runs = Path(args.from_run or args.runs or tempfile.mkdtemp(prefix="fedet-daemon-"))
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        if args.from_run:
            result = subprocess.CompletedProcess([], 0)
        else:
            result = run_scenario(args.set, runs, Path(tmp))
    if result.returncode != 0:
        raise SystemExit(f"fcl simulate failed ({result.returncode}): {result.stderr[-2000:]}")
    res = {
        "command": "python benchmarks/bench_fedet_daemon.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "load_before": round(load_before, 2),
            "load_after": round(os.getloadavg()[0], 2),
        },
        "scenario": str(SCENARIO.relative_to(ROOT)),
        "overrides": args.set,
        **measure(runs),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
    out.with_suffix(".md").write_text(
        "\n".join(
            [
                "# FedET through the client daemon, the aggregator service and Mosquitto",
                "",
                f"`{res['command']}` on {platform.platform()}, {os.cpu_count()} cores (load average "
                f"{res['machine']['load_before']} before, {res['machine']['load_after']} after).",
                "",
                "| measure | value |",
                "|---|---|",
                f"| FedET settings of the run | {json.dumps(res['fedet_settings'])} |",
                f"| average incremental accuracy | {res['avg_incremental_accuracy']:.4f} |",
                f"| accuracy after each task | {', '.join(f'{a:.4f}' for a in res['accuracy_after_task'])} |",
                f"| forgetting | {res['forgetting']:.4f} |",
                f"| upload per device, class-sum round | {res['upload_bytes_per_sums_round_per_device']:,.0f} B |",
                f"| upload per device, training round | {res['upload_bytes_per_train_round_per_device']:,.0f} B |",
                f"| largest upload vs the full fine-tuned model in fp32 ({res['full_fp32_bytes']:,} B) | "
                f"{100 * res['upload_ratio_vs_full_fp32']:.2f}% |",
                f"| device CPU seconds per training round (median) | {res['device_cpu_s_per_train_round']:.2f} |",
                f"| device peak RSS (largest over devices) | {res['device_peak_rss_mb']:,.0f} MB |",
                f"| run time (aggregator start to summary) | {res['minutes']:.1f} min |",
                "",
            ]
        )
    )
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
