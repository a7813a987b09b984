"""What the device sends: every uplink frame encoded, numbered by the device's own counter for its
run and signed when the device has a key (``fclcore.signing``); the last update kept until a
later round is announced, sent again when the aggregator asks for it, and renumbered when the
aggregator says its number was behind (docs/protocol.md, "Sequences and clocks").

No clock numbers a frame: a Raspberry Pi's clock steps when NTP first syncs after boot, and an
aggregator's may step too, so a number taken from either could fall behind the device's mark or
far ahead of it.  A counter kept in the checkpoint only rises."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from fclcore import topics
from fclcore.codec import CodecLimits, Frame, Header, Kind, decode, encode, max_value, with_sequence
from fclcore.errors import TrainingDiverged
from fclcore.runid import started_us
from fclcore.signing import sign, verify

log = logging.getLogger("edge_client.daemon")  # its parts log as the daemon did before the split
FINAL_SEND_S = 60.0  # how long the final evaluation is retried across broker outages


class Uplink:
    def __init__(
        self, federation: str, client_id: str, link, key: bytes | None, limits: CodecLimits, stop: threading.Event
    ) -> None:
        self.federation, self.client_id = federation, client_id
        self.link, self.key, self.limits, self.stop = link, key, limits, stop
        self.sequence = 0  # the last number this device used (checkpointed with each update: P-SEQ-1)
        self.unacked: bytes | None = None  # the update for the last round done, until a later round is announced
        self.sent_at = 0.0  # when it was published (monotonic)
        self.in_flight = None  # paho's handle of the last copy of ``unacked`` published, until the broker has it

    def frame(
        self, kind: Kind, rnd: int, task: int, meta: dict, tensors: dict, value_coding: str, run: str | None = None
    ) -> bytes:
        """An uplink message: encoded, and signed when the device has a key.  Its number is the
        next of this device's counter, above the start of ``run`` (P-SEQ-1, P-SEQ-2)."""
        self.sequence = max(self.sequence, started_us(run) if run else 0) + 1
        header = Header(kind, self.federation, rnd, task, self.client_id, self.sequence)
        payload = encode(Frame(header, meta, tensors), value_coding, self.limits)
        return self._signed(payload)

    def renumber(self, nack: dict) -> bool:
        """After a NACK that says the unacknowledged update's number is at or behind the device's
        mark (its checkpoint was lost or older) or beyond the window: give it the number after
        the mark, every other byte the same (P-SEQ-6).  True when it was renumbered (the caller
        checkpoints and sends it)."""
        mark, reason = nack.get("mark"), nack.get("reason")
        if self.unacked is None or not isinstance(mark, int):
            return False
        header = decode(self._plain(self.unacked), self.limits, lambda h: False).header
        named = (nack.get("kind"), nack.get("round"), nack.get("sequence"))
        if (header.kind.name, header.round, header.sequence) != named:
            return False  # not this device's update (a replayed or forged frame under its name)
        behind = reason in ("replay", "duplicate") and header.sequence <= mark  # "duplicate": the mark's number
        if not (behind or reason == "sequence"):
            return False
        self.sequence = mark + 1  # numbers above the mark were never accepted: none is a replay
        log.warning("the aggregator's mark for this device is %d: update for round %d renumbered", mark, header.round)
        self.unacked = self._signed(with_sequence(self._plain(self.unacked), self.sequence))
        return True

    def _signed(self, payload: bytes) -> bytes:
        return sign(payload, self.key) if self.key is not None else payload

    def _plain(self, payload: bytes) -> bytes:
        return verify(payload, self.key) if self.key is not None else payload

    def decoded_tensors(self, payload: bytes) -> dict:
        """The tensors of one of this device's own messages as the aggregator will decode them."""
        return decode(self._plain(payload), self.limits).tensors

    def send(self, payload: bytes, tag: str):
        info = self.link.publish(topics.update_topic(self.federation, self.client_id), payload, tag=tag)
        if payload is self.unacked:
            self.in_flight = info
        return info

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
        (at ``arrival``) before the update was first sent (it queued up while this device was
        training), or the last copy has not reached the broker yet: paho sends a QoS 1 message
        again after a reconnect by itself, and on a slow uplink a multi-megabyte update takes
        longer than the aggregator's re-send interval, so each copy more would queue behind
        it and delay everything after it (docs/links.md)."""
        if rnd != done_round or self.unacked is None or arrival < self.sent_at:
            return
        if self._on_its_way():
            log.info("not re-sending the update for round %d (%s): its last copy is still on its way", rnd, why)
            return
        log.info("re-sending the update for round %d: %s", rnd, why)
        self.send(self.unacked, f"resend:{rnd}")
        self.sent_at = time.monotonic()

    def _on_its_way(self) -> bool:
        """Whether paho still holds the last copy published, unacknowledged."""
        try:
            return self.in_flight is not None and not self.in_flight.is_published()
        except (RuntimeError, ValueError):  # paho: published while the link was down; it cannot tell
            return False


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
