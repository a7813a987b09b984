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


def test_a_foreign_message_on_its_round_topic_has_the_retained_one_published_again() -> None:
    """Issue 42: garbage retained on the round topic stalled a device that restarted meanwhile
    until the round's deadline; the service's own echoes (retained or not) change nothing."""
    link = RecordingLink(connects=1)
    outbox = Outbox(link, "fed", "run-1")
    outbox.observe("fcl/fed/round", b"garbage")  # before it has announced anything: nothing to restore
    outbox.publish("fcl/fed/round", b"announcement", tag="round:0")
    outbox.publish("fcl/fed/round", b"ask", tag="request:0", retain=False)
    for echo in (b"announcement", b"ask"):
        outbox.observe("fcl/fed/round", echo)
    outbox.repair(now=100.0)
    assert len(link.sent) == 2
    for foreign in (b"garbage", b""):  # a forged frame, or the retained message deleted
        outbox.observe("fcl/fed/round", foreign)
        outbox.repair(now=100.0 if foreign else 100.5)
    assert link.sent[2:] == [("fcl/fed/round", b"announcement", True, "republish")]  # at most once a second
    outbox.observe("fcl/fed/round", b"announcement")  # the echo of the repair itself
    outbox.repair(now=101.0)
    assert link.sent[3:] == [("fcl/fed/round", b"announcement", True, "republish")]  # the deletion, repaired
    outbox.repair(now=105.0)
    assert len(link.sent) == 4
