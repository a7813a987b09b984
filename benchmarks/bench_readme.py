"""How long each README step takes on this machine; the README quotes what this writes.

Steps timed, in order, each as a subprocess from the repository root with this checkout's
code (``python -m fcl_edge.cli`` is what the ``fcl`` entry point runs):

1. ``fcl simulate configs/scenarios/quickstart.yaml --out DIR`` into a fresh directory
   (ConFedMADE, then dense FedAvg, each with its own embedded broker and processes);
2. ``fcl report DIR`` on that run.

Not timed: the set-up command (pip downloads depend on the network) and the test suite (its
runtime is taken from a CI run).  The 1-minute load average is recorded before and after each
step: on a busy machine wall times are inflated, so quote them with it.

    python benchmarks/bench_readme.py [--repeat 3]
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
from bench_quickstart import SCENARIO, one_run  # noqa: E402

RESULT = ROOT / "benchmarks/results/readme_timings.json"


def load() -> float:
    return round(os.getloadavg()[0], 2)


def time_report(run_dir: Path) -> dict:
    """``fcl report DIR``, timed from start to exit."""
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "fcl_edge.cli", "report", str(run_dir)], cwd=ROOT, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise SystemExit(f"fcl report failed (exit {done.returncode}): {done.stderr.strip()}")
    return {"wall_s": round(time.perf_counter() - start, 2)}


def one_pass(work: Path) -> dict:
    """Every README step once, into ``work``; wall seconds and load averages per step."""
    run_dir = work / "quickstart"
    before = load()
    quick = one_run(run_dir)
    steps = {"quickstart": {"load_avg_1m_before": before, **quick, "load_avg_1m_after": load()}}
    before = load()
    steps["report"] = {"load_avg_1m_before": before, **time_report(run_dir), "load_avg_1m_after": load()}
    return steps


def median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def readme_line(result: dict) -> str:
    """The README's timing sentence, to paste over the old one."""
    med, passes = result["median_wall_s"], result["passes"]
    loads = [p[step][k] for p in passes for step in p for k in ("load_avg_1m_before", "load_avg_1m_after")]
    return (
        f"the quickstart {med['quickstart']:.0f} s, `fcl report` on its run {med['report']:.1f} s "
        f"(medians of {len(passes)}; 1-minute load average {min(loads):.0f}-{max(loads):.0f})"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Time the README's steps (quickstart, fcl report) on this machine.",
        epilog=f"Writes {RESULT.relative_to(ROOT)} (machine, load averages, wall seconds per step).",
    )
    parser.add_argument("--repeat", type=int, default=1, help="passes over the steps, each into a fresh directory")
    parser.add_argument("--out", default=str(RESULT), help="result JSON (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error(f"--repeat: expected >= 1, got {args.repeat}")
    passes = []
    with tempfile.TemporaryDirectory() as work:
        for i in range(args.repeat):
            passes.append(one_pass(Path(work) / f"pass{i}"))
            print(f"pass {i}: " + ", ".join(f"{k} {v['wall_s']} s" for k, v in passes[-1].items()), flush=True)
    result = {
        "commands": {
            "quickstart": f"fcl simulate {SCENARIO} --out DIR",
            "report": "fcl report DIR",
        },
        "machine": machine_info(),
        "median_wall_s": {step: median([p[step]["wall_s"] for p in passes]) for step in passes[0]},
        "passes": passes,
    }
    result["readme"] = readme_line(result)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"median: {result['median_wall_s']} -> {args.out}")
    print(f"for the README: {result['readme']}")


if __name__ == "__main__":
    main()
