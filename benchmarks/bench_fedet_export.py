#!/usr/bin/env python
"""FedET ONNX export on BBC News: accuracy torch vs ONNX fp32 vs ONNX int8, sizes, latency, RSS.

    python benchmarks/bench_fedet_export.py                 # ~5-10 min on 2 shared cores

1. Trains a FedET state as ``benchmarks/bench_fedet_bbc.py`` does (the aggregator service and
   5 client daemons in process: BBC News, class-incremental tasks, prototype selector, double
   distillation, entropy-aware server distillation), shortened: by default 2 rounds per task,
   20 training texts per (client, class), one seed.  The exported state is client 0's, rebuilt
   from its checkpoint after its last update.
2. Exports it with ``export.onnx_text_groups.export_client_text_classifier`` (the text-groups
   format; fp32 + int8, parity-checked on --parity-rows test texts, MiniLM's tokenizer.json
   embedded).
3. On the whole held-out BBC test split (20% of every class; texts never seen in training):
   accuracy of torch (``FedETClient.predict`` on ``TextTokenizer`` ids), of the fp32 and int8
   files through the torch-free ``TextClassifierRuntime`` from the raw texts (its own
   tokenization), and their label / group agreement with torch.
4. Batch-1 latency of ``TextClassifierRuntime.classify([text])`` (tokenization included),
   median and p90 over --latency-texts test texts, fp32 and int8, 1 onnxruntime thread;
   torch eager (selector pass + routed group, 1 thread) on the same token ids for reference.
5. Peak RSS (VmHWM) of a separate process that blocks torch/onnx/yaml imports, loads the
   runtime and classifies --rss-texts texts.

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
from export.onnx_text_groups import export_client_text_classifier, int8_path_for  # noqa: E402
from export.text_runtime import TextClassifierRuntime  # noqa: E402
from fclcore.models.enhancer import (  # noqa: E402
    FrozenBackbone,
    default_minilm_dir,
    enhanced_logits,
    load_minilm,
    pooled_embeddings,
)
from fclcore.text import EncodedDocs, TextTokenizer, bbc_split, default_tokenizer_json  # noqa: E402
from methods.fedet.client import FedETClient  # noqa: E402

RSS_CHILD = r"""
import json, sys, time
for name in ("torch", "onnx", "yaml"):
    sys.modules[name] = None  # any import of them fails
t0 = time.perf_counter()
from export.text_runtime import TextClassifierRuntime
rt = TextClassifierRuntime(sys.argv[1])
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


def latency(fn, items: list, warmup: int = 5) -> dict[str, float]:
    for it in items[:warmup]:
        fn(it)
    times = []
    for it in items:
        t0 = time.perf_counter()
        fn(it)
        times.append((time.perf_counter() - t0) * 1e3)
    q = np.percentile(times, [10, 50, 90])
    return {"median_ms": float(q[1]), "p10_ms": float(q[0]), "p90_ms": float(q[2]), "n": len(times)}


def flips(pred: np.ndarray, ref: np.ndarray, labels: np.ndarray) -> dict[str, int]:
    """Texts whose label differs from torch's: how many, and how many of them became right / wrong."""
    diff = pred != ref
    return {
        "texts_changed_vs_torch": int(diff.sum()),
        "changed_to_right": int((diff & (pred == labels)).sum()),
        "changed_to_wrong": int((diff & (ref == labels)).sum()),
    }


def rss_child(model: Path, texts_file: Path) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-c", RSS_CHILD, str(model), str(texts_file)],
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
    path = tmpdir / "fedet.onnx"
    par = np.arange(0, len(texts), max(1, len(texts) // args.parity_rows))[: args.parity_rows]
    log(f"exporting (fp32 + int8, parity on {len(par)} test texts)")
    t0 = time.perf_counter()
    report = export_client_text_classifier(
        client,
        path,
        method="fedet",
        int8=True,
        parity_ids=sc.test.ids[par],
        parity_mask=sc.test.mask[par],
        tokenizer_json=tok_json,
        max_length=args.seq_len,
        class_names=list(class_names),
        int8_per_channel=not args.int8_per_tensor,
        toolkit_version="0.1.0",
    )
    export_s = time.perf_counter() - t0
    q_path = int8_path_for(path)
    log(
        f"exported in {export_s:.0f} s: {report['bytes']:,} B fp32, {report['int8_bytes']:,} B int8; "
        f"parity max scaled err {report['max_scaled_err']:.2e}"
    )

    results: dict[str, Any] = {}
    preds: dict[str, np.ndarray] = {}
    for kind, model in (("fp32", path), ("int8", q_path)):
        rt = TextClassifierRuntime(model)
        enc = rt.encode(texts)
        same_ids = all(r == sc.test.ids[i][sc.test.mask[i] == 1].tolist() for i, r in enumerate(enc))
        t0 = time.perf_counter()
        pred, route, _ = rt.predict_texts(texts)
        all_s = time.perf_counter() - t0
        preds[kind] = pred
        acc = float((pred == labels).mean())
        results[kind] = {
            "bytes": model.stat().st_size,
            "accuracy": acc,
            "accuracy_change_vs_torch": acc - acc_torch,
            "label_agreement_with_torch": float((pred == t_pred).mean()),
            "group_agreement_with_torch": float((route == t_route).mean()),
            "routing_acc": float((route == np.array([group_of[c] for c in labels])).mean()),
            **flips(pred, t_pred, labels),
            "runtime_token_ids_equal_training_tokenizer": bool(same_ids),
            "seconds_all_test_texts": all_s,
        }
        log(
            f"{kind}: accuracy {acc:.4f} (torch {acc_torch:.4f}), "
            f"agreement {results[kind]['label_agreement_with_torch']:.4f}"
        )
        classify = rt.classify
        results[kind]["latency_batch1"] = latency(lambda t: classify([t]), texts[: args.latency_texts])
        results[kind]["latency_batch1_tokens_mean"] = float(np.mean([len(r) for r in enc[: args.latency_texts]]))
        log(f"{kind}: batch-1 classify median {results[kind]['latency_batch1']['median_ms']:.1f} ms")
        rt = classify = None  # free this model before loading the next
    # the other int8 weight-scale layout, for information (accuracy only)
    alt_path = tmpdir / "alt.onnx"
    alt = export_client_text_classifier(
        client,
        alt_path,
        method="fedet",
        int8=True,
        parity_ids=sc.test.ids[par],
        parity_mask=sc.test.mask[par],
        max_length=args.seq_len,
        int8_per_channel=args.int8_per_tensor,
        tokenizer_json=tok_json,
        int8_min_agreement=0.0,
    )
    alt_rt = TextClassifierRuntime(int8_path_for(alt_path), tok_json)
    alt_pred, alt_route, _ = alt_rt.predict_texts(texts)
    alt_latency = latency(lambda t: alt_rt.classify([t]), texts[: args.latency_texts])
    alt_rt = None  # free it
    alt_res = {
        "int8_per_channel": args.int8_per_tensor,
        "bytes": alt["int8_bytes"],
        "accuracy": float((alt_pred == labels).mean()),
        "label_agreement_with_torch": float((alt_pred == t_pred).mean()),
        "group_agreement_with_torch": float((alt_route == t_route).mean()),
        **flips(alt_pred, t_pred, labels),
        "export_parity_rows_label_agreement": alt["int8_label_agreement"],
        "latency_batch1": alt_latency,
    }
    for f in (alt_path, int8_path_for(alt_path)):
        f.unlink()
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
    rss = {}
    for kind, model in (("fp32", path), ("int8", q_path)):
        out = rss_child(model, texts_file)
        want = preds[kind][: args.rss_texts].tolist()
        rss[kind] = {
            "peak_rss_mb": out["vmhwm_kb"] / 1024,
            "end_rss_mb": out["vmrss_kb"] / 1024,
            "load_s": out["load_s"],
            "texts": args.rss_texts,
            "heavy_modules": out["heavy_modules"],
            "labels_match_in_process_runtime": out["labels"] == want,
        }
        log(f"{kind}: torch-free process peak RSS {rss[kind]['peak_rss_mb']:.1f} MB")

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
            "seconds": round(export_s, 1),
            "tokenizer_bytes": tok_json.stat().st_size,
        },
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
    for f in (path, q_path, texts_file):
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
        "# FedET export: torch vs ONNX fp32 vs ONNX int8 on held-out BBC News",
        "",
        f"Command: `{r['command']}`  ",
        f"Date: {r['date']}, wall clock {r['wall_seconds']:.0f} s (training {s['train_seconds']:.0f} s, "
        f"export fp32 + int8 {e['seconds']:.0f} s).  ",
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
        f"{pct(e['int8_min_agreement'])}), selector MatMul kept fp32 ({e['int8_excluded_nodes']}), per-channel "
        f"{e['int8_per_channel']}.",
        f"- Both files embed MiniLM's tokenizer.json ({e.get('tokenizer_bytes', 466247):,} B) in their metadata; "
        f"the runtime's token ids equal the training tokenizer's for every test text: "
        f"fp32 {o['fp32']['runtime_token_ids_equal_training_tokenizer']}, "
        f"int8 {o['int8']['runtime_token_ids_equal_training_tokenizer']}.",
        f"- Latency: `TextClassifierRuntime.classify([text])` (tokenization + validation + one session run) over "
        f"the first {o['fp32']['latency_batch1']['n']} test texts ({o['fp32']['latency_batch1_tokens_mean']:.1f} "
        f"tokens on average, at most {s['seq_len']}); the graph runs the backbone {1 + len(e['groups'])} times "
        "(selector pass + every group). The torch row runs only the selector pass and the routed group, on "
        "token ids, without tokenization.",
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
