"""FedET vs its FedAvg baselines on class-incremental BBC News, through the real services.

Every method runs as ``fcl simulate configs/scenarios/bbc_fedet.yaml --in-process``: the
aggregator service and one client daemon per device, as threads of this process over the
in-process transport, with the method's own strategy and learner from the registry.  There
is no second protocol here: the numbers are the run directories' ``summary.json`` and
``metrics.jsonl``, the same files a fleet writes.

    python benchmarks/bench_fedet_bbc.py                                   # all methods, seeds 0,1
    python benchmarks/bench_fedet_bbc.py --methods fedet --rounds-per-task 2 --per-class 8 --seeds 0   # smoke

Methods (presets of ``methods/fedet``): ``fedet`` (J groups, prototype selector, double
distillation, entropy-aware server distillation), ``fedet-j1`` (``fedet`` with one group),
``finetune-fl`` (``fedet-finetune``: one Enhancer group over the classes seen so far, FedAvg),
``replay-fl`` (``fedet-replay``: the same plus the sample memory), ``multitask``
(``fedet-finetune`` on one task holding every class for the same total rounds: the upper bound).
Each task's first round is the class-sum round of the prototype selector, for every method.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SCENARIO = ROOT / "configs" / "scenarios" / "bbc_fedet.yaml"
METHODS = {
    "fedet": "fedet",
    "fedet-j1": "fedet",
    "finetune-fl": "fedet-finetune",
    "replay-fl": "fedet-replay",
    "multitask": "fedet-finetune",
}


def overrides(args: argparse.Namespace, name: str, seed: int) -> list[str]:
    """``--set`` items that make the shipped scenario the benchmark's, for one method and seed."""
    tasks = [sum(args.tasks)] if name == "multitask" else args.tasks
    rounds = args.rounds_per_task * (len(args.tasks) if name == "multitask" else 1)
    groups = 1 if name == "fedet-j1" else args.groups
    return [
        f"federation.method={METHODS[name]}",
        f"federation.name=bbc-{name}",
        f"federation.seed={seed}",
        f"federation.rounds_per_task={rounds}",
        f"tasks.sizes={tasks}",
        f"clients={args.clients}",
        f"data.class_fraction={args.fraction}",
        f"data.per_class={args.per_class}",
        f"data.test_per_class={args.test_per_class}",
        f"federation.train.lr={args.lr}",
        f"federation.train.batch_size={args.batch_size}",
        f"federation.options.num_groups={groups}",
        f"federation.options.bottleneck={args.bottleneck}",
        f"federation.options.max_length={args.seq_len}",
        f"federation.options.gamma={args.gamma}",
        f"federation.options.server_epochs={args.server_epochs}",
        f"federation.options.aux_per_round={args.aux_per_round}",
        f"federation.options.proto_init={args.proto_init}",
        *(f"federation.options.{item}" for item in args.option),
    ]


def measure(run: Path, wall: float) -> dict:
    """The headline numbers of one finished run directory."""
    summary = json.loads((run / "summary.json").read_text())
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    accepted = [e for e in events if e["event"] == "round_client" and e["status"] == "accepted"]
    per_round: dict[int, int] = {}
    for e in accepted:
        per_round[e["round"]] = per_round.get(e["round"], 0) + e["bytes_up"]
    dense = summary["bytes"]["dense_fp32_up_total"] / max(1, len(accepted))
    cpu = []
    for wire in sorted((run / "clients").glob("*/wire.json")):
        cpu += list(json.loads(wire.read_text())["round_cpu_s"].values())
    final = summary["final"]
    return {
        "acc_after_task": final.get("accuracy_per_task"),
        "avg_incremental_acc": final.get("avg_incremental_accuracy"),
        "forgetting": final.get("forgetting"),
        "rounds": summary["rounds"],
        "upload_bytes_total": summary["bytes"]["up_total"],
        "download_bytes_total": summary["bytes"]["down_total"],
        "upload_bytes_per_round_mean": float(np.mean(list(per_round.values()))),
        "upload_ratio_vs_full_fp32": max(e["bytes_up"] for e in accepted) / dense,
        "device_cpu_s_per_round_median": float(np.median(cpu)) if cpu else None,
        "wall_seconds": round(wall, 1),
    }


def run_method(args: argparse.Namespace, name: str, seed: int) -> dict:
    from fcl_edge.simulate import simulate

    out = Path(args.work) / f"seed{seed}" / name
    started = time.perf_counter()
    code = simulate(
        str(SCENARIO),
        str(out),
        overrides=overrides(args, name, seed),
        timeout=args.timeout,
        in_process=True,
        force=True,
    )
    if code != 0:
        raise SystemExit(f"{name} (seed {seed}): fcl simulate --in-process exited {code}; logs in {out / 'logs'}")
    return measure(out, time.perf_counter() - started)


def combine_seeds(runs: list[dict]) -> dict:
    """Per method, over seeds: mean and standard deviation of the headline numbers."""
    out = {}
    for name in runs[0]["methods"]:
        per = [r["methods"][name] for r in runs]
        acc = [m["avg_incremental_acc"] for m in per]
        forgetting = [m["forgetting"] for m in per if m["forgetting"] is not None and name != "multitask"]
        out[name] = {
            "avg_incremental_acc_mean": float(np.mean(acc)),
            "avg_incremental_acc_std": float(np.std(acc)),
            "avg_incremental_acc_per_seed": acc,
            "acc_after_task_per_seed": [m["acc_after_task"] for m in per],
            "forgetting_mean": float(np.mean(forgetting)) if forgetting else None,
            "upload_bytes_per_round_mean": float(np.mean([m["upload_bytes_per_round_mean"] for m in per])),
            "upload_ratio_vs_full_fp32": float(max(m["upload_ratio_vs_full_fp32"] for m in per)),
            "device_cpu_s_per_round_median": per[0]["device_cpu_s_per_round_median"],
        }
    return out


def write_markdown(path: Path, res: dict) -> None:
    lines = [
        f"# FedET on class-incremental BBC News ({res['args']['tasks']} new classes per task)",
        "",
        f"`{res['command']}` on {res['machine']['cpus']} CPUs ({res['machine']['platform']}; load average "
        f"{res['machine']['load_before']} before, {res['machine']['load_after']} after), "
        f"{res['wall_seconds']:.0f} s wall clock, seeds {res['args']['seeds']}. Every method ran through "
        "the aggregator service and the client daemons (`fcl simulate --in-process`).",
        "",
        "| method | registered as | avg incremental acc (mean +- std) | per seed | forgetting "
        "| upload B / round (all clients) | largest upload vs full fp32 model | device CPU s / round |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, m in res["methods"].items():
        forgetting = "-" if m["forgetting_mean"] is None else f"{m['forgetting_mean']:.3f}"
        seeds = ", ".join(f"{a:.3f}" for a in m["avg_incremental_acc_per_seed"])
        cpu = m["device_cpu_s_per_round_median"]
        lines.append(
            f"| {name} | `{METHODS[name]}` | {m['avg_incremental_acc_mean']:.4f} +- "
            f"{m['avg_incremental_acc_std']:.4f} | {seeds} | {forgetting} "
            f"| {m['upload_bytes_per_round_mean']:,.0f} | {100 * m['upload_ratio_vs_full_fp32']:.2f}% "
            f"| {'-' if cpu is None else f'{cpu:.2f}'} |"
        )
    lines += [
        "",
        "Accuracy after task t is each device's accuracy on the test texts of every class seen by "
        "then, averaged over devices; the average incremental accuracy is its mean over tasks "
        "(docs/metrics.md). Upload bytes are MQTT PUBLISH packet bytes as the aggregator meters them; every "
        "method's include the class-sum round at each task start.",
    ]
    path.write_text("\n".join(lines) + "\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ", ".join(METHODS))
    p.add_argument("--tasks", default="2,3", help="new classes per task (BBC has 5 classes)")
    p.add_argument("--clients", type=int, default=5)
    p.add_argument("--fraction", type=float, default=0.6, help="share of the classes each client holds")
    p.add_argument("--groups", type=int, default=2, help="J, Enhancer groups of the fedet method")
    p.add_argument("--rounds-per-task", type=int, default=4, help="rounds per task, the class-sum round included")
    p.add_argument("--per-class", type=int, default=30, help="training texts per (client, class)")
    p.add_argument("--test-per-class", type=int, default=40)
    p.add_argument("--aux-per-round", type=int, default=40, help="auxiliary texts per server distillation")
    p.add_argument("--server-epochs", type=int, default=4, help="server distillation epochs per round")
    p.add_argument(
        "--proto-init",
        type=float,
        default=0.0,
        help="new head rows start as a nearest-prototype classifier of this logit scale (0: zeros)",
    )
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="another federation option of every method, e.g. int8_blocks=false (default: the scenario's)",
    )
    p.add_argument("--bottleneck", type=int, default=64, help="Enhancer width m")
    p.add_argument("--gamma", type=float, default=0.1, help="sample memory store ratio")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seeds", default="0,1", help="comma-separated seeds: one full run each")
    p.add_argument("--timeout", type=float, default=7200.0, help="per run, seconds")
    p.add_argument("--work", default="/tmp/fcl-bench-fedet-bbc", help="where the run directories go")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="results directory")
    p.add_argument("--name", default="fedet_bbc", help="results file stem")
    args = p.parse_args(argv)
    args.tasks = [int(v) for v in args.tasks.split(",")]
    args.seeds = [int(v) for v in args.seeds.split(",")]
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown:
        p.error(f"unknown methods {unknown}; choose from {', '.join(METHODS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start, load_before = time.perf_counter(), os.getloadavg()[0]
    runs = []
    for seed in args.seeds:
        runs.append({"seed": seed, "methods": {name: run_method(args, name, seed) for name in args.methods}})
        for name, m in runs[-1]["methods"].items():
            print(
                f"seed {seed} {name}: avg incremental acc {m['avg_incremental_acc']:.4f}, "
                f"upload/round {m['upload_bytes_per_round_mean']:,.0f} B",
                flush=True,
            )
    res = {
        "command": "python benchmarks/bench_fedet_bbc.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_before": round(load_before, 2),
            "load_after": round(os.getloadavg()[0], 2),
        },
        "args": {k: v for k, v in vars(args).items() if k not in ("out", "work")},
        "wall_seconds": time.perf_counter() - start,
        "runs": runs,
        "methods": combine_seeds(runs),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(res, indent=2))
    write_markdown(out / f"{args.name}.md", res)
    print(f"wrote {out / (args.name + '.json')} and .md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
