"""What the aggregator says (aggregator.progress): the quorum as a count, the round line, and
the notice naming the devices it waits for, on a clock the test moves."""

from __future__ import annotations

import logging

import pytest

from aggregator.progress import WaitNotice, byte_totals, quorum_count, round_line


@pytest.mark.parametrize(
    "share, enrolled, need",
    [
        (0.67, 3, 2),  # two thirds, written as 0.67: 2 of 3 meet it
        (0.66, 3, 2),
        (0.34, 3, 2),  # one third does not meet 0.34
        (0.33, 3, 1),
        (1.0, 3, 3),
        (1.0, 300, 300),  # "all" stays all in a large fleet
        (0.9, 1000, 900),  # the slack is never more than half a device
        (0.5, 4, 2),
        (0.5, 5, 3),
        (0.8, 5, 4),
        (0.0, 5, 1),  # at least one update
        (1.0, 0, 1),
    ],
)
def test_quorum_is_a_count(share: float, enrolled: int, need: int) -> None:
    assert quorum_count(share, enrolled) == need


def test_round_line_counts_rounds_from_one_and_names_everything() -> None:
    line = round_line(4, 16, 0, 2, 3, 248_994, 1_251_529, 0.4321)
    assert line == "round 5/16 task 0: 2/3 updates, 249.0 kB up, 1,251.5 kB down, 0.4 s"


def test_byte_totals_sum_the_run_logs_counters() -> None:
    assert byte_totals({"a": {"up": 3, "down": 5, "payload_up": 2}, "b": {"up": 7}}) == (10, 5)


def test_wait_notice_names_the_missing_devices_when_it_is_due(caplog) -> None:
    now = [100.0]
    notice = WaitNotice("start", first_s=3.0, every_s=30.0, clock=lambda: now[0])
    caplog.set_level(logging.INFO, logger="aggregator.progress")
    assert notice.check({"client-2", "client-1"}, 1, 2, 3) is None  # not yet: most waits are short
    now[0] = 103.5
    assert notice.check({"client-2", "client-1"}, 1, 2, 3) == "start: waiting for client-1, client-2 (1/3 in, 2 needed)"
    now[0] = 110.0
    assert notice.check({"client-1", "client-2"}, 1, 2, 3) is None  # the same set: said already
    assert notice.check({"client-2"}, 2, 2, 3) == "start: waiting for client-2 (2/3 in, 2 needed)"  # changed
    now[0] = 141.0
    assert notice.check({"client-2"}, 2, 2, 3) is not None  # still the same after every_s: said again
    assert notice.check(set(), 3, 2, 3) is None  # nobody missing
    assert [r.getMessage() for r in caplog.records] == [
        "start: waiting for client-1, client-2 (1/3 in, 2 needed)",
        "start: waiting for client-2 (2/3 in, 2 needed)",
        "start: waiting for client-2 (2/3 in, 2 needed)",
    ]
