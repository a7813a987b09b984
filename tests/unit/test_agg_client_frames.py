"""Per-client downlink frames alone: whatever a strategy hands out for single clients is
published retained on each client's own topics, in this run, one sequence number each, the
clients' frames before the full ones; the sizes returned are what each client is charged."""

from __future__ import annotations

import json

import numpy as np
from support.agg_parts import FED, RecordingLink, federation

from aggregator.client_frames import ClientFrames
from aggregator.outbox import Outbox
from aggregator.runlog import RunLog
from aggregator.variants import Variants
from fclcore import topics
from fclcore.codec import CodecLimits, Kind, decode
from fclcore.transport import publish_packet_bytes


class HandsOut:
    """A strategy's per-client frames: an entry for each client, all of them for c1."""

    def __init__(self, strategy) -> None:
        self.strategy = strategy

    def __getattr__(self, name: str):
        return getattr(self.strategy, name)

    def client_downlinks(self, rnd: int, clients) -> dict:
        return {c: ({"for_task": 1}, {f"entry:{c}": np.full(3, i, np.float32)}) for i, c in enumerate(clients)}

    def full_downlinks(self, rnd: int, clients) -> dict:
        return {"c1": ({"for_task": 1, "full": True}, {"entry:c0": np.zeros(3, np.float32)})}

    def downlink_log(self, meta: dict) -> dict:
        return {"for_task": meta["for_task"]}


def test_frames_are_published_retained_per_client_in_this_run(tmp_path) -> None:
    fed, strategy = federation()
    link, runlog = RecordingLink(), RunLog(tmp_path)
    outbox = Outbox(link, FED, "run-7", sequence=10)
    frames = ClientFrames(outbox, fed, HandsOut(strategy), CodecLimits(), runlog, Variants(outbox, FED, CodecLimits()))
    sizes = frames.publish(2, 1, ["c0", "c1"])
    runlog.close()
    assert [(topic, retain, tag) for topic, _, retain, tag in link.sent] == [
        (topics.knowledge_topic(FED, "c0"), True, "knowledge:1"),
        (topics.knowledge_topic(FED, "c1"), True, "knowledge:1"),
        (topics.knowledge_full_topic(FED, "c1"), True, "knowledge-full:1"),
    ]
    decoded = [decode(payload) for _, payload, _, _ in link.sent]
    assert [f.header.sequence for f in decoded] == [11, 12, 13]
    assert {(f.header.kind, f.header.round, f.header.task, f.meta["run"]) for f in decoded} == {
        (Kind.KNOWLEDGE, 2, 1, "run-7")
    }
    np.testing.assert_array_equal(decoded[1].tensors["entry:c1"], np.ones(3, np.float32))
    assert sizes == {
        topic.rsplit("/", 1)[1]: (publish_packet_bytes(topic, len(payload)), len(payload))
        for topic, payload, _, _ in link.sent[:2]
    }
    events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(e["event"], e["client"], e["bytes"], e["for_task"]) for e in events] == [
        ("knowledge", c, sizes[c][0], 1) for c in ("c0", "c1")
    ]


def test_a_new_run_clears_every_clients_frame_topics(tmp_path) -> None:
    fed, strategy = federation()
    runlog = RunLog(tmp_path)
    outbox = Outbox(RecordingLink(), FED, "run-7")
    frames = ClientFrames(outbox, fed, strategy, CodecLimits(), runlog, Variants(outbox, FED, CodecLimits()))
    runlog.close()
    assert frames.retained_topics(["a", "b"]) == [
        topics.knowledge_topic(FED, "a"),
        topics.knowledge_topic(FED, "b"),
        topics.knowledge_full_topic(FED, "a"),
        topics.knowledge_full_topic(FED, "b"),
    ]
