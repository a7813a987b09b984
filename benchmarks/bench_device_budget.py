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
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fcl_edge.broker import MosquittoProcess  # noqa: E402

# result name -> (scenario file, whether --rounds-per-task shortens it).  Every shipped method
# has a row; the scenarios with per-task round lists (task_rounds) run as shipped.
SCENARIOS = {
    "quickstart": ("quickstart", True),
    "digits_continual": ("digits_continual", True),
    "seqmnist_confedmade": ("seqmnist_confedmade", True),
    "seqmnist_fedavg": ("seqmnist_fedcl_finetune", True),  # dense FedAvg of the same MADE
    "fedet": ("bbc_fedet", True),
    "fedseit": ("bbc_fedseit", True),
    "filver": ("mnist_filver", False),
    "ngfl": ("mnist_ngfl", False),
}
# The most a device of a method may use (daemon peak plus export child), MB: a row over it is
# marked ``within_budget: false`` (issue 40: FedSeIT measured 1,019 MB, FIL-VER 654 MB).
BUDGETS_MB = {"fedseit": 700, "filver": 700}
# A board's memory, less what runs beside the daemon: the OS with its services (about 250 MB
# on a Raspberry Pi OS Lite / JetPack without a desktop) and a margin for the page cache and
# the MQTT client's buffers.  A scenario fits a board when its device peak (the daemon's plus
# an export child's, which runs while the daemon is resident) is within the rest.
BOARDS_MB = {"1 GB": 1024, "2 GB": 2048, "4 GB": 4096}
RESERVED_MB = 250 + 150


def fits(peak_mb: float) -> list[str]:
    return [name for name, mb in BOARDS_MB.items() if peak_mb <= mb - RESERVED_MB]


def run_dir(out: Path, scenario: Path) -> Path:
    """Where ``fcl simulate`` wrote the run: ``out`` itself, or ``out/<method>/`` of the first
    method of a scenario that compares several (``compare:``, e.g. the quickstart)."""
    if (out / "metrics.jsonl").is_file():
        return out
    compare = yaml.safe_load(scenario.read_text()).get("compare") or []
    if compare and (out / compare[0] / "metrics.jsonl").is_file():
        return out / compare[0]
    raise SystemExit(f"{scenario.name}: no metrics.jsonl under {out} (nor under {out}/<first compared method>/)")


def measure(name: str, rounds_per_task: int, work: Path, broker_url: str) -> dict:
    scenario, shorten = SCENARIOS[name]
    out = work / name
    cmd = [
        sys.executable,
        "-m",
        "fcl_edge.cli",
        "simulate",
        str(ROOT / "configs/scenarios" / f"{scenario}.yaml"),
        "--out",
        str(out),
        "--broker",
        broker_url,
        "--force",  # a re-run replaces the earlier run
    ]
    if shorten:
        cmd += ["--set", f"federation.rounds_per_task={rounds_per_task}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(
            f"{name}: fcl simulate exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        )
    out = run_dir(out, ROOT / "configs/scenarios" / f"{scenario}.yaml")
    wires = [json.loads(p.read_text()) for p in sorted((out / "clients").glob("*/wire.json"))]
    cpu = [s for w in wires for s in w["round_cpu_s"].values()]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["event"] == "round_client" and r["status"] == "accepted"]
    up, down = [r["bytes_up"] for r in rows], [r["bytes_down"] for r in rows]
    by_round: dict[str, float] = {}  # the largest peak RSS over devices after each round
    for w in wires:
        for rnd, (_, peak) in w.get("round_rss_mb", {}).items():
            by_round[rnd] = max(by_round.get(rnd, 0.0), peak)
    peak = max(w["max_rss_mb"] for w in wires)
    child = max(w.get("export_child_peak_rss_mb", 0.0) for w in wires)
    served = sorted((out / "clients").glob("*/model.onnx"))
    return {
        "scenario": scenario,
        "shortened": shorten,
        "clients": len(wires),
        "client_peak_rss_mb_by_round": {r: by_round[r] for r in sorted(by_round, key=int)},
        "export_child_peak_rss_mb_max": child,
        "device_peak_rss_mb": round(peak + child, 1),
        "fits_boards": fits(peak + child),
        **({"infer_peak_rss_mb": infer_rss(served[0])} if served and _is_made(served[0]) else {}),
        "rounds": len({r["round"] for r in rows}),
        "client_peak_rss_mb_max": peak,
        "client_cpu_s_per_round_median": round(float(np.median(cpu)), 3),
        "client_cpu_s_per_round_p90": round(float(np.percentile(cpu, 90)), 3),
        "bytes_up_per_round_median": int(np.median(up)),
        "bytes_down_per_round_median": int(np.median(down)),
        "bytes_down_per_round_max": int(max(down)),  # task starts carry knowledge-base entries
    }


# A serving-only device: the torch-free runtime (fcl-edge[infer]) with torch, onnx and yaml
# imports blocked, loading a served MADE and scoring rows; its own VmHWM.
INFER_CHILD = r"""
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "onnx", "yaml"):
            raise ImportError(f"{name} is blocked in a serving-only process")
sys.meta_path.insert(0, Block())
import numpy as np
from export.runtime import MadeRuntime
rt = MadeRuntime.load(sys.argv[1])
x = (np.random.default_rng(0).random((256, rt.input_dim)) < 0.2).astype(np.float32)
for i in range(0, 256, 16):
    rt.log_likelihood(x[i : i + 16])
for line in open("/proc/self/status"):
    if line.startswith("VmHWM:"):
        print(int(line.split()[1]) / 1024)
"""


def _is_made(model: Path) -> bool:
    """A served MADE by its ``fcl.format`` (every format writes a ``served.npz`` beside its model)."""
    from export._meta import FORMAT, PREFIX
    from export._proto import parse_model

    return parse_model(model.read_bytes()).metadata.get(PREFIX + "format") == FORMAT


def infer_rss(model: Path) -> float:
    done = subprocess.run(
        [sys.executable, "-c", INFER_CHILD, str(model)], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    if done.returncode != 0:
        raise SystemExit(f"serving-only process failed on {model}: {done.stderr[-2000:]}")
    return round(float(done.stdout.split()[-1]), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    parser.add_argument("--rounds-per-task", type=int, default=2)
    parser.add_argument(
        "--rounds-per-day",
        type=int,
        default=144,
        help="for the per-day bandwidth (default: one round every 10 minutes)",
    )
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/device_budget.json"))
    parser.add_argument(
        "--update",
        action="store_true",
        help="keep the other scenarios' rows of --out (each row records the command that measured it)",
    )
    args = parser.parse_args()
    results = {}
    if args.update and Path(args.out).is_file():
        results = json.loads(Path(args.out).read_text())["scenarios"]
    with tempfile.TemporaryDirectory() as tmp:
        broker = MosquittoProcess(Path(tmp) / "broker").start()
        try:
            for name in args.scenarios:
                print(f"{name} ...", flush=True)
                r = measure(name, args.rounds_per_task, Path(tmp), broker.url)
                r["command"] = " ".join(["python", *sys.argv])
                if name in BUDGETS_MB:
                    r["budget_mb"] = BUDGETS_MB[name]
                    r["within_budget"] = r["device_peak_rss_mb"] <= BUDGETS_MB[name]
                r["mb_up_per_day"] = round(r["bytes_up_per_round_median"] * args.rounds_per_day / 1e6, 2)
                r["mb_down_per_day"] = round(r["bytes_down_per_round_median"] * args.rounds_per_day / 1e6, 2)
                results[name] = r
                print(json.dumps(r), flush=True)
        finally:
            broker.stop()
    made = [r["infer_peak_rss_mb"] for r in results.values() if "infer_peak_rss_mb" in r]
    doc = {
        "scenarios": results,
        **({"infer_made_peak_rss_mb": max(made)} if made else {}),
        "boards_mb": BOARDS_MB,
        "reserved_mb": RESERVED_MB,
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
    md = markdown(doc)
    Path(args.out).with_suffix(".md").write_text(md)
    print(md)


def markdown(doc: dict) -> str:
    """The table of ``doc`` (device_budget.json), with the command that measured each row (an
    ``--update`` run re-measures some rows and keeps the others)."""
    results, made = doc["scenarios"], doc.get("infer_made_peak_rss_mb")
    commands: dict[str, list[str]] = {}
    for name, r in results.items():
        commands.setdefault(r.get("command", doc["command"]), []).append(name)
    said = "; ".join(f"`{c}` ({', '.join(rows)})" for c, rows in commands.items())
    md = [
        f"Commands: {said}, on {doc['machine']['platform']}, {doc['machine']['cpus']} CPUs. "
        f"Shortened scenarios run {doc['rounds_per_task']} rounds per task. A board fits when the daemon's peak "
        f"plus its export child's is within the board less {doc['reserved_mb']} MB (OS, services, page cache, MQTT).",
        "",
        "| scenario | daemon peak RSS | + export child | fits | CPU s / round (median, p90) | up / round "
        f"| down / round (max) | MB / day up, down at {doc['rounds_per_day']} rounds |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        md.append(
            f"| {name} | {r['client_peak_rss_mb_max']} MB | {r['export_child_peak_rss_mb_max']} MB | "
            f"{', '.join(r['fits_boards']) or 'none'}{_budget(r)} | {r['client_cpu_s_per_round_median']}, "
            f"{r['client_cpu_s_per_round_p90']} | {r['bytes_up_per_round_median']:,} B | "
            f"{r['bytes_down_per_round_median']:,} B ({r['bytes_down_per_round_max']:,}) | "
            f"{r['mb_up_per_day']}, {r['mb_down_per_day']} |"
        )
    if made:
        md += ["", f"A serving-only device (torch-free runtime, a served MADE): peak RSS {made} MB."]
    return "\n".join(md) + "\n"


def _budget(row: dict) -> str:
    if "budget_mb" not in row:
        return ""
    return f" (budget {row['budget_mb']} MB: {'within' if row['within_budget'] else 'OVER'})"


if __name__ == "__main__":
    main()
