"""What the device sends (``edge_client.uplink.Uplink``) alone, without a broker: sequences on the
aggregator's clock, signing, and when the last update is sent again."""

from __future__ import annotations

import threading
import time

import pytest

from edge_client.uplink import SEQUENCE_AHEAD_US, Uplink
from fclcore import topics
from fclcore.codec import CodecLimits, Frame, Header, Kind, decode
from fclcore.signing import verify

KEY = bytes(range(32))


class Link:
    def __init__(self) -> None:
        self.published: list[tuple[str, bytes, str]] = []

    def publish(self, topic: str, payload: bytes, tag: str = ""):
        self.published.append((topic, payload, tag))


def uplink(key: bytes | None = None) -> tuple[Uplink, Link]:
    link = Link()
    return Uplink("fed", "dev-1", link, key, CodecLimits(), threading.Event()), link


def announcement(clock_us: object) -> Frame:
    return Frame(Header(Kind.ROUND, "fed", 1, 0, "aggregator", 1), {"clock_us": clock_us}, {})


def test_sequences_rise_and_follow_the_aggregators_clock() -> None:
    up, _ = uplink()
    first = decode(up.frame(Kind.UPDATE, 0, 0, {"n_samples": 1}, {}, "float32")).header
    second = decode(up.frame(Kind.UPDATE, 1, 0, {}, {}, "float32")).header
    assert (first.kind, first.federation, first.client, first.round) == (Kind.UPDATE, "fed", "dev-1", 0)
    assert second.sequence > first.sequence
    ahead = time.time_ns() // 1000 + 3_600_000_000  # the aggregator's clock is an hour ahead
    up.note_clock(announcement(ahead))
    assert decode(up.frame(Kind.UPDATE, 2, 0, {}, {}, "float32")).header.sequence >= ahead
    for bad in (True, -5, "soon", None):  # not a clock: ignored
        offset = up.clock_offset_us
        up.note_clock(announcement(bad))
        assert up.clock_offset_us == offset


def test_a_sequence_far_ahead_of_the_aggregators_clock_is_brought_back() -> None:
    up, _ = uplink()
    up.sequence = time.time_ns() // 1000 + 10 * SEQUENCE_AHEAD_US  # a checkpoint written under a wrong clock
    sent = decode(up.frame(Kind.UPDATE, 0, 0, {}, {}, "float32")).header.sequence
    assert sent <= time.time_ns() // 1000 + SEQUENCE_AHEAD_US


def test_frames_are_signed_when_the_device_has_a_key() -> None:
    up, _ = uplink(KEY)
    frame = decode(verify(up.frame(Kind.EVAL, 3, 1, {"rejected": {}}, {}, "float32"), KEY))
    assert frame.header.kind is Kind.EVAL and frame.meta == {"rejected": {}}


@pytest.mark.parametrize(
    ("rnd", "arrival", "resent"),
    [(4, 10.0, True), (3, 10.0, False), (4, 1.0, False)],  # its round / another round / asked before it was sent
)
def test_the_last_update_is_sent_again_only_for_its_round_and_after_it_went_out(rnd, arrival, resent) -> None:
    up, link = uplink()
    up.unacked, up.sent_at = b"update", 5.0
    up.resend(rnd, done_round=4, arrival=arrival, why="asked")
    assert link.published == ([(topics.update_topic("fed", "dev-1"), b"update", "resend:4")] if resent else [])
    up.unacked = None
    up.resend(4, done_round=4, arrival=99.0, why="asked")  # acknowledged: nothing to send
    assert len(link.published) == int(resent)
