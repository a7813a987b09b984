"""The aggregator's outbox alone: one sequence for every frame, a record of what is retained,
and the retained messages published again after (and only after) a reconnect."""

from __future__ import annotations

from support.agg_parts import RecordingLink

from aggregator.outbox import Outbox
from fclcore import topics
from fclcore.codec import Kind


def test_headers_go_on_from_the_committed_sequence() -> None:
    outbox = Outbox(RecordingLink(), "fed", "run-1", sequence=41)
    first = outbox.header(Kind.ROUND, 3, 1)
    second = outbox.header(Kind.REQUEST, 3, 1)
    assert (first.sequence, second.sequence, outbox.sequence) == (42, 43, 43)
    assert (first.kind, first.federation, first.round, first.task) == (Kind.ROUND, "fed", 3, 1)
    assert first.client == second.client == topics.AGGREGATOR_ID


def test_only_retained_publishes_are_remembered_and_clearing_is_not() -> None:
    link = RecordingLink()
    outbox = Outbox(link, "fed", "run-1")
    outbox.publish("fcl/fed/round", b"one", tag="round:0")
    outbox.publish("fcl/fed/round", b"two", tag="round:1")
    outbox.publish("fcl/fed/round", b"ask", tag="request:1", retain=False)
    outbox.clear(["fcl/fed/kb/a", "fcl/fed/kb/b"])
    assert outbox.retained == {"fcl/fed/round": b"two"}
    assert link.sent == [
        ("fcl/fed/round", b"one", True, "round:0"),
        ("fcl/fed/round", b"two", True, "round:1"),
        ("fcl/fed/round", b"ask", False, "request:1"),
        ("fcl/fed/kb/a", b"", True, "clear"),
        ("fcl/fed/kb/b", b"", True, "clear"),
    ]


def test_retained_messages_are_published_again_once_per_reconnect() -> None:
    link = RecordingLink(connects=1)
    outbox = Outbox(link, "fed", "run-1")
    outbox.publish("fcl/fed/round", b"announcement", tag="round:0")
    outbox.publish("fcl/fed/model/full", b"model", tag="sync:full")
    outbox.republish_after_outage()  # the first connection: nothing was lost
    outbox.republish_after_outage()
    assert len(link.sent) == 2
    link.connects = 2  # the broker went away and came back
    outbox.republish_after_outage()
    outbox.republish_after_outage()
    again = [(topic, payload, retain, tag) for topic, payload, retain, tag in link.sent[2:]]
    assert again == [
        ("fcl/fed/round", b"announcement", True, "republish"),
        ("fcl/fed/model/full", b"model", True, "republish"),
    ]
