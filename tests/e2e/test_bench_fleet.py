"""The fleet benchmark's smoke run (benchmarks/bench_fleet.py --quick): 20 synthetic devices on
real Mosquitto brokers, through one aggregator and through a root with two bridged sites, must
complete with every device's update counted once; and the check that says so must catch an
update counted twice or lost."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
fleet = importlib.import_module("bench_fleet")


@pytest.mark.parametrize("layout", ["flat", "sites"])
def test_quick_run_completes_and_counts_every_update_once(tmp_path: Path, layout: str) -> None:
    out = tmp_path / "fleet.json"
    code = fleet.main(["--quick", "--layout", layout, "--timeout", "60", "--out", str(out), "--workdir", str(tmp_path)])
    (run,) = json.loads(out.read_text())["runs"]
    assert code == 0 and run["completed"], run["problem"]
    assert (run["devices"], run["layout"], run["sites"]) == (20, layout, 2 if layout == "sites" else 0)
    assert run["folds_per_s"] > 0 and run["close_latency_s"] >= 0 and run["aggregator_peak_rss_mb"] > 0
    assert run["up_bytes_per_device"] > 0 and run["down_bytes_per_device"] > 0  # the update up, the model down
    assert (tmp_path / "fleet.md").read_text().count("\n| 20 |") == 1


def _log(path: Path, *events: dict) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


def _row(client: str, n: int) -> dict:
    return {"event": "round_client", "round": 0, "client": client, "status": "accepted", "n_samples": n}


DEVICES = [("d0", 3), ("d1", 5), ("d2", 7)]


@pytest.mark.parametrize(
    "root, partials, problem",
    [
        ([_row("site-00", 8), _row("site-01", 7)], [["d0", "d1"], ["d2"]], None),
        ([_row("site-00", 8), _row("site-01", 10)], [["d0", "d1"], ["d0"]], "n_samples sum to 18"),  # d0 twice
        (
            [_row("site-00", 8), _row("site-01", 7)],
            [["d0", "d1"], ["d1"]],
            "3 device updates named (2 distinct)",
        ),  # d2 lost
        ([_row("site-00", 8)], [["d0", "d1"], []], "n_samples sum to 8"),
    ],
)
def test_the_count_check_catches_double_counted_and_lost_updates(tmp_path, root, partials, problem) -> None:
    _log(tmp_path / "root", *root)
    for s, devices in enumerate(partials):
        _log(tmp_path / f"site-{s:02d}", {"event": "partial", "round": 0, "devices": devices})
    args = argparse.Namespace(layout="sites", sites=len(partials))
    got = fleet.counted_once(args, DEVICES, tmp_path)
    assert got == problem if problem is None else problem in got, got
