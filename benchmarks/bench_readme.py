"""How long each README step takes on this machine; the README quotes what this writes.

Steps timed, in order, each as a subprocess from the repository root with this checkout's
code (``python -m fcl_edge.cli`` is what the ``fcl`` entry point runs):

1. ``fcl simulate configs/scenarios/quickstart.yaml --out DIR`` into a fresh directory
   (ConFedMADE, then dense FedAvg, each with its own embedded broker and processes);
2. ``fcl report DIR`` on that run.

With ``--fresh``, instead: the README's set-up command itself (the line under ``# 1.``, read
from README.md), run part by part in a fresh virtual environment on a fresh clone of this
checkout's HEAD, as a new user would; each part's wall seconds, its exit code and every output
line that says ERROR or WARNING (pip's own index warnings excepted) are recorded under
``fresh_setup``.  Downloads come from whatever index pip is configured with, so quote the pip
steps with that.  Not timed: the test suite (its runtime is taken from a CI run).  The 1-minute
load average is recorded before and after each step: on a busy machine wall times are inflated,
so quote them with it.

    python benchmarks/bench_readme.py [--repeat 3]
    python benchmarks/bench_readme.py --fresh
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
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


def setup_command(readme: Path = ROOT / "README.md") -> str:
    """The README's set-up command: the line under ``# 1.`` in its first bash block."""
    lines = readme.read_text().splitlines()
    for i, line in enumerate(lines):
        if line.startswith("# 1."):
            return lines[i + 1].strip()
    raise SystemExit(f"{readme}: no '# 1.' line (the set-up command) found")


# pip's notes about this machine's own extra index (not about the install) are not findings.
PIP_INDEX_NOTE = re.compile(r"^WARNING: Location 'file://.*' is ignored")


def fresh_setup(work: Path) -> dict:
    """The set-up command in a fresh venv on a fresh clone, timed part by part."""
    repo, venv = work / "repo", work / "venv"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(repo)], check=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}:{env['PATH']}"
    env["VIRTUAL_ENV"] = str(venv)
    parts = []
    for part in setup_command().split(" && "):
        before = load()
        start = time.perf_counter()
        done = subprocess.run(["bash", "-c", part], cwd=repo, env=env, capture_output=True, text=True)
        wall = round(time.perf_counter() - start, 1)
        said = [
            line
            for line in (done.stdout + done.stderr).splitlines()
            if ("ERROR" in line or "WARNING" in line) and not PIP_INDEX_NOTE.match(line)
        ]
        parts.append(
            {"command": part, "exit": done.returncode, "wall_s": wall, "errors_or_warnings": said}
            | {"load_avg_1m_before": before, "load_avg_1m_after": load()}
        )
        print(f"{wall:7.1f} s  exit {done.returncode}  {shlex.split(part)[:3]}  {len(said)} ERROR/WARNING lines")
        if done.returncode != 0:
            print(done.stderr[-3000:])
            break
    return {
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip(),
        "python": subprocess.run(
            [str(venv / "bin/python"), "--version"], capture_output=True, text=True
        ).stdout.strip(),
        "parts": parts,
        "total_wall_s": round(sum(p["wall_s"] for p in parts), 1),
        "ok": all(p["exit"] == 0 for p in parts) and not any(p["errors_or_warnings"] for p in parts),
    }


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


def _earlier(path: str) -> dict:
    """The result file as it is (each mode rewrites only its own keys)."""
    return json.loads(Path(path).read_text()) if Path(path).exists() else {}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Time the README's steps (quickstart, fcl report; or, with --fresh, the set-up command) here.",
        epilog=f"Writes {RESULT.relative_to(ROOT)} (machine, load averages, wall seconds per step).",
    )
    parser.add_argument("--repeat", type=int, default=1, help="passes over the steps, each into a fresh directory")
    parser.add_argument("--out", default=str(RESULT), help="result JSON (default: %(default)s)")
    parser.add_argument(
        "--fresh", action="store_true", help="run the README's set-up command in a fresh venv on a fresh clone instead"
    )
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error(f"--repeat: expected >= 1, got {args.repeat}")
    if args.fresh:
        with tempfile.TemporaryDirectory() as work:
            fresh = fresh_setup(Path(work))
        result = _earlier(args.out)
        result["fresh_setup"] = {"machine": machine_info(), **fresh}
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"set-up command: {fresh['total_wall_s']} s in all, clean: {fresh['ok']} -> {args.out}")
        raise SystemExit(0 if fresh["ok"] else 1)
    passes = []
    with tempfile.TemporaryDirectory() as work:
        for i in range(args.repeat):
            passes.append(one_pass(Path(work) / f"pass{i}"))
            print(f"pass {i}: " + ", ".join(f"{k} {v['wall_s']} s" for k, v in passes[-1].items()), flush=True)
    result = {
        **_earlier(args.out),  # keeps the last --fresh run's fresh_setup
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
