"""How long the README's quickstart takes, and what its table says, on this machine.

Runs exactly ``fcl simulate configs/scenarios/quickstart.yaml --out DIR`` (ConFedMADE, then
dense FedAvg, each through its own embedded broker and processes) ``--repeat`` times into
fresh directories and records the wall time of each and the comparison rows.

    python benchmarks/bench_quickstart.py --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_codec import machine_info  # noqa: E402

from fcl_edge.compare import row_of  # noqa: E402

SCENARIO = "configs/scenarios/quickstart.yaml"


def one_run(out: Path) -> dict:
    """The README command, timed from start to exit."""
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "fcl_edge.cli", "simulate", SCENARIO, "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"quickstart failed (exit {done.returncode}): {done.stderr.strip()}")
    names = [p.parent.name for p in sorted(out.glob("*/summary.json"))]
    rows = [vars(row_of(json.loads((out / n / "summary.json").read_text()))) for n in names]
    return {"wall_s": round(seconds, 2), "rows": rows, "last_line": done.stdout.strip().splitlines()[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs, each into a fresh directory")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/quickstart.json"))
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error("--repeat: expected >= 1")
    runs = []
    with tempfile.TemporaryDirectory() as work:
        for i in range(args.repeat):
            runs.append({"load_avg_1m_before": round(os.getloadavg()[0], 2), **one_run(Path(work) / f"run{i}")})
            print(f"run {i}: {runs[-1]['wall_s']} s", flush=True)
    walls = sorted(r["wall_s"] for r in runs)
    result = {
        "command": f"fcl simulate {SCENARIO} --out DIR",
        "machine": machine_info(),
        "wall_s_median": walls[len(walls) // 2],
        "wall_s_max": walls[-1],
        "runs": runs,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"median {result['wall_s_median']} s, max {result['wall_s_max']} s -> {args.out}")


if __name__ == "__main__":
    main()
