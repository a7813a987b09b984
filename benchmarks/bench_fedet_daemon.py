"""FedET through the real harness: ``fcl simulate configs/scenarios/bbc_fedet.yaml`` with a
Mosquitto broker this script starts, one OS process per device and one aggregator.

Writes ``benchmarks/results/fedet_daemon.json`` and ``.md``: average incremental accuracy
(per task and overall), forgetting, upload bytes per device and round (class-sum rounds and
training rounds apart) against the full fine-tuned model in float32, the devices' CPU
seconds per training round, and wall-clock minutes.

    python benchmarks/bench_fedet_daemon.py                      # the scenario as shipped
    python benchmarks/bench_fedet_daemon.py --set federation.seed=1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fcl_edge.broker import MosquittoProcess  # noqa: E402

SCENARIO = ROOT / "configs" / "scenarios" / "bbc_fedet.yaml"


def measure(run: Path, minutes: float) -> dict:
    summary = json.loads((run / "summary.json").read_text())
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [e for e in events if e["event"] == "round_client" and e["status"] == "accepted"]
    per_task = summary["rounds_per_task"]
    sums = [e["bytes_up"] for e in rows if e["round"] % per_task == 0]
    train = [e for e in rows if e["round"] % per_task and e["n_samples"]]
    cpu = []
    for wire in sorted((run / "clients").glob("*/wire.json")):
        rounds = json.loads(wire.read_text())["round_cpu_s"]
        cpu += [s for r, s in rounds.items() if int(r) % per_task]
    final = summary["final"]
    return {
        "avg_incremental_accuracy": final["avg_incremental_accuracy"],
        "accuracy_after_task": final["accuracy_per_task"],
        "forgetting": final["forgetting"],
        "upload_bytes_per_sums_round_per_device": float(np.mean(sums)),
        "upload_bytes_per_train_round_per_device": float(np.mean([e["bytes_up"] for e in train])),
        "upload_ratio_vs_full_fp32": float(max(e["bytes_up"] / e["dense_fp32_up"] for e in train)),
        "full_fp32_bytes": max(e["dense_fp32_up"] for e in train),
        "device_cpu_s_per_train_round": float(np.median(cpu)),
        "bytes_up_total": summary["bytes"]["up_total"],
        "bytes_down_total": summary["bytes"]["down_total"],
        "minutes": round(minutes, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="scenario override")
    parser.add_argument("--runs", default=None, help="run directory (default: a temporary one)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fedet_daemon"),
                        help="results path without extension")
    args = parser.parse_args(argv)
    runs = Path(args.runs or tempfile.mkdtemp(prefix="fedet-daemon-"))
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        broker = MosquittoProcess(Path(tmp)).start()
        try:
            cmd = [sys.executable, "-m", "fcl_edge.cli", "simulate", str(SCENARIO), "--out", str(runs),
                   "--broker", broker.url]
            for item in args.set:
                cmd += ["--set", item]
            started = time.monotonic()
            result = subprocess.run(cmd, capture_output=True, text=True)
            minutes = (time.monotonic() - started) / 60
        finally:
            broker.stop()
    if result.returncode != 0:
        raise SystemExit(f"fcl simulate failed ({result.returncode}): {result.stderr[-2000:]}")
    res = {"command": "python benchmarks/bench_fedet_daemon.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                       "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2)},
           "scenario": str(SCENARIO.relative_to(ROOT)), "overrides": args.set, **measure(runs, minutes)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
    out.with_suffix(".md").write_text("\n".join([
        "# FedET through the client daemon, the aggregator service and Mosquitto", "",
        f"`{res['command']}` on {platform.platform()}, {os.cpu_count()} cores (load average "
        f"{res['machine']['load_before']} before, {res['machine']['load_after']} after).", "",
        "| measure | value |", "|---|---|",
        f"| average incremental accuracy | {res['avg_incremental_accuracy']:.4f} |",
        f"| accuracy after each task | {', '.join(f'{a:.4f}' for a in res['accuracy_after_task'])} |",
        f"| forgetting | {res['forgetting']:.4f} |",
        f"| upload per device, class-sum round | {res['upload_bytes_per_sums_round_per_device']:,.0f} B |",
        f"| upload per device, training round | {res['upload_bytes_per_train_round_per_device']:,.0f} B |",
        f"| largest upload vs the full fine-tuned model in fp32 ({res['full_fp32_bytes']:,} B) | "
        f"{100 * res['upload_ratio_vs_full_fp32']:.2f}% |",
        f"| device CPU seconds per training round (median) | {res['device_cpu_s_per_train_round']:.2f} |",
        f"| wall clock | {res['minutes']:.1f} min |", ""]))
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
