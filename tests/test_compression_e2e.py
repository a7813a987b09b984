"""End to end over a real Mosquitto: NGFL's smoke scenario with the compression stage off and
with its default (top-k with error feedback both ways).  The compressed run's extractor
crosses the broker as sparse ``@delta`` tensors, every update is accepted, every device's
model verifies by hash (no resync), and the run moves fewer bytes each way."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import run_fcl
from support.listener import Listener

import methods
from fclcore import topics
from fclcore.codec import SparseTensor
from fclcore.sparsify import DELTA

FED = "compress-e2e"


def _run(mosquitto, out: Path, repo_root: Path, *extra: str) -> tuple[dict, list]:
    spec = methods.lookup("ngfl")
    listener = Listener(mosquitto.port)
    sets = [item for o in (*spec.smoke_overrides, f"federation.name={FED}", *extra) for item in ("--set", o)]
    result = run_fcl(
        "simulate", str(repo_root / spec.example_scenario), "--out", str(out), "--broker", mosquitto.url, *sets
    )
    listener.stop()
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((out / "summary.json").read_text()), listener.frames


def test_ngfl_compressed_both_ways_moves_fewer_bytes_through_mosquitto(mosquitto, tmp_path: Path, repo_root: Path):
    dense, _ = _run(
        mosquitto, tmp_path / "off", repo_root, "federation.wire.sparsify=none", "federation.wire.down_sparsify=none"
    )
    small, frames = _run(mosquitto, tmp_path / "on", repo_root)
    updates = [f for topic, f in frames if topic.startswith(topics.update_topic(FED, "")) and f.tensors]
    assert updates and all(
        isinstance(t, SparseTensor) for f in updates for name, t in f.tensors.items() if name.endswith(DELTA)
    )
    assert all(any(name.endswith(DELTA) for name in f.tensors) for f in updates)
    events = [json.loads(line) for line in (tmp_path / "on" / "metrics.jsonl").read_text().splitlines()]
    accepted = [e for e in events if e["event"] == "round_client" and e["status"] == "accepted"]
    assert len(accepted) == small["rounds"] * small["clients"]
    assert not small["bytes"]["syncs"]  # every announcement's hash verified on every device
    for way in ("up_total", "down_total"):
        assert small["bytes"][way] < dense["bytes"][way], way
    assert small["bytes"]["up_total"] < 0.2 * dense["bytes"]["up_total"]
