"""The end of a run and a stopped aggregator, with separate ``fcl aggregator`` / ``fcl client``
processes on a real Mosquitto (issues 41 and 42).

* The aggregator killed (-9) or stopped (SIGTERM) between FINISH and its end commit, with some
  final evaluations in and one still to come: the restart takes the journaled ones back, the
  devices hold theirs until the end is committed, and the run ends with the undisturbed run's
  numbers (a stop exits 130 and commits nothing it did not finish).
* SIGINT while the aggregator waits for its devices: exit 130 at once, no failure announced,
  ``summary.json`` says ``interrupted`` (``fcl report`` warns); a restart continues the same run.
* A device that comes online after its run ended exits ``RUN_ENDED``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from support.fleet import QUICK_OVERRIDES as OVERRIDES
from support.fleet import QUICK_SCENARIO as SCENARIO
from support.fleet import Fleet, matrices
from support.timescale import scaled

from aggregator.state import StateStore
from fclcore.exitcodes import ExitCode

ROUNDS = 8  # QUICK_OVERRIDES: 2 tasks x 4 rounds


def closed(fleet: Fleet, rnd: int) -> bool:
    return any(e["round"] == rnd for e in fleet.events("round"))


def wait_until(predicate, timeout: float, what: str, poll: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(poll)
    raise AssertionError(f"{what} did not happen in {timeout} s")


@pytest.mark.parametrize("how", ["kill", "sigterm"])
def test_the_final_evaluation_survives_the_aggregator_dying_at_the_end(
    how, mosquitto, tmp_path, repo_root, quickstart_reference
) -> None:
    fleet = Fleet(repo_root / SCENARIO, tmp_path / "run", mosquitto.url, OVERRIDES)
    try:
        fleet.start_all()
        store, late = StateStore(tmp_path / "run/state"), "client-2"
        wait_until(  # its last update is in (the round closes as soon as the others' are too)
            lambda: late in store.journaled_clients(ROUNDS - 1) or closed(fleet, ROUNDS - 1),
            240,
            "its last update",
            poll=0.005,
        )
        with fleet.paused(late):  # it has not evaluated the final model yet: that comes after the aggregator died
            wait_until(lambda: len(store.journaled_clients(ROUNDS)) == 2, 120, "two final evaluations")
            assert store.journaled_clients(ROUNDS) == ["client-0", "client-1"]
            if how == "kill":
                fleet.kill("aggregator")
            else:
                os.kill(fleet.procs["aggregator"].pid, signal.SIGTERM)
                assert fleet.procs["aggregator"].wait(60) == ExitCode.INTERRUPTED
        first = fleet.summary() if how == "sigterm" else None
        time.sleep(1.0)  # the paused device sends its evaluation meanwhile, to nobody
        fleet.start("aggregator")
        codes = fleet.wait()
        assert set(codes.values()) == {0}, (codes, fleet.logs())
        log2 = (tmp_path / "run/logs/aggregator.2.log").read_text()
        assert "2 final evaluation(s) recovered from the journal" in log2, log2[-3000:]
        summary = fleet.summary()
        assert summary["status"] == "complete" and summary["missing_final_evaluations"] == []
        assert matrices(summary) == quickstart_reference  # the same final metrics as an undisturbed run
        assert not fleet.events("failed")
        if first is not None:  # the stop committed nothing and said so
            assert first["status"] == "interrupted" and first["missing_final_evaluations"] == [late]
            assert "stopped during the final evaluation" in (tmp_path / "run/logs/aggregator.1.log").read_text()
    finally:
        fleet.stop()


def test_sigint_while_waiting_for_devices_stops_and_the_restart_continues_the_run(
    mosquitto, tmp_path, repo_root, quickstart_reference
) -> None:
    fleet = Fleet(repo_root / SCENARIO, tmp_path / "run", mosquitto.url, OVERRIDES)
    try:
        fleet.start("aggregator")
        fleet.wait_for_log("aggregator", "(new)")
        time.sleep(1.0)
        started = time.monotonic()
        os.kill(fleet.procs["aggregator"].pid, signal.SIGINT)
        assert fleet.procs["aggregator"].wait(60) == ExitCode.INTERRUPTED
        assert time.monotonic() - started < 30
        log1 = (tmp_path / "run/logs/aggregator.1.log").read_text()
        assert "stopped while waiting for devices" in log1 and "online after" not in log1
        run_id = re.search(r"run (\S+) of quickstart \(new\)", log1).group(1)
        assert not fleet.events("failed")  # no failed FINISH: devices started now take part
        assert fleet.summary()["status"] == "interrupted"
        report = subprocess.run(
            [sys.executable, "-m", "fcl_edge.cli", "report", str(tmp_path / "run"), "--out", str(tmp_path / "rep")],
            capture_output=True,
            text=True,
            timeout=scaled(300),
        )
        assert report.returncode == 0, report.stderr
        assert "warning: run run is interrupted" in report.stderr
        assert "**Warning**: run run is interrupted" in (tmp_path / "rep/report.md").read_text()

        fleet.start_all()
        codes = fleet.wait()
        assert set(codes.values()) == {0}, (codes, fleet.logs())
        assert f"run {run_id} of quickstart (resumed)" in (tmp_path / "run/logs/aggregator.2.log").read_text()
        summary = fleet.summary()
        assert summary["status"] == "complete" and summary["run"] == run_id
        assert matrices(summary) == quickstart_reference

        # a device that comes online after the run ended: it exits RUN_ENDED, not waiting forever
        kind, path = fleet.configs["client-0"]
        cfg = yaml.safe_load(path.read_text())
        late = {**cfg, "state_dir": str(tmp_path / "late/state"), "out_dir": str(tmp_path / "late"), "run_over_s": 1}
        (tmp_path / "late.yaml").write_text(yaml.safe_dump(late))
        proc = subprocess.run(
            [sys.executable, "-m", "fcl_edge.cli", kind, "--config", str(tmp_path / "late.yaml")],
            capture_output=True,
            text=True,
            timeout=scaled(120),
        )
        assert proc.returncode == ExitCode.RUN_ENDED, proc.stderr[-2000:]
        assert "ended before this device took part" in proc.stderr
    finally:
        fleet.stop()


def test_summary_status_names_a_run_that_is_not_complete(tmp_path) -> None:
    """The summary of a run stopped before it finished says so (read as ``fcl report`` reads it)."""
    from fcl_edge.report import run_warnings

    runs = {
        "a": ({"status": "complete", "missing_final_evaluations": []}, []),
        "b": ({"status": "interrupted", "missing_final_evaluations": ["c1"]}, []),
        "c": ({"status": "failed"}, []),
        "d": ({}, []),  # written before summaries had a status
    }
    lines = run_warnings(runs)
    assert [line.split(" ")[1].rstrip(":") for line in lines] == ["b", "b", "c"]
    assert "no final evaluation from c1" in json.dumps(lines)


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_sigterm_to_fcl_simulate_stops_its_processes(tmp_path, repo_root) -> None:
    """Issue 41: SIGTERM to ``fcl simulate`` used to leave the aggregator and devices running."""
    out = tmp_path / "run"
    sim = subprocess.Popen(
        [sys.executable, "-m", "fcl_edge.cli", "simulate", str(repo_root / SCENARIO), "--out", str(out)]
        + [a for o in OVERRIDES for a in ("--set", o)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(lambda: len(_children(sim.pid)) >= 5, 120, "broker, aggregator and 3 devices started")
        children = _children(sim.pid)
        wait_until(lambda: any(out.rglob("aggregator.log")), 60, "the aggregator's log")
        sim.send_signal(signal.SIGTERM)
        assert sim.wait(120) == ExitCode.INTERRUPTED, sim.stderr.read()[-2000:]
        wait_until(lambda: not any(_alive(pid) for pid in children), 30, "every process of the run stopped")
    finally:
        for pid in _children(sim.pid):
            os.kill(pid, signal.SIGKILL)
        sim.kill()
        sim.wait(10)
