"""Crash, restart and outage tests with separate ``fcl aggregator`` / ``fcl client`` processes
on a real Mosquitto: the aggregator and a client are SIGKILLed mid-run and restarted, and
the broker is stopped and restarted mid-run.  Every run must end with exactly the numbers of
an undisturbed run (training is deterministic), no round counted twice and none lost; an
aggregator started again after the end leaves at once."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from support.fleet import QUICK_OVERRIDES as OVERRIDES
from support.fleet import QUICK_SCENARIO as SCENARIO
from support.fleet import Fleet, assert_each_round_once, matrices


def test_aggregator_and_client_killed_mid_round_resume(mosquitto, tmp_path, repo_root, quickstart_reference) -> None:
    fleet = Fleet(repo_root / SCENARIO, tmp_path / "run", mosquitto.url, OVERRIDES)
    try:
        fleet.start_all()
        fleet.wait_for_round(1)  # round 2 is open: some updates in, some not (rounds take ~0.1 s)
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
        assert_each_round_once(fleet, rounds=8, clients=3)
        assert matrices(fleet.summary()) == quickstart_reference
        assert_a_restart_after_the_end_announces_it_again_and_exits(fleet, tmp_path / "run", "aggregator.3.log")
    finally:
        fleet.stop()


def assert_a_restart_after_the_end_announces_it_again_and_exits(fleet: Fleet, run: Path, log: str) -> None:
    """An aggregator started again on a finished federation's state re-announces FINISH and
    exits 0 at once (it used to wait for devices that had gone, then exit 4), leaving the
    run's summary as it was.  (On the finished run of the test above: one run less to wait for.)"""
    summary = (run / "summary.json").read_text()
    fleet.start("aggregator")
    assert fleet.procs["aggregator"].wait(30) == 0
    assert "finished before this start" in (run / "logs" / log).read_text()
    assert (run / "summary.json").read_text() == summary


@pytest.mark.parametrize("how", ["stop", "kill"])
def test_broker_restarted_mid_round(how, mosquitto, tmp_path, repo_root, quickstart_reference) -> None:
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
        assert_each_round_once(fleet, rounds=8, clients=3)
        assert matrices(fleet.summary()) == quickstart_reference
    finally:
        fleet.stop()
