"""Waiting for the devices: until they are online at the start, and until a round's replies
(updates, or the final evaluations) are in.

A round is complete when every device of its roster replied; or when the quorum did and the
rest are known to be gone (their status is "stopped" or the last-will "dead"), so waiting for
the deadline is moot.  Devices still missing are asked to re-send every ``resend_after_s``
(their update may have been lost with a broker, or sent while the service was down), and after
a reconnect the service's retained messages are published again.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

from aggregator.announcer import Announcer
from aggregator.clients import ClientSet
from aggregator.intake import Intake, Model
from aggregator.outbox import Outbox
from aggregator.progress import WaitNotice, quorum_count
from fclcore.codec import Kind
from fclcore.errors import NotEnoughClients
from fclcore.schema import RoundSpec
from fclcore.strategy import Update

log = logging.getLogger(__name__)
POLL_S = 0.2


@dataclass
class Collector:
    rounds: RoundSpec
    clients: ClientSet
    intake: Intake
    announcer: Announcer
    outbox: Outbox
    stop: threading.Event
    beat: Callable[[], None] = lambda: None  # called before each message is taken (the service's watchdog)
    resend: "ResendClock" = None  # type: ignore[assignment]  # set in __post_init__

    def __post_init__(self) -> None:
        if self.resend is None:
            self.resend = ResendClock(self.rounds.resend_after_s)

    def quorum(self, enrolled: int) -> int:
        """Updates a round needs: the configured share of the clients enrolled for it, as a count
        (buffered rounds: ``buffer_k``, from whichever devices send them)."""
        if self.rounds.mode == "buffered":
            return self.rounds.buffer_k
        return quorum_count(self.rounds.quorum, enrolled)

    def wait_online(self, expected: set[str], open_round: int, carried: dict[str, Update], model: Model) -> None:
        """Wait for the ``expected`` clients' online status.  After a restart the round in
        progress is open already (its announcement is retained), so updates queued for it are
        taken into ``carried`` here (``open_round``: -1 before the first round)."""
        started = time.monotonic()
        deadline = started + self.rounds.start_timeout_s
        need, notice = self.quorum(len(expected)), WaitNotice("start")
        while not expected <= self.clients.online and time.monotonic() < deadline and not self.stop.is_set():
            self._take(open_round, carried, POLL_S, model, Kind.UPDATE)
            notice.check(expected - self.clients.online, len(expected & self.clients.online), need, len(expected))
        online = len(self.clients.online & expected)
        if self.stop.is_set():  # a stop is not a failed federation: the run stays resumable
            log.info("stopped while waiting for devices (%d/%d online)", online, len(expected))
            return
        if online < need:
            raise NotEnoughClients(
                f"{online} of {len(expected)} clients online after "
                f"{time.monotonic() - started:.0f} s; quorum needs {need}"
            )
        log.info("%d/%d clients online", online, len(expected))

    def collect(
        self,
        rnd: int,
        roster: list[str],
        model: Model,
        received: dict[str, Update] | None = None,
        kind: Kind = Kind.UPDATE,
    ) -> dict[str, Update]:
        """Fill ``received`` until the round is complete or its deadline passes."""
        received = {} if received is None else received
        deadline = time.monotonic() + self.rounds.deadline_s
        resend = self.resend.open(len(received))
        expected = set(roster)
        need = self.quorum(len(expected))
        notice = WaitNotice(f"round {rnd + 1}" if kind is Kind.UPDATE else "final evaluation")
        while not self.complete(received, expected, kind) and time.monotonic() < deadline and not self.stop.is_set():
            self._take(rnd, received, min(POLL_S, max(0.0, deadline - time.monotonic())), model, kind)
            resend.arrived(len(received))
            notice.check(expected - set(received), len(received), need, len(expected))
            self.outbox.republish_after_outage()
            self.outbox.repair()  # a foreign message replaced a retained one (garbage, a forgery)
            if resend.due() and set(received) < expected:
                self.announcer.request(kind, rnd, sorted(expected - set(received)))
                resend.asked()
        resend.close()
        return received

    def complete(self, received: dict[str, Update], expected: set[str], kind: Kind = Kind.UPDATE) -> bool:
        if self.rounds.mode == "buffered" and kind is Kind.UPDATE:
            return len(received) >= self.rounds.buffer_k  # the version is published, whoever is still training
        if set(received) >= expected:
            return True
        return len(received) >= self.quorum(len(expected)) and set(received) >= (expected & self.clients.online)

    def _take(self, open_round: int, received: dict[str, Update], timeout: float, model: Model, kind: Kind) -> None:
        self.beat()
        self.intake.drain(open_round, received, timeout, model, kind)


class ResendClock:
    """When to ask the devices still missing to re-send (a REQUEST): once their update is
    overdue by the round's own timing, not while they may still be training.  Due
    ``resend_after_s`` after the round opened, or at twice the median time the updates in so far
    took to arrive if that is later (this round's, else the last round's that had any: a FedET
    device trains for minutes, a MADE device for a second); then every ``resend_after_s``."""

    def __init__(self, resend_after_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.after, self.clock = resend_after_s, clock
        self.typical: float | None = None  # median arrival (s after opening) of the last round with arrivals
        self.opened, self.seen, self.arrivals, self.next_at = 0.0, 0, [], 0.0

    def open(self, already_in: int) -> "ResendClock":
        self.opened, self.seen, self.arrivals = self.clock(), already_in, []
        self.next_at = self.opened + self.after
        return self

    def arrived(self, count: int) -> None:
        """``count`` replies are in now; the new ones arrived at this time."""
        now = self.clock()
        self.arrivals += [now - self.opened] * max(0, count - self.seen)
        self.seen = max(self.seen, count)

    def _median(self) -> float | None:
        if not self.arrivals:
            return self.typical
        ordered = sorted(self.arrivals)
        return ordered[len(ordered) // 2]

    def due(self) -> bool:
        typical = self._median()
        first = self.opened + max(self.after, 2.0 * typical) if typical is not None else self.opened + self.after
        return self.clock() >= max(self.next_at, first)

    def asked(self) -> None:
        self.next_at = self.clock() + self.after

    def close(self) -> None:
        if self.arrivals:
            self.typical = self._median()
