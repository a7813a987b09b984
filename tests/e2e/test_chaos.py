"""One chaos schedule per fault kind, with the harness of benchmarks/bench_chaos.py (which runs
many seeded ones): separate aggregator and device processes on a Mosquitto with persistence,
one fault injected, then the checks against an undisturbed run of the same scenario: every
process exits 0, no update lost, none counted twice, no forged or replayed frame accepted, and
the committed global model is bit-identical to the undisturbed run's."""

from __future__ import annotations

import importlib
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
chaos = importlib.import_module("bench_chaos")

pytestmark = pytest.mark.slow
TIMEOUT = 60.0  # a schedule still running then is hung (an undisturbed run takes ~6-10 s)

# One representative schedule per kind: the seed draws the rest, the forced parameters pin the
# variant (restarted rather than permanently dead devices: those take 16 s of round deadlines).
CASES = {
    "aggregator_kill": (1, {"kills": [{"round": 1, "frac": 0.5, "down_s": 0.5}]}),
    "device_kill_training": (2, {"client": "client-1", "round": 2, "frac": 0.3, "permanent": False, "down_s": 0.3}),
    "device_kill_upload": (3, {"client": "client-2", "round": 1, "when": "after", "permanent": False, "down_s": 0.3}),
    "broker_kill": (4, {"kills": [{"round": 2, "frac": 0.5, "down_s": 1.5}]}),
    "stale_retained": (
        5,
        {"old": "aborted", "abort_round": 1, "abort_frac": 0.5, "broker_restart": True, "devices_first": True},
    ),
    "duplicate_delayed": (6, {"p_now": 1.0, "p_later": 1.0, "delay_s": [0.3, 3.0], "copies_max": 2}),
    "forged_replayed": (
        7,
        {"future_rounds": [0, 2], "old_seq_rounds": [1, 3], "old_seq_source": "this_run", "future_eval": True},
    ),
    # issue 42: the end of a run, forged run ids, late devices, retained garbage
    "end_interrupted_kill": (8, {"signal": "kill", "client": "client-2", "down_s": 0.5}),
    "end_interrupted_term": (9, {"signal": "term", "client": "client-0", "down_s": 0.5}),
    "forged_run": (10, {"round": 1, "run": "far_future", "copies": 2}),
    "forged_run_newer": (11, {"round": 2, "run": "newer", "copies": 1}),
    "late_device": (12, {"client": "client-1"}),
    "garbage_retained": (13, {"round": 2, "client": "client-1", "frac": 0.2, "garbage_bytes": 64}),
}


@pytest.fixture(scope="module")
def chaos_plan():
    if shutil.which("mosquitto") is None and not Path("/usr/sbin/mosquitto").exists():
        pytest.skip("mosquitto is not installed (apt-get install mosquitto); .ci/run installs it")
    return chaos.chaos_plan()


@pytest.fixture(scope="module")
def reference(chaos_plan, tmp_path_factory):
    return chaos.run_reference(chaos_plan, tmp_path_factory.mktemp("chaos-reference"), timeout=TIMEOUT)


def test_schedules_are_seeded() -> None:
    """The same seed gives the same schedule; the default set covers every kind."""
    clients = ["client-0", "client-1", "client-2"]
    first = chaos.schedules_for(14, 5, chaos.KINDS, 4, clients)
    assert first == chaos.schedules_for(14, 5, chaos.KINDS, 4, clients)
    assert first != chaos.schedules_for(14, 6, chaos.KINDS, 4, clients)
    assert {s.kind for s in first} == set(chaos.KINDS)


@pytest.mark.parametrize("kind", list(CASES))
def test_one_schedule_per_fault_kind(kind, chaos_plan, reference, tmp_path) -> None:
    seed, force = CASES[kind]
    fault = next(k for k in chaos.KINDS if kind.startswith(k))
    schedule = chaos.make_schedule(fault, seed, reference.rounds, reference.clients, **force)
    timeout = TIMEOUT + (chaos.LATE_RUN_OVER_S + 25 if kind == "late_device" else 0)  # it starts after the run
    result = chaos.run_schedule(schedule, chaos_plan, reference, tmp_path / "chaos", timeout)
    report = result.to_json()
    assert result.outcome == "finished", report
    assert result.lost == [], report
    assert result.double == [], report
    assert result.hash_match is True, report
    if kind in ("aggregator_kill", "device_kill_training", "device_kill_upload", "broker_kill"):
        assert any("kill -9" in note for note in result.notes), report  # the fault did happen
    if kind in ("duplicate_delayed", "forged_replayed"):
        assert sum(result.injected.values()) >= 4, report
        assert sum(result.rejected.values()) >= 4, report  # what reached the aggregator was dropped
    if kind == "forged_replayed":
        assert result.injected.get("forged-future", 0) == 2 and result.injected.get("forged-old-sequence", 0) == 2
    if kind == "stale_retained":
        assert any("earlier run killed" in note for note in result.notes), report
    if kind.startswith("end_interrupted"):  # the fault landed in the window: one evaluation not yet sent
        assert any("final evaluation not sent" in note for note in result.notes), report
    if kind.startswith("forged_run"):
        assert sum(result.injected.values()) == force["copies"], report
    if kind == "late_device":
        assert result.codes.get("late") == chaos.RUN_ENDED, report
    if kind == "garbage_retained":
        assert result.injected == {"garbage-retained": 1} and result.stalled == [], report


# docs/protocol.md, P-SEQ-1 to P-SEQ-5: no wall clock orders frames, so a clock that steps mid-run (the
# process's time.time/time_ns shifted by benchmarks/clock_shim.py) changes nothing: every run
# finishes with the undisturbed model, and nothing is rejected for its sequence.
CLOCK_CASES = [
    ("device_clock_training", {"client": "client-0", "round": 1, "frac": 0.3, "step_s": 3600}),
    ("device_clock_training", {"client": "client-1", "round": 2, "frac": 0.3, "step_s": -3600}),
    ("device_clock_upload", {"client": "client-2", "round": 1, "when": "before", "lead_s": 0.02, "step_s": -3600}),
    ("device_clock_upload", {"client": "client-0", "round": 2, "when": "after", "lead_s": 0.0, "step_s": 3600}),
    ("aggregator_clock", {"round": 1, "frac": 0.5, "step_s": -120}),
    ("aggregator_clock", {"round": 2, "frac": 0.5, "step_s": 3600}),
]


@pytest.mark.parametrize(("kind", "force"), CLOCK_CASES, ids=[f"{k}{f['step_s']:+d}" for k, f in CLOCK_CASES])
def test_a_wall_clock_step_changes_nothing(kind, force, chaos_plan, reference, tmp_path) -> None:
    schedule = chaos.make_schedule(kind, 11, reference.rounds, reference.clients, **force)
    result = chaos.run_schedule(schedule, chaos_plan, reference, tmp_path / "chaos", TIMEOUT)
    report = result.to_json()
    assert any("wall clock stepped" in note for note in result.notes), report  # the step did happen
    assert result.outcome == "finished" and result.lost == [] and result.double == [], report
    assert result.hash_match is True, report
    assert not {"sequence", "replay"} & set(result.rejected), report
