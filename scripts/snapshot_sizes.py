"""The size of the snapshot (``served.npz``) each method's devices write beside their model.

    python scripts/snapshot_sizes.py --work /tmp/snapshot-sizes [--only fedseit]

Runs each method's scenario with ``fcl simulate --in-process``, shortened (one or two rounds a
task, a few samples a class) but with the scenario's own model sizes and number of tasks, so
the files have the sizes a full run's have (a snapshot holds float32 arrays of fixed shapes,
stored uncompressed); then prints, per run, the sizes of client-0's ``served.npz`` and
``model.onnx`` and the snapshot's largest arrays.  A run whose directory already holds a
``summary.json`` (a ``compare:`` run: one per method) is not run again.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUNS = {  # name -> (scenario, --set overrides)
    "quickstart": ("quickstart.yaml", ["federation.rounds_per_task=1"]),
    "filver": (
        "mnist_filver.yaml",
        [
            "federation.task_rounds=[2,1,1,1]",
            "federation.options.phase0_rounds=1",
            "data.per_class=10",
            "data.test_per_class=10",
        ],
    ),
    "ngfl": (
        "mnist_ngfl.yaml",
        [
            "federation.task_rounds=[1,1,1,1,1]",
            "federation.options.rounds_per_task=1",
            "federation.options.base_rounds=1",
            "data.per_class=20",
            "data.test_per_class=10",
        ],
    ),
    "fedseit": (
        "bbc_fedseit.yaml",
        ["federation.rounds_per_task=1", "data.per_class=8", "data.test_per_class=8"],
    ),
    "fedet": (
        "bbc_fedet.yaml",
        [
            "federation.rounds_per_task=2",
            "data.per_class=8",
            "data.test_per_class=8",
            "federation.options.aux_per_round=8",
            "federation.options.server_epochs=1",
        ],
    ),
}


def run(name: str, work: Path) -> Path:
    scenario, sets = RUNS[name]
    out = work / name
    if not any(out.glob("**/summary.json")):  # a compare: run has one per method
        cmd = [sys.executable, "-m", "fcl_edge.cli", "simulate", str(REPO / "configs/scenarios" / scenario)]
        cmd += ["--out", str(out), "--in-process", "--timeout", "3000"]
        for s in sets:
            cmd += ["--set", s]
        print("$", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return out


def report(out: Path) -> list[str]:
    import numpy as np

    lines = []
    for snapshot in sorted(out.glob("**/clients/client-0/served.npz")):
        model = snapshot.with_name("model.onnx")
        with np.load(snapshot, allow_pickle=False) as npz:
            sizes = sorted(((npz[n].nbytes, n) for n in npz.files if n != "__meta__"), reverse=True)
        biggest = ", ".join(f"{n} {b:,}" for b, n in sizes[:2])
        lines.append(
            f"| {snapshot.relative_to(out.parent).parent} | {snapshot.stat().st_size:,} | "
            f"{model.stat().st_size:,} | {len(sizes)} | {biggest} |"
        )
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, required=True, help="where the runs go")
    p.add_argument("--only", choices=sorted(RUNS), action="append", help="only these runs")
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    rows = [
        "| client-0 of | served.npz bytes | model.onnx bytes | arrays | largest arrays (bytes) |",
        "|---|---:|---:|---:|---|",
    ]
    for name in args.only or RUNS:
        rows += report(run(name, args.work))
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
