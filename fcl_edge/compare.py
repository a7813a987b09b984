"""``compare:`` in a scenario: the same scenario run once per method, then one small table.

The quickstart uses it to put the toolkit's sparse continual method next to dense FedAvg:
each method runs in turn (its own broker session, its own participants) into
``OUT/<method>``, so ``fcl report OUT`` draws them on the same axes.  Bytes are per device
and set against dense float32 FedAvg (every trainable tensor sent dense, both ways).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable, Sequence

import methods
from fcl_edge.rundir import prepare_out
from fclcore.errors import ConfigError
from fclcore.exitcodes import ExitCode
from fclcore.method import HEADLINES

TABLE_NAME = "comparison.md"


@dataclasses.dataclass(frozen=True)
class Row:
    """One method's line of the comparison: what a person reads off the quickstart."""

    method: str
    score: float | None  # the method's headline number (``headline``)
    forgetting: float | None
    up_per_device: float  # MQTT PUBLISH bytes
    down_per_device: float
    dense_share: float  # (up + down) / (dense fp32 up + dense fp32 down)


def headline(summary: dict) -> tuple[str, float | None, bool]:
    """(name, value, from the fleet matrix) of the one number a run's method reports in its
    results table (``MethodSpec.headline``).  A run where no device reported at every task end
    (devices that enroll late and retire) has it only in the fleet's matrix."""
    final, fleet = summary.get("final") or {}, summary.get("fleet") or {}
    spec = methods.REGISTRY.get(summary.get("method"))
    key = spec.headline_key if spec else next((k for k in HEADLINES if k in final), "avg_nll")
    if final.get(key) is None and fleet.get(key) is not None:
        return HEADLINES[key], fleet[key], True
    return HEADLINES[key], final.get(key), False


def row_of(summary: dict) -> Row:
    """The comparison row of one run's summary.json.  The dense download reference is
    ``bytes.dense_fp32_down_total`` when the run logs it, else the dense upload (FedAvg sends
    every device the same dense model it receives from each)."""
    b, final, clients = summary["bytes"], summary.get("final", {}), max(1, int(summary["clients"]))
    dense = b["dense_fp32_up_total"] + b.get("dense_fp32_down_total", b["dense_fp32_up_total"])
    _, score, _ = headline(summary)
    return Row(
        method=summary["method"],
        score=score,
        forgetting=final.get("forgetting"),
        up_per_device=b["up_total"] / clients,
        down_per_device=b["down_total"] / clients,
        dense_share=(b["up_total"] + b["down_total"]) / dense if dense else float("nan"),
    )


def format_table(rows: Sequence[Row], score_name: str) -> list[str]:
    """Fixed-width lines for the terminal, under a line that says what the bytes are."""
    w = max(9, len(score_name))
    lines = [
        "bytes per device (MQTT PUBLISH); vs dense: up+down as a share of dense fp32 FedAvg's",
        f"{'method':<12} {score_name:>{w}} {'forgetting':>10} {'up/device':>10} {'down/device':>11} {'vs dense':>8}",
    ]
    for r in rows:
        lines.append(
            f"{r.method:<12} {_num(r.score):>{w}} {_num(r.forgetting):>10} {_mb(r.up_per_device):>10} "
            f"{_mb(r.down_per_device):>11} {r.dense_share:>8.0%}"
        )
    return lines


def verdict(rows: Sequence[Row]) -> str:
    """The last line: which method moved the fewest bytes and which forgot the least."""
    cheapest = min(rows, key=lambda r: r.dense_share)
    known = [r for r in rows if r.forgetting is not None]
    least = min(known, key=lambda r: r.forgetting).method if known else "n/a"
    return (
        f"fewest bytes: {cheapest.method} ({cheapest.dense_share:.0%} of dense fp32 FedAvg); least forgetting: {least}"
    )


def run_compare(
    names: Sequence[str],
    out: str,
    *,
    force: bool,
    check: Callable[[str], object],
    run_one: Callable[[str, str], int],
) -> int:
    """Check every method first (``check(name)`` raises on a bad one), then run each with
    ``run_one(name, out_dir)`` into ``out/<name>``; stop at the first failure."""
    keys = {methods.lookup(n, "compare").headline_key for n in names}
    if len(keys) > 1:
        raise ConfigError(
            f"compare: {list(names)} report different metrics ({', '.join(sorted(keys))}); compare like with like"
        )
    for name in names:
        check(name)
    out_dir = prepare_out(Path(out), force, (TABLE_NAME, *names))
    for name in names:
        print(f"== {name} ==", flush=True)
        code = run_one(name, str(out_dir / name))
        if code != ExitCode.OK:
            return code
    rows = [row_of(json.loads((out_dir / n / "summary.json").read_text())) for n in names]
    score_name = HEADLINES[keys.pop()]
    lines = format_table(rows, score_name)
    (out_dir / TABLE_NAME).write_text(_markdown(rows, score_name))
    print(f"\nwrote {out_dir / TABLE_NAME}; plots: fcl report {out_dir}")
    print("\n".join(lines))
    print(verdict(rows))
    return int(ExitCode.OK)


def _markdown(rows: Sequence[Row], score_name: str) -> str:
    head = f"| method | {score_name} | forgetting | up per device | down per device | up+down vs dense fp32 FedAvg |"
    lines = [head, "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r.method} | {_num(r.score)} | {_num(r.forgetting)} | {_mb(r.up_per_device)} | "
            f"{_mb(r.down_per_device)} | {r.dense_share:.0%} |"
        )
    return "\n".join(lines) + "\n"


def _num(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"
