"""Large retained frames in chunks (docs/protocol.md section 16, P-CHK-*): the aggregator's outbox
splits what is longer than ``wire.chunk_bytes``, a device puts it together from the chunks it
lacks (``edge_client.chunkfetch``), and a hostile chunk is dropped with its reason while the
fetch goes on unharmed.  The chunk layout is written here from the documented table, not from
the module's own packer."""

from __future__ import annotations

import hashlib
import os
import struct
import zlib

import pytest

from aggregator.outbox import Outbox
from edge_client.chunkfetch import ChunkFetch
from fclcore.chunks import CHUNK_MAGIC, MANIFEST, ChunkError, chunk_topic, parse, parse_chunk_topic, split
from fclcore.codec import Frame, Header, Kind, encode
from fclcore.transport import publish_packet_bytes

TOPIC = "fcl/fed/round"
LIMIT = 64 * 2**20
SIZE = 4096


class Link:
    """What the outbox and the fetch need of a transport: publish, (un)subscribe, a session's list."""

    connects = 1

    def __init__(self) -> None:
        self.published: list[tuple[str, bytes, bool, str | None]] = []
        self.subscriptions: list[str] = [TOPIC]

    def publish(self, topic: str, payload: bytes, *, retain: bool = False, tag: str | None = None) -> None:
        self.published.append((topic, payload, retain, tag))

    def subscribe(self, topic: str) -> None:
        if topic not in self.subscriptions:
            self.subscriptions.append(topic)

    def unsubscribe(self, topic: str) -> None:
        if topic in self.subscriptions:
            self.subscriptions.remove(topic)


def message(index: int, count: int, total: int, size: int, digest: bytes, data: bytes, kind: int = 1) -> bytes:
    """A chunk message from the documented layout (docs/protocol.md, section 16)."""
    body = CHUNK_MAGIC + struct.pack("<BBHIIQI", 1, kind, 0, index, count, total, size) + digest + data
    return body + struct.pack("<I", zlib.crc32(body))


def frame(n: int = 3 * SIZE + 100) -> bytes:
    """A real ROUND frame of about ``n`` bytes (random values: nothing compresses)."""
    import numpy as np

    values = np.frombuffer(os.urandom(n - n % 4), dtype=np.float32).copy()
    values[~np.isfinite(values)] = 0.0
    return encode(Frame(Header(Kind.ROUND, "fed", 3, 0, "aggregator", 9), {"run": "x"}, {"w": values}))


def published(payload: bytes, chunk_bytes: int = SIZE) -> tuple[bytes, list[bytes]]:
    return split(payload, chunk_bytes)


def test_a_frame_above_the_threshold_leaves_as_chunks_then_its_manifest_and_one_below_whole() -> None:
    """P-CHK-1, P-CHK-2: chunks first, then the manifest where the frame would have been; the
    sizes the outbox returns are what a device that receives it once receives."""
    link = Link()
    outbox = Outbox(link, "fed", "run", chunk_bytes=SIZE)
    small = frame(SIZE // 2)
    assert outbox.publish(TOPIC, small, tag="round:0") == (publish_packet_bytes(TOPIC, len(small)), len(small))
    assert link.published == [(TOPIC, small, True, "round:0")]
    big = frame()
    link.published.clear()
    wire, sent = outbox.publish(TOPIC, big, tag="round:1")
    topics_ = [t for t, *_ in link.published]
    assert topics_ == [chunk_topic(TOPIC, i) for i in range(4)] + [TOPIC]
    assert all(retain and tag == "round:1" for _, _, retain, tag in link.published)
    assert wire == sum(publish_packet_bytes(t, len(p)) for t, p, *_ in link.published)
    assert sent == sum(len(p) for _, p, *_ in link.published)
    assert b"".join(parse(p, LIMIT).data for _, p, *_ in link.published[:4]) == big
    assert outbox.publish(TOPIC, b"r" * 10, tag="request:1", retain=False) == (publish_packet_bytes(TOPIC, 10), 10)


def test_chunk_topics_a_longer_frame_left_are_cleared_and_a_reconnect_publishes_the_chunks_again() -> None:
    link = Link()
    outbox = Outbox(link, "fed", "run", chunk_bytes=SIZE)
    outbox.publish(TOPIC, frame(), tag="round:1")
    link.published.clear()
    outbox.publish(TOPIC, frame(2 * SIZE), tag="round:2")  # 3 chunks: the 4th topic still holds the last frame's
    assert (chunk_topic(TOPIC, 3), b"", True, "clear") in link.published
    link.published.clear()
    link.connects, outbox.seen_connects = 2, 1
    outbox.republish_after_outage()
    assert [t for t, *_ in link.published] == [chunk_topic(TOPIC, i) for i in range(3)] + [TOPIC]


def fetch_all(fetch: ChunkFetch, manifest: bytes, chunks: list[bytes], order=None):
    got = fetch.take(TOPIC, manifest, 100)
    assert got is None
    for i in order if order is not None else range(len(chunks)):
        got = fetch.take(chunk_topic(TOPIC, i), chunks[i], 1000 + i)
    return got


def test_a_device_puts_the_frame_together_whatever_order_its_chunks_come_in() -> None:
    payload = frame()
    manifest, chunks = published(payload)
    link = Link()
    fetch = ChunkFetch(link, LIMIT)
    got = fetch_all(fetch, manifest, chunks, order=[2, 0, 3, 1])
    assert got == (TOPIC, payload, 100 + 1000 * 4 + 0 + 1 + 2 + 3)
    assert link.subscriptions == [TOPIC]  # each chunk topic left once its chunk was in


def test_after_a_drop_only_the_missing_chunks_are_subscribed_and_the_manifest_again_changes_nothing() -> None:
    """P-CHK-4: the session subscribes again to what is in its list, so a reconnect brings the
    manifest again (dropped: its fetch is under way) and only the chunks still missing."""
    payload = frame()
    manifest, chunks = published(payload)
    link = Link()
    fetch = ChunkFetch(link, LIMIT)
    assert fetch.take(TOPIC, manifest, 100) is None
    assert fetch.take(chunk_topic(TOPIC, 0), chunks[0], 1000) is None
    assert fetch.take(chunk_topic(TOPIC, 1), chunks[1], 1000) is None
    # the link drops here, halfway through chunk 2; the broker sends the retained messages again
    assert link.subscriptions == [TOPIC, chunk_topic(TOPIC, 2), chunk_topic(TOPIC, 3)]
    assert fetch.take(TOPIC, manifest, 100) is None
    assert fetch.take(chunk_topic(TOPIC, 2), chunks[2], 1000) is None
    assert fetch.take(chunk_topic(TOPIC, 3), chunks[3], 1000) == (TOPIC, payload, 4100)


def test_the_round_topics_frame_is_kept_so_a_manifest_seen_again_brings_it_without_a_fetch() -> None:
    payload = frame()
    manifest, chunks = published(payload)
    link = Link()
    fetch = ChunkFetch(link, LIMIT, keep_whole=(TOPIC,))
    assert fetch_all(fetch, manifest, chunks) is not None
    assert fetch.take(TOPIC, manifest, 100) == (TOPIC, payload, 100)  # a reconnect: the manifest alone
    assert link.subscriptions == [TOPIC]


def hostile_cases(payload: bytes, digest: bytes) -> dict[str, tuple[str, bytes, str]]:
    """reason -> (topic, message, the reason counted) of chunks that must change nothing."""
    total = len(payload)
    first = payload[:SIZE]
    tampered = bytes([first[0] ^ 1]) + first[1:]
    return {
        "index beyond count": (chunk_topic(TOPIC, 7), message(7, 4, total, SIZE, digest, first), "chunk-index"),
        "index not its topic's": (chunk_topic(TOPIC, 1), message(0, 4, total, SIZE, digest, first), "chunk-index"),
        "wrong count": (chunk_topic(TOPIC, 0), message(0, 5, 5 * SIZE, SIZE, digest, first), "chunk-count"),
        "count that does not make total": (
            chunk_topic(TOPIC, 0),
            message(0, 9, total, SIZE, digest, first),
            "chunk-count",
        ),
        "digest mismatch": (chunk_topic(TOPIC, 0), message(0, 4, total, SIZE, digest, tampered), "chunk-digest"),
        "oversize frame": (chunk_topic(TOPIC, 0), message(0, 4, LIMIT * 4, LIMIT, digest, first), "chunk-size"),
        "short chunk": (chunk_topic(TOPIC, 0), message(0, 4, total, SIZE, digest, first[:-1]), "chunk-size"),
        "bad CRC": (chunk_topic(TOPIC, 0), message(0, 4, total, SIZE, digest, first)[:-1] + b"\0", "chunk-codec"),
        "not a chunk": (chunk_topic(TOPIC, 0), b"FCLC" + b"\0" * 10, "chunk-codec"),
        "manifest on a chunk topic": (
            chunk_topic(TOPIC, 0),
            message(MANIFEST, 4, total, SIZE, digest, b"\0" * 128),
            "chunk-index",
        ),
    }


@pytest.mark.parametrize(
    "case", list(hostile_cases(b"\0" * (3 * SIZE + 10), b"\0" * 32))
)  # P-CHK-5: each is dropped with a counted reason, and the genuine chunks still make the frame
def test_a_hostile_chunk_is_dropped_with_its_reason_and_loses_nothing(case: str) -> None:
    payload = frame()
    manifest, chunks = published(payload)
    link = Link()
    fetch = ChunkFetch(link, LIMIT)
    assert fetch.take(TOPIC, manifest, 100) is None
    assert fetch.take(chunk_topic(TOPIC, 1), chunks[1], 1000) is None
    before = (dict(fetch.fetches[TOPIC].parts), list(link.subscriptions))
    topic, raw, reason = hostile_cases(payload, hashlib.sha256(payload).digest())[case]
    with pytest.raises(ChunkError) as caught:
        fetch.take(topic, raw, len(raw))
    assert str(caught.value).split(":", 1)[0] == reason
    assert (dict(fetch.fetches[TOPIC].parts), list(link.subscriptions)) == before
    for i in (0, 2, 3):
        got = fetch.take(chunk_topic(TOPIC, i), chunks[i], 1000)
    assert got == (TOPIC, payload, 4100)


def test_a_manifest_whose_chunks_do_not_make_its_digest_is_dropped() -> None:
    """Chunks that match a forged manifest's own hashes still fail the whole frame's digest."""
    payload = frame()
    digest = hashlib.sha256(b"another frame").digest()
    datas = [payload[i * SIZE : (i + 1) * SIZE] for i in range(4)]
    hashes = b"".join(hashlib.sha256(d).digest() for d in datas)
    link = Link()
    fetch = ChunkFetch(link, LIMIT)
    fetch.take(TOPIC, message(MANIFEST, 4, len(payload), SIZE, digest, hashes), 100)
    for i in range(3):
        assert fetch.take(chunk_topic(TOPIC, i), message(i, 4, len(payload), SIZE, digest, datas[i]), 1000) is None
    with pytest.raises(ChunkError, match="^chunk-digest"):
        fetch.take(chunk_topic(TOPIC, 3), message(3, 4, len(payload), SIZE, digest, datas[3]), 1000)
    assert fetch.fetched == 0


def test_a_newer_frame_replaces_the_fetch_and_its_chunks_that_came_first_are_kept() -> None:
    """The aggregator publishes a newer frame's chunks before its manifest: a chunk that arrives
    on a topic still subscribed for the older fetch is kept and checked once its manifest comes."""
    old, new = frame(), frame()
    old_manifest, old_chunks = published(old)
    new_manifest, new_chunks = published(new)
    link = Link()
    fetch = ChunkFetch(link, LIMIT)
    fetch.take(TOPIC, old_manifest, 100)
    fetch.take(chunk_topic(TOPIC, 0), old_chunks[0], 1000)
    assert fetch.take(chunk_topic(TOPIC, 2), new_chunks[2], 1000) is None  # the newer frame's, live
    assert fetch.take(TOPIC, new_manifest, 100) is None
    assert sorted(link.subscriptions) == sorted([TOPIC] + [chunk_topic(TOPIC, i) for i in (0, 1, 3)])
    for i in (0, 1):
        assert fetch.take(chunk_topic(TOPIC, i), new_chunks[i], 1000) is None
    assert fetch.take(chunk_topic(TOPIC, 3), new_chunks[3], 1000) == (TOPIC, new, 4100)


def test_split_refuses_what_the_threshold_keeps_whole_and_topics_parse_back() -> None:
    with pytest.raises(ValueError):
        split(b"x" * SIZE, SIZE)
    assert parse_chunk_topic(chunk_topic("fcl/fed/kb/dev-1/full", 12)) == ("fcl/fed/kb/dev-1/full", 12)
    assert parse_chunk_topic("fcl/fed/round") is None
    assert parse_chunk_topic("fcl/fed/round/chunk/x") is None


def test_a_foreign_manifest_mid_fetch_loses_nothing_when_the_genuine_one_comes_back() -> None:
    """A manifest the aggregator did not send (it re-publishes its own: ``Outbox.repair``)
    replaces the fetch; the chunks held are kept aside and taken again with the genuine one."""
    payload = frame()
    manifest, chunks = published(payload)
    forged, _ = published(frame())
    link = Link()
    fetch = ChunkFetch(link, LIMIT)
    fetch.take(TOPIC, manifest, 100)
    fetch.take(chunk_topic(TOPIC, 0), chunks[0], 1000)
    fetch.take(chunk_topic(TOPIC, 2), chunks[2], 1000)
    assert fetch.take(TOPIC, forged, 100) is None
    assert fetch.take(TOPIC, manifest, 100) is None  # the genuine manifest again: chunks 0 and 2 are held
    assert sorted(link.subscriptions) == sorted([TOPIC] + [chunk_topic(TOPIC, i) for i in (1, 3)])
    fetch.take(chunk_topic(TOPIC, 1), chunks[1], 1000)
    assert fetch.take(chunk_topic(TOPIC, 3), chunks[3], 1000) == (TOPIC, payload, 4100)
