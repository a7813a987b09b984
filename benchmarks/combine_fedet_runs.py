"""Merge several ``bench_fedet_bbc.py`` result files into one per-seed table.

Each input is a ``<name>.json`` written by ``bench_fedet_bbc.py``; a method may be given a
label per file (``fedet@proto``) so variants of one method stay apart.  Writes a JSON and a
markdown table: per (method, seed) the average incremental accuracy, then per method the
mean, standard deviation and wins against a reference method on the seeds both ran.

    python benchmarks/combine_fedet_runs.py benchmarks/results/fedet_bbc.json \\
        benchmarks/results/fedet_bbc_seeds23.json benchmarks/results/fedet_proto.json=proto \\
        --reference replay-fl --out benchmarks/results/fedet_bbc_seeds
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def load(spec: str) -> tuple[Path, str, dict]:
    path, _, label = spec.partition("=")
    return Path(path), label, json.loads(Path(path).read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="+", help="result JSON files, each optionally =LABEL (appended to its methods)")
    parser.add_argument("--reference", default="replay-fl", help="method the others are compared with per seed")
    parser.add_argument("--out", required=True, help="output path without extension")
    args = parser.parse_args(argv)
    table: dict[str, dict[int, float]] = {}
    sources = []
    for spec in args.inputs:
        path, label, res = load(spec)
        sources.append({"file": str(path), "label": label, "command": res["command"], "machine": res["machine"]})
        for run in res["runs"]:
            seed = run["scenario"]["seed"]
            for method, m in run["methods"].items():
                name = f"{method}@{label}" if label else method
                if seed in table.setdefault(name, {}):
                    raise SystemExit(f"{name} seed {seed} appears twice")
                table[name][seed] = m["avg_incremental_acc"]
    ref = table.get(args.reference, {})
    summary = {}
    for name, per_seed in table.items():
        common = sorted(set(per_seed) & set(ref))
        values = [per_seed[s] for s in sorted(per_seed)]
        summary[name] = {
            "per_seed": {str(s): per_seed[s] for s in sorted(per_seed)},
            "mean": float(np.mean(values)),
            "std": float(np.std(values)),
            "seeds": len(values),
            f"wins_vs_{args.reference}": sum(per_seed[s] > ref[s] for s in common),
            f"mean_gap_vs_{args.reference}": float(np.mean([per_seed[s] - ref[s] for s in common])) if common else None,
            "common_seeds": common,
        }
    out = Path(args.out)
    out.with_suffix(".json").write_text(
        json.dumps({"sources": sources, "reference": args.reference, "methods": summary}, indent=2) + "\n"
    )
    seeds = sorted({s for v in table.values() for s in v})
    lines = [
        "# FedET on class-incremental BBC News, per seed",
        "",
        "Average incremental accuracy per seed, merged by `python benchmarks/combine_fedet_runs.py "
        + " ".join(args.inputs)
        + f" --reference {args.reference} --out {args.out}` from:",
        "",
    ]
    lines += [
        f"- `{s['file']}`{' (label ' + s['label'] + ')' if s['label'] else ''}: `{s['command']}`" for s in sources
    ]
    lines += [
        "",
        "| method | "
        + " | ".join(f"seed {s}" for s in seeds)
        + f" | mean +- std | wins vs {args.reference} | mean gap vs {args.reference} |",
        "|---|" + "---:|" * (len(seeds) + 3),
    ]
    for name, m in summary.items():
        cells = [f"{table[name][s]:.4f}" if s in table[name] else "-" for s in seeds]
        gap = m[f"mean_gap_vs_{args.reference}"]
        lines.append(
            f"| {name} | " + " | ".join(cells) + f" | {m['mean']:.4f} +- {m['std']:.4f} | "
            f"{m[f'wins_vs_{args.reference}']}/{len(m['common_seeds'])} | "
            f"{'-' if gap is None else f'{gap:+.4f}'} |"
        )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
