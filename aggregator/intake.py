"""Taking messages into the open round: statuses, updates and evaluations, checked, folded,
journaled.

paho's network thread only puts raw messages on ``queue``; the service's one thread takes them
off here, so no lock guards the model.  Everything is checked by the ``Inbox`` before it can
touch the model.  A strategy whose server step is a weighted sum (``Strategy.streams``) has each
accepted update folded into the round's ``RunningSum`` as it arrives; the round then keeps only
the update's metadata (and what the strategy asks to keep), so it holds O(model) memory.  The
sum lives in memory only: after a restart it is rebuilt from the round's journal, which replays
each accepted update through the same accept path once.
"""

from __future__ import annotations

import logging
import queue
from dataclasses import dataclass
from typing import Callable

import numpy as np

from aggregator.buffered import Buffer
from aggregator.clients import ClientSet
from aggregator.inbox import Inbox, Rejection
from aggregator.metrics import AggregatorMetrics
from aggregator.nacks import Nacks
from aggregator.partial import Sites
from aggregator.progress import still_working
from aggregator.report import RunReport
from aggregator.runlog import RunLog
from aggregator.state import StateStore
from fclcore import topics
from fclcore.aggregation import RunningSum
from fclcore.codec import Kind
from fclcore.strategy import Strategy, Update
from fclcore.transport import parse_status

log = logging.getLogger(__name__)
Model = dict[str, np.ndarray]


@dataclass(frozen=True)
class Incoming:
    topic: str
    payload: bytes
    packet_bytes: int


class Intake:
    def __init__(
        self,
        federation: str,
        strategy: Strategy,
        clients: ClientSet,
        inbox: Inbox,
        sites: Sites,
        store: StateStore,
        runlog: RunLog,
        metrics: AggregatorMetrics,
        report: RunReport,
        nacks: Nacks | None = None,
        buffer: Buffer | None = None,
    ) -> None:
        """``nacks``: where a dropped frame's sender is told why (None: nobody is)."""
        self.federation = federation
        self.strategy = strategy
        self.schedule = strategy.schedule
        self.clients = clients
        self.inbox = inbox
        self.sites = sites  # senders whose frames are partial sums
        self.store = store
        self.runlog = runlog
        self.metrics = metrics
        self.report = report
        self.nacks = nacks
        self.buffer = buffer  # buffered rounds: each update weighed by its staleness as it is folded
        # buffered: (version, client, its second update in that version), at most one per client
        self.held: list[tuple[int, str, Incoming]] = []
        self.queue: queue.Queue[Incoming] = queue.Queue()
        # a streaming strategy's open round: (round, its sums, the clients whose update was folded)
        self.round_sum: tuple[int, RunningSum, set[str]] | None = None
        # topics the service publishes on and listens to, each with what takes its messages
        self.own_topics: dict[str, Callable[[str, bytes], None]] = {}
        # (client, its status) -> why no frame can be made for what it declares, or None (``Variants.on_status``)
        self.declares: Callable[[str, dict], str | None] | None = None
        self.refused: dict[str, str] = {}  # client -> the reason it was refused, told once

    def put(self, topic: str, payload: bytes, packet_bytes: int) -> None:
        """A message from the broker (paho's thread): queued for the service's thread."""
        self.queue.put(Incoming(topic, payload, packet_bytes))

    def drain(
        self, open_round: int, received: dict[str, Update], timeout: float, model: Model, kind: Kind = Kind.UPDATE
    ) -> None:
        """Take the next message, waiting up to ``timeout`` s for one, into ``received`` (the
        replies to ``open_round`` so far; ``model``: the global model they are checked against)."""
        if self.held and self.held[0][0] < open_round:  # held back from an earlier version: first
            item = self.held.pop(0)[2]
        else:
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                self.store.sync()  # the queue ran dry: one fdatasync for what was journaled since the last
                try:
                    item = self.queue.get(timeout=timeout)
                except queue.Empty:
                    return
        if item.topic in self.own_topics:
            self.own_topics[item.topic](item.topic, item.payload)
            return
        who = topics.parse_status_topic(self.federation, item.topic)
        if who is not None:
            self._on_status(who, item.payload, open_round)
            return
        client = topics.parse_update_topic(self.federation, item.topic)
        if self.buffer is not None and kind is Kind.UPDATE and client in received and not self._holds(client):
            self.held.append((open_round, client, item))  # one update per device per version: into the next
            return
        task = self.schedule.task_of(max(0, open_round))
        if client is not None and client in self.clients and not self.clients.active(client, task):
            why = Rejection("inactive", f"{client} is not active in task {task}", client)
            self.reject(item.topic, why, open_round)
            return
        result = self.inbox.check(client, item.payload, item.packet_bytes, open_round, set(received), kind, model)
        if isinstance(result, Rejection):
            self.reject(item.topic, result, open_round)
            return
        self.accept(result, open_round, item.payload, received, model, journal=True, kind=kind)

    def accept(
        self,
        update: Update,
        rnd: int,
        payload: bytes,
        received: dict[str, Update],
        model: Model,
        journal: bool,
        kind: Kind = Kind.UPDATE,
    ) -> None:
        """Take a checked message into round ``rnd``: an update is folded (streaming strategies)
        before it is journaled, so a crash in between loses nothing that a restart would not
        replay; a replayed update (``journal=False``) is folded into the rebuilt sum once.  A final
        evaluation is journaled too (in the journal of round ``total_rounds``): the end of a run
        interrupted after it arrived still counts it."""
        if kind is Kind.UPDATE:
            self.report.measure(update, payload)
            if self.strategy.streams:
                running, folded = self.running(rnd, model)
                if update.client in folded:  # the inbox refuses a second update per round; never fold one
                    raise AssertionError(f"round {rnd}: a second fold for {update.client}")
                try:
                    if self.buffer is not None:
                        update = self.buffer.fold(self.strategy, running, update, rnd)
                    else:
                        update = self.sites.fold(self.strategy, running, update)
                    folded.add(update.client)
                except ValueError as exc:  # the sums are unchanged (RunningSum checks before it adds)
                    why = Rejection("fold", str(exc), update.client)
                    self.reject(topics.update_topic(self.federation, update.client), why, rnd)
                    return
            self.report.arrived()
            self.metrics.devices.update(update.client, rnd)
        if journal:
            self.store.journal(rnd, update.client, payload, update.packet_bytes)
        if "eval" in update.frame.meta:
            self.runlog.evaluation(update.client, update.frame.meta["eval"])
        received[update.client] = update

    def replay(self, rnd: int, model: Model, kind: Kind = Kind.UPDATE) -> dict[str, Update]:
        """Updates (``kind``: or final evaluations) accepted in round ``rnd`` before a restart,
        checked again like new arrivals."""
        received: dict[str, Update] = {}
        for client, payload, packet_bytes in self.store.journaled(rnd):
            result = self.inbox.check(client, payload, packet_bytes, rnd, set(received), kind, model)
            if isinstance(result, Update):
                self.accept(result, rnd, payload, received, model, journal=False, kind=kind)
        if received:
            what = "update(s)" if kind is Kind.UPDATE else "final evaluation(s)"
            log.info("round %d: %d %s recovered from the journal", rnd, len(received), what)
        return received

    def close(self, rnd: int, received: dict[str, Update], model: Model) -> Model:
        """The round's next global model: from the running sums (streaming) or every update (batch)."""
        updates = [received[c] for c in sorted(received)]  # arrival order must not change the result
        with still_working(f"round {rnd + 1}: aggregating {len(updates)} update(s) on the server"):
            if not self.strategy.streams:
                return self.strategy.aggregate(updates, model)
            running, folded = self.running(rnd, model)
            if folded != set(received):  # each accepted update went through ``fold`` exactly once
                raise AssertionError(f"round {rnd}: folded {sorted(folded)}, accepted {sorted(received)}")
            self.round_sum = None
            return self.strategy.close(running, updates, model)

    def running(self, rnd: int, model: Model) -> tuple[RunningSum, set[str]]:
        """Round ``rnd``'s running sum and who is in it; a new (empty) one when the round has none yet."""
        if self.round_sum is None or self.round_sum[0] != rnd:
            self.round_sum = (rnd, self.strategy.running_sum(model), set())
        return self.round_sum[1], self.round_sum[2]

    def _holds(self, client: str) -> bool:
        return any(held == client for _, held, _ in self.held)

    def reject(self, topic: str, rejection: Rejection, open_round: int) -> None:
        log.warning("dropped message on %s: %s: %s", topic, rejection.reason, rejection.detail)
        self.metrics.rejected(rejection.reason)
        if rejection.client is not None and self._tracked(rejection.client):
            self.metrics.devices.rejected(rejection.client, rejection.reason)
        h = rejection.header  # once the frame decoded: which of the device's frames it was
        frame = None if h is None else {"kind": h.kind.name, "round": h.round, "sequence": h.sequence}
        self.runlog.rejected(
            rejection.reason, rejection.detail, topic=topic, client=rejection.client, open_round=open_round, frame=frame
        )
        if self.nacks is not None and topics.parse_update_topic(self.federation, topic) is not None:
            self.nacks.send(rejection, open_round)  # P-NACK-1: every dropped frame, rate limits permitting

    def _on_status(self, who: str, payload: bytes, open_round: int) -> None:
        if who == topics.AGGREGATOR_ID or not payload:
            return
        status = parse_status(payload)
        if status is None:
            self.reject(
                topics.status_topic(self.federation, who),
                Rejection("status", "not a JSON status object", who),
                open_round,
            )
            return
        refused = self._refused(who, status, open_round)
        self.clients.on_status(who, "refused" if refused else status["state"])  # not "online": offline
        if self._tracked(who):
            self.metrics.devices.status(who, status)
        if status["state"] != "online":
            log.info("client %s is %s", who, status["state"])
        self.metrics.clients_online(len(self.clients.online & set(self.clients.enrolled)))

    def _refused(self, who: str, status: dict, open_round: int) -> bool:
        """A device whose status declares it decodes what no frame can be made in (P-CAP-5): it is
        told once by a NACK (reason ``decodes``) and a log line, and counts as offline."""
        problem = self.declares(who, status) if self.declares is not None else None
        if problem is None:
            self.refused.pop(who, None)
            return False
        if self.refused.get(who) != problem:
            self.refused[who] = problem
            log.warning("client %s cannot be served: it declares %s", who, problem)
            if self.nacks is not None:
                self.nacks.send(Rejection("decodes", f"declares {problem}", who), open_round)
        return True

    def _tracked(self, client: str) -> bool:
        """Whether ``client`` has per-device series: enrolled, enrolling, or tracked before (so a
        stream of made-up ids cannot grow them)."""
        return client in self.clients or client in self.clients.waiting or self.metrics.devices.get(client) is not None
