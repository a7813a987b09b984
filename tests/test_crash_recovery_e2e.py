"""Crash, restart and outage tests with separate ``fcl aggregator`` / ``fcl client`` processes
on a real Mosquitto: the aggregator and a client are SIGKILLed mid-run and restarted, and
the broker is stopped and restarted mid-run.  Every run must end with exactly the numbers of
an undisturbed run (training is deterministic), no round counted twice and none lost."""

from __future__ import annotations

import collections
import time
from pathlib import Path

import pytest

from support.fleet import Fleet

SCENARIO = "configs/scenarios/quickstart.yaml"
OVERRIDES = ["federation.rounds_per_task=4", "federation.rounds.resend_after_s=2",
             "federation.rounds.deadline_s=90"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, repo_root_module) -> dict:
    """The undisturbed run's per-client NLL matrices."""
    from support.mosquitto import Mosquitto
    work = tmp_path_factory.mktemp("reference")
    broker = Mosquitto(work / "broker").start()
    fleet = Fleet(repo_root_module / SCENARIO, work / "run", broker.url, OVERRIDES)
    try:
        fleet.start_all()
        assert set(fleet.wait().values()) == {0}, fleet.logs()
        return _matrices(fleet.summary())
    finally:
        fleet.stop()
        broker.stop()


@pytest.fixture(scope="module")
def repo_root_module() -> Path:
    return Path(__file__).resolve().parent.parent


def _matrices(summary: dict) -> dict:
    return {c: v["nll_matrix"] for c, v in summary["final"]["per_client"].items()}


def _assert_each_round_once(fleet: Fleet, rounds: int, clients: int) -> None:
    per_round = collections.Counter(e["round"] for e in fleet.events("round"))
    assert per_round == {r: 1 for r in range(rounds)}, per_round
    pairs = collections.Counter((e["round"], e["client"]) for e in fleet.events("round_client"))
    assert set(pairs.values()) == {1} and len(pairs) == rounds * clients
    assert all(e["status"] == "accepted" for e in fleet.events("round_client"))


def test_aggregator_and_client_killed_mid_round_resume(mosquitto, tmp_path, repo_root, reference) -> None:
    fleet = Fleet(repo_root / SCENARIO, tmp_path / "run", mosquitto.url, OVERRIDES)
    try:
        fleet.start_all()
        fleet.wait_for_round(1)
        time.sleep(0.3)  # into round 2: some updates in, some not
        fleet.kill("aggregator")
        time.sleep(1.0)  # clients keep publishing into the void meanwhile
        fleet.start("aggregator")
        fleet.wait_for_round(4)
        time.sleep(0.2)
        fleet.kill("client-1")  # mid-training or mid-upload
        fleet.start("client-1")
        codes = fleet.wait()
        assert set(codes.values()) == {0}, (codes, fleet.logs())
        assert "resuming quickstart after committed round" in (tmp_path / "run/logs/aggregator.2.log").read_text()
        assert "resuming after round" in (tmp_path / "run/logs/client-1.2.log").read_text()
        _assert_each_round_once(fleet, rounds=8, clients=3)
        assert _matrices(fleet.summary()) == reference
    finally:
        fleet.stop()


@pytest.mark.parametrize("how", ["stop", "kill"])
def test_broker_restarted_mid_round(how, mosquitto, tmp_path, repo_root, reference) -> None:
    fleet = Fleet(repo_root / SCENARIO, tmp_path / "run", mosquitto.url, OVERRIDES)
    try:
        fleet.start_all()
        fleet.wait_for_round(2)
        time.sleep(0.2)
        getattr(mosquitto, how)()  # retained messages and in-flight updates are gone (no persistence)
        time.sleep(2.0)
        mosquitto.restart()
        codes = fleet.wait()
        assert set(codes.values()) == {0}, (codes, fleet.logs())
        _assert_each_round_once(fleet, rounds=8, clients=3)
        assert _matrices(fleet.summary()) == reference
    finally:
        fleet.stop()
