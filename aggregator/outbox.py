"""Where every frame the aggregator sends leaves it: one sequence, one run id, one record of
what is retained.

Every frame carries the next number of the service's sequence (committed with each round, so a
restart goes on counting) and its run id (``meta.run``: a device acts only on its own run's
frames).  What is published retained is remembered per topic, so that after a reconnect the
service can publish it again: a broker that restarted without persistence has lost it, and
devices that reconnect need it.  The service also sees what the broker delivers on its own
round topic (``observe``): a message there that it did not send (garbage, a forgery, a deletion)
may have replaced its retained announcement, so that one is published again (``repair``, at
most once a second), and a device that restarts meanwhile finds the genuine one.

A retained frame longer than ``chunk_bytes`` (``wire.chunk_bytes``) leaves as chunks and a
manifest (``fclcore.chunks``): the chunks first, so a device that sees the manifest finds them,
and chunk topics a longer frame used before on that topic are cleared.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import deque
from typing import Iterable, Protocol

from fclcore import topics
from fclcore.chunks import chunk_topic, split
from fclcore.codec import Header, Kind
from fclcore.transport import publish_packet_bytes

log = logging.getLogger(__name__)
REPAIR_EVERY_S = 1.0  # a topic's retained message is published again at most this often
OWN_REMEMBERED = 256  # digests of the latest payloads this service sent (its own, echoed back)


class Link(Protocol):
    """What the outbox needs of a transport (``fclcore.transport.MqttLink``)."""

    connects: int

    def publish(self, topic: str, payload: bytes, *, retain: bool = False, tag: str | None = None) -> object: ...


class Outbox:
    def __init__(
        self, link: Link, federation: str, run_id: str, sequence: int = 0, chunk_bytes: int | None = None
    ) -> None:
        """``sequence``: the last number a committed round used (0 for a new run); ``chunk_bytes``:
        retained frames longer than this go in chunks (None: every frame whole)."""
        self.link = link
        self.chunk_bytes = chunk_bytes
        self.chunked: dict[str, int] = {}  # topic -> chunks its retained frame was published in
        self.whole: set[str] = set()  # topics whose retained frame goes whole (its readers take no chunks)
        self.federation = federation
        self.run_id = run_id
        self.sequence = sequence
        self.retained: dict[str, bytes] = {}  # what this service last published retained, per topic
        self.seen_connects = 0
        self._own: deque[bytes] = deque(maxlen=OWN_REMEMBERED)
        self.foreign: set[str] = set()  # topics where a message this service did not send was seen
        self._repaired: dict[str, float] = {}  # topic -> when its retained message was last published again

    def header(self, kind: Kind, rnd: int, task: int) -> Header:
        """The header of the next frame the aggregator sends (it takes the next sequence number)."""
        self.sequence += 1
        return Header(kind, self.federation, rnd, task, topics.AGGREGATOR_ID, self.sequence)

    def publish(
        self, topic: str, payload: bytes, tag: str, retain: bool = True, whole: bool = False
    ) -> tuple[int, int]:
        """(MQTT PUBLISH bytes, payload bytes) of what went out for ``payload``: a device that
        receives it once receives that many.  ``whole``: never in chunks (its reader takes none)."""
        if retain:
            self.retained[topic] = payload
        (self.whole.add if whole else self.whole.discard)(topic)
        return self._send(topic, payload, tag, retain)

    def _send(self, topic: str, payload: bytes, tag: str, retain: bool = True) -> tuple[int, int]:
        whole = topic in self.whole or not (retain and self.chunk_bytes and len(payload) > self.chunk_bytes)
        manifest, chunks = (payload, []) if whole else split(payload, self.chunk_bytes)
        messages = [(chunk_topic(topic, i), c) for i, c in enumerate(chunks)] + [(topic, manifest)]
        for where, message in messages:
            self._own.append(_digest(message))
            self.link.publish(where, message, retain=retain, tag=tag)
        if retain:
            for index in range(len(chunks), self.chunked.get(topic, 0)):
                self.link.publish(chunk_topic(topic, index), b"", retain=True, tag="clear")
            self.chunked[topic] = len(chunks)
        return sum(publish_packet_bytes(t, len(m)) for t, m in messages), sum(len(m) for _, m in messages)

    def observe(self, topic: str, payload: bytes) -> None:
        """A message the broker delivered on one of this service's topics: one it did not send
        puts its retained message there up for ``repair`` (nothing to do where it holds none)."""
        if topic not in self.retained or _digest(payload) in self._own or topic in self.foreign:
            return
        log.warning("a message this service did not send on %s (%d bytes): re-publishing its own", topic, len(payload))
        self.foreign.add(topic)

    def repair(self, now: float | None = None) -> None:
        """Publish the retained message again on every topic where a foreign one was seen."""
        now = time.monotonic() if now is None else now
        for topic in sorted(self.foreign):
            if now - self._repaired.get(topic, -REPAIR_EVERY_S) >= REPAIR_EVERY_S:
                self._send(topic, self.retained[topic], "republish")
                self._repaired[topic] = now
                self.foreign.discard(topic)

    def clear(self, topics_: Iterable[str]) -> None:
        """Delete the retained messages on ``topics_`` (an empty retained payload)."""
        for topic in topics_:  # its echo changes nothing: a new run holds no retained message there yet
            self.link.publish(topic, b"", retain=True, tag="clear")

    def republish_after_outage(self) -> None:
        """After a reconnect, publish every retained message again (nothing on the first connect)."""
        if self.link.connects == self.seen_connects:
            return
        if self.seen_connects:
            log.warning("reconnected to the broker; re-publishing %d retained message(s)", len(self.retained))
            for topic, payload in self.retained.items():
                self._send(topic, payload, "republish")
        self.seen_connects = self.link.connects


def _digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()
