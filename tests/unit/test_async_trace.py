"""The plumbing of benchmarks/bench_async.py: seeded availability traces (the share online, the
same trace for the same seed), and the accounting of device training against the aggregator's
records (folded, refused, lost, double counted) on hand-made cases.  Its runs are benchmarks."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
at = importlib.import_module("async_trace")


def test_a_trace_is_online_its_share_of_the_time_in_sessions_of_its_mean_length() -> None:
    sessions = at.trace(200_000, 0.3, 20.0, seed=3)
    assert at.online_fraction(sessions, 200_000) == pytest.approx(0.3, abs=0.02)
    lengths = [end - start for start, end in sessions[:-1]]
    assert sum(lengths) / len(lengths) == pytest.approx(20.0, rel=0.1)
    assert all(a_end < b_start for (_, a_end), (b_start, _) in zip(sessions, sessions[1:]))  # apart, in order


def test_a_seed_gives_one_trace_and_devices_get_their_own() -> None:
    devices = [f"client-{i}" for i in range(5)]
    first = at.traces(devices, 600, 0.3, 20.0, seed=1)
    assert first == at.traces(devices, 600, 0.3, 20.0, seed=1)
    assert first != at.traces(devices, 600, 0.3, 20.0, seed=2)
    assert len({tuple(s) for s in first.values()}) == 5


def test_online_at_follows_the_sessions() -> None:
    sessions = [(0.0, 5.0), (10.0, 12.5)]
    assert [at.online_at(sessions, t) for t in (0.0, 4.9, 5.0, 7.0, 10.0, 12.4, 12.5, 99.0)] == [
        True,
        True,
        False,
        False,
        True,
        True,
        False,
        False,
    ]
    assert at.online_fraction(sessions, 20.0) == pytest.approx(7.5 / 20.0)


@pytest.mark.parametrize("share, mean", [(0.0, 20.0), (1.0, 20.0), (0.3, 0.0)])
def test_a_trace_that_cannot_be_is_refused(share, mean) -> None:
    with pytest.raises(ValueError, match="online_share"):
        at.trace(100, share, mean, seed=0)


def test_outcomes_count_what_became_of_each_round_of_training() -> None:
    trained = {"a": {0, 1, 2, 3}, "b": {0, 2}}
    sent = {"a": {0, 1, 2, 3}, "b": {0, 2}}
    folded = [("a", 0), ("a", 1), ("b", 0)]
    refused = [("a", 2, "stale"), ("b", 2, "late"), ("b", 2, "duplicate")]  # b's update sent twice
    fate = at.outcomes(trained, sent, folded, refused, after_end={("a", 3)})
    assert (fate.trained, fate.folded, fate.lost, fate.after_end, fate.double_counted) == (6, 3, 0, 1, 0)
    assert fate.training_used_share == pytest.approx(0.5)
    assert fate.refused == {"duplicate": 1, "late": 1, "stale": 1}


def test_an_update_without_any_record_is_lost_and_a_second_fold_is_double_counted() -> None:
    trained = {"a": {0, 1}, "b": {0}}
    sent = {"a": {0, 1}, "b": {0}}
    fate = at.outcomes(trained, sent, folded=[("a", 0), ("a", 0), ("b", 5)], refused=[])
    assert fate.lost == 2  # a's round 1 and b's round 0: nobody says what became of them
    assert fate.double_counted == 2  # a's round 0 twice, and b's round 5 it never trained
    assert fate.folded == 1


def test_the_records_are_read_from_the_journal_and_the_device_meter() -> None:
    events = [
        {"event": "round_client", "round": 4, "client": "a", "status": "accepted", "trained_on": 2},
        {"event": "round_client", "round": 4, "client": "b", "status": "accepted"},
        {"event": "round_client", "round": 4, "client": "c", "status": "missing"},
        {"event": "rejected", "reason": "stale", "client": "c", "frame": {"kind": "UPDATE", "round": 1}},
        {"event": "rejected", "reason": "codec", "client": "c", "frame": None},
        {"event": "rejected", "reason": "kind", "client": "c", "frame": {"kind": "EVAL", "round": 9}},
    ]
    assert at.aggregator_records(events) == ([("a", 2), ("b", 4)], [("c", 1, "stale")])
    wire = {
        "round_cpu_s": {"0": 0.1, "3": 0.2},
        "by_tag": {"up:update:0": {}, "up:resend:3": {}, "up:eval:4": {}, "up:status": {}, "down:round": {}},
    }
    assert at.device_records(wire) == ({0, 3}, {0, 3})


def test_a_version_metric_is_its_nll_on_the_last_task_and_the_target_time_its_publication() -> None:
    events = [
        {"event": "eval", "client": "a", "round": -1, "task": 0, "nll": [40.0]},
        {"event": "eval", "client": "a", "round": 1, "task": 0, "nll": [30.0]},  # task 0's version: not counted
        {"event": "eval", "client": "a", "round": 2, "task": 1, "nll": [None, 28.0]},
        {"event": "eval", "client": "a", "round": 3, "task": 1, "nll": [29.0, 27.0]},
        {"event": "eval", "client": "b", "round": 3, "task": 1, "nll": [29.0, 27.0]},
        {"event": "eval", "client": "b", "round": 5, "task": 1, "nll": [None, 25.0]},
        {"event": "eval", "client": "b", "round": 6, "task": 1, "nll": [27.0, float("nan")]},  # not a number
    ]
    metrics = at.version_metrics(events, task=1)
    assert metrics == {2: 28.0, 3: 27.0, 5: 25.0}
    assert at.all_tasks_metric(events, 3, tasks=2) == 28.0
    assert at.all_tasks_metric(events, 5, tasks=2) is None  # nobody evaluated it on both tasks
    published = {2: 30.0, 3: 40.0, 4: 50.0, 5: 61.0}
    assert at.time_to_target(published, metrics, 27.5) == 40.0
    assert at.time_to_target(published, metrics, 26.0) == 61.0
    assert at.time_to_target(published, metrics, 20.0) is None
