#!/usr/bin/env python
"""FedET ONNX export on BBC News: torch vs ONNX fp32 vs ONNX int8, and the served graph before
vs after the two-pass change: sizes, accuracy, batch-1 latency, peak RSS.

    python benchmarks/bench_fedet_export.py                 # ~5-10 min on 2 shared cores

1. Trains a FedET state as ``benchmarks/bench_fedet_bbc.py`` does (the aggregator service and
   5 client daemons in process: BBC News, class-incremental tasks, prototype selector, double
   distillation, entropy-aware server distillation), shortened: by default 2 rounds per task,
   20 training texts per (client, class), one seed.  The exported state is client 0's, rebuilt
   from its checkpoint after its last update.  (``--reuse-work``: take the state a previous run
   left in ``--work`` instead of training; for development only.)
2. Exports it with ``export.onnx_text_groups.export_client_text_classifier`` (the text-groups
   format; fp32 + int8, parity-checked on --parity-rows test texts, MiniLM's tokenizer.json
   embedded) twice: AFTER = the served two-pass graph (the frozen pass the selector routes on +
   the routed group only), BEFORE = ``graph="all-groups"``, the graph served until then (the
   frozen pass + every group), loaded with the runtime's session options of then
   (:class:`BeforeRuntime`: onnxruntime's SkipLayerNormFusion on).
3. On the whole held-out BBC test split (20% of every class; texts never seen in training):
   accuracy of torch (``FedETClient.predict`` on ``TextTokenizer`` ids), of every file through
   the torch-free ``TextClassifierRuntime`` from the raw texts (its own tokenization), and
   their label / group agreement with torch and with each other.
4. Batch-1 latency of ``TextClassifierRuntime.classify([text])`` (tokenization included) over
   --latency-texts test texts, 1 onnxruntime thread, BEFORE and AFTER (fp32 and int8, plus the
   BEFORE graph with the AFTER session options, to separate the two changes) interleaved text
   by text in one process, so machine load hits all alike; torch eager (selector pass +
   routed group, 1 thread) on the same token ids for reference.
5. Peak RSS (VmHWM) of a separate process that blocks torch/onnx/yaml imports, loads the
   runtime and classifies --rss-texts texts, for each of the four files.

Writes benchmarks/results/fedet_export.json and .md (machine, load average, exact command).
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
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_fedet_bbc as bbc  # noqa: E402
import torch  # noqa: E402

from edge_client.state import learner_from_state  # noqa: E402
from export.onnx_text_groups import backbone_passes, export_client_text_classifier, int8_path_for  # noqa: E402
from export.text_runtime import TextClassifierRuntime  # noqa: E402
from fclbases.minilm.backbone import FrozenBackbone, default_minilm_dir, load_minilm, pooled_embeddings  # noqa: E402
from fclbases.minilm.enhancer import enhanced_logits  # noqa: E402
from fclcore.text import EncodedDocs, TextTokenizer, bbc_split, default_tokenizer_json  # noqa: E402
from methods.fedet.client import FedETClient  # noqa: E402


class BeforeRuntime(TextClassifierRuntime):
    """``TextClassifierRuntime`` with the session options it had before the two-pass graph
    (no session config entries: onnxruntime's SkipLayerNormFusion on)."""

    session_config: dict[str, str] = {}


RSS_CHILD = r"""
import json, sys, time
for name in ("torch", "onnx", "yaml"):
    sys.modules[name] = None  # any import of them fails
t0 = time.perf_counter()
from export.text_runtime import TextClassifierRuntime
class Runtime(TextClassifierRuntime):
    session_config = json.loads(sys.argv[3])
rt = Runtime(sys.argv[1])
load_s = time.perf_counter() - t0
texts = json.load(open(sys.argv[2]))
answers = rt.classify(texts)
status = dict(l.split(":", 1) for l in open("/proc/self/status") if ":" in l)
print(json.dumps({"labels": [a["label"] for a in answers], "load_s": load_s,
                  "vmhwm_kb": int(status["VmHWM"].split()[0]), "vmrss_kb": int(status["VmRSS"].split()[0]),
                  "heavy_modules": sorted(m for m in ("torch", "onnx", "yaml", "paho")
                                          if sys.modules.get(m) is not None)}))
"""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds-per-task", type=int, default=2)
    p.add_argument("--per-class", type=int, default=20, help="training texts per (client, class)")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per text in training and in the export")
    p.add_argument("--parity-rows", type=int, default=64, help="test texts used by the export's parity check")
    p.add_argument(
        "--int8-per-tensor",
        action="store_true",
        help="one int8 weight scale per tensor instead of the exporter's default per output channel",
    )
    p.add_argument("--latency-texts", type=int, default=100)
    p.add_argument("--rss-texts", type=int, default=100)
    p.add_argument("--threads", type=int, default=1, help="torch threads for training and the torch baseline")
    p.add_argument("--work", default="/tmp/fcl-bench-fedet-export", help="where the training run goes")
    p.add_argument(
        "--reuse-work", action="store_true", help="use the state a previous run left in --work (no training)"
    )
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--name", default="fedet_export")
    return p.parse_args(argv)


def train_state(args: argparse.Namespace, backbone: FrozenBackbone) -> tuple[FedETClient, Any, Any, dict]:
    """bench_fedet_bbc's fedet run (J=2), through the services in process; returns client 0's
    FedET state (rebuilt from its checkpoint), its test split (all classes), the bench args and
    the run's accuracies."""
    bargs = bbc.parse_args(
        [
            "--methods",
            "fedet",
            "--seeds",
            str(args.seed),
            "--rounds-per-task",
            str(args.rounds_per_task),
            "--per-class",
            str(args.per_class),
            "--seq-len",
            str(args.seq_len),
            "--work",
            args.work,
        ]
    )
    run_dir = Path(args.work) / f"seed{args.seed}" / "fedet"
    if args.reuse_work and (run_dir / "summary.json").is_file():
        measured = bbc.measure(run_dir, 0.0)
    else:
        measured = bbc.run_method(bargs, "fedet", args.seed)
    learner, _ = learner_from_state(Path(args.work) / f"seed{args.seed}" / "fedet" / "clients" / "client-0" / "state")
    corpus, _, test_idx, _ = bbc_split(None, args.seed)
    test = TextTokenizer(default_tokenizer_json(), args.seq_len).encode(
        [corpus.texts[i] for i in test_idx], corpus.labels[test_idx]
    )
    seen = sorted(learner.client.selector.group_of)
    keep = np.isin(test.labels, seen)  # the classes the state was trained on (every class after the last task)
    test = EncodedDocs(test.ids[keep], test.mask[keep], test.labels[keep])
    sc = SimpleNamespace(
        test=test,
        test_pooled=pooled_embeddings(backbone, test.ids, test.mask),
        tasks=[seen],
        texts=[corpus.texts[i] for i in test_idx[keep]],
        class_names=corpus.class_names,
    )
    return learner.client, sc, bargs, {"acc_after_task": measured["acc_after_task"], "rounds": measured["rounds"]}


def test_texts(sc: Any) -> tuple[list[str], np.ndarray, tuple[str, ...]]:
    """The raw texts of the scenario's test rows (the daemon's seeded split, in order)."""
    return sc.texts, sc.test.labels, tuple(sc.class_names)


@torch.no_grad()
def torch_predict_one(client: FedETClient, ids: torch.Tensor, mask: torch.Tensor) -> int:
    """Batch-1 torch eager: selector pass + the routed group (what FedETClient.predict runs per text)."""
    pooled = client.backbone.pooled(ids, mask).numpy()
    j = int(client.selector.route(pooled)[0])
    g = client.groups[j]
    return g.classes[int(enhanced_logits(client.backbone, g, ids, mask).argmax(1)[0])]


def _stats(times: list[float]) -> dict[str, float]:
    q = np.percentile(times, [10, 50, 90])
    return {"median_ms": float(q[1]), "p10_ms": float(q[0]), "p90_ms": float(q[2]), "n": len(times)}


def latency(fn, items: list, warmup: int = 5) -> dict[str, float]:
    for it in items[:warmup]:
        fn(it)
    times = []
    for it in items:
        t0 = time.perf_counter()
        fn(it)
        times.append((time.perf_counter() - t0) * 1e3)
    return _stats(times)


def interleaved_latency(
    fns: dict[str, Any], items: list, block: int = 10, warmup: int = 5
) -> dict[str, dict[str, float]]:
    """Batch-1 latency of several models, interleaved in blocks: the items go in blocks of
    ``block``, and every block runs on every model in turn (the starting model rotating),
    after one untimed call that warms that model's weights back into the CPU caches.  Load
    changes on the machine thus reach all models alike, and each is timed in the steady state
    of a device that serves one model."""
    names = list(fns)
    for it in items[:warmup]:
        for n in names:
            fns[n](it)
    times: dict[str, list[float]] = {n: [] for n in names}
    for b, start in enumerate(range(0, len(items), block)):
        chunk = items[start : start + block]
        for n in names[b % len(names) :] + names[: b % len(names)]:
            fns[n](chunk[0])
            for it in chunk:
                t0 = time.perf_counter()
                fns[n](it)
                times[n].append((time.perf_counter() - t0) * 1e3)
    return {n: _stats(t) for n, t in times.items()}


def flips(pred: np.ndarray, ref: np.ndarray, labels: np.ndarray) -> dict[str, int]:
    """Texts whose label differs from torch's: how many, and how many of them became right / wrong."""
    diff = pred != ref
    return {
        "texts_changed_vs_torch": int(diff.sum()),
        "changed_to_right": int((diff & (pred == labels)).sum()),
        "changed_to_wrong": int((diff & (ref == labels)).sum()),
    }


def rss_child(model: Path, texts_file: Path, session_config: dict[str, str]) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-c", RSS_CHILD, str(model), str(texts_file), json.dumps(session_config)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"RSS child failed: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    start, load_before = time.perf_counter(), os.getloadavg()
    backbone = FrozenBackbone(load_minilm())
    log("training the FedET state (bench_fedet_bbc's fedet method, shortened)")
    t0 = time.perf_counter()
    client, sc, bargs, runlog = train_state(args, backbone)
    train_s = time.perf_counter() - t0
    texts, labels, class_names = test_texts(sc)
    if not np.array_equal(labels, sc.test.labels):
        raise RuntimeError("test texts and the scenario's test rows differ")
    log(
        f"trained in {train_s:.0f} s; {len(texts)} held-out test texts; accuracy in bench_fedet_bbc's loop "
        f"{runlog['acc_after_task']}"
    )

    # torch reference on the whole test split
    t_pred, t_route = client.predict(sc.test, sc.test_pooled)
    acc_torch = float((t_pred == labels).mean())
    group_of = dict(client.selector.group_of)

    tok_json = default_minilm_dir() / "tokenizer.json"
    tmpdir = Path(tempfile.mkdtemp(prefix="fedet_export_"))
    par = np.arange(0, len(texts), max(1, len(texts) // args.parity_rows))[: args.parity_rows]
    common = dict(
        method="fedet",
        int8=True,
        parity_ids=sc.test.ids[par],
        parity_mask=sc.test.mask[par],
        tokenizer_json=tok_json,
        max_length=args.seq_len,
        class_names=list(class_names),
        toolkit_version="0.1.0",
    )
    paths = {"after": tmpdir / "fedet.onnx", "before": tmpdir / "before.onnx"}
    reports, export_s = {}, {}
    for which, graph in (("after", "two-pass"), ("before", "all-groups")):
        log(f"exporting {which} ({graph} graph, fp32 + int8, parity on {len(par)} test texts)")
        t0 = time.perf_counter()
        reports[which] = export_client_text_classifier(
            client, paths[which], graph=graph, int8_per_channel=not args.int8_per_tensor, **common
        )
        export_s[which] = time.perf_counter() - t0
        r = reports[which]
        log(
            f"{which}: exported in {export_s[which]:.0f} s: {r['bytes']:,} B fp32, {r['int8_bytes']:,} B int8; "
            f"parity max scaled err {r['max_scaled_err']:.2e}, int8 agreement {r['int8_label_agreement']:.4f}"
        )
    report, path, q_path = reports["after"], paths["after"], int8_path_for(paths["after"])
    # the other int8 weight-scale layout, for information (accuracy, and latency in the int8 rotation)
    alt_path = tmpdir / "alt.onnx"
    alt = export_client_text_classifier(
        client, alt_path, int8_per_channel=args.int8_per_tensor, int8_min_agreement=0.0, **common
    )
    models = {  # name -> (file, runtime class)
        "before_fp32": (paths["before"], BeforeRuntime),
        "after_fp32": (path, TextClassifierRuntime),
        "before_int8": (int8_path_for(paths["before"]), BeforeRuntime),
        "after_int8": (q_path, TextClassifierRuntime),
        "before_graph_after_options_int8": (int8_path_for(paths["before"]), TextClassifierRuntime),
        "after_other_scale_layout_int8": (int8_path_for(alt_path), TextClassifierRuntime),
    }
    runtimes = {name: cls(model) for name, (model, cls) in models.items()}
    passes = {name: rt.metadata["backbone_passes"] for name, rt in runtimes.items()}
    if passes["after_int8"] != backbone_passes("two-pass", len(report["groups"])):
        raise RuntimeError(f"the served file records {passes['after_int8']} backbone passes")

    evaluated: dict[str, dict[str, Any]] = {}
    preds: dict[str, np.ndarray] = {}
    for name in ("before_fp32", "after_fp32", "before_int8", "after_int8"):
        rt, model = runtimes[name], models[name][0]
        enc = rt.encode(texts)
        same_ids = all(r == sc.test.ids[i][sc.test.mask[i] == 1].tolist() for i, r in enumerate(enc))
        t0 = time.perf_counter()
        pred, route, _ = rt.predict_texts(texts)
        all_s = time.perf_counter() - t0
        preds[name] = pred
        acc = float((pred == labels).mean())
        evaluated[name] = {
            "bytes": model.stat().st_size,
            "backbone_passes": passes[name],
            "accuracy": acc,
            "accuracy_change_vs_torch": acc - acc_torch,
            "label_agreement_with_torch": float((pred == t_pred).mean()),
            "group_agreement_with_torch": float((route == t_route).mean()),
            "routing_acc": float((route == np.array([group_of[c] for c in labels])).mean()),
            **flips(pred, t_pred, labels),
            "runtime_token_ids_equal_training_tokenizer": bool(same_ids),
            "seconds_all_test_texts": all_s,
            "latency_batch1_tokens_mean": float(np.mean([len(r) for r in enc[: args.latency_texts]])),
        }
        log(
            f"{name}: accuracy {acc:.4f} (torch {acc_torch:.4f}), "
            f"agreement {evaluated[name]['label_agreement_with_torch']:.4f}"
        )
    preds["alt"], alt_route, _ = runtimes["after_other_scale_layout_int8"].predict_texts(texts)
    agreement_after_vs_before = {
        kind: float((preds[f"after_{kind}"] == preds[f"before_{kind}"]).mean()) for kind in ("fp32", "int8")
    }

    # interleaved per kind, in blocks of texts (see interleaved_latency)
    lat: dict[str, dict[str, float]] = {}
    for kind in ("fp32", "int8"):
        group = {name: rt for name, rt in runtimes.items() if name.endswith(kind)}
        log(f"batch-1 latency, {kind}: {sorted(group)} interleaved over {args.latency_texts} texts")
        lat.update(
            interleaved_latency(
                {name: (lambda t, rt=rt: rt.classify([t])) for name, rt in group.items()}, texts[: args.latency_texts]
            )
        )
    for name, v in lat.items():
        log(f"{name}: batch-1 classify median {v['median_ms']:.1f} ms")
    runtimes.clear()  # free the sessions before the next steps
    for name in evaluated:
        evaluated[name]["latency_batch1"] = lat[name]
    results = {kind: evaluated[f"after_{kind}"] for kind in ("fp32", "int8")}
    alt_res = {
        "int8_per_channel": args.int8_per_tensor,
        "bytes": alt["int8_bytes"],
        "accuracy": float((preds["alt"] == labels).mean()),
        "label_agreement_with_torch": float((preds["alt"] == t_pred).mean()),
        "group_agreement_with_torch": float((alt_route == t_route).mean()),
        **flips(preds["alt"], t_pred, labels),
        "export_parity_rows_label_agreement": alt["int8_label_agreement"],
        "latency_batch1": lat["after_other_scale_layout_int8"],
    }
    log(f"int8 with per_channel={args.int8_per_tensor}: accuracy {alt_res['accuracy']:.4f}")

    rows = [
        (
            torch.from_numpy(sc.test.ids[i : i + 1, : int(sc.test.mask[i].sum())]),
            torch.from_numpy(sc.test.mask[i : i + 1, : int(sc.test.mask[i].sum())]),
        )
        for i in range(args.latency_texts)
    ]
    torch_lat = latency(lambda r: torch_predict_one(client, *r), rows)
    log(f"torch eager batch-1 (token ids, no tokenization) median {torch_lat['median_ms']:.1f} ms")

    texts_file = tmpdir / "texts.json"
    texts_file.write_text(json.dumps(texts[: args.rss_texts]))
    rss_all = {}
    for name in ("before_fp32", "after_fp32", "before_int8", "after_int8"):
        model, cls = models[name]
        out = rss_child(model, texts_file, cls.session_config)
        want = preds[name][: args.rss_texts].tolist()
        rss_all[name] = {
            "peak_rss_mb": out["vmhwm_kb"] / 1024,
            "end_rss_mb": out["vmrss_kb"] / 1024,
            "load_s": out["load_s"],
            "texts": args.rss_texts,
            "heavy_modules": out["heavy_modules"],
            "labels_match_in_process_runtime": out["labels"] == want,
        }
        log(f"{name}: torch-free process peak RSS {rss_all[name]['peak_rss_mb']:.1f} MB")
    rss = {kind: rss_all[f"after_{kind}"] for kind in ("fp32", "int8")}
    ratio = {kind: lat[f"after_{kind}"]["median_ms"] / lat[f"before_{kind}"]["median_ms"] for kind in ("fp32", "int8")}
    before = {
        "graph": "all-groups",
        "backbone_passes": passes["before_int8"],
        "session_config": BeforeRuntime.session_config,
        "export": {
            **{k: v for k, v in reports["before"].items() if k not in ("path", "int8_path")},
            "seconds": round(export_s["before"], 1),
        },
        "onnx": {kind: evaluated[f"before_{kind}"] for kind in ("fp32", "int8")},
        "rss": {kind: rss_all[f"before_{kind}"] for kind in ("fp32", "int8")},
        "int8_with_after_session_config": {
            "latency_batch1": lat["before_graph_after_options_int8"],
            "session_config": TextClassifierRuntime.session_config,
        },
    }

    res = {
        "command": " ".join(
            [
                "python",
                "benchmarks/bench_fedet_export.py",
                *(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])),
            ]
        ),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {
            "platform": platform.platform(),
            "cpu": _cpu_name(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "onnxruntime": _version("onnxruntime"),
            "onnx": _version("onnx"),
            "tokenizers": _version("tokenizers"),
            "torch_threads": args.threads,
            "ort_threads": 1,
            "load_average_before": [round(v, 2) for v in load_before],
            "load_average_after": [round(v, 2) for v in os.getloadavg()],
        },
        "scenario": {
            "seed": args.seed,
            "tasks": [list(t) for t in sc.tasks],
            "class_names": list(class_names),
            "clients": bargs.clients,
            "groups": bargs.groups,
            "rounds_per_task": args.rounds_per_task,
            "per_class": args.per_class,
            "seq_len": args.seq_len,
            "test_texts": len(texts),
            "group_of": {str(c): j for c, j in sorted(group_of.items())},
            "train_seconds": round(train_s, 1),
            "bench_fedet_bbc_loop": runlog,
        },
        "export": {
            **{k: v for k, v in report.items() if k not in ("path", "int8_path")},
            "seconds": round(export_s["after"], 1),
            "tokenizer_bytes": tok_json.stat().st_size,
        },
        "backbone_passes": passes["after_int8"],
        "int8_latency_ratio_vs_before": ratio["int8"],
        "fp32_latency_ratio_vs_before": ratio["fp32"],
        "session_config": TextClassifierRuntime.session_config,
        "label_agreement_after_vs_before": agreement_after_vs_before,
        "before": before,
        "torch": {"accuracy": acc_torch, "latency_batch1": torch_lat},
        "onnx": results,
        "int8_accuracy_change_vs_fp32": results["int8"]["accuracy"] - results["fp32"]["accuracy"],
        "int8_other_scale_layout": alt_res,
        "rss": rss,
        "wall_seconds": round(time.perf_counter() - start, 1),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(res, indent=2) + "\n")
    write_markdown(out / f"{args.name}.md", res)
    for f in (
        path,
        q_path,
        paths["before"],
        int8_path_for(paths["before"]),
        alt_path,
        int8_path_for(alt_path),
        texts_file,
    ):
        f.unlink()
    tmpdir.rmdir()
    log(f"wrote {out / (args.name + '.json')} and .md in {res['wall_seconds']:.0f} s")
    return 0


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def write_markdown(path: Path, r: dict) -> None:
    m, s, e, o, t = r["machine"], r["scenario"], r["export"], r["onnx"], r["torch"]
    pct = lambda v: f"{100 * v:.2f}%"  # noqa: E731
    lines = [
        "# FedET export: torch vs ONNX fp32 vs ONNX int8 on held-out BBC News, two-pass graph vs before",
        "",
        f"Command: `{r['command']}`  ",
        f"Date: {r['date']}, wall clock {r['wall_seconds']:.0f} s (training {s['train_seconds']:.0f} s, "
        f"export fp32 + int8 {e['seconds']:.0f} s, the before graph {r['before']['export']['seconds']:.0f} s).  ",
        f"Machine: {m['cpu']}, {m['cpus']} CPUs shared with other jobs (load average {m['load_average_before']} "
        f"before, {m['load_average_after']} after), {m['platform']}, Python {m['python']}, torch {m['torch']}, "
        f"onnxruntime {m['onnxruntime']}, onnx {m['onnx']}, tokenizers {m['tokenizers']}; torch "
        f"{m['torch_threads']} thread(s), onnxruntime {m['ort_threads']} intra-op thread.",
        "",
        f"State: `bench_fedet_bbc.py`'s fedet method (J={s['groups']} groups, {s['clients']} clients, tasks "
        f"{s['tasks']}, {s['rounds_per_task']} round(s) per task, {s['per_class']} training texts per "
        f"(client, class), {s['seq_len']} tokens, seed {s['seed']}); client 0 after the last task is exported. "
        f"Evaluated on all {s['test_texts']} test texts of the seeded 20% held-out split (never trained on).",
        "",
        "| model | file bytes | accuracy | change vs torch | label agreement with torch | group agreement "
        "| batch-1 classify median (p10-p90) | peak RSS, torch-free process |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        f"| torch eager (FedETClient.predict) | - | {t['accuracy']:.4f} | - | - | - | "
        f"{t['latency_batch1']['median_ms']:.1f} ms ({t['latency_batch1']['p10_ms']:.1f}-"
        f"{t['latency_batch1']['p90_ms']:.1f}), token ids only | - |",
    ]
    for kind in ("fp32", "int8"):
        k, lat, rs = o[kind], o[kind]["latency_batch1"], r["rss"][kind]
        lines.append(
            f"| ONNX {kind} (TextClassifierRuntime, raw text) | {k['bytes']:,} | {k['accuracy']:.4f} | "
            f"{100 * k['accuracy_change_vs_torch']:+.2f} pt | {pct(k['label_agreement_with_torch'])} | "
            f"{pct(k['group_agreement_with_torch'])} | {lat['median_ms']:.1f} ms ({lat['p10_ms']:.1f}-"
            f"{lat['p90_ms']:.1f}) | {rs['peak_rss_mb']:.1f} MB |"
        )
    b = r["before"]
    fmt_lat = lambda v: f"{v['median_ms']:.1f} ms ({v['p10_ms']:.1f}-{v['p90_ms']:.1f})"  # noqa: E731
    lines += [
        "",
        "## Before / after: the served graph in at most two backbone passes",
        "",
        f"Before: the frozen pass + every group ({b['backbone_passes']} backbone passes with J={len(e['groups'])} "
        f"non-empty groups), loaded with the runtime's session options of then (no config entries). After: the "
        f"frozen pass + the routed group only ({r['backbone_passes']} passes; block 0 is shared, so 2D - 1 = 11 "
        "of MiniLM's blocks per text, against 6 + 5J after onnxruntime merges the before graph's identical "
        "block-0 copies), attention fused "
        f"(com.microsoft Attention / QAttention), session config {r['session_config']}. Batch-1 latency: "
        f"`classify([text])` over the first {o['int8']['latency_batch1']['n']} test texts, in one process, the "
        "models of a kind (fp32: before, after; int8: before, after, before graph with the after session config) "
        "interleaved in blocks of 10 texts (each block runs on every model in turn, the starting model rotating, "
        "after one untimed call that warms the model's weights back into the caches).",
        "",
        "| graph | kind | backbone passes | file bytes | accuracy | label agreement with torch | batch-1 classify "
        "median (p10-p90) | after / before | peak RSS, torch-free process |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for kind in ("fp32", "int8"):
        for which, src, rs in (("before", b["onnx"][kind], b["rss"][kind]), ("after", o[kind], r["rss"][kind])):
            ratio = f"**{r[kind + '_latency_ratio_vs_before']:.3f}**" if which == "after" else "1"
            lines.append(
                f"| {which} | {kind} | {src['backbone_passes']} | {src['bytes']:,} | {src['accuracy']:.4f} | "
                f"{pct(src['label_agreement_with_torch'])} | {fmt_lat(src['latency_batch1'])} | {ratio} | "
                f"{rs['peak_rss_mb']:.1f} MB |"
            )
    bo = b["int8_with_after_session_config"]["latency_batch1"]
    lines += [
        "",
        f"**int8 batch-1 latency after / before: {r['int8_latency_ratio_vs_before']:.3f}** "
        f"(fp32 {r['fp32_latency_ratio_vs_before']:.3f}). Of that, the session config alone (the before graph "
        f"with the after session config, same interleaved run): {fmt_lat(bo)}, "
        f"{bo['median_ms'] / b['onnx']['int8']['latency_batch1']['median_ms']:.3f} of before; the graph "
        f"accounts for the rest ({o['int8']['latency_batch1']['median_ms'] / bo['median_ms']:.3f} of that). "
        f"Labels after vs before on all {s['test_texts']} test texts: fp32 "
        f"{pct(r['label_agreement_after_vs_before']['fp32'])} equal, int8 "
        f"{pct(r['label_agreement_after_vs_before']['int8'])}. Before export parity: max scaled logit error "
        f"{b['export']['max_scaled_err']:.2e}, int8 agreement on the parity rows "
        f"{pct(b['export']['int8_label_agreement'])}.",
    ]
    lines += [
        "",
        f"**int8 accuracy change: {100 * r['int8_accuracy_change_vs_fp32']:+.2f} points vs ONNX fp32** "
        f"({o['int8']['accuracy']:.4f} vs {o['fp32']['accuracy']:.4f}; torch {t['accuracy']:.4f}). "
        f"int8 file / fp32 file = {o['int8']['bytes'] / o['fp32']['bytes']:.3f}. "
        f"int8 changed the label of {o['int8']['texts_changed_vs_torch']} of {s['test_texts']} texts "
        f"({o['int8']['changed_to_right']} became right, {o['int8']['changed_to_wrong']} became wrong, the rest "
        "stayed wrong): one seed and 444 texts, so a change of a few texts is within noise.",
        "",
        f"- The other int8 weight-scale layout (per_channel={r['int8_other_scale_layout']['int8_per_channel']} instead "
        f"of {e['int8_per_channel']}): {r['int8_other_scale_layout']['bytes']:,} B, accuracy "
        f"{r['int8_other_scale_layout']['accuracy']:.4f}, label agreement with torch "
        f"{pct(r['int8_other_scale_layout']['label_agreement_with_torch'])}, group agreement "
        f"{pct(r['int8_other_scale_layout']['group_agreement_with_torch'])}, batch-1 classify median "
        f"{r['int8_other_scale_layout']['latency_batch1']['median_ms']:.1f} ms; labels changed vs torch: "
        f"{r['int8_other_scale_layout']['texts_changed_vs_torch']} ({r['int8_other_scale_layout']['changed_to_right']}"
        f" became right, {r['int8_other_scale_layout']['changed_to_wrong']} wrong).",
        f"- Export parity (fp32, {e['parity_rows']} test texts): max |onnx - torch| logit {e['max_abs_err']:.2e}, "
        f"max scaled {e['max_scaled_err']:.2e} (tolerance 1e-4), float32 ties {e['float32_ties']}; the exporter's "
        f"int8 check: label agreement {pct(e['int8_label_agreement'])} on the same rows (threshold "
        f"{pct(e['int8_min_agreement'])}); int8 ops {e.get('int8_quantized_ops')}; kept fp32: the selector's "
        f"MatMul and the {len(e['int8_excluded_nodes']) - 1} Gathers of the stacked per-group Enhancer/head "
        f"tensors (and the per-row MatMuls they feed); per-channel {e['int8_per_channel']}.",
        f"- Both files embed MiniLM's tokenizer.json ({e.get('tokenizer_bytes', 466247):,} B) in their metadata; "
        f"the runtime's token ids equal the training tokenizer's for every test text: "
        f"fp32 {o['fp32']['runtime_token_ids_equal_training_tokenizer']}, "
        f"int8 {o['int8']['runtime_token_ids_equal_training_tokenizer']}.",
        f"- Latency: `TextClassifierRuntime.classify([text])` (tokenization + validation + one session run) over "
        f"the first {o['fp32']['latency_batch1']['n']} test texts ({o['fp32']['latency_batch1_tokens_mean']:.1f} "
        f"tokens on average, at most {s['seq_len']}); the graph runs the backbone {r['backbone_passes']} times "
        "(selector pass + the routed group). The torch row runs the same two passes, on token ids, without "
        "tokenization.",
        f"- Peak RSS: VmHWM of a separate process with torch, onnx and yaml imports blocked, which loads the model "
        f"(validation + onnxruntime session) and classifies {r['rss']['fp32']['texts']} texts; modules loaded: "
        f"fp32 {r['rss']['fp32']['heavy_modules']}, int8 {r['rss']['int8']['heavy_modules']}; its labels equal "
        f"the in-process runtime's: fp32 {r['rss']['fp32']['labels_match_in_process_runtime']}, int8 "
        f"{r['rss']['int8']['labels_match_in_process_runtime']}.",
        f"- Routing accuracy (selector group = the true class's group): torch/ONNX fp32 "
        f"{pct(o['fp32']['routing_acc'])}, int8 {pct(o['int8']['routing_acc'])}.",
        f"- The training run (bench_fedet_bbc's fedet method through the services) reported accuracy after each "
        f"task {s['bench_fedet_bbc_loop']['acc_after_task']} (averaged over devices, on each device's test texts "
        "of the classes seen so far); the exported state is client 0's checkpoint after its last update.",
    ]
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
