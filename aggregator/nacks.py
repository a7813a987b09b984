"""Rejections a device can read: each frame the aggregator drops is answered with a small JSON
NACK on ``fcl/<fed>/nack/<client>`` (non-retained, QoS 1; the shipped ACL lets only that device
read it), so a device learns why within a round instead of being asked to re-send forever.

A flood of garbage must not make the aggregator flood back: every device has a token bucket
(``PER_DEVICE_BURST`` at once, then one per ``PER_DEVICE_EVERY_S``) and all NACKs share one more
(``GLOBAL_BURST``, ``GLOBAL_PER_S``); what a bucket refuses is counted, not sent.  The rules are
docs/protocol.md, "Rejections (NACK)" (P-NACK-*).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Callable

from aggregator.inbox import Rejection
from fclcore import topics

NACK_VERSION = 1  # the ``nack`` field: the layout of this JSON object
MAX_DETAIL = 200  # characters of the rejection's text a NACK carries
PER_DEVICE_BURST, PER_DEVICE_EVERY_S = 3, 10.0
GLOBAL_BURST, GLOBAL_PER_S = 50, 10.0
MAX_TRACKED = 10_000  # per-device buckets kept; ids beyond it (topic spam) get no NACK


@dataclass
class Bucket:
    tokens: float
    at: float

    def take(self, now: float, burst: float, per_s: float) -> bool:
        self.tokens = min(burst, self.tokens + (now - self.at) * per_s)
        self.at = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


class Nacks:
    def __init__(
        self,
        publish: Callable[..., object],
        federation: str,
        run_id: str,
        versions: tuple[int, ...],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``publish(topic, payload, retain=, tag=)``: the link's; ``versions``: the frame
        versions this service decodes (every NACK names them: P-VER-3)."""
        self.publish, self.federation, self.run_id, self.versions = publish, federation, run_id, versions
        self.clock = clock
        self.devices: dict[str, Bucket] = {}
        self.all = Bucket(GLOBAL_BURST, clock())
        self.sent = 0
        self.suppressed = 0

    def send(self, rejection: Rejection, open_round: int) -> bool:
        """Publish the NACK for ``rejection`` unless a bucket refuses it; True when sent."""
        client = rejection.client
        if client is None or not self._allowed(client):
            self.suppressed += 1
            return False
        self.publish(
            topics.nack_topic(self.federation, client), self.payload(rejection, open_round), retain=False, tag="nack"
        )
        self.sent += 1
        return True

    def payload(self, rejection: Rejection, open_round: int) -> bytes:
        """P-NACK-2: what was dropped (round, kind, sequence: null when the frame did not decode)
        and why (a reason code from a closed set, and its text)."""
        h = rejection.header
        return json.dumps(
            {
                "nack": NACK_VERSION,
                "run": self.run_id,
                "round": None if h is None else h.round,
                "kind": None if h is None else h.kind.name,
                "sequence": None if h is None else h.sequence,
                "reason": rejection.reason,
                "detail": rejection.detail[:MAX_DETAIL],
                "mark": rejection.mark,
                "open_round": open_round,
                "versions": list(self.versions),
            },
            separators=(",", ":"),
        ).encode()

    def _allowed(self, client: str) -> bool:
        now = self.clock()
        bucket = self.devices.get(client)
        if bucket is None:
            if len(self.devices) >= MAX_TRACKED:
                self._forget_full(now)
                if len(self.devices) >= MAX_TRACKED:
                    return False
            bucket = self.devices[client] = Bucket(PER_DEVICE_BURST, now)
        if bucket.tokens + (now - bucket.at) / PER_DEVICE_EVERY_S < 1:
            return False  # the device's bucket is empty: the global one is not charged
        return self.all.take(now, GLOBAL_BURST, GLOBAL_PER_S) and bucket.take(
            now, PER_DEVICE_BURST, 1 / PER_DEVICE_EVERY_S
        )

    def _forget_full(self, now: float) -> None:
        """Drop the buckets that have refilled: forgetting them changes nothing."""
        for client in [
            c for c, b in self.devices.items() if b.tokens + (now - b.at) / PER_DEVICE_EVERY_S >= PER_DEVICE_BURST
        ]:
            del self.devices[client]
