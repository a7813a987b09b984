"""FIL-VER on rotated MNIST (0/20/40/60 degrees) in the paper's four enrollment scenarios,
through the real services.

Every run is ``fcl simulate configs/scenarios/mnist_filver*.yaml --in-process``: the
aggregator service and one client daemon per device as threads of this process over the
in-process transport; devices that enroll late are started when their first task begins
and retired ones end themselves.  Numbers come from the run directories (``summary.json``'s
fleet matrix, ``metrics.jsonl``, the aggregator's committed state).

    python benchmarks/bench_filver.py                         # the issue's grid, seeds 0,1
    python benchmarks/bench_filver.py --scenarios s1 --methods vanilla,offline --seeds 0 --name filver_pilot

Runs: scenario 1: vanilla, ver (no SST), ver-sampled+sst, ver-stats+sst, ebr+sst, offline;
scenarios 2-4: vanilla, ver, ver-sampled+sst; and the beta sweep of ver-sampled+sst in
scenario 1 (beta 1e-3, 1e-1 beside the scenarios' 1e-2).

Accuracy matrix: row t is the accuracy of the federation's model (the post-SST classifier on
the frozen encoder's mu) on the test set of every task <= t after task t, averaged over the
devices that reported it (all test sets are shared, so every device reports the same).
Forgetting: mean over tasks before the last of (best earlier accuracy - final accuracy).

Re-identification (notes 1.5): for every rehearsal item in the aggregator's buffer, the
attacker knows the frozen encoder and the source device's whole shard of that task (1000
images): "nearest mu" takes the image whose mu is closest to the uploaded vector; the
likelihood attacker takes argmax_i log N(z; mu_i, sigma_i).  Chance is 1/shard size.

Gate (notes 1.4 item 13), on seed means in scenario 1: learnability (offline mean accuracy
>= 0.60) and interference (vanilla forgetting >= 0.10).  A failed gate is printed with the
notes' fallback (interference fails: --step 25; learnability fails: --step 15); a run that
passes no gate is labelled "mechanics only".
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
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SCENARIOS = {
    "s1": "mnist_filver.yaml",
    "s2": "mnist_filver_s2_decreasing.yaml",
    "s3": "mnist_filver_s3_increasing.yaml",
    "s4": "mnist_filver_s4_scattered.yaml",
}
METHODS = {
    "vanilla": "filver-vanilla",
    "ver": "filver-nosst",
    "ver-sampled+sst": "filver",
    "ver-stats+sst": "filver-stats",
    "ebr+sst": "filver-ebr",
    "offline": "filver-offline",
}
PER_SCENARIO = {
    "s1": list(METHODS),
    "s2": ["vanilla", "ver", "ver-sampled+sst"],
    "s3": ["vanilla", "ver", "ver-sampled+sst"],
    "s4": ["vanilla", "ver", "ver-sampled+sst"],
}
BETAS = (1e-3, 1e-1)  # the sweep beside the scenario's beta (1e-2), ver-sampled+sst in s1


def overrides(args: argparse.Namespace, scenario: str, name: str, seed: int, beta: float | None) -> list[str]:
    out = [
        f"federation.method={METHODS[name]}",
        f"federation.name=filver-{scenario}-{name.replace('+', '-')}",
        f"federation.seed={seed}",
        f"tasks.domains.step_deg={args.step}",
    ]
    if beta is not None:
        out.append(f"federation.options.beta={beta}")
    if args.device != "cpu":  # cpu: the very commands of before
        out.append(f"device={args.device}")
    return out


def fleet(summary: dict) -> dict:
    f = summary.get("fleet") or {}
    if "accuracy_matrix" not in f:
        raise SystemExit(f"{summary.get('federation')}: summary.json has no fleet accuracy matrix")
    return f


def bytes_per_round(events: list[dict], phase0_rounds: int) -> dict:
    """Per device and round after phase 0 (and phase 0 apart): packet bytes up and down, and
    the update's payload split into model and embeddings."""
    accepted = [e for e in events if e.get("event") == "round_client" and e["status"] == "accepted"]
    later = [e for e in accepted if e["round"] >= phase0_rounds]
    early = [e for e in accepted if e["round"] < phase0_rounds]

    def mean(rows: list[dict], key) -> int:
        return int(np.mean([key(e) for e in rows])) if rows else 0

    kinds = lambda kind: lambda e: (e.get("tensor_bytes_by_kind") or {}).get(kind, 0)  # noqa: E731
    return {
        "model_up_bytes_per_round": mean(later, kinds("model")),
        "embed_up_bytes_per_round": mean(later, kinds("embeddings")),
        "up_bytes_per_round": mean(later, lambda e: e["bytes_up"]),
        "down_bytes_per_round": mean(later, lambda e: e["bytes_down"]),
        "phase0_up_bytes_per_round": mean(early, lambda e: e["bytes_up"]),
        "phase0_down_bytes_per_round": mean(early, lambda e: e["bytes_down"]),
        "encoder_down_bytes": sum(e["bytes"] for e in events if e.get("event") == "knowledge"),
    }


def recoded(z: np.ndarray, value_dtype: str) -> np.ndarray:
    """``z`` as the aggregator would decode it had it travelled in ``value_dtype`` (one frame:
    int8 blocks run over rows in order, as an upload's rows do)."""
    from fclcore.codec import Frame, Header, Kind, ValueCoding, decode, encode

    frame = Frame(Header(Kind.UPDATE, "f", 0, 0, "c", 0), {}, {"z": np.asarray(z, np.float32)})
    return np.asarray(decode(encode(frame, ValueCoding(value_dtype))).tensors["z"])


def reidentify(run: Path, value_dtype: str | None = None) -> dict | None:
    """Both attackers over every item in the aggregator's buffer (None: no embeddings went up);
    ``value_dtype``: the items re-coded so first (for a run whose embeddings went as float32)."""
    import torch

    import methods
    from aggregator.state import StateStore
    from fclcore.config import load_config
    from fclcore.data import domain_task_split, load_dataset
    from fclcore.schema import Scenario
    from methods.filver.model import Encoder, load_params

    committed = StateStore(run / "state").load()
    arrays, meta = committed.strategy_arrays, committed.strategy
    if not len(arrays.get("buffer/y", [])):
        return None
    sc = load_config(Scenario, run / "scenario.yaml")
    _, options, fed = methods.resolve(sc.federation)
    train, test = load_dataset(sc.data.dataset, sc.data.path, fed.seed, gray=True)
    encoder = Encoder(options, train.x.shape[1])
    load_params(encoder, "", {k.removeprefix("encoder/enc."): v for k, v in arrays.items() if k.startswith("encoder/")})
    encoder.eval()
    hits = {"nearest_mu": [], "likelihood": []}
    shard_sizes = []
    for ci, client in enumerate(meta["buffer_clients"]):
        index = int(client.rsplit("-", 1)[1])
        shards = domain_task_split(
            train, test, sc.tasks.domains, index, sc.clients, fed.seed, sc.data.per_class, sc.data.test_per_class
        ).train
        learner = methods.learner_for(fed, train.x.shape[1], index)  # its rehearsal choice, as on the device
        for task in sorted(set(arrays["buffer/task"][arrays["buffer/client"] == ci].tolist())):
            rows = np.flatnonzero((arrays["buffer/client"] == ci) & (arrays["buffer/task"] == task))
            rows = rows[np.argsort(arrays["buffer/seq"][rows])]
            shard = shards[task]
            source = learner.rehearsal_rows(shard.y, task)[: len(rows)]
            with torch.no_grad():
                mu, log_sigma = encoder(torch.from_numpy(shard.x))
            mu = mu.numpy().astype(np.float64)
            z = arrays["buffer/z"][rows]
            z = (z if value_dtype is None else recoded(z, value_dtype)).astype(np.float64)
            d2 = (z**2).sum(1)[:, None] - 2 * z @ mu.T + (mu**2).sum(1)[None, :]
            hits["nearest_mu"] += (d2.argmin(1) == source).tolist()
            if log_sigma is None:
                hits["likelihood"] += (d2.argmin(1) == source).tolist()
            else:
                ls = log_sigma.numpy().astype(np.float64)
                inv = np.exp(-2 * ls)  # (N, d)
                quad = (z**2) @ inv.T - 2 * z @ (mu * inv).T + ((mu**2) * inv).sum(1)[None, :]
                hits["likelihood"] += ((-0.5 * quad - ls.sum(1)[None, :]).argmax(1) == source).tolist()
            shard_sizes.append(len(shard.y))
    out = {k: round(float(np.mean(v)), 4) for k, v in hits.items()}
    out.update(chance=round(1.0 / float(np.mean(shard_sizes)), 6), items=len(hits["nearest_mu"]))
    return out


def run_one(job: tuple) -> tuple:
    args, scenario, name, seed, beta = job
    import torch

    from fcl_edge.simulate import simulate

    torch.set_num_threads(1)
    tag = f"{scenario}-{name}-s{seed}" + ("" if beta is None else f"-beta{beta:g}")
    out = Path(args.work) / tag
    started = time.perf_counter()
    code = simulate(
        str(ROOT / "configs" / "scenarios" / SCENARIOS[scenario]),
        str(out),
        overrides=overrides(args, scenario, name, seed, beta),
        timeout=args.timeout,
        in_process=True,
        force=True,
    )
    if code != 0:
        raise SystemExit(f"{tag}: fcl simulate --in-process exited {code}; logs in {out / 'logs'}")
    summary = json.loads((out / "summary.json").read_text())
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    f = fleet(summary)
    phase0 = int(yaml.safe_load((out / "scenario.yaml").read_text())["federation"]["options"]["phase0_rounds"])
    res = {
        "mean_acc": f["avg_accuracy"],
        "forgetting": f["forgetting"],
        "acc_matrix": f["accuracy_matrix"],
        **bytes_per_round(events, phase0),
        "rejected": summary["rejected"],
        "minutes": round((time.perf_counter() - started) / 60, 2),
    }
    reid = reidentify(out)
    if reid is not None:
        res["reid"] = reid
        res["reid_rate"] = max(reid["nearest_mu"], reid["likelihood"])
    return scenario, name, seed, beta, res


def combine(per_seed: dict[int, dict]) -> dict:
    """Seed means (and the per-seed figures) of one (scenario, method)."""
    runs = list(per_seed.values())
    matrix = np.array([[np.nan if v is None else v for v in row] for row in runs[0]["acc_matrix"]], dtype=float)
    for r in runs[1:]:
        matrix = matrix + np.array([[np.nan if v is None else v for v in row] for row in r["acc_matrix"]], dtype=float)
    matrix /= len(runs)
    out = {
        "mean_acc": round(float(np.mean([r["mean_acc"] for r in runs])), 4),
        "forgetting": round(float(np.mean([r["forgetting"] for r in runs])), 4),
        "per_seed": {str(s): {"mean_acc": r["mean_acc"], "forgetting": r["forgetting"]} for s, r in per_seed.items()},
        "acc_matrix": [[None if np.isnan(v) else round(float(v), 4) for v in row] for row in matrix],
    }
    for key in (
        "embed_up_bytes_per_round",
        "model_up_bytes_per_round",
        "up_bytes_per_round",
        "down_bytes_per_round",
        "phase0_up_bytes_per_round",
        "phase0_down_bytes_per_round",
        "encoder_down_bytes",
    ):
        out[key] = int(np.mean([r[key] for r in runs]))
    if all("reid" in r for r in runs):
        out["reid_rate"] = round(float(np.mean([r["reid_rate"] for r in runs])), 4)
        out["reid"] = {
            k: round(float(np.mean([r["reid"][k] for r in runs])), 6) for k in ("nearest_mu", "likelihood", "chance")
        }
    out["minutes_per_run"] = round(float(np.mean([r["minutes"] for r in runs])), 2)
    out["rejected"] = {k: sum(r["rejected"].get(k, 0) for r in runs) for r in runs for k in r["rejected"]}
    return out


def check_gate(s1: dict) -> dict:
    offline = s1.get("offline", {}).get("mean_acc")
    vanilla = s1.get("vanilla", {}).get("forgetting")
    learnable = offline is not None and offline >= 0.60
    interfering = vanilla is not None and vanilla >= 0.10
    failed = []
    if not learnable:
        failed.append(f"learnability: offline mean accuracy {offline} < 0.60 (fallback: --step 15)")
    if not interfering:
        failed.append(f"interference: vanilla forgetting {vanilla} < 0.10 (fallback: --step 25)")
    label = "valid" if learnable and interfering else ("mechanics only" if not (learnable or interfering) else "weak")
    return {
        "offline_mean_acc": offline,
        "vanilla_forgetting": vanilla,
        "passed": not failed,
        "failed": failed,
        "label": label,
    }


def targets(res: dict) -> list[tuple[str, bool]]:
    """The issue's targets, each with whether this run met it."""
    sc = res["scenarios"]
    s1 = sc.get("s1", {})
    out = []
    if {"ver-sampled+sst", "vanilla", "ver", "offline"} <= set(s1):
        v, van, ver, off = s1["ver-sampled+sst"], s1["vanilla"], s1["ver"], s1["offline"]
        out.append(("S1: VER-Sampled+SST >= Vanilla + 10 points", v["mean_acc"] >= van["mean_acc"] + 0.10))
        out.append(("S1: forgetting at most half of Vanilla's", v["forgetting"] <= van["forgetting"] / 2))
        out.append(("S1: >= VER without SST - 1 point", v["mean_acc"] >= ver["mean_acc"] - 0.01))
        out.append(("S1: within 5 points of offline", v["mean_acc"] >= off["mean_acc"] - 0.05))
    forms = [s1[n]["mean_acc"] for n in ("ver-sampled+sst", "ver-stats+sst", "ebr+sst") if n in s1]
    if len(forms) == 3:
        out.append(("S1: Sampled, Stats and EBR within 3 points", max(forms) - min(forms) <= 0.03))
    gains = {}
    for name in ("s2", "s3", "s4"):
        s = sc.get(name, {})
        if {"ver-sampled+sst", "ver", "vanilla"} <= set(s):
            a, b, c = (s[n]["mean_acc"] for n in ("ver-sampled+sst", "ver", "vanilla"))
            out.append((f"{name.upper()}: VER+SST > VER without SST >= Vanilla - 1", a > b >= c - 0.01))
            gains[name] = a - b
    if len(gains) == 3:
        out.append(("SST gain largest in S4 (scattered)", max(gains, key=gains.get) == "s4"))
    v = s1.get("ver-sampled+sst", {})
    if "reid" in v:
        out.append(("Re-identification of sampled z <= 0.10 (both attackers)", v["reid_rate"] <= 0.10))
    if v.get("model_up_bytes_per_round"):
        out.append(
            (
                "Embedding upload per round <= the classifier",
                v["embed_up_bytes_per_round"] <= v["model_up_bytes_per_round"],
            )
        )
    return out


def write_markdown(path: Path, res: dict) -> None:
    g = res["gate"]
    lines = [
        f"# FIL-VER on {res['family']} ({res['gate']['label']})",
        "",
        f"`{res['command']}` on {res['machine']['cpus']} CPUs ({res['machine']['platform']}), "
        f"{res['minutes']:.0f} min wall clock, {res['workers']} runs at a time, seeds {res['seeds']}. Every run "
        "went through the aggregator service and the device daemons (`fcl simulate --in-process`); devices "
        "enrolled late were started mid-run and retired ones ended themselves.",
        "",
        f"Gate (scenario 1, seed means): offline mean accuracy {g['offline_mean_acc']} (>= 0.60), vanilla "
        f"forgetting {g['vanilla_forgetting']} (>= 0.10): " + ("passed." if g["passed"] else "; ".join(g["failed"])),
        "",
        "| scenario | method | mean acc | forgetting | per seed (acc) | model up B/round | embeddings up B/round "
        "| ratio | down B/round | re-id nearest / likelihood (chance) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for scenario, methods_ in res["scenarios"].items():
        for name, m in methods_.items():
            seeds = ", ".join(f"{s}: {v['mean_acc']:.3f}" for s, v in m["per_seed"].items())
            ratio = m["embed_up_bytes_per_round"] / max(1, m["model_up_bytes_per_round"])
            reid = m.get("reid")
            reid_s = f"{reid['nearest_mu']:.3f} / {reid['likelihood']:.3f} ({reid['chance']:.4f})" if reid else "-"
            lines.append(
                f"| {scenario} | {name} | {m['mean_acc']:.3f} | {m['forgetting']:.3f} | {seeds} "
                f"| {m['model_up_bytes_per_round']:,} | {m['embed_up_bytes_per_round']:,} | {ratio:.4f} "
                f"| {m['down_bytes_per_round']:,} | {reid_s} |"
            )
    if res.get("beta_sweep"):
        lines += ["", "Beta sweep (scenario 1, VER-Sampled+SST): accuracy against re-identification.", ""]
        lines += [
            "| beta | mean acc | forgetting | re-id nearest | re-id likelihood | chance |",
            "|---|---|---|---|---|---|",
        ]
        for beta, m in res["beta_sweep"].items():
            r = m.get("reid", {})
            lines.append(
                f"| {beta} | {m['mean_acc']:.3f} | {m['forgetting']:.3f} | {r.get('nearest_mu', '-')} "
                f"| {r.get('likelihood', '-')} | {r.get('chance', '-')} |"
            )
    lines += ["", "Targets:", ""]
    lines += [f"- [{'x' if ok else ' '}] {text}" for text, ok in res["targets"]]
    lines += [
        "",
        "Bytes are per device and round after phase 0: MQTT PUBLISH packets as the aggregator metered them "
        "(down: the classifier every round, plus the frozen encoder once per device: `encoder_down_bytes` in "
        "the JSON, with phase-0 rounds apart). The model/embedding split is of the update's tensors as decoded.",
    ]
    path.write_text("\n".join(lines) + "\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--scenarios", default="s1,s2,s3,s4", help="comma-separated subset of s1..s4")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ", ".join(METHODS))
    p.add_argument("--seeds", default="0,1", help="federation seeds (initialisation, sampling)")
    p.add_argument("--step", type=float, default=20.0, help="rotation step in degrees (the task family)")
    p.add_argument("--no-beta-sweep", action="store_true", help="skip the beta sweep")
    p.add_argument("--workers", type=int, default=2, help="runs at a time (one process each)")
    p.add_argument("--timeout", type=float, default=3600.0, help="per run, seconds")
    p.add_argument("--work", default="/tmp/fcl-bench-filver", help="where the run directories go")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="results directory")
    p.add_argument("--name", default="filver", help="results file stem")
    p.add_argument("--device", default="cpu", help="train.device of every client (docs/accelerators.md)")
    args = p.parse_args(argv)
    args.scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    args.seeds = [int(v) for v in args.seeds.split(",")]
    bad = sorted(set(args.scenarios) - set(SCENARIOS)) + sorted(set(args.methods) - set(METHODS))
    if bad:
        p.error(f"unknown scenarios or methods {bad}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    jobs = [
        (args, s, m, seed, None)
        for s in args.scenarios
        for m in PER_SCENARIO[s]
        if m in args.methods
        for seed in args.seeds
    ]
    if not args.no_beta_sweep and "s1" in args.scenarios and "ver-sampled+sst" in args.methods:
        jobs += [(args, "s1", "ver-sampled+sst", seed, beta) for beta in BETAS for seed in args.seeds]
    print(f"{len(jobs)} runs, {args.workers} at a time", flush=True)
    results: dict = {}
    with ProcessPoolExecutor(args.workers) as pool:
        for scenario, name, seed, beta, res in pool.map(run_one, jobs):
            results.setdefault((scenario, name, beta), {})[seed] = res
            print(
                f"{scenario} {name} seed {seed}"
                + ("" if beta is None else f" beta {beta:g}")
                + f": acc {res['mean_acc']:.4f} forgetting {res['forgetting']:.4f} ({res['minutes']:.1f} min)"
                + (f" re-id {res['reid_rate']:.3f}" if "reid_rate" in res else ""),
                flush=True,
            )
    scenarios = {
        s: {m: combine(results[(s, m, None)]) for m in PER_SCENARIO[s] if (s, m, None) in results}
        for s in args.scenarios
    }
    out = {
        "family": "rotated MNIST, 4 tasks at " + "/".join(f"{t * args.step:g}" for t in range(4)) + " degrees",
        "gate": check_gate(scenarios.get("s1", {})),
        "scenarios": scenarios,
        "beta_sweep": {
            ("0.01" if b is None else f"{b:g}"): combine(results[("s1", "ver-sampled+sst", b)])
            for b in (None, *BETAS)
            if ("s1", "ver-sampled+sst", b) in results
        },
        "minutes": round((time.perf_counter() - started) / 60, 1),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "command": "python benchmarks/bench_filver.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
        "workers": args.workers,
        "seeds": args.seeds,
    }
    out["targets"] = targets(out)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{args.name}.json").write_text(json.dumps(out, indent=2) + "\n")
    write_markdown(out_dir / f"{args.name}.md", out)
    g = out["gate"]
    print(f"gate: {g['label']}" + ("" if g["passed"] else " - " + "; ".join(g["failed"])))
    for text, ok in out["targets"]:
        print(f"  [{'x' if ok else ' '}] {text}")
    print(f"wrote {out_dir / (args.name + '.json')} and .md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
