"""Run scenarios with ``fcl simulate`` from a given checkout and print their final numbers, so
two checkouts (before and after a refactor) can be compared to the printed precision.

    python benchmarks/same_numbers.py --repo /path/to/checkout --out /tmp/runs > numbers.md

Each row: scenario, method, avg NLL (or average incremental accuracy), forgetting, bytes up, bytes down.
On a checkout from before the method packages, pass ``--legacy-keys``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

MADE_METHODS = [
    "confedmade",
    "fedweit-made-star",
    "fedweit-made",
    "fedavg",
    "fedcl-finetune",
    "fedprox",
    "fedcurv",
    "fedcl-cumulative-replay",
    "offline",
]
FEDET = [
    "data.per_class=10",
    "data.test_per_class=10",
    "federation.rounds_per_task=3",
    "federation.options.server_epochs=2",
]
SHORT = ["federation.rounds_per_task=2"]
RUNS = (
    [("quickstart", "configs/scenarios/quickstart.yaml", ["compare=[]"])]
    + [
        (f"digits_continual/{m}", "configs/scenarios/digits_continual.yaml", [f"federation.method={m}"])
        for m in MADE_METHODS
    ]
    + [("bbc_fedet (shortened)", "configs/scenarios/bbc_fedet.yaml", FEDET)]
    + [
        ("seqmnist_confedmade (2 rounds/task)", "configs/scenarios/seqmnist_confedmade.yaml", SHORT),
        ("seqmnist_fedcl_finetune (2 rounds/task)", "configs/scenarios/seqmnist_fedcl_finetune.yaml", SHORT),
        ("mnist_ngfl", "configs/scenarios/mnist_ngfl.yaml", []),
    ]
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", required=True, help="checkout whose fcl_edge runs the scenarios")
    parser.add_argument("--out", required=True, help="directory for the run directories")
    parser.add_argument("--only", help="run only rows whose name contains this")
    parser.add_argument(
        "--legacy-keys",
        action="store_true",
        help="the checkout predates method packages: FedET's options are federation.fedet.*",
    )
    args = parser.parse_args()
    print("| run | score | forgetting | bytes up | bytes down |")
    print("|---|---|---|---|---|")
    for name, scenario, overrides in RUNS:
        if args.only and args.only not in name:
            continue
        out = Path(args.out) / name.split(" ")[0].replace("/", "-")
        cmd = [sys.executable, "-m", "fcl_edge.cli", "--log-level", "WARNING", "simulate", scenario, "--out", str(out)]
        for item in overrides:
            if args.legacy_keys and "fedet" in scenario:
                item = item.replace("federation.options.", "federation.fedet.")
            cmd += ["--set", item]
        done = subprocess.run(cmd, cwd=args.repo, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"| {name} | failed (exit {done.returncode}) | | | |", flush=True)
            continue
        s = json.loads((out / "summary.json").read_text())
        final = s["final"]
        score = final.get("avg_nll", final.get("avg_incremental_accuracy"))
        print(
            f"| {name} | {score} | {final.get('forgetting')} | {s['bytes']['up_total']:,} | "
            f"{s['bytes']['down_total']:,} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
