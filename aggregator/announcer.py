"""The round protocol's frames from the aggregator: announcements (ROUND, FINISH), the retained
model sync frames published with them, and re-send requests.

An announcement carries the federation, the schedule, the strategy's metadata for the round and
the model: the delta that brings devices from the version before to this one
(``aggregator.downlink``).  The delta is put through the codec before it is announced, and the
model every device decodes from it becomes the global model (``Announced.model``), so the
aggregator holds what the devices hold, rounding included.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from aggregator.downlink import ModelDownlink
from aggregator.outbox import Outbox
from aggregator.runlog import RunLog
from aggregator.variants import Sent, Shared, Variants
from fclcore import topics
from fclcore.codec import CodecLimits, Frame, Header, Kind, decode, encode
from fclcore.config import to_dict
from fclcore.schema import FederationSpec
from fclcore.strategy import Strategy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Announced:
    """What one announcement sent: its MQTT packet and payload bytes, the payload bytes of the
    model in it, and the global model as devices decode it (the model given, for a failure);
    ``variants``: what each device that reads its own topic got instead (``aggregator.variants``)."""

    packet_bytes: int
    payload_bytes: int
    model_bytes: int
    model: dict[str, np.ndarray]
    variants: Mapping[str, Sent] = field(default_factory=dict)

    def to(self, client: str) -> Announced | Sent:
        """What ``client`` received of it (the three byte counts)."""
        return self.variants.get(client, self)


@dataclass
class Announcer:
    outbox: Outbox
    fed: FederationSpec
    input_dim: int
    strategy: Strategy
    downlink: ModelDownlink
    limits: CodecLimits
    runlog: RunLog
    variants: Variants

    def announce(
        self,
        kind: Kind,
        rnd: int,
        task: int,
        model: dict[str, np.ndarray],
        attempt: int = 1,
        frames: list[str] | None = None,
        failed: str | None = None,
    ) -> Announced:
        """Publish round ``rnd``'s ROUND or FINISH (retained) bringing devices to ``model``.
        ``frames``: the clients sent a frame of their own for this round; with a membership
        table the announcement names them (``client_frames``), so only they wait for one.
        ``failed``: a FINISH saying the run failed (no model, the reason)."""
        meta = {
            "run": self.outbox.run_id,
            "clock_us": time.time_ns() // 1000,  # protocol-1 devices number their frames on it (P-SEQ-7)
            "federation": to_dict(self.fed),
            "input_dim": self.input_dim,
            "total_rounds": self.fed.total_rounds,
            "attempt": attempt,
            "schedule": self._schedule_meta(rnd),
            **self.strategy.announce_meta(rnd),
        }
        if frames is not None and meta.get("client_frames") is True:
            meta["client_frames"] = frames
        if failed is not None:
            meta["failed"] = failed[:200]
        header = self.outbox.header(kind, rnd, task)
        tensors: dict = {}
        coding = self.fed.value_coding
        if failed is None:
            tensors, ref = self.downlink.prepare(rnd, model, lambda t: self._roundtrip(header, t))
            model = self.downlink.served  # the model as every device decodes it
            meta["model"] = ref.to_meta()
            self._publish_sync(rnd, task)
        payload = encode(Frame(header, meta, tensors), coding, self.limits)
        topic, tag = topics.round_topic(self.fed.name), f"{kind.name.lower()}:{rnd}"
        wire, sent = self.outbox.publish(topic, payload, tag=tag)
        model_bytes = len(payload) - len(encode(Frame(header, meta, {}), coding, self.limits))
        step = self.downlink.steps[-1] if failed is None and self.downlink.steps else None
        shared = Shared(header, meta, payload, None if failed is not None else model, step, tag)
        return Announced(wire, sent, model_bytes, model, self.variants.announce(shared))

    def request(self, kind: Kind, rnd: int, missing: list[str]) -> None:
        """Ask ``missing`` clients to send their update (or evaluation) for ``rnd`` again."""
        header = self.outbox.header(Kind.REQUEST, rnd, self.strategy.schedule.task_of(rnd))
        meta = {"missing": missing, "kind": kind.name, "run": self.outbox.run_id}
        payload = encode(Frame(header, meta, {}), limits=self.limits)
        self.outbox.publish(topics.round_topic(self.fed.name), payload, tag=f"request:{rnd}", retain=False)
        self.variants.request(payload, missing, f"request:{rnd}")
        self.runlog.write("request", round=rnd, kind=kind.name, missing=missing)
        log.info("round %d: asked %s to re-send", rnd, ", ".join(missing))

    def retained_topics(self) -> list[str]:
        """The retained topics announcements and sync frames are published on (a new run clears them)."""
        return [topics.round_topic(self.fed.name)] + [topics.model_topic(self.fed.name, w) for w in ("full", "catchup")]

    def _roundtrip(self, header: Header, tensors: dict) -> dict:
        """``tensors`` as a device decodes them from an announcement with ``header``."""
        payload = encode(Frame(header, {}, tensors), self.fed.value_coding, self.limits)
        return decode(payload, self.limits).tensors

    def _publish_sync(self, rnd: int, task: int) -> None:
        """The retained sync frames of the model about to be announced (published first, so a
        device that sees the announcement finds them): the full model and the catch-up."""
        for which, (tensors, ref, dtype) in self.downlink.sync_frames().items():
            header = self.outbox.header(Kind.MODEL, rnd, task)
            meta = {"run": self.outbox.run_id, "model": ref.to_meta()}
            tensors, coding, whole = self.variants.sync(tensors, self.downlink.served, dtype, header)
            payload = encode(Frame(header, meta, tensors), coding, self.limits)
            self.outbox.publish(topics.model_topic(self.fed.name, which), payload, tag=f"sync:{which}", whole=whole)

    def _schedule_meta(self, rnd: int) -> dict:
        """This round's place in the task schedule and the previous round's (what the device's
        evaluation in this round's reply is of)."""
        previous = self.strategy.schedule.place(rnd - 1).to_meta() if rnd > 0 else None
        return {**self.strategy.schedule.place(rnd).to_meta(), "previous": previous}
