"""FedSeIT vs FedWeIT on the text CNN, task-incremental BBC News, through the real services.

Every run is ``fcl simulate configs/scenarios/bbc_fedseit.yaml --in-process``: the
aggregator service and one client daemon per device as threads of this process over the
in-process transport, with the method's strategy and learner from the registry.  The numbers
come from the run directories (``summary.json``, ``metrics.jsonl``, the aggregator's
``runlog``), the files a fleet writes.

    python benchmarks/bench_fedseit.py                                  # the issue's grid, seeds 1,2
    python benchmarks/bench_fedseit.py --methods fedweit-cnn --lambda2 1.0 --seeds 1 --name fedseit_pilot
    python benchmarks/bench_fedseit.py --compression off       # as before issue 40 (fedseit_bbc.md)

Methods (``NAME/lambda2``): ``fedweit-cnn`` (FedWeIT: previous-task A of every client summed
into the filters), ``fedseit`` (segregated branches over the same slots), ``fedseit+sit``
(top-3 of every stored entry by the similarity of the tasks' document centres),
``fedseit+sit5`` (top-5) and ``fedseit+dls`` (W_f, W_c federated too).

Task-averaged accuracy (TTA) is the mean over (device, task) of that task's test accuracy
with the device's final model.  Bytes are MQTT PUBLISH packet bytes; each update's split by
kind (base, A, centres) is from its tensors' sizes as the codec wrote them.
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
METHODS = {
    "fedweit-cnn": ["federation.method=fedweit-cnn"],
    "fedseit": ["federation.method=fedseit"],
    "fedseit+sit": ["federation.method=fedseit", "federation.options.sit=true", "federation.options.sit_k=3"],
    "fedseit+sit5": ["federation.method=fedseit", "federation.options.sit=true", "federation.options.sit_k=5"],
    "fedseit+dls": ["federation.method=fedseit", "federation.options.dls=true"],
}


def overrides(args: argparse.Namespace, name: str, lam: float, seed: int) -> list[str]:
    out = [
        *METHODS[name],
        f"federation.name=bbc-{name.replace('+', '-')}",
        f"federation.seed={seed}",
        f"federation.options.lambda2={lam}",
        f"federation.rounds_per_task={args.rounds_per_task}",
        f"federation.train.local_epochs={args.epochs}",
        f"federation.options.max_length={args.max_length}",
    ]
    if args.per_class is not None:
        out.append(f"data.per_class={args.per_class}")
    if args.compression == "off":  # every unit's base, every entry of A, dense announcements
        out += [
            "federation.options.keep_units=1.0",
            "federation.options.kb_density=1.0",
            "federation.wire.down_sparsify=none",
        ]
    return out + args.set


def _tensor_bytes(frame_tensors: dict) -> dict[str, int]:
    """Payload bytes per kind of an update's tensors (values, indices and unit maps)."""
    from fclcore.codec import SparseTensor

    kinds = {"base": 0, "adaptive": 0, "centres": 0}
    for name, t in frame_tensors.items():
        size = t.values.nbytes + t.indices.nbytes if isinstance(t, SparseTensor) else t.nbytes
        kind = "adaptive" if name.startswith("kb:") else "centres" if name.startswith("sit:") else "base"
        kinds[kind] += int(size)
    return kinds


def measure(run: Path, wall: float) -> dict:
    summary = json.loads((run / "summary.json").read_text())
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    accepted = [e for e in events if e["event"] == "round_client" and e["status"] == "accepted"]
    knowledge = [e for e in events if e["event"] == "knowledge"]
    tasks = summary["rounds"] and max(e["task"] for e in accepted) + 1
    clients = len({e["client"] for e in accepted})
    kinds = {"base": 0, "adaptive": 0, "centres": 0}
    for e in accepted:
        for k, v in (e.get("tensor_bytes_by_kind") or {}).items():
            kinds[k] += v
    per = clients * tasks
    up = sum(e["bytes_up"] for e in accepted)
    down = sum(e["bytes_down"] for e in accepted)
    foreign = sum(e["bytes"] for e in knowledge)
    return {
        "tta": summary["final"]["avg_accuracy"],
        "acc_matrix_per_client": {c: m.get("accuracy_matrix") for c, m in summary["final"]["per_client"].items()},
        "up_bytes_per_task": int(up / per),
        "down_bytes_per_task": int(down / per),
        "foreign_down_bytes_per_task": int(foreign / per),
        "up_payload_bytes_per_task_by_kind": {k: int(v / per) for k, v in kinds.items()},
        "up_bytes_per_round": int(up / max(1, len(accepted))),
        "down_bytes_per_round": int(down / max(1, len(accepted))),
        "kb_entries": summary.get("strategy", {}).get("entries"),
        "minutes": round(wall / 60, 2),
    }


def all_entries_bytes(run: Path) -> int:
    """The foreign downlink per (device, task) if every stored entry were sent instead of the
    K chosen: mean over (device, task) of (entries stored before the task that are not the
    device's own) x the mean bytes of an entry's A as uploaded."""
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    accepted = [e for e in events if e["event"] == "round_client" and e["status"] == "accepted"]
    sizes = [
        e["tensor_bytes_by_kind"]["adaptive"] for e in accepted if e.get("tensor_bytes_by_kind", {}).get("adaptive")
    ]
    if not sizes:
        return 0
    tasks = max(e["task"] for e in accepted) + 1
    clients = len({e["client"] for e in accepted})
    stored_foreign = [(clients - 1) * t for t in range(tasks)]  # entries of the other clients' earlier tasks
    return int(np.mean(sizes) * np.mean(stored_foreign))


def run_one(job: tuple) -> tuple:
    args, name, lam, seed = job
    import torch

    from fcl_edge.simulate import simulate

    torch.set_num_threads(1)
    out = Path(args.work) / f"{name}-{lam}-s{seed}"
    started = time.perf_counter()
    code = simulate(
        str(SCENARIO),
        str(out),
        overrides=overrides(args, name, lam, seed),
        timeout=args.timeout,
        in_process=True,
        force=True,
    )
    if code != 0:
        raise SystemExit(f"{name}/{lam} seed {seed}: fcl simulate --in-process exited {code}; logs in {out / 'logs'}")
    res = measure(out, time.perf_counter() - started)
    res["all_entries_down_bytes_per_task"] = all_entries_bytes(out)
    return name, lam, seed, res


def write_markdown(path: Path, res: dict) -> None:
    lines = [
        "# FedSeIT on task-incremental BBC News (15 pool tasks of 3 labels, 3 devices x 5 tasks)",
        "",
        f"`{res['command']}` on {res['machine']['cpus']} CPUs ({res['machine']['platform']}), "
        f"{res['minutes']:.0f} min wall clock, {res['workers']} runs at a time, seeds {res['seeds']}, "
        f"difficulty rung {res['difficulty_rung']}. Every run went through the aggregator service and the "
        "client daemons (`fcl simulate --in-process`).",
        "",
        "| method / lambda2 | TTA mean | per seed | up B / task | down B / task | foreign down B / task "
        "| every entry down B / task | minutes / run |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, m in res["methods"].items():
        seeds = ", ".join(f"{s}: {a:.4f}" for s, a in m["per_seed"].items())
        lines.append(
            f"| {name} | {m['mean_acc']:.4f} | {seeds} | {m['up_bytes_per_task']:,} | {m['down_bytes_per_task']:,} "
            f"| {m['foreign_down_bytes_per_task']:,} | {m['all_entries_down_bytes_per_task']:,} | {m['minutes']:.1f} |"
        )
    lines += [
        "",
        "TTA: mean over (device, task) of the task's test accuracy after the last round (each task scored "
        "by its own head). Bytes per task are per device: MQTT PUBLISH packets as the aggregator metered "
        "them (up: the masked base every round, A at each task end, the centres once per task with SIT; "
        "down: the global base every round plus the device's own knowledge frames). 'every entry' is "
        "what sending every stored entry of every client would cost instead of SIT's K.",
    ]
    path.write_text("\n".join(lines) + "\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ", ".join(METHODS))
    p.add_argument("--lambda2", default="0.1,1.0", help="comma-separated drift weights")
    p.add_argument("--seeds", default="1,2", help="allocation and initialisation seeds")
    p.add_argument("--rounds-per-task", type=int, default=4)
    p.add_argument("--epochs", type=int, default=3, help="local epochs per round")
    p.add_argument("--max-length", type=int, default=32, help="wordpieces per text (the difficulty ladder's rung 1)")
    p.add_argument("--per-class", type=int, default=None, help="cap of training texts per (task, label)")
    p.add_argument(
        "--compression",
        choices=("default", "off"),
        default="default",
        help="off: keep_units 1, every entry of A, dense announcements (the method before issue 40)",
    )
    p.add_argument("--set", action="append", default=[], help="another scenario override (KEY=VALUE), repeatable")
    p.add_argument("--rung", default="1 (max_length 32)", help="the difficulty rung, recorded")
    p.add_argument("--workers", type=int, default=2, help="runs at a time (one process each)")
    p.add_argument("--timeout", type=float, default=3600.0, help="per run, seconds")
    p.add_argument("--work", default="/tmp/fcl-bench-fedseit", help="where the run directories go")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="results directory")
    p.add_argument("--name", default="fedseit_bbc", help="results file stem")
    args = p.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    args.lambda2 = [float(v) for v in args.lambda2.split(",")]
    args.seeds = [int(v) for v in args.seeds.split(",")]
    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown:
        p.error(f"unknown methods {unknown}; choose from {', '.join(METHODS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    jobs = [(args, n, lam, s) for lam in args.lambda2 for n in args.methods for s in args.seeds]
    results: dict[str, dict] = {}
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        for name, lam, seed, r in pool.map(run_one, jobs):
            key = f"{name}/{lam:g}" if lam != 1.0 else f"{name}/1.0"
            results.setdefault(key, {})[seed] = r
            print(f"{key} seed {seed}: TTA {r['tta']:.4f}, {r['minutes']:.1f} min", flush=True)
    methods = {}
    for key, per_seed in results.items():
        runs = list(per_seed.values())
        methods[key] = {
            "mean_acc": round(float(np.mean([r["tta"] for r in runs])), 4),
            "per_seed": {str(s): r["tta"] for s, r in per_seed.items()},
            **{
                k: int(np.mean([r[k] for r in runs]))
                for k in (
                    "up_bytes_per_task",
                    "down_bytes_per_task",
                    "foreign_down_bytes_per_task",
                    "all_entries_down_bytes_per_task",
                    "up_bytes_per_round",
                    "down_bytes_per_round",
                )
            },
            "up_payload_bytes_per_task_by_kind": runs[0]["up_payload_bytes_per_task_by_kind"],
            "minutes": round(float(np.mean([r["minutes"] for r in runs])), 2),
            "runs": {str(s): r for s, r in per_seed.items()},
        }
    res = {
        "command": shlex.join(["python", "benchmarks/bench_fedseit.py", *(argv if argv is not None else sys.argv[1:])]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "difficulty_rung": args.rung,
        "compression": args.compression,
        "overrides": args.set,
        "seeds": args.seeds,
        "workers": args.workers,
        "minutes": round((time.perf_counter() - started) / 60, 1),
        "methods": methods,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(res, indent=2))
    write_markdown(out / f"{args.name}.md", res)
    print(f"wrote {out / (args.name + '.json')} and .md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
