"""Per-client downlink frames: what the strategy sends to single clients before a round.

A strategy may have a frame for each client of a round (``Strategy.client_downlinks``: say,
at a task start, what the method shares with that client) and, beside it, a frame with all of
it for a client that lacks something its frame refers to (``Strategy.full_downlinks``).  Both
are published retained on the client's own topics before the round is announced, as KNOWLEDGE
frames (the wire kind and topics the methods named them by); the service knows nothing of what
they hold.  Their bytes count against each client's downlink in the run log (``knowledge``).
A client that declared it decodes less gets its frames coded within that (``Variants.knowledge``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from aggregator.outbox import Outbox
from aggregator.runlog import RunLog
from aggregator.variants import Variants
from fclcore import topics
from fclcore.codec import CodecLimits, Frame, Kind, encode
from fclcore.schema import FederationSpec
from fclcore.strategy import Strategy

FrameSizes = dict[str, tuple[int, int]]  # client -> (MQTT packet bytes, payload bytes) of its frame


@dataclass
class ClientFrames:
    outbox: Outbox
    fed: FederationSpec
    strategy: Strategy
    limits: CodecLimits
    runlog: RunLog
    variants: Variants

    def publish(self, rnd: int, task: int, roster: Sequence[str]) -> FrameSizes:
        """Publish the strategy's frames for round ``rnd`` (retained); the size of each client's."""
        sizes = {}
        for client, (meta, tensors) in self.strategy.client_downlinks(rnd, roster).items():
            topic = topics.knowledge_topic(self.fed.name, client)
            sizes[client] = self._publish(rnd, task, client, topic, f"knowledge:{task}", meta, tensors)
            self.runlog.write(
                "knowledge", task=task, client=client, bytes=sizes[client][0], **self.strategy.downlink_log(meta)
            )
        # what a device that lacks something its frame refers to fetches instead (it reports the bytes)
        for client, (meta, tensors) in self.strategy.full_downlinks(rnd, roster).items():
            topic = topics.knowledge_full_topic(self.fed.name, client)
            self._publish(rnd, task, client, topic, f"knowledge-full:{task}", meta, tensors)
        return sizes

    def retained_topics(self, clients: Sequence[str]) -> list[str]:
        """The retained topics the frames of ``clients`` are published on (a new run clears them)."""
        frames = [topics.knowledge_topic(self.fed.name, c) for c in clients]
        return frames + [topics.knowledge_full_topic(self.fed.name, c) for c in clients]

    def _publish(
        self, rnd: int, task: int, client: str, topic: str, tag: str, meta: dict, tensors: dict
    ) -> tuple[int, int]:
        header = self.outbox.header(Kind.KNOWLEDGE, rnd, task)
        frame = Frame(header, {**meta, "run": self.outbox.run_id}, tensors)
        payload, whole = self.variants.knowledge(client, encode(frame, self.fed.value_coding, self.limits))
        return self.outbox.publish(topic, payload, tag=tag, whole=whole)
