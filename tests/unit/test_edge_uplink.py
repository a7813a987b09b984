"""What the device sends (``edge_client.uplink.Uplink``) alone, without a broker: sequences from
the device's counter for its run (no clock), renumbering after a NACK, signing, and when the last
update is sent again."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from edge_client.uplink import Uplink
from fclcore import topics
from fclcore.codec import CodecLimits, Kind, decode
from fclcore.runid import started_us
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


RUN = "0006f1c2a3b4c5d6-1a2b3c4d"
LATER_RUN = "0006f1c2a3b4c5e0-00000000"


def test_sequences_count_up_above_the_runs_start_whatever_the_clock(monkeypatch) -> None:
    """P-SEQ-1, P-SEQ-2: the next number is max(last, start of the run) + 1; the wall clock
    stepping back or forward an hour between frames changes nothing."""
    up, _ = uplink()
    first = decode(up.frame(Kind.UPDATE, 0, 0, {"n_samples": 1}, {}, "float32", RUN)).header
    assert (first.kind, first.federation, first.client, first.round) == (Kind.UPDATE, "fed", "dev-1", 0)
    assert first.sequence == started_us(RUN) + 1
    for step in (-3600, 3600):
        now = time.time()
        monkeypatch.setattr(time, "time", lambda now=now, step=step: now + step)
        monkeypatch.setattr(time, "time_ns", lambda now=now, step=step: int((now + step) * 1e9))
        assert decode(up.frame(Kind.UPDATE, 1, 0, {}, {}, "float32", RUN)).header.sequence == up.sequence
    assert up.sequence == started_us(RUN) + 3
    assert (
        decode(up.frame(Kind.UPDATE, 0, 0, {}, {}, "float32", LATER_RUN)).header.sequence == started_us(LATER_RUN) + 1
    )


def test_a_counter_restored_from_a_checkpoint_goes_on_from_there() -> None:
    up, _ = uplink()
    up.sequence = started_us(RUN) + 41  # the checkpoint's
    assert decode(up.frame(Kind.EVAL, 3, 0, {}, {}, "float32", RUN)).header.sequence == started_us(RUN) + 42


def _nack(header, reason: str, mark: int) -> dict:
    return {
        "kind": header.kind.name,
        "round": header.round,
        "sequence": header.sequence,
        "reason": reason,
        "mark": mark,
    }


@pytest.mark.parametrize("key", [None, KEY], ids=["unsigned", "signed"])
@pytest.mark.parametrize("reason", ["replay", "sequence", "duplicate"])  # duplicate: numbered as the mark
def test_a_nack_naming_the_unacked_update_renumbers_it_and_nothing_else(key, reason) -> None:
    """P-SEQ-6: renumbered to mark + 1, every other byte of the frame the same (int8 values too)."""
    up, _ = uplink(key)
    values = np.linspace(-1, 1, 300, dtype=np.float32)
    up.unacked = up.frame(Kind.UPDATE, 2, 0, {"n_samples": 5}, {"w": values}, "int8", RUN)
    plain = verify(up.unacked, key) if key else up.unacked
    header = decode(plain).header
    mark = header.sequence if reason == "duplicate" else started_us(RUN) + 1000  # duplicate: its number is the mark
    others = (
        {**_nack(header, reason, mark), "sequence": header.sequence + 1},  # another frame (a forgery in its name)
        _nack(header, "content", mark),  # a reason a new number does not cure
        _nack(header, "duplicate", header.sequence - 1),  # a second update for the round: above the mark
    )
    for other in others:
        assert up.renumber(other) is False
    assert up.renumber(_nack(header, reason, mark)) is True
    again = verify(up.unacked, key) if key else up.unacked
    assert decode(again).header.sequence == mark + 1 == up.sequence
    assert again[:16] == plain[:16] and again[24:-4] == plain[24:-4]  # only the sequence and the CRC changed
    np.testing.assert_array_equal(decode(again).tensors["w"], decode(plain).tensors["w"])


def test_frames_are_signed_when_the_device_has_a_key() -> None:
    up, _ = uplink(KEY)
    frame = decode(verify(up.frame(Kind.EVAL, 3, 1, {"rejected": {}}, {}, "float32", RUN), KEY))
    assert frame.header.kind is Kind.EVAL and frame.meta == {"rejected": {}}


@pytest.mark.parametrize(
    ("rnd", "arrival", "resent"),
    [(4, 10.0, True), (3, 10.0, False), (4, 1.0, False)],  # its round / another round / asked before it was sent
)  # docs/protocol.md P-NACK-5: only a later round acknowledges an update; it stays until then
def test_the_last_update_is_sent_again_only_for_its_round_and_after_it_went_out(rnd, arrival, resent) -> None:
    up, link = uplink()
    up.unacked, up.sent_at = b"update", 5.0
    up.resend(rnd, done_round=4, arrival=arrival, why="asked")
    assert link.published == ([(topics.update_topic("fed", "dev-1"), b"update", "resend:4")] if resent else [])
    up.unacked = None
    up.resend(4, done_round=4, arrival=99.0, why="asked")  # acknowledged: nothing to send
    assert len(link.published) == int(resent)


class Info:
    """paho's MQTTMessageInfo as far as the uplink asks: whether the broker has the message."""

    def __init__(self) -> None:
        self.published = False

    def is_published(self) -> bool:
        return self.published


def test_no_copy_more_is_queued_while_the_last_one_is_still_on_its_way() -> None:
    """A multi-megabyte update on a slow uplink outlasts the aggregator's re-send interval: each
    REQUEST queuing another copy behind it kept Sequential-MNIST FedAvg devices under lte-m
    from ever delivering their final evaluation (docs/links.md).  paho re-sends an unacknowledged
    QoS 1 message after a reconnect by itself, so the uplink waits until the broker has it."""
    up, link = uplink()
    infos: list[Info] = []

    def publish(topic: str, payload: bytes, tag: str = "") -> Info:
        link.published.append((topic, payload, tag))
        infos.append(Info())
        return infos[-1]

    link.publish = publish
    up.unacked = b"update"
    up.send(up.unacked, "update:4")
    up.sent_at = 5.0
    for arrival in (10.0, 30.0, 50.0):
        up.resend(4, done_round=4, arrival=arrival, why="asked")
    assert [tag for *_, tag in link.published] == ["update:4"]
    infos[0].published = True  # the broker acknowledged it, and the aggregator asks again: it lost it
    up.resend(4, done_round=4, arrival=70.0, why="asked")
    assert [tag for *_, tag in link.published] == ["update:4", "resend:4"]
    up.resend(4, done_round=4, arrival=90.0, why="asked")  # the re-sent copy is on its way in turn
    assert len(link.published) == 2


def test_a_copy_published_while_the_link_was_down_does_not_stop_a_re_send() -> None:
    """paho's handle of a message published while disconnected raises instead of answering
    (a broker restart mid-round): the update is sent again, as before."""
    up, link = uplink()

    class Unknown(Info):
        def is_published(self) -> bool:
            raise RuntimeError("Message publish failed: The client is not currently connected.")

    up.unacked, up.in_flight, up.sent_at = b"update", Unknown(), 5.0
    up.resend(4, done_round=4, arrival=10.0, why="its round is still open")
    assert [tag for *_, tag in link.published] == ["resend:4"]
