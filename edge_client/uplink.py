"""What the device sends: every uplink frame encoded, sequenced on the aggregator's clock and
signed when the device has a key (``fclcore.signing``); the last update kept until a later
round is announced, and sent again when the aggregator asks for it."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from fclcore import topics
from fclcore.codec import CodecLimits, Frame, Header, Kind, decode, encode, max_value
from fclcore.errors import TrainingDiverged
from fclcore.signing import sign, verify

log = logging.getLogger("edge_client.daemon")  # its parts log as the daemon did before the split
SEQUENCE_AHEAD_US = 10_000_000  # a sequence further ahead of the aggregator's clock is reset to it
FINAL_SEND_S = 60.0  # how long the final evaluation is retried across broker outages


class Uplink:
    def __init__(
        self, federation: str, client_id: str, link, key: bytes | None, limits: CodecLimits, stop: threading.Event
    ) -> None:
        self.federation, self.client_id = federation, client_id
        self.link, self.key, self.limits, self.stop = link, key, limits, stop
        self.sequence = time.time_ns() // 1000  # above anything sent before, even without saved state
        self.clock_offset_us = 0  # the aggregator's clock minus ours (from its announcements): sequences follow it
        self.unacked: bytes | None = None  # the update for the last round done, until a later round is announced
        self.sent_at = 0.0  # when it was published (monotonic)

    def note_clock(self, frame: Frame) -> None:
        """The aggregator's clock, from its announcement: this device's sequence numbers follow it."""
        clock = frame.meta.get("clock_us")
        if isinstance(clock, int) and not isinstance(clock, bool) and clock > 0:
            self.clock_offset_us = clock - time.time_ns() // 1000

    def frame(self, kind: Kind, rnd: int, task: int, meta: dict, tensors: dict, value_coding: str) -> bytes:
        """An uplink message: encoded, and signed when the device has a key.  Its sequence runs on
        the aggregator's clock (which bounds what it accepts); one far ahead of it (a clock that
        was wrong when the checkpoint was written) is brought back to it."""
        now = time.time_ns() // 1000 + self.clock_offset_us
        if self.sequence + 1 > now + SEQUENCE_AHEAD_US:
            log.warning(
                "this device's sequence was %.0f s ahead of the aggregator's clock: reset", (self.sequence - now) / 1e6
            )
            self.sequence = now
        self.sequence = max(self.sequence + 1, now)
        header = Header(kind, self.federation, rnd, task, self.client_id, self.sequence)
        payload = encode(Frame(header, meta, tensors), value_coding, self.limits)
        return sign(payload, self.key) if self.key is not None else payload

    def decoded_tensors(self, payload: bytes) -> dict:
        """The tensors of one of this device's own messages as the aggregator will decode them."""
        return decode(verify(payload, self.key) if self.key is not None else payload, self.limits).tensors

    def send(self, payload: bytes, tag: str):
        return self.link.publish(topics.update_topic(self.federation, self.client_id), payload, tag=tag)

    def deliver(self, payload: bytes, tag: str, timeout: float = FINAL_SEND_S) -> bool:
        """Publish and wait until the broker has it; a link that drops meanwhile (a broker
        restart) is waited for and the frame sent again (the aggregator drops a duplicate)."""
        deadline = time.monotonic() + timeout
        info = self.send(payload, tag)
        while not self.stop.is_set() and (left := deadline - time.monotonic()) > 0:
            try:
                info.wait_for_publish(min(2.0, left))
                if info.is_published():
                    return True
            except (RuntimeError, ValueError):  # paho: published while the link was down
                if self.link.connected.wait(min(2.0, left)):
                    info = self.send(payload, tag)
        log.warning("%s was not delivered within %.0f s; the aggregator will go on without it", tag, timeout)
        return False

    def resend(self, rnd: int, done_round: int, arrival: float, why: str) -> None:
        """Publish the unacknowledged update again, unless the message asking for it arrived
        (at ``arrival``) before the update was first sent (it queued up while this device was training)."""
        if rnd == done_round and self.unacked is not None and arrival >= self.sent_at:
            log.info("re-sending the update for round %d: %s", rnd, why)
            self.link.publish(topics.update_topic(self.federation, self.client_id), self.unacked, tag=f"resend:{rnd}")
            self.sent_at = time.monotonic()


def check_finite(rnd: int, loss: float | None, tensors: dict, value_dtype: str) -> None:
    """Raise ``TrainingDiverged`` if the round's loss or any value of its update is not a finite
    number in the wire's value type (a float32 value beyond float16's range would become inf)."""
    if loss is not None and not np.isfinite(loss):
        raise TrainingDiverged(f"training diverged at round {rnd} (loss={loss}): lower `federation.train.lr`")
    bound = max_value(value_dtype)
    for name, tensor in tensors.items():
        values = np.asarray(getattr(tensor, "values", tensor), dtype=np.float64)
        if values.size and not np.all(np.abs(values) <= bound):  # False for nan too
            shown = "" if loss is None else f"loss={loss:.4g}, "
            raise TrainingDiverged(
                f"training diverged at round {rnd} ({shown}update {name!r} is not finite in {value_dtype}): "
                "lower `federation.train.lr`"
            )
