"""How long each row of the bad-input table takes to fail (issue 21: "each in a few seconds").

The rows, the files they point at and the way each is run are those of
``tests/e2e/test_bad_inputs.py`` (imported, not copied); the test checks exit codes and messages,
this measures time.  Each row runs ``--repeat`` times as a subprocess, as a user would run it;
each run must exit with the row's code, and the median is compared with the row's budget
(``Case.seconds``: 8 s for a row that fails before any training, 20 s for the two tiny
in-process runs).  The 1-minute load average is recorded before and after: on a busy machine
wall times are inflated, so quote them with it.

    python benchmarks/bench_bad_inputs.py [--repeat 3] [--only NAME ...]

Writes ``benchmarks/results/bad_inputs.{json,md}`` and exits 1 if a row is over its budget.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from bench_codec import machine_info  # noqa: E402

table = importlib.import_module("test_bad_inputs")
RESULT = ROOT / "benchmarks/results/bad_inputs.json"


def measure(names: list[str], repeat: int) -> list[dict]:
    """Each row ``repeat`` times in one prepared work directory; wall seconds per run."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = table.make_work(Path(tmp))
        for name in names:
            case = table.CASES[name]
            walls, codes = [], set()
            for attempt in range(repeat):
                result, took = table.run_case(name, work, attempt)
                walls.append(round(took, 2))
                codes.add(result.returncode)
            median = statistics.median(walls)
            rows.append(
                {
                    "row": name,
                    "exit_codes": sorted(codes),
                    "expected_exit": case.code,
                    "wall_s": walls,
                    "median_s": round(median, 2),
                    "budget_s": case.seconds,
                    "within": median < case.seconds and codes == {case.code},
                }
            )
            print(f"{name:55s} {median:6.2f} s (budget {case.seconds:g})", flush=True)
    return rows


def markdown(doc: dict) -> str:
    lines = [
        "# The bad-input table: seconds per row",
        "",
        f"`{doc['command']}` on {doc['machine']['platform']}, {doc['machine']['cpu_count']} CPUs "
        f"(load average {doc['load_avg_1m_before']} before, {doc['load_avg_1m_after']} after).",
        "",
        f"{doc['within_budget']} of {len(doc['rows'])} rows within their budget; slowest median "
        f"{doc['max_median_s']} s.",
        "",
        "| row | exit | median s | budget s | runs s |",
        "|---|---:|---:|---:|---|",
    ]
    for row in doc["rows"]:
        codes = ",".join(str(c) for c in row["exit_codes"])
        runs = ", ".join(f"{w:.2f}" for w in row["wall_s"])
        lines.append(f"| {row['row']} | {codes} | {row['median_s']:.2f} | {row['budget_s']:g} | {runs} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3, help="runs per row (default 3; the median is kept)")
    ap.add_argument("--only", nargs="+", metavar="NAME", help="only these rows (default: every row)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave benchmarks/results alone")
    args = ap.parse_args(argv)
    names = args.only or list(table.CASES)
    unknown = [n for n in names if n not in table.CASES]
    if unknown:
        ap.error(f"unknown row(s): {', '.join(unknown)}")
    before = round(os.getloadavg()[0], 2)
    rows = measure(names, args.repeat)
    doc = {
        "command": "python benchmarks/bench_bad_inputs.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine_info(),
        "load_avg_1m_before": before,
        "load_avg_1m_after": round(os.getloadavg()[0], 2),
        "repeat": args.repeat,
        "within_budget": sum(r["within"] for r in rows),
        "max_median_s": max(r["median_s"] for r in rows),
        "rows": rows,
    }
    doc["command"] = doc["command"].strip()
    if not args.no_write:
        RESULT.write_text(json.dumps(doc, indent=2) + "\n")
        RESULT.with_suffix(".md").write_text(markdown(doc))
    print(f"{doc['within_budget']}/{len(rows)} rows within budget (load {before} -> {doc['load_avg_1m_after']})")
    return 0 if doc["within_budget"] == len(rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
