"""The availability benchmark's smoke run (benchmarks/bench_async.py, tiny): four devices behind
relays that follow their seeded traces, over a real Mosquitto, once in synchronous and once in
buffered rounds; both runs finish, their result file has the issue's shape, and every update a
device trained is accounted for (folded, refused with a reason, or sent after the run's end),
none lost, none folded twice.  Four minutes at a load average of 20: slow."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.timescale import scaled

ROOT = Path(__file__).resolve().parents[2]
KEYS = {"time_to_target_s", "final_metric", "bytes_up", "bytes_down", "training_used_share"}


@pytest.mark.slow
def test_a_tiny_trace_runs_both_modes_and_accounts_for_every_update(tmp_path: Path) -> None:
    out = tmp_path / "async.json"
    argv = [sys.executable, str(ROOT / "benchmarks/bench_async.py"), "--devices", "4", "--online-share", "0.5"]
    argv += ["--mean-online-s", "5", "--train-s", "1", "--rounds-per-task", "2", "--versions-per-task", "3"]
    argv += ["--buffer-k", "2", "--deadline-s", "15", "--timeout", "200", "--out", str(out)]
    argv += ["--keep", str(tmp_path / "runs")]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=scaled(600))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result) >= {"sync", "buffered", "target_metric", "devices", "online_share", "lost_updates"}
    assert set(result["sync"]) == KEYS and set(result["buffered"]) == KEYS
    assert (result["lost_updates"], result["double_counted"], result["devices"]) == (0, 0, 4)
    for mode, versions in (("sync", 4), ("buffered", 6)):
        run = result["details"][mode]
        assert run["aggregator_exit"] == 0 and run["versions"] == versions, run
        assert result[mode]["final_metric"] is not None
        accounted = run["device_rounds_folded"] + sum(run["refused"].values()) + run["after_end"]
        assert run["device_rounds_trained"] <= accounted  # a re-sent update may be refused once more
        assert 0 < result[mode]["training_used_share"] <= 1
    assert result["sync"]["time_to_target_s"] is not None  # its own final version meets its target
    assert "| training used share |" in out.with_suffix(".md").read_text()
