#!/usr/bin/env python
"""Every method's bytes on the wire, compression off and with its defaults, side by side.

For each method (``--methods``, default: every method package's own method), its benchmark
scenario from ``benchmarks/wire_all.yaml`` runs through the services (``fcl simulate``: an
aggregator and one process per device over the embedded broker) twice per seed: with the
wire's compression off (``off``: no sparsification either way, float32 values) and with the
method's defaults.  Written: ``benchmarks/results/wire_all.json`` (per method its reference,
``off`` and ``default`` as seed means of ``up_ratio`` / ``down_ratio``, the bytes over the
dense fp32 reference as ``summary.json`` has them, and of its ``metric``; each run's
figures, with the run-level share of the devices' bytes and what no record accounts for)
and ``wire_all.md``, the table.

    python benchmarks/bench_wire_all.py                                   # every method, seeds 0 1
    python benchmarks/bench_wire_all.py --methods confedmade ngfl --seeds 0
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_codec import machine_info  # noqa: E402  (a sibling script: benchmarks/ is sys.path[0])

import methods  # noqa: E402

VARIANTS = ("off", "default")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "benchmarks" / "wire_all.yaml")
    parser.add_argument("--methods", nargs="+", help="registered method names (default: each package's own method)")
    parser.add_argument("--seeds", nargs="+", type=int, help="federation seeds (default: the config's)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="extra override for every run")
    parser.add_argument("--in-process", action="store_true", help="threads over the in-process transport")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "wire_all.json")
    parser.add_argument(
        "--reuse",
        type=Path,
        help="read a run's summary from REUSE/<method>-<variant>-<seed>.summary.json where there is one "
        "(kept from an earlier run of this script) instead of running it",
    )
    return parser.parse_args(argv)


def default_methods() -> list[str]:
    """One method per package: the one named like its package (a new package is included)."""
    return sorted(name for name, spec in methods.REGISTRY.items() if name == spec.package)


def plan_runs(config: dict, name: str) -> dict:
    """The scenario, the overrides of each variant and the metric key of ``name``."""
    spec = methods.lookup(name, "--methods")
    entry = (config.get("methods") or {}).get(name)
    if entry is None:  # not configured: its example at smoke size
        entry = {"scenario": spec.example_scenario, "overrides": list(spec.smoke_overrides)}
    base = [f"federation.method={name}", "compare=[]", *entry.get("overrides", [])]
    return {
        "scenario": entry["scenario"],
        "off": [*base, *config.get("uncompressed", []), *entry.get("uncompressed", [])],
        "default": base,
        "metric": entry.get("metric", "final.avg_nll" if spec.metric == "nll" else "final.avg_accuracy"),
        "seeds": entry.get("seeds"),
    }


def simulate(scenario: str, overrides: list[str], out: Path, in_process: bool) -> dict:
    """One run through ``fcl simulate``; its summary.json."""
    cmd = [sys.executable, "-m", "fcl_edge.cli", "simulate", str(ROOT / scenario), "--out", str(out), "--force"]
    cmd += ["--in-process"] if in_process else []
    for item in overrides:
        cmd += ["--set", item]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"{shlex.join(cmd)} failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads((out / "summary.json").read_text())


def figures(summary: dict, metric: str) -> dict:
    """What one run contributes: its ratios to the dense reference, its metric, its run-level bytes."""
    b = summary["bytes"]
    run = b.get("run_level") or {}
    return {
        "up_ratio": b["up_vs_dense"],
        "down_ratio": b["down_vs_dense"],
        "metric": metric_value(summary, metric),
        "up_bytes": b["up_total"],
        "down_bytes": b["down_total"],
        "run_level_share": run.get("share"),
        # a method that trains part of a model (FedET) also has the paper's reference
        "up_vs_full_finetune": b.get("up_vs_full_finetune"),
        "down_vs_full_finetune": b.get("down_vs_full_finetune"),
        "unattributed": run.get("unattributed"),
    }


def metric_value(summary: dict, path: str) -> float | None:
    """``path`` (``block.key``, e.g. ``final.avg_nll``, ``fleet.avg_accuracy``) in summary.json."""
    block, _, key = path.partition(".")
    return (summary.get(block) or {}).get(key)


def seed_mean(runs: list[dict], metric_name: str) -> dict:
    """The variant's figures as seed means (a value a run lacks leaves the mean None)."""

    def mean(key: str) -> float | None:
        values = [r.get(key) for r in runs]
        return None if any(v is None for v in values) else round(float(np.mean(values)), 4)

    return {"up_ratio": mean("up_ratio"), "down_ratio": mean("down_ratio"), "metric": mean("metric"),
            "metric_name": metric_name, "runs": runs,
            "up_vs_full_finetune": mean("up_vs_full_finetune"),
            "down_vs_full_finetune": mean("down_vs_full_finetune")}  # fmt: skip


def bench_method(
    config: dict, name: str, seeds: list[int], extra: list[str], work: Path, in_process: bool, reuse: Path | None
) -> dict:
    runs = plan_runs(config, name)
    seeds = runs["seeds"] or seeds  # a method whose run is long names fewer seeds in the config
    out: dict = {"scenario": runs["scenario"], "seeds": seeds}
    per_variant: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for seed in seeds:
        for variant in VARIANTS:
            overrides = [*runs[variant], f"federation.seed={seed}", *extra]
            kept = reuse / f"{name}-{variant}-{seed}.summary.json" if reuse else None
            if kept is not None and kept.is_file():
                summary = json.loads(kept.read_text())
            else:
                summary = simulate(runs["scenario"], overrides, work / f"{name}-{variant}-{seed}", in_process)
            out.setdefault("reference", summary["bytes"].get("reference"))
            per_variant[variant].append({"seed": seed, **figures(summary, runs["metric"])})
            print(f"{name} {variant} seed {seed}: {per_variant[variant][-1]}", flush=True)
    for variant in VARIANTS:
        out[variant] = {**seed_mean(per_variant[variant], runs["metric"]), "overrides": runs[variant]}
    return out


def _both(runs: list[dict]) -> float:
    """Up and down together over the reference's up and down together, seed mean."""
    ratios = [
        (x["up_bytes"] + x["down_bytes"]) / (x["up_bytes"] / x["up_ratio"] + x["down_bytes"] / x["down_ratio"])
        for x in runs
    ]
    return float(np.mean(ratios))


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def markdown(results: dict) -> str:
    lines = [
        "| method | seeds | off: up / down vs dense | off: up + down | off: metric | default: up / down vs dense "
        "| default: up + down | default: metric | metric change | run-level share (default) | reference |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, r in results.items():
        off, on = r["off"], r["default"]
        change = None if off["metric"] is None or on["metric"] is None else on["metric"] - off["metric"]
        shares = [x["run_level_share"] for x in on["runs"] if x["run_level_share"] is not None]
        both = {v: _both(r[v]["runs"]) for v in VARIANTS}
        lines.append(
            f"| {name} | {', '.join(map(str, r['seeds']))} | {_pct(off['up_ratio'])} / {_pct(off['down_ratio'])} "
            f"| {_pct(both['off'])} | {_num(off['metric'])} ({off['metric_name']}) "
            f"| {_pct(on['up_ratio'])} / {_pct(on['down_ratio'])} | **{_pct(both['default'])}** | {_num(on['metric'])} "
            f"| {'-' if change is None else f'{change:+.4f}'} "
            f"| {_pct(float(np.mean(shares)) if shares else None)} | {r['reference']} |"
        )
    for name, r in results.items():  # the paper's reference where a method trains part of a model
        off, on = r["off"], r["default"]
        if on.get("up_vs_full_finetune") is not None:
            lines.append(
                f"\n{name} against dense fp32 full fine-tuning (the whole model every round, the paper's "
                f"reference): off {_pct(off.get('up_vs_full_finetune'))} / {_pct(off.get('down_vs_full_finetune'))}, "
                f"default {_pct(on['up_vs_full_finetune'])} / {_pct(on['down_vs_full_finetune'])} (up / down)."
            )
    return "\n".join(lines)


def write_report(out: Path, results: dict, command: str, wall: dict) -> None:
    """``out`` (json) and its ``.md`` table; each method carries the command and load of its own run."""
    report = {"methods": results, "machine": {**machine_info(), **wall}, "command": command}
    m = report["machine"]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    runs = "\n".join(
        f"- {name}: `{r.get('command', command)}`, {r.get('machine', wall)['wall_s'] / 60:.0f} min wall clock "
        f"until it was done, load average {r.get('machine', wall)['load_avg_1min'][0]} at the start and "
        f"{r.get('machine', wall)['load_avg_1min'][1]} at its end"
        for name, r in results.items()
    )
    out.with_suffix(".md").write_text(
        f"# Bytes on the wire per method: compression off and the defaults\n\n"
        f"{m['cpu_count']} CPUs ({m['machine']}, {m['platform']}).  Per method:\n\n{runs}\n\n"
        "Seed means; up / down vs dense: the run's MQTT PUBLISH bytes over its dense fp32 reference "
        "(`summary.json` `bytes.up_vs_dense`, `down_vs_dense`); metric: the `summary.json` figure named; "
        "run-level share: the devices' bytes no round row counts (statuses, EVAL, FINISH, ...).\n\n"
        f"{markdown(results)}\n"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = yaml.safe_load(args.config.read_text())
    names = args.methods or default_methods()
    seeds = args.seeds or list(config.get("seeds", [0]))
    for name in names:
        plan_runs(config, name)  # an unknown name fails before anything runs
    results, start, load = {}, time.monotonic(), os.getloadavg()[0]
    command = shlex.join(["python", *sys.argv])
    with tempfile.TemporaryDirectory() as work:
        for name in names:
            mine = bench_method(config, name, seeds, args.overrides, Path(work), args.in_process, args.reuse)
            loads = [round(load, 2), round(os.getloadavg()[0], 2)]
            wall = {"wall_s": round(time.monotonic() - start), "load_avg_1min": loads}
            # re-read before each write: another run's methods (earlier, or running beside) are kept
            results = json.loads(args.out.read_text()).get("methods", {}) if args.out.exists() else {}
            results[name] = {**mine, "command": command, "machine": wall}
            write_report(args.out, results, command, wall)  # after each method: a stopped run keeps what it measured
    print("\n" + markdown(results))
    print(f"\nwrote {args.out} and {args.out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
