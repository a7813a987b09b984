"""FIL-VER's bytes on the wire against its accuracy: the compression stage off and on (issue 40).

Every run is ``fcl simulate configs/scenarios/mnist_filver*.yaml --in-process`` (the
aggregator service and the device daemons as threads of this process), as in
``bench_filver.py``, whose run reading and re-identification attack this script reuses.
A variant is ``+``-joined settings of ``federation.wire`` (and of the encoder's density):

* ``off``: no compression either way; ``default``: the method's defaults (``methods/filver/
  wire.py: COMPRESSION``);
* ``d<x>``: top-k density ``x`` both ways, ``up<x>`` / ``down<x>``: one way;
* ``enc<x>``: phase 0's encoder at top-k density ``x`` each way (``federation.options.
  encoder_density``; the default 1.0 sends its whole change; before it, the encoder went at
  the classifier's density);
* ``int8`` / ``float16``: the value dtype of every frame (embeddings included).

Reported per (scenario, method, variant), seed means: bytes up and down against the dense
reference (``summary.json``: ``bytes.up_vs_dense`` / ``down_vs_dense``: dense fp32 FedAvg of
the classifier every round), mean accuracy after the last task, forgetting, and the
re-identification rate of the uploaded embeddings (``bench_filver.reidentify``; for ``off``
also with the same embeddings re-coded as float16 and int8: the effect of the dtype alone).

    python benchmarks/bench_filver_wire.py --variants off,default --seeds 0,1
    python benchmarks/bench_filver_wire.py --variants d0.05,d0.1+int8 --seeds 0 --name filver_wire_curve
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_filver import METHODS, SCENARIOS, fleet, reidentify  # noqa: E402

TARGET_BYTES, TARGET_POINTS = 0.15, 0.01  # up + down vs dense; accuracy below the uncompressed run
TARGET_REID = 0.10  # re-identification, both attackers: the bar bench_filver holds the method to


def variant_overrides(variant: str) -> list[str]:
    """``--set`` items of a variant name (ValueError on an unknown part)."""
    out: list[str] = []
    for part in variant.split("+"):
        if part == "off":
            out += ["federation.wire.sparsify=none", "federation.wire.down_sparsify=none"]
        elif part in ("int8", "float16", "float32"):
            out.append(f"federation.wire.value_dtype={part}")
        elif m := re.fullmatch(r"enc(\d*\.?\d+)", part):
            out.append(f"federation.options.encoder_density={m.group(1)}")
        elif m := re.fullmatch(r"(d|up|down)(\d*\.?\d+)", part):
            keys = {"d": ("density", "down_density"), "up": ("density",), "down": ("down_density",)}
            out += [f"federation.wire.{k}={m.group(2)}" for k in keys[m.group(1)]]
        elif part != "default":
            raise ValueError(
                f"unknown variant part {part!r} (off, default, d<x>, up<x>, down<x>, enc<x>, int8, float16)"
            )
    return out


def ran_with(out: Path, sets: list[str]) -> bool:
    """Whether ``out`` holds a finished run whose scenario has every ``--set`` of ``sets``."""
    if not (out / "summary.json").is_file():
        return False
    scenario = yaml.safe_load((out / "scenario.yaml").read_text())
    for item in sets:
        key, value = item.split("=", 1)
        node = scenario
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node != yaml.safe_load(value):
            return False
    return True


def run_one(job: tuple) -> tuple:
    work, timeout, reuse, scenario, name, variant, seed = job
    import torch

    from fcl_edge.simulate import simulate

    torch.set_num_threads(1)
    tag = f"{scenario}-{name.replace('+', '-')}-{variant.replace('+', '-')}-s{seed}"
    out = Path(work) / tag
    started = time.perf_counter()
    sets = [f"federation.method={METHODS[name]}", f"federation.seed={seed}", *variant_overrides(variant)]
    if reuse and not ran_with(out, sets):
        raise SystemExit(f"{tag}: --reuse, but {out} holds no finished run with {sets}")
    if not reuse:
        code = simulate(
            str(ROOT / "configs" / "scenarios" / SCENARIOS[scenario]),
            str(out),
            overrides=sets,
            timeout=timeout,
            in_process=True,
            force=True,
        )
        if code != 0:
            raise SystemExit(f"{tag}: fcl simulate --in-process exited {code}; logs in {out / 'logs'}")
    summary = json.loads((out / "summary.json").read_text())
    f, b = fleet(summary), summary["bytes"]
    res = {
        "mean_acc": f["avg_accuracy"],
        "forgetting": f["forgetting"],
        "up_ratio": b["up_vs_dense"],
        "down_ratio": b["down_vs_dense"],
        "up_total": b["up_total"],
        "down_total": b["down_total"],
        "dense_up_total": b["dense_fp32_up_total"],
        "dense_down_total": b["dense_fp32_down_total"],
        "syncs": b["syncs"],
        "rejected": summary["rejected"],
        "minutes": round((time.perf_counter() - started) / 60, 2),
    }
    reid = reidentify(out)
    if reid is not None:
        res["reid"] = reid
        if variant == "off":  # what 8 or 16 bits alone would change of today's float32 embeddings
            res["reid_recoded"] = {dt: reidentify(out, dt) for dt in ("float16", "int8")}
    return scenario, name, variant, seed, res


def combine(per_seed: dict[int, dict]) -> dict:
    runs = list(per_seed.values())
    mean = lambda key: round(float(np.mean([r[key] for r in runs])), 4)  # noqa: E731
    out = {k: mean(k) for k in ("mean_acc", "forgetting", "up_ratio", "down_ratio")}
    both = [(r["up_total"] + r["down_total"]) / (r["dense_up_total"] + r["dense_down_total"]) for r in runs]
    out["total_ratio"] = round(float(np.mean(both)), 4)  # up + down over dense up + dense down
    keys = ("mean_acc", "up_ratio", "down_ratio", "reid")
    out["per_seed"] = {str(s): {k: r[k] for k in keys if k in r} for s, r in per_seed.items()}
    if all("reid" in r for r in runs):
        out["reid"] = {k: round(float(np.mean([r["reid"][k] for r in runs])), 4) for k in ("nearest_mu", "likelihood")}
    if all("reid_recoded" in r for r in runs):
        out["reid_recoded"] = {
            dt: {
                k: round(float(np.mean([r["reid_recoded"][dt][k] for r in runs])), 4)
                for k in ("nearest_mu", "likelihood")
            }
            for dt in ("float16", "int8")
        }
    out["syncs"] = sum(sum(r["syncs"].values()) if isinstance(r["syncs"], dict) else 0 for r in runs)
    out["rejected"] = sum(sum(r["rejected"].values()) for r in runs)
    out["minutes_per_run"] = mean("minutes")
    return out


def verdicts(table: dict) -> list[str]:
    """Per (scenario, method): each variant against the targets, measured from the off run
    (``off`` or ``off+<dtype>``, the first listed)."""
    lines = []
    for scenario, by_method in table.items():
        for name, by_variant in by_method.items():
            offs = [v for v in by_variant if v.split("+")[0] == "off"]
            off = by_variant[offs[0]] if offs else None
            for variant, m in by_variant.items():
                if variant in offs or off is None:
                    continue
                small = m["total_ratio"] <= TARGET_BYTES
                close = m["mean_acc"] >= off["mean_acc"] - TARGET_POINTS
                line = (
                    f"{scenario} {name} {variant}: up + down {m['total_ratio']:.1%} of dense "
                    f"({'<=' if small else '>'} {TARGET_BYTES:.0%}), accuracy {m['mean_acc']:.3f} vs off "
                    f"{off['mean_acc']:.3f} ({(m['mean_acc'] - off['mean_acc']) * 100:+.1f} points; "
                    f"{'within' if close else 'beyond'} {TARGET_POINTS * 100:.0f})"
                )
                if "reid" in m:
                    worst = max(m["reid"].values())
                    line += f", re-id up to {worst:.3f} ({'<=' if worst <= TARGET_REID else '>'} {TARGET_REID})"
                lines.append(line)
    return lines


def write_markdown(path: Path, res: dict) -> None:
    lines = [
        f"# FIL-VER: bytes against accuracy ({', '.join(res['scenarios'])})",
        "",
        f"`{res['command']}` on {res['machine']['cpus']} CPUs ({res['machine']['platform']}), load average "
        f"{res['load']} at the start, {res['minutes']:.0f} min wall clock, seeds {res['seeds']}. Reference: "
        f"{res['reference']}.",
        "",
        "| scenario | method | variant | up / dense | down / dense | up + down | mean acc | forgetting "
        "| per seed (acc) | re-id nearest / likelihood | syncs |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for scenario, by_method in res["table"].items():
        for name, by_variant in by_method.items():
            for variant, m in by_variant.items():
                seeds = ", ".join(f"{s}: {v['mean_acc']:.3f}" for s, v in m["per_seed"].items())
                reid = m.get("reid")
                reid_s = f"{reid['nearest_mu']:.3f} / {reid['likelihood']:.3f}" if reid else "-"
                lines.append(
                    f"| {scenario} | {name} | {variant} | {m['up_ratio']:.1%} | {m['down_ratio']:.1%} "
                    f"| {m['total_ratio']:.1%} | {m['mean_acc']:.3f} | {m['forgetting']:.3f} | {seeds} | {reid_s} "
                    f"| {m['syncs']} |"
                )
    for scenario, by_method in res["table"].items():
        for name, by_variant in by_method.items():
            for variant, m in by_variant.items():
                for dt, r in m.get("reid_recoded", {}).items():
                    lines.append(
                        f"\n{scenario} {name} {variant}: its float32 embeddings re-coded as {dt} "
                        f"are re-identified {r['nearest_mu']:.4f} / {r['likelihood']:.4f} (nearest / likelihood)."
                    )
    lines += ["", "Against the targets (up + down <= 15% of dense, at most 1 point below off, re-id <= 0.10):", ""]
    lines += [f"- {v}" for v in res["verdicts"]]
    path.write_text("\n".join(lines) + "\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--scenarios", default="s1", help="comma-separated subset of " + ", ".join(SCENARIOS))
    p.add_argument("--methods", default="ver-sampled+sst", help="comma-separated subset of " + ", ".join(METHODS))
    p.add_argument("--variants", default="off,default", help="comma-separated variants (see above)")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--workers", type=int, default=2, help="runs at a time (one process each)")
    p.add_argument("--timeout", type=float, default=3600.0, help="per run, seconds")
    p.add_argument("--work", default="/tmp/fcl-bench-filver-wire", help="where the run directories go")
    p.add_argument(
        "--reuse", action="store_true", help="run nothing: read the finished runs in --work made with these settings"
    )
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="results directory")
    p.add_argument("--name", default="filver_wire", help="results file stem")
    args = p.parse_args(argv)
    split = lambda text: [v.strip() for v in text.split(",") if v.strip()]  # noqa: E731
    args.scenarios, args.methods, args.variants = split(args.scenarios), split(args.methods), split(args.variants)
    args.seeds = [int(v) for v in split(args.seeds)]
    bad = sorted(set(args.scenarios) - set(SCENARIOS)) + sorted(set(args.methods) - set(METHODS))
    if bad:
        p.error(f"unknown scenarios or methods {bad}")
    for v in args.variants:
        try:
            variant_overrides(v)
        except ValueError as exc:
            p.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started, load = time.perf_counter(), round(os.getloadavg()[0], 2)
    jobs = [
        (args.work, args.timeout, args.reuse, s, m, v, seed)
        for s in args.scenarios
        for m in args.methods
        for v in args.variants
        for seed in args.seeds
    ]
    print(f"{len(jobs)} runs, {args.workers} at a time (load {load})", flush=True)
    results: dict = {}
    with ProcessPoolExecutor(args.workers) as pool:
        for scenario, name, variant, seed, res in pool.map(run_one, jobs):
            results.setdefault((scenario, name, variant), {})[seed] = res
            print(
                f"{scenario} {name} {variant} seed {seed}: acc {res['mean_acc']:.4f} up {res['up_ratio']:.1%} "
                f"down {res['down_ratio']:.1%} ({res['minutes']:.1f} min)",
                flush=True,
            )
    table: dict = {}
    for (scenario, name, variant), per_seed in results.items():
        table.setdefault(scenario, {}).setdefault(name, {})[variant] = combine(per_seed)
    out = {
        "table": table,
        "reference": "dense fp32 FedAvg of the classifier, every round, both ways (FIL-VER's dense_fp32_bytes)",
        "verdicts": verdicts(table),
        "scenarios": args.scenarios,
        "seeds": args.seeds,
        "load": load,
        "minutes": round((time.perf_counter() - started) / 60, 1),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "command": "python benchmarks/bench_filver_wire.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
    }
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{args.name}.json").write_text(json.dumps(out, indent=2) + "\n")
    write_markdown(out_dir / f"{args.name}.md", out)
    print("\n".join(out["verdicts"]))
    print(f"wrote {out_dir / (args.name + '.json')} and .md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
