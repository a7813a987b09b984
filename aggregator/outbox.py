"""Where every frame the aggregator sends leaves it: one sequence, one run id, one record of
what is retained.

Every frame carries the next number of the service's sequence (committed with each round, so a
restart goes on counting) and its run id (``meta.run``: a device acts only on its own run's
frames).  What is published retained is remembered per topic, so that after a reconnect the
service can publish it again: a broker that restarted without persistence has lost it, and
devices that reconnect need it.
"""

from __future__ import annotations

import logging
from typing import Iterable, Protocol

from fclcore import topics
from fclcore.codec import Header, Kind

log = logging.getLogger(__name__)


class Link(Protocol):
    """What the outbox needs of a transport (``fclcore.transport.MqttLink``)."""

    connects: int

    def publish(self, topic: str, payload: bytes, *, retain: bool = False, tag: str | None = None) -> object: ...


class Outbox:
    def __init__(self, link: Link, federation: str, run_id: str, sequence: int = 0) -> None:
        """``sequence``: the last number a committed round used (0 for a new run)."""
        self.link = link
        self.federation = federation
        self.run_id = run_id
        self.sequence = sequence
        self.retained: dict[str, bytes] = {}  # what this service last published retained, per topic
        self.seen_connects = 0

    def header(self, kind: Kind, rnd: int, task: int) -> Header:
        """The header of the next frame the aggregator sends (it takes the next sequence number)."""
        self.sequence += 1
        return Header(kind, self.federation, rnd, task, topics.AGGREGATOR_ID, self.sequence)

    def publish(self, topic: str, payload: bytes, tag: str, retain: bool = True) -> None:
        self.link.publish(topic, payload, retain=retain, tag=tag)
        if retain:
            self.retained[topic] = payload

    def clear(self, topics_: Iterable[str]) -> None:
        """Delete the retained messages on ``topics_`` (an empty retained payload)."""
        for topic in topics_:
            self.link.publish(topic, b"", retain=True, tag="clear")

    def republish_after_outage(self) -> None:
        """After a reconnect, publish every retained message again (nothing on the first connect)."""
        if self.link.connects == self.seen_connects:
            return
        if self.seen_connects:
            log.warning("reconnected to the broker; re-publishing %d retained message(s)", len(self.retained))
            for topic, payload in self.retained.items():
                self.link.publish(topic, payload, retain=True, tag="republish")
        self.seen_connects = self.link.connects
