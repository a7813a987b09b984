"""Round time on slow links, per method: the same federation behind each link profile.

Each run is ``fcl simulate`` (the real aggregator, daemons and broker) with every device behind
a shaped link (``links.default=PROFILE``: its own network namespace with tbf-limited bandwidth,
and a relay adding the profile's round trip and stalls; fcl_edge/links.py).  Per run, from its
run directory: whether every round closed with every device (``completed``), the median and
95th-percentile round time (the aggregator's ``round`` events), bytes up and down
(summary.json), and the time until the round's task metric first reached the scenario's target
(``time_to_target_s``, summed round times; null if never).

    python benchmarks/bench_links.py                                  # quickstart-sized, every profile
    python benchmarks/bench_links.py --scenarios seqmnist --profiles lte-m --rounds 2

Writes ``benchmarks/results/links.json`` and ``links.png`` (median round time against profile).
Needs root (namespaces and qdiscs).  Timings depend on the machine and its load; both are
recorded.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks/results"
sys.path.insert(0, str(ROOT))

from fcl_edge.links import PROFILES  # noqa: E402

# name -> (scenario file, overrides, metric target: the round's task NLL at or below it)
SCENARIOS = {
    "quickstart": ("configs/scenarios/quickstart.yaml", ["federation.rounds.deadline_s=300"], 28.0),
    "seqmnist": (
        "configs/scenarios/seqmnist_base.yaml",
        ["federation.num_tasks=1", "federation.rounds.deadline_s=900", "tasks.random.classes_per_task=1"],
        250.0,
    ),
}
# method -> overrides: ConFedMADE with 8-bit values and dense float32 FedAvg, the two ends
METHODS = {
    "confedmade-int8": [
        "federation.method=confedmade",
        "federation.wire.value_dtype=int8",
        "federation.options.keep_units=0.35",
    ],
    "fedavg": ["federation.method=fedavg", "federation.wire.value_dtype=float32"],
}


def one_run(scenario: str, method: str, profile: str, rounds: int, work: Path, timeout: float = 1800.0) -> dict:
    path, extra, target = SCENARIOS[scenario]
    out = work / f"{scenario}-{method}-{profile}"
    sets = [*extra, *METHODS[method], f"federation.rounds_per_task={rounds}", "compare=[]"]
    if profile != "loopback":
        sets.append(f"links.default={profile}")
    argv = [
        sys.executable,
        "-m",
        "fcl_edge.cli",
        "simulate",
        str(ROOT / path),
        "--out",
        str(out),
        "--timeout",
        str(timeout),
    ]
    for item in sets:
        argv += ["--set", item]
    started = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
    wall = time.monotonic() - started
    events = (
        [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()] if out.exists() else []
    )
    closed = [e for e in events if e.get("event") == "round"]
    scores = {e["round"]: e.get("mean_nll") for e in events if e.get("event") == "round_summary"}
    durations = [e["duration_s"] for e in closed]
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    elapsed, to_target = 0.0, None
    for e in closed:
        elapsed += e["duration_s"]
        score = scores.get(e["round"])
        if to_target is None and score is not None and score <= target:
            to_target = round(elapsed, 1)
    full = all(e["accepted"] == e["expected"] for e in closed)
    return {
        "scenario": scenario,
        "method": method,
        "profile": profile,
        "devices": summary.get("clients"),
        "rounds": len(closed),
        "completed": done.returncode == 0 and len(closed) == rounds * _tasks(summary) and full,
        "median_round_s": round(statistics.median(durations), 2) if durations else None,
        "p95_round_s": _nearest_rank(durations, 0.95),
        "round_s": durations,
        "bytes_up": summary.get("bytes", {}).get("up_total"),
        "bytes_down": summary.get("bytes", {}).get("down_total"),
        "time_to_target_s": to_target,
        "target": f"round's task NLL <= {target}",
        "wall_s": round(wall, 1),
        "exit": done.returncode,
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }


def _nearest_rank(values: list[float], q: float) -> float | None:
    """The q-quantile by nearest rank (the smallest value with at least q of the values at or below it)."""
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[max(0, math.ceil(q * len(ordered)) - 1)], 2)


def _tasks(summary: dict) -> int:
    return int(summary.get("tasks") or 1)


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = sorted({r["scenario"] for r in runs})
    fig, axes = plt.subplots(1, len(scenarios), figsize=(6 * len(scenarios), 4), squeeze=False)
    for ax, scenario in zip(axes[0], scenarios):
        mine = [r for r in runs if r["scenario"] == scenario]
        profiles = list(dict.fromkeys(r["profile"] for r in mine))
        for method in dict.fromkeys(r["method"] for r in mine):
            ys = [
                next((r["median_round_s"] for r in mine if r["method"] == method and r["profile"] == p), None)
                for p in profiles
            ]
            ax.plot(profiles, [float("nan") if y is None else y for y in ys], marker="o", label=method)
        ax.set_title(f"{scenario}: median round time by link")
        ax.set_ylabel("seconds per round (lower is better)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", nargs="+", default=["quickstart"], choices=sorted(SCENARIOS))
    parser.add_argument("--profiles", nargs="+", default=["loopback", *PROFILES], help="link profiles, or loopback")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--rounds", type=int, default=2, help="rounds per task")
    parser.add_argument(
        "--run-timeout", type=float, default=1800.0, help="seconds a run may take (it is recorded as not completed)"
    )
    parser.add_argument("--out", default=str(RESULTS / "links.json"))
    parser.add_argument("--update", action="store_true", help="keep the earlier file's runs of other cells")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("bench_links: shaping needs root", file=sys.stderr)
        return 2
    out = Path(args.out)
    earlier = json.loads(out.read_text())["runs"] if args.update and out.exists() else []
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-links-") as work:
        for scenario in args.scenarios:
            for profile in args.profiles:
                for method in args.methods:
                    run = one_run(scenario, method, profile, args.rounds, Path(work), args.run_timeout)
                    print(json.dumps(run), flush=True)
                    runs.append(run)
    keys = {(r["scenario"], r["method"], r["profile"]) for r in runs}
    runs = [r for r in earlier if (r["scenario"], r["method"], r["profile"]) not in keys] + runs
    result = {
        "runs": runs,
        "profiles": {name: p.describe for name, p in PROFILES.items()},
        "machine": f"{platform.node()} {platform.platform()}, {os.cpu_count()} CPUs",
        "command": "python benchmarks/bench_links.py " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    out.write_text(json.dumps(result, indent=2) + "\n")
    plot(runs, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
