#!/usr/bin/env python
"""One scenario under each wire value coding: bytes both ways and NLL, side by side.

Runs ``fcl simulate SCENARIO`` (embedded Mosquitto broker, real MQTT) once per coding in
--codings (float32, float16, int8 nearest, int8 stochastic), with the same seed and data,
and writes ``benchmarks/results/wire_dtypes.json`` and ``.md``: bytes up and down (MQTT
PUBLISH packets), their ratio to float16's, avg NLL and forgetting, and the NLL change
against float16.

    python benchmarks/bench_wire_dtypes.py                      # configs/scenarios/digits_continual.yaml
    python benchmarks/bench_wire_dtypes.py --set federation.method=fedweit-made
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_codec import machine_info  # noqa: E402  (a sibling script: benchmarks/ is sys.path[0])

CODINGS = {  # name -> overrides
    "float32": ["federation.wire.value_dtype=float32"],
    "float16": ["federation.wire.value_dtype=float16"],
    "int8": ["federation.wire.value_dtype=int8", "federation.wire.int8_rounding=nearest"],
    "int8-stochastic": ["federation.wire.value_dtype=int8", "federation.wire.int8_rounding=stochastic"],
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", type=Path, default=ROOT / "configs" / "scenarios" / "digits_continual.yaml")
    parser.add_argument("--codings", nargs="+", choices=list(CODINGS), default=list(CODINGS))
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="extra scenario override")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "wire_dtypes.json")
    return parser.parse_args(argv)


def run(scenario: Path, overrides: list[str], out: Path) -> dict:
    cmd = [sys.executable, "-m", "fcl_edge.cli", "simulate", str(scenario), "--out", str(out), "--force"]
    for item in overrides:
        cmd += ["--set", item]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{shlex.join(cmd)} failed ({done.returncode}): {done.stderr[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    return {
        "up_bytes": summary["bytes"]["up_total"],
        "down_bytes": summary["bytes"]["down_total"],
        "avg_nll": summary["final"]["avg_nll"],
        "forgetting": summary["final"]["forgetting"],
    }


def markdown(results: dict, reference: str | None) -> str:
    lines = [
        "| coding | up bytes | down bytes | up+down vs float16 | avg NLL | NLL - float16 | forgetting |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    ref = results.get(reference) if reference else None
    for name, r in results.items():
        total = r["up_bytes"] + r["down_bytes"]
        ratio = f"{total / (ref['up_bytes'] + ref['down_bytes']):.3f}" if ref else "-"
        delta = f"{r['avg_nll'] - ref['avg_nll']:+.4f}" if ref else "-"
        lines.append(
            f"| {name} | {r['up_bytes']:,} | {r['down_bytes']:,} | {ratio} | {r['avg_nll']:.4f} | {delta} "
            f"| {r['forgetting']:.4f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory() as work:
        for name in args.codings:
            results[name] = run(args.scenario, args.overrides + CODINGS[name], Path(work) / name)
            print(f"{name}: {results[name]}", flush=True)
    table = markdown(results, "float16" if "float16" in results else None)
    print("\n" + table)
    command = shlex.join([sys.executable, *sys.argv])
    report = {
        "benchmark": "wire_dtypes",
        "command": command,
        "scenario": str(args.scenario.relative_to(ROOT) if args.scenario.is_relative_to(ROOT) else args.scenario),
        "overrides": args.overrides,
        "machine": machine_info(),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(
        f"# Wire value codings on one scenario\n\n`{command}`\n\nscenario `{report['scenario']}`, "
        f"overrides {args.overrides or 'none'}; bytes are MQTT PUBLISH packets over the whole run.\n\n{table}\n"
    )
    print(f"\nwrote {args.out} and {args.out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
