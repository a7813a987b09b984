"""FedET through the real harness: ``fcl simulate configs/scenarios/bbc_fedet.yaml`` with a
Mosquitto broker this script starts, one OS process per device and one aggregator.

Writes ``benchmarks/results/fedet_daemon.json`` and ``.md``: average incremental accuracy
(per task and overall), forgetting, upload bytes per device and round (class-sum rounds and
training rounds apart) against the full fine-tuned model in float32, the devices' CPU
seconds per training round (each device's ``round_cpu_s``: process CPU time of the round,
evaluation and background threads included), and wall-clock minutes.

The CPU of a training round is compared with a "before".  With ``--before-run DIR`` (a
finished run directory of the earlier code, ``--before-run-commit`` naming that code, made on
the same machine just before or after this run) that is the side-by-side figure behind
``cpu_s_per_round_ratio_vs_before``, and the median that the results file being replaced holds
is kept for context only (``cpu_s_per_round_ratio_vs_recorded``).  Without it: that recorded
median (with that file's command and commit), or ``--before SECONDS``.

    python benchmarks/bench_fedet_daemon.py                      # the scenario as shipped
    python benchmarks/bench_fedet_daemon.py --set federation.seed=1
    python benchmarks/bench_fedet_daemon.py --from-run DIR      # re-measure a finished run
    python benchmarks/bench_fedet_daemon.py --before-run OLD_RUN --before-run-commit cbdf8ff
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
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


def train_round_cpu(run: Path) -> dict[str, dict[str, float]]:
    """Client -> {round: CPU seconds} of its training rounds (a task's first round, the class-sum
    round, is not one)."""
    per_task = json.loads((run / "summary.json").read_text())["rounds_per_task"]
    out = {}
    for wire in sorted((run / "clients").glob("*/wire.json")):
        device = json.loads(wire.read_text())
        out[wire.parent.name] = {r: s for r, s in device["round_cpu_s"].items() if int(r) % per_task}
    return out


def measure(run: Path) -> dict:
    summary = json.loads((run / "summary.json").read_text())
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [e for e in events if e["event"] == "round_client" and e["status"] == "accepted"]
    per_task = summary["rounds_per_task"]
    sums = [e["bytes_up"] for e in rows if e["round"] % per_task == 0]
    train = [e for e in rows if e["round"] % per_task and e["n_samples"]]
    by_client = train_round_cpu(run)
    cpu = [s for rounds in by_client.values() for s in rounds.values()]
    rss = [json.loads(w.read_text())["max_rss_mb"] for w in sorted((run / "clients").glob("*/wire.json"))]
    final = summary["final"]
    scenario = yaml.safe_load((run / "scenario.yaml").read_text())  # as the run resolved it
    federation = scenario["federation"]
    return {
        "fedet_settings": federation.get("options", federation.get("fedet")),  # older runs: "fedet"
        "data": scenario["data"],
        "avg_incremental_accuracy": final["avg_incremental_accuracy"],
        "accuracy_after_task": final["accuracy_per_task"],
        "forgetting": final["forgetting"],
        "upload_bytes_per_sums_round_per_device": float(np.mean(sums)),
        "upload_bytes_per_train_round_per_device": float(np.mean([e["bytes_up"] for e in train])),
        "upload_ratio_vs_full_fp32": float(max(e["bytes_up"] / e["dense_fp32_up"] for e in train)),
        "full_fp32_bytes": max(e["dense_fp32_up"] for e in train),
        "device_cpu_s_per_train_round": float(np.median(cpu)),
        "device_cpu_s_per_train_round_mean": float(np.mean(cpu)),
        "device_cpu_s_train_rounds": by_client,
        "device_peak_rss_mb": max(rss),
        "bytes_up_total": summary["bytes"]["up_total"],
        "bytes_down_total": summary["bytes"]["down_total"],
        "minutes": round(summary["duration_s"] / 60, 2),  # the aggregator's run, start to summary
    }


def git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        return ""


def before_of(args: argparse.Namespace, out: Path) -> dict | None:
    """The CPU seconds per training round to compare with, and where they come from."""
    if args.before is not None:
        return {"device_cpu_s_per_train_round": args.before, "from": "--before", "commit": args.before_commit}
    previous = out.with_suffix(".json")
    if not previous.exists():
        return None
    old = json.loads(previous.read_text())
    rel = str(previous.relative_to(ROOT)) if previous.is_relative_to(ROOT) else str(previous)
    return {
        "device_cpu_s_per_train_round": old["device_cpu_s_per_train_round"],
        "device_cpu_s_per_train_round_mean": old.get("device_cpu_s_per_train_round_mean"),
        "avg_incremental_accuracy": old.get("avg_incremental_accuracy"),
        "from": f"{rel} as it was before this run",
        "command": old.get("command"),
        "commit": old.get("commit") or git("log", "-1", "--format=%h", "--", rel) or None,
    }


def remeasured_before(run: Path, commit: str | None) -> dict:
    """The same numbers from a finished run directory of the earlier code."""
    cpu = [s for rounds in train_round_cpu(run).values() for s in rounds.values()]
    summary = json.loads((run / "summary.json").read_text())
    return {
        "device_cpu_s_per_train_round": float(np.median(cpu)),
        "device_cpu_s_per_train_round_mean": float(np.mean(cpu)),
        "device_cpu_s_train_rounds": train_round_cpu(run),
        "avg_incremental_accuracy": summary["final"]["avg_incremental_accuracy"],
        "accuracy_after_task": summary["final"]["accuracy_per_task"],
        "from": f"run directory {run}",
        "commit": commit,
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
    parser.add_argument("--commit", default=None, help="with --from-run: the commit the run was made with")
    parser.add_argument("--before", type=float, default=None, help="the earlier CPU s per training round (median)")
    parser.add_argument("--before-commit", default=None, help="with --before: the commit it was measured at")
    parser.add_argument("--before-run", default=None, metavar="DIR", help="a run directory of the earlier code")
    parser.add_argument("--before-run-commit", default=None, help="the commit --before-run was made with")
    parser.add_argument(
        "--note", default=None, help="a sentence for the report, e.g. when and under what load the runs were made"
    )
    args = parser.parse_args(argv)
    out = Path(args.out)
    before = before_of(args, out)  # read before the results file is replaced
    again = remeasured_before(Path(args.before_run), args.before_run_commit) if args.before_run else None
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
        "command": "python benchmarks/bench_fedet_daemon.py " + shlex.join(argv if argv is not None else sys.argv[1:]),
        # the code that ran: this checkout (a re-measured run: --commit, else unknown)
        "commit": args.commit if args.from_run else git("rev-parse", "--short", "HEAD") or None,
        "uncommitted_changes": False if args.from_run else bool(git("status", "--porcelain", "--untracked-files=no")),
        "machine": {
            "platform": platform.platform(),
            "cpu": cpu_model(),
            "cpus": os.cpu_count(),
            "load_before": round(load_before, 2),
            "load_after": round(os.getloadavg()[0], 2),
        },
        "scenario": str(SCENARIO.relative_to(ROOT)),
        "overrides": args.set,
        **({"note": args.note} if args.note else {}),
        **measure(runs),
    }
    if again is not None:  # side by side: the headline ratio; a recorded figure is context only
        res["cpu_before"] = again
        res["cpu_s_per_round_ratio_vs_before"] = round(
            res["device_cpu_s_per_train_round"] / again["device_cpu_s_per_train_round"], 4
        )
        res["cpu_s_per_round_mean_ratio_vs_before"] = round(
            res["device_cpu_s_per_train_round_mean"] / again["device_cpu_s_per_train_round_mean"], 4
        )
        if before is not None:
            res["cpu_before_recorded"] = before
            res["cpu_s_per_round_ratio_vs_recorded"] = round(
                res["device_cpu_s_per_train_round"] / before["device_cpu_s_per_train_round"], 4
            )
    elif before is not None:
        res["cpu_before"] = before
        res["cpu_s_per_round_ratio_vs_before"] = round(
            res["device_cpu_s_per_train_round"] / before["device_cpu_s_per_train_round"], 4
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
    out.with_suffix(".md").write_text(
        "\n".join(
            [
                "# FedET through the client daemon, the aggregator service and Mosquitto",
                "",
                f"`{res['command']}` at commit {res['commit'] or 'unknown'}"
                f"{' with uncommitted changes' if res['uncommitted_changes'] else ''} on {platform.platform()}, "
                f"{res['machine']['cpu'] or 'CPU unknown'}, {os.cpu_count()} cores (load average "
                f"{res['machine']['load_before']} before, {res['machine']['load_after']} after).",
                "",
                *([res["note"], ""] if res.get("note") else []),
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
                f"| device CPU seconds per training round (mean) | {res['device_cpu_s_per_train_round_mean']:.2f} |",
                *before_rows(res),
                f"| device peak RSS (largest over devices) | {res['device_peak_rss_mb']:,.0f} MB |",
                f"| run time (aggregator start to summary) | {res['minutes']:.1f} min |",
                "",
            ]
        )
    )
    print(json.dumps(res, indent=2))
    return 0


def before_rows(res: dict) -> list[str]:
    rows = []
    before = res.get("cpu_before")
    if before is not None and "device_cpu_s_train_rounds" in before:  # a run of the earlier code (--before-run)
        where = before["from"] + (f", commit {before['commit']}" if before.get("commit") else "")
        rows += [
            f"| CPU per training round before, side by side (median / mean; {where}; its accuracy "
            f"{before['avg_incremental_accuracy']:.4f}) | {before['device_cpu_s_per_train_round']:.2f} / "
            f"{before['device_cpu_s_per_train_round_mean']:.2f} |",
            f"| CPU per training round, now / before (median / mean) | "
            f"{res['cpu_s_per_round_ratio_vs_before']:.3f} / {res['cpu_s_per_round_mean_ratio_vs_before']:.3f} |",
        ]
    elif before is not None:
        where = before["from"] + (f", commit {before['commit']}" if before.get("commit") else "")
        where += f", `{before['command']}`" if before.get("command") else ""
        rows += [
            f"| CPU per training round before (median; {where}) | {before['device_cpu_s_per_train_round']:.2f} |",
            f"| CPU per training round, now / before (median) | {res['cpu_s_per_round_ratio_vs_before']:.3f} |",
        ]
    recorded = res.get("cpu_before_recorded")
    if recorded is not None:
        where = recorded["from"] + (f", commit {recorded['commit']}" if recorded.get("commit") else "")
        rows += [
            f"| for context, not side by side: CPU per training round recorded before ({where}) | "
            f"{recorded['device_cpu_s_per_train_round']:.2f} (now / recorded "
            f"{res['cpu_s_per_round_ratio_vs_recorded']:.3f}) |",
        ]
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
