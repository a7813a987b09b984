"""NGFL on class-incremental MNIST: the four lower settings and the two upper references, in
the "intensive" (2 rounds per pool) and "sparse" (4) regimes, through the real services.

Every run is ``fcl simulate configs/scenarios/mnist_ngfl.yaml --in-process``: the aggregator
service and five device daemons as threads of this process over the in-process transport.
The scenario is stage-synchronous (reading notes 3.4 G1): the base task {0, 1} on every
device for 5 rounds, then pools {2,3} {4,5} {6,7} {8,9}, each taken by the devices that drew
it (2 of 4 per device); devices without an active task send skip notices.

    python benchmarks/bench_ngfl.py                    # 6 settings x 2 regimes x 2 seeds = 24 runs
    python benchmarks/bench_ngfl.py --settings ta-tf,sa-pf --regimes intensive --seeds 0 --name ngfl_pilot

Per run, from the run directory: the fleet accuracy matrix (``summary.json``: row s is the
global model's accuracy on each stage's classes after stage s, over every device; every device
holds the same global model and test sets, so they agree); ``final_acc`` = accuracy on all
classes seen after the last stage (the mean of the last row: every class has the same number
of test images); ``avg_acc`` = the mean over stages of that figure (the paper's Avg, base
stage included); ``forgetting`` per docs/metrics.md; bytes from ``metrics.jsonl`` (accepted
updates: packet bytes up, the announcement's bytes down, the head rows' and the table's
share of the upload).
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

SCENARIO = ROOT / "configs" / "scenarios" / "mnist_ngfl.yaml"
SETTINGS = {
    "ta-tf": "ngfl-ta-tf",
    "ta-pf": "ngfl-ta-pf",
    "sa-tf": "ngfl-sa-tf",
    "sa-pf": "ngfl",
    "self": "ngfl-self",
    "global": "ngfl-global",
}
LOWER = ("ta-tf", "ta-pf", "sa-tf", "sa-pf")
REGIMES = {"intensive": 2, "sparse": 4}  # rounds per pool (notes G11)
BASE_ROUNDS = 5


def overrides(setting: str, regime: str, seed: int, device: str = "cpu") -> list[str]:
    r = REGIMES[regime]
    on = [f"device={device}"] if device != "cpu" else []  # cpu: the very commands of before
    return on + [
        f"federation.method={SETTINGS[setting]}",
        f"federation.name=ngfl-{regime}-{setting}",
        f"federation.seed={seed}",
        f"federation.task_rounds=[{BASE_ROUNDS}, {r}, {r}, {r}, {r}]",
        f"federation.options.rounds_per_task={r}",
        f"federation.options.base_rounds={BASE_ROUNDS}",
    ]


def measure(out: Path) -> dict:
    """The figures of one finished run directory."""
    summary = json.loads((out / "summary.json").read_text())
    fleet = summary.get("fleet") or {}
    if "accuracy_matrix" not in fleet:
        raise SystemExit(f"{out}: summary.json has no fleet accuracy matrix")
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    accepted = [e for e in events if e.get("event") == "round_client" and e["status"] == "accepted"]
    kinds = [e.get("tensor_bytes_by_kind") or {} for e in accepted]
    trained = [e for e in accepted if (e.get("n_samples") or 0) > 0]
    return {
        "final_acc": fleet["avg_accuracy"],
        "avg_acc": fleet["avg_incremental_accuracy"],
        "forgetting": fleet["forgetting"],
        "acc_per_stage": fleet["accuracy_per_task"],
        "acc_matrix": fleet["accuracy_matrix"],
        "up_bytes": int(sum(e["bytes_up"] for e in accepted)),
        "down_bytes": int(sum(e["bytes_down"] for e in accepted)),
        "head_up_bytes": int(sum(k.get("head", 0) for k in kinds)),
        "table_up_bytes": int(sum(k.get("table", 0) for k in kinds)),
        "extractor_up_bytes": int(sum(k.get("extractor", 0) for k in kinds)),
        "updates": len(trained),
        "skip_notices": len(accepted) - len(trained),
        "rejected": summary.get("rejected", {}),
    }


def run_one(job: tuple) -> tuple:
    work, setting, regime, seed, timeout, device = job
    import torch

    from fcl_edge.simulate import simulate

    torch.set_num_threads(1)
    out = Path(work) / f"{regime}-{setting}-s{seed}"
    started = time.perf_counter()
    code = simulate(
        str(SCENARIO),
        str(out),
        overrides=overrides(setting, regime, seed, device),
        timeout=timeout,
        in_process=True,
        force=True,
    )
    if code != 0:
        raise SystemExit(f"{out.name}: fcl simulate --in-process exited {code}; logs in {out / 'logs'}")
    res = measure(out)
    res["minutes"] = round((time.perf_counter() - started) / 60, 3)
    return regime, setting, seed, res


def combine(per_seed: dict[int, dict]) -> dict:
    """Seed means of one (regime, setting), with the per-seed figures."""
    runs = list(per_seed.values())

    def mean(key: str, digits: int = 4) -> float:
        return round(float(np.mean([r[key] for r in runs])), digits)

    out = {
        "final_acc": mean("final_acc"),
        "avg_acc": mean("avg_acc"),
        "forgetting": mean("forgetting"),
        "acc_per_stage": [round(float(v), 4) for v in np.mean([r["acc_per_stage"] for r in runs], axis=0)],
        "per_seed": {
            str(s): {k: r[k] for k in ("final_acc", "avg_acc", "forgetting", "acc_per_stage")}
            for s, r in per_seed.items()
        },
    }
    for key in ("up_bytes", "down_bytes", "head_up_bytes", "table_up_bytes", "extractor_up_bytes", "updates"):
        out[key] = int(np.mean([r[key] for r in runs]))
    out["skip_notices"] = int(np.mean([r["skip_notices"] for r in runs]))
    out["table_share_of_up"] = round(out["table_up_bytes"] / max(1, out["up_bytes"]), 6)
    out["minutes_per_run"] = mean("minutes", 3)
    out["rejected"] = {k: sum(r["rejected"].get(k, 0) for r in runs) for r in runs for k in r["rejected"]}
    return out


def targets(res: dict) -> list[tuple[str, bool]]:
    """The issue's targets on seed means, in every regime present."""
    out = []
    for regime, s in res["regimes"].items():
        if not set(LOWER) <= set(s):
            continue
        best_lower = max(s[n]["avg_acc"] for n in LOWER)
        out.append(
            (f"{regime}: SA-TF >= TA-TF + 2 points (avg)", s["sa-tf"]["avg_acc"] >= s["ta-tf"]["avg_acc"] + 0.02)
        )
        out.append(
            (f"{regime}: SA-TF >= TA-TF + 2 points (final)", s["sa-tf"]["final_acc"] >= s["ta-tf"]["final_acc"] + 0.02)
        )
        out.append(
            (
                f"{regime}: SA-PF within 0.5 points of the best lower setting (avg)",
                s["sa-pf"]["avg_acc"] >= best_lower - 0.005,
            )
        )
        out.append((f"{regime}: TA-TF final accuracy <= 0.30 (it forgets)", s["ta-tf"]["final_acc"] <= 0.30))
        out.append(
            (
                f"{regime}: partial fusion uploads fewer head bytes than total",
                s["sa-pf"]["head_up_bytes"] < s["sa-tf"]["head_up_bytes"]
                and s["ta-pf"]["head_up_bytes"] < s["ta-tf"]["head_up_bytes"],
            )
        )
        if {"self", "global"} <= set(s):
            out.append(
                (f"{regime}: Global >= Self - 0.5 points (avg)", s["global"]["avg_acc"] >= s["self"]["avg_acc"] - 0.005)
            )
            out.append(
                (
                    f"{regime}: upper references >= 10 points above every lower setting (final)",
                    min(s["self"]["final_acc"], s["global"]["final_acc"])
                    >= max(s[n]["final_acc"] for n in LOWER) + 0.10,
                )
            )
    if res.get("runs") == 24:
        out.append(("24 runs in <= 30 minutes", res["minutes"] <= 30))
    return out


def write_markdown(path: Path, res: dict) -> None:
    lines = [
        "# NGFL on class-incremental MNIST",
        "",
        f"`{res['command']}` on {res['machine']['cpus']} CPUs ({res['machine']['platform']}), "
        f"{res['minutes']:.1f} min wall clock for {res['runs']} runs, {res['workers']} at a time, "
        f"seeds {res['seeds']}. "
        "Every run went through the aggregator service and five device daemons (`fcl simulate --in-process`).",
        "",
        "Accuracy: the global model on the test images of every class seen, after the last stage (final) and "
        "averaged over the 5 stages (avg, base stage included). Bytes: whole run, all devices; head = the uploaded "
        "head rows, table = the JSON table in the uploads' metadata.",
        "",
    ]
    for regime, settings in res["regimes"].items():
        lines += [
            f"## {regime} ({REGIMES[regime]} rounds per pool)",
            "",
            "| setting | final acc | avg acc | forgetting | acc after each stage | per seed final | up MB | down MB "
            "| head up B | table up B (share of up) | skip notices |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, m in settings.items():
            seeds = ", ".join(f"{s}: {v['final_acc']:.3f}" for s, v in m["per_seed"].items())
            stages = " ".join(f"{v:.3f}" for v in m["acc_per_stage"])
            lines.append(
                f"| {name} | {m['final_acc']:.3f} | {m['avg_acc']:.3f} | {m['forgetting']:.3f} | {stages} | {seeds} "
                f"| {m['up_bytes'] / 1e6:.1f} | {m['down_bytes'] / 1e6:.1f} | {m['head_up_bytes']:,} "
                f"| {m['table_up_bytes']:,} ({m['table_share_of_up']:.5f}) | {m['skip_notices']} |"
            )
        if {"sa-pf", "sa-tf"} <= set(settings):
            ratio = settings["sa-pf"]["head_up_bytes"] / max(1, settings["sa-tf"]["head_up_bytes"])
            lines += ["", f"Head bytes up, partial / total fusion (SA): {ratio:.3f}."]
        lines.append("")
    lines += ["## Targets", ""]
    lines += [f"- [{'x' if ok else ' '}] {text}" for text, ok in res["targets"]]
    path.write_text("\n".join(lines) + "\n")


def plot(path: Path, res: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    regimes = list(res["regimes"])
    fig, axes = plt.subplots(1, len(regimes), figsize=(5.2 * len(regimes), 3.8), squeeze=False)
    for ax, regime in zip(axes[0], regimes):
        for name, m in res["regimes"][regime].items():
            values = m["acc_per_stage"]
            ax.plot(
                range(1, len(values) + 1),
                values,
                marker="o",
                label=name,
                linestyle="--" if name in ("self", "global") else "-",
            )
        ax.set_title(f"{regime}: accuracy on all classes seen")
        ax.set_xlabel("after stage")
        ax.set_ylabel("test accuracy")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated, of: " + ", ".join(SETTINGS))
    parser.add_argument("--regimes", default=",".join(REGIMES), help="comma-separated, of: " + ", ".join(REGIMES))
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--workers", type=int, default=2, help="runs at a time (one torch thread each)")
    parser.add_argument("--work", default="/tmp/bench_ngfl", help="where the run directories go")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    parser.add_argument("--name", default="ngfl", help="result files: benchmarks/results/NAME.{json,md}")
    parser.add_argument("--device", default="cpu", help="train.device of every client (docs/accelerators.md)")
    args = parser.parse_args(argv)
    settings = [s for s in args.settings.split(",") if s]
    regimes = [r for r in args.regimes.split(",") if r]
    unknown = [s for s in settings if s not in SETTINGS] + [r for r in regimes if r not in REGIMES]
    if unknown:
        parser.error(f"unknown settings or regimes: {unknown}")
    seeds = [int(s) for s in args.seeds.split(",")]
    jobs = [(args.work, s, r, seed, args.timeout, args.device) for r in regimes for s in settings for seed in seeds]
    started = time.perf_counter()
    raw: dict = {}
    from tqdm import tqdm

    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        for regime, setting, seed, res in tqdm(pool.map(run_one, jobs), total=len(jobs), desc="ngfl runs", unit="run"):
            raw.setdefault(regime, {}).setdefault(setting, {})[seed] = res
    minutes = (time.perf_counter() - started) / 60
    res = {
        "regimes": {r: {s: combine(raw[r][s]) for s in settings} for r in regimes},
        "minutes": round(minutes, 2),
        "runs": len(jobs),
        "workers": args.workers,
        "seeds": seeds,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "command": "python benchmarks/bench_ngfl.py" + "".join(f" {shlex.quote(a)}" for a in (argv or sys.argv[1:])),
    }
    res["targets"] = targets(res)
    results = ROOT / "benchmarks" / "results"
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{args.name}.json").write_text(json.dumps(res, indent=2) + "\n")
    write_markdown(results / f"{args.name}.md", res)
    plot(results / f"{args.name}_stages.png", res)
    for text, ok in res["targets"]:
        print(f"[{'x' if ok else ' '}] {text}")
    print(f"wrote {results / args.name}.json, .md and _stages.png ({minutes:.1f} min)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
