"""Keeping the device's global model in step: the replica (``edge_client.replica``) takes each
announcement; when it cannot (it holds no version, or one the delta does not bridge) the
announcement is parked and the retained sync frame it needs is fetched, on a topic subscribed
only meanwhile.  Once the replica has caught up, the parked announcement is handled again.
A device that declared it derives no mask positions (docs/protocol.md P-CAP-4) holds itself to
that: a delta with derived values does not apply, and it resyncs as from any bad delta."""

from __future__ import annotations

import logging

import methods
from edge_client.protocol import RejectedFrame
from edge_client.replica import CATCHUP, FULL, ModelReplica
from fclcore import topics
from fclcore.codec import Frame, Tensor
from fclcore.schema import FederationSpec

log = logging.getLogger("edge_client.daemon")  # its parts log as the daemon did before the split
Message = tuple[str, bytes, int]  # (topic, payload, size) as it arrived


class ModelSync:
    def __init__(self, federation: str, link, derives: bool = True) -> None:
        self.federation, self.link, self.derives = federation, link, derives
        # subscribed only while the device resyncs: "full" or "catchup"
        self.topics = {topics.model_topic(federation, w): w for w in (FULL, CATCHUP)}
        self.replica: ModelReplica | None = None  # the global model as announced, kept in step by deltas
        self.syncing: str | None = None  # the sync frame being fetched
        self.parked: Message | None = None  # the announcement that waits for it

    def model(self, frame: Frame, fed: FederationSpec, message: Message) -> dict[str, Tensor] | None:
        """The whole global model an announcement brings, or None while the sync frame it needs
        is fetched (``message`` waits in ``parked``)."""
        if self.replica is None:
            positions = methods.positions_for(fed, frame.meta["input_dim"], "round message") if self.derives else _none
            self.replica = ModelReplica(positions)
        try:
            got = self.replica.take(frame)
        except ValueError as exc:
            raise RejectedFrame(f"model: {exc}") from None
        if isinstance(got, str):
            self.parked = message
            self._fetch(got)
            return None
        self._fetch(None)
        return got

    def take(self, topic: str, frame: Frame, size: int) -> Message | None:
        """A sync frame: the parked announcement once the replica has caught up, else None."""
        which = self.topics[topic]
        if which != self.syncing or self.replica is None:
            return None  # a retained copy delivered after the fetch ended
        try:
            wanted = self.replica.sync(frame, which, size)
        except ValueError as exc:
            raise RejectedFrame(f"model: {exc}") from None
        if wanted is not None:
            self._fetch(wanted)
            return None
        parked = self.parked
        self._fetch(None)
        return parked

    def report(self) -> dict[str, int]:
        """The replica's cumulative resync counts (``ModelReplica.report``)."""
        return self.replica.report() if self.replica else {}

    def totals(self) -> dict[str, int]:
        return dict(self.replica.totals) if self.replica else {}

    def _fetch(self, which: str | None) -> None:
        """Subscribe to sync frame ``which`` (None: to none), leaving the one fetched before."""
        if which == self.syncing:
            return
        if self.syncing is not None:
            self.link.unsubscribe(topics.model_topic(self.federation, self.syncing))
        if which is not None:
            log.info("fetching the %s model (holding version %s)", which, self.replica.version)
            self.link.subscribe(topics.model_topic(self.federation, which))
        else:
            self.parked = None
        self.syncing = which


def _none(rnd: int) -> None:
    """No derived positions: the device derives none."""
    return None
