"""End to end over a real Mosquitto: NGFL's smoke scenario with the compression stage off and
with its default (top-k with error feedback both ways).  The compressed run's extractor
crosses the broker as sparse ``@delta`` tensors, every update is accepted, every device's
model verifies by hash (no resync), and the run moves fewer bytes each way; a device and the
aggregator killed mid-run end with the undisturbed run's numbers."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from conftest import run_fcl
from support.fleet import Fleet, assert_each_round_once
from support.listener import Listener

import methods
from aggregator.state import StateStore
from fclcore import topics
from fclcore.codec import SparseTensor
from fclcore.sparsify import DELTA

FED = "compress-e2e"


def _run(mosquitto, out: Path, repo_root: Path, *extra: str) -> tuple[dict, list]:
    spec = methods.lookup("ngfl")
    listener = Listener(mosquitto.port)
    overrides = (*spec.smoke_overrides, "clients=2", f"federation.name={FED}", *extra)  # the scenario's 5: 2 will do
    sets = [item for o in overrides for item in ("--set", o)]
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


def _fleet_run(mosquitto, out: Path, repo_root: Path, disturb) -> tuple[dict, dict]:
    spec = methods.lookup("ngfl")
    overrides = [
        *spec.smoke_overrides,
        "federation.task_rounds=[3, 3]",
        "federation.options.base_rounds=3",
        "federation.options.rounds_per_task=3",
        "federation.rounds.resend_after_s=2",
        "clients=3",
    ]
    fleet = Fleet(repo_root / spec.example_scenario, out, mosquitto.url, overrides)
    try:
        fleet.start_all()
        disturb(fleet)
        codes = fleet.wait()
        assert set(codes.values()) == {0}, (codes, fleet.logs())
        assert_each_round_once(fleet, rounds=6, clients=3)
        committed = StateStore(out / "state").load()
        return fleet.summary()["final"]["per_client"], committed.global_params
    finally:
        fleet.stop()


def _kill_mid_run(fleet: Fleet) -> None:
    fleet.wait_for_round(1)
    fleet.kill("client-1")  # its residuals come back from its checkpoint
    fleet.start("client-1")
    fleet.wait_for_round(3)
    fleet.kill("aggregator")  # its true extractor comes back from committed.npz
    time.sleep(1.0)
    fleet.start("aggregator")


# the default suite's 10 min; NGFL compressed through Mosquitto stays: the test above
@pytest.mark.slow
def test_compressed_ngfl_killed_mid_run_ends_with_the_undisturbed_numbers(mosquitto, tmp_path, repo_root):
    """kill -9 of a device and of the aggregator: the device's residuals and the aggregator's
    true extractor are restored bit for bit, so the final model and every device's accuracy
    are those of the undisturbed run."""
    reference, model = _fleet_run(mosquitto, tmp_path / "ref", repo_root, lambda fleet: None)
    killed, again = _fleet_run(mosquitto, tmp_path / "killed", repo_root, _kill_mid_run)
    assert "resuming after round" in (tmp_path / "killed/logs/client-1.2.log").read_text()
    assert "after committed round" in (tmp_path / "killed/logs/aggregator.2.log").read_text()
    assert killed == reference
    assert model.keys() == again.keys() and all(model[k].tobytes() == again[k].tobytes() for k in model)
