"""Waiting for replies alone, with a scripted intake: a round is complete when its roster
replied, or its quorum did and the rest are gone; the missing are asked again every
``resend_after_s``; the deadline ends the wait; too few devices online fail the start."""

from __future__ import annotations

import threading
import time

import pytest
from support.agg_parts import FED, RecordingLink, federation

from aggregator.clients import ClientSet
from aggregator.collector import Collector
from aggregator.outbox import Outbox
from fclcore.codec import Kind
from fclcore.errors import NotEnoughClients


class ScriptedIntake:
    """Hands out the scripted replies one per ``drain``; waits out the timeout when none is left."""

    def __init__(self, clients: ClientSet, replies: list[str], online: list[str] = ()) -> None:
        self.clients, self.replies, self.online = clients, list(replies), list(online)

    def drain(self, open_round, received, timeout, model, kind=Kind.UPDATE) -> None:
        if self.online:
            self.clients.on_status(self.online.pop(0), "online")
        elif self.replies:
            received[self.replies.pop(0)] = object()
        else:
            time.sleep(timeout)


class Requests:
    def __init__(self) -> None:
        self.asked: list[tuple[Kind, int, list[str]]] = []

    def request(self, kind: Kind, rnd: int, missing: list[str]) -> None:
        self.asked.append((kind, rnd, missing))


def _collector(replies: list[str], online: list[str] = (), **rounds) -> tuple[Collector, Requests, list[int]]:
    fed, _ = federation(**rounds)
    clients = ClientSet(["a", "b", "c", "d"])
    requests, beats = Requests(), []
    intake = ScriptedIntake(clients, replies, online)
    outbox = Outbox(RecordingLink(), FED, "run-1")
    beat = lambda: beats.append(1)  # noqa: E731
    return Collector(fed.rounds, clients, intake, requests, outbox, threading.Event(), beat), requests, beats


def test_a_round_is_complete_when_its_roster_replied() -> None:
    collector, requests, beats = _collector(["b", "a", "c", "d"])
    received = collector.collect(0, ["a", "b", "c", "d"], {})
    assert set(received) == {"a", "b", "c", "d"} and requests.asked == [] and len(beats) == 4


# docs/protocol.md P-11.2
def test_with_the_quorum_in_the_gone_are_not_waited_for() -> None:
    collector, _, _ = _collector([], quorum=0.5)
    collector.clients.online = {"a", "b"}  # c and d are stopped or dead
    assert not collector.complete({"a": None}, {"a", "b", "c", "d"})  # below the quorum
    assert not collector.complete({"c": None, "d": None}, {"a", "b", "c", "d"})  # a and b are still online
    assert collector.complete({"a": None, "b": None}, {"a", "b", "c", "d"})
    assert collector.quorum(4) == 2


# docs/protocol.md P-8.6, P-11.2
def test_the_missing_are_asked_again_until_the_deadline() -> None:
    collector, requests, _ = _collector(["a"], deadline_s=0.5, resend_after_s=0.2)
    started = time.monotonic()
    received = collector.collect(3, ["a", "b"], {}, kind=Kind.EVAL)
    assert 0.5 <= time.monotonic() - started < 5
    assert set(received) == {"a"}
    assert requests.asked and all(asked == (Kind.EVAL, 3, ["b"]) for asked in requests.asked)


# docs/protocol.md P-10.2
def test_the_start_waits_for_the_roster_and_fails_below_the_quorum() -> None:
    collector, _, _ = _collector([], online=["a", "c"], start_timeout_s=0.3)
    collector.wait_online({"a", "c"}, -1, {}, {})
    assert collector.clients.online == {"a", "c"}
    collector, _, _ = _collector([], online=["a"], start_timeout_s=0.3, quorum=0.75)
    with pytest.raises(NotEnoughClients, match="1 of 4 clients online after 0 s; quorum needs 3"):
        collector.wait_online({"a", "b", "c", "d"}, -1, {}, {})


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_request_waits_until_the_update_is_overdue_by_the_rounds_own_timing() -> None:
    from aggregator.collector import ResendClock

    clock = FakeClock()
    resend = ResendClock(10.0, clock).open(0)
    clock.now += 10.0
    assert resend.due()  # nothing known yet: resend_after_s
    clock.now += 30.0  # the first update arrives 40 s into the round: devices train for long
    resend.arrived(1)
    assert not resend.due()  # 40 s in, the median arrival is 40 s: the others are not overdue yet
    clock.now += 39.9
    assert not resend.due()
    clock.now += 0.2  # past twice the median
    assert resend.due()
    resend.asked()
    clock.now += 5.0
    assert not resend.due()  # then every resend_after_s
    clock.now += 5.0
    assert resend.due()
    resend.close()
    resend.open(0)  # the next round starts from what the last one measured (median 40 s)
    clock.now += 79.0
    assert not resend.due()
    clock.now += 1.5
    assert resend.due()


def test_long_server_work_says_it_is_still_running(caplog) -> None:
    from aggregator.progress import still_working

    with caplog.at_level("INFO", logger="aggregator.progress"):
        with still_working("round 3: aggregating", every_s=0.05):
            time.sleep(0.3)
        quiet = len(caplog.records)
        with still_working("round 4: aggregating", every_s=5.0):
            pass
    lines = [r.getMessage() for r in caplog.records]
    assert quiet >= 2 and all(line.startswith("round 3: aggregating: still running") for line in lines), lines
    assert len(lines) == quiet  # work shorter than every_s says nothing
