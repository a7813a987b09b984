"""The device's half of chunked frames (``fclcore.chunks``; docs/protocol.md, section 16): a
manifest starts a fetch, each chunk is checked against it and kept, and the whole frame, once
every chunk is in and its digest is right, goes on as if it had arrived in one message.

Each chunk topic is subscribed alone and left once its chunk is in, so after a dropped link the
session subscribes again only to what is still missing: a drop costs the chunk it cut, not the
frame.  A chunk that does not fit its manifest (index, count, size, hash) is dropped with its
reason and changes nothing: the fetch still waits for the genuine one.

The last whole frame of the round topic is kept: the broker hands the retained manifest again
after every reconnect, and a re-announced round must reach the daemon (it re-sends its update
then) without fetching the frame again.

A device that declared it reads no chunks (docs/protocol.md P-CAP-4) holds itself to that: it
drops every chunk message (``chunk-declared``), so a frame sent to it in chunks never arrives.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field

from fclcore.chunks import ChunkError, Part, chunk_topic, parse, parse_chunk_topic

log = logging.getLogger("edge_client.daemon")
Message = tuple[str, bytes, int]  # (topic, payload, size on the wire)


@dataclass
class Fetch:
    manifest: Part
    size: int  # wire bytes of the manifest
    parts: dict[int, tuple[bytes, int]] = field(default_factory=dict)  # index -> (its bytes, its wire bytes)


ASIDE = 2  # frames per topic whose chunks are kept without a fetch of their own


class ChunkFetch:
    def __init__(self, link, max_total: int, keep_whole: tuple[str, ...] = (), reads: bool = True) -> None:
        """``keep_whole``: topics whose last whole frame is kept for a manifest seen again;
        ``reads``: False for a device that declared it reads no chunks."""
        self.link, self.max_total, self.keep_whole, self.reads = link, max_total, keep_whole, reads
        self.fetches: dict[str, Fetch] = {}  # the frame's topic -> its fetch in progress
        # topic -> digest -> (its layout, its chunks) of frames without a fetch: chunks that came
        # before their manifest, and those of a fetch another manifest replaced (it may come back)
        self.aside: dict[str, dict[bytes, tuple[Part, dict[int, tuple[bytes, int]]]]] = {}
        self.whole: dict[str, tuple[bytes, bytes]] = {}  # topic -> (digest, frame) last fetched, for keep_whole
        self.fetched = 0  # frames put together

    def take(self, topic: str, raw: bytes, size: int) -> Message | None:
        """A chunk message (manifest or chunk): the whole frame once it is in, else None.
        ``ChunkError`` (the reason first) for a message to drop and count."""
        if not self.reads:
            raise ChunkError(f"chunk-declared: a chunk message on {topic}; this device declared it reads none")
        part = parse(raw, self.max_total)
        where = parse_chunk_topic(topic)
        if part.is_manifest:
            if where is not None:
                raise ChunkError(f"chunk-index: a manifest on the chunk topic {topic}")
            return self._manifest(topic, part, size)
        if where is None or where[1] != part.index:
            raise ChunkError(f"chunk-index: chunk {part.index} on {topic}")
        return self._chunk(where[0], part, size)

    def owns(self, topic: str) -> bool:
        """Whether ``topic`` is a chunk topic this device subscribed to."""
        return topic in self.link.subscriptions and parse_chunk_topic(topic) is not None

    def _manifest(self, topic: str, part: Part, size: int) -> Message | None:
        kept = self.whole.get(topic)
        if kept is not None and kept[0] == part.digest:
            return topic, kept[1], size  # seen again (a reconnect): the frame it names is here
        fetch = self.fetches.get(topic)
        if fetch is not None and fetch.manifest.digest == part.digest:
            return None  # seen again while its chunks come
        if fetch is not None:  # another frame replaced it: its chunks are kept aside, it may come back
            self._leave(topic, fetch)
            self._put_aside(topic, fetch.manifest, fetch.parts)
        fetch = self.fetches[topic] = Fetch(part, size)
        _, held = self.aside.get(topic, {}).pop(part.digest, (None, {}))
        log.info("fetching a %d-byte frame on %s in %d chunks", part.total, topic, part.count)
        for index in range(part.count):
            data, got = held.get(index, (b"", 0))
            if got and len(data) == part.length_of(index) and hashlib.sha256(data).digest() == part.hashes[index]:
                self._keep(topic, fetch, index, data, got)
            if index not in fetch.parts:
                self.link.subscribe(chunk_topic(topic, index))
        return self._complete(topic, fetch)

    def _chunk(self, topic: str, part: Part, size: int) -> Message | None:
        fetch = self.fetches.get(topic)
        if fetch is None or fetch.manifest.digest != part.digest:
            self._put_aside(topic, part, {part.index: (part.data, size)})  # a newer frame's, before its manifest
            return None
        m = fetch.manifest
        if (part.count, part.total, part.size, part.kind) != (m.count, m.total, m.size, m.kind):
            raise ChunkError(f"chunk-count: chunk {part.index} says {part.count} x {part.size} bytes of {part.total}")
        if hashlib.sha256(part.data).digest() != m.hashes[part.index]:
            raise ChunkError(f"chunk-digest: chunk {part.index} does not hash to its manifest's entry")
        if part.index in fetch.parts:
            return None  # delivered twice
        self._keep(topic, fetch, part.index, part.data, size)
        return self._complete(topic, fetch)

    def _keep(self, topic: str, fetch: Fetch, index: int, data: bytes, size: int) -> None:
        fetch.parts[index] = (data, size)
        self.link.unsubscribe(chunk_topic(topic, index))

    def _complete(self, topic: str, fetch: Fetch) -> Message | None:
        if len(fetch.parts) < fetch.manifest.count:
            return None
        del self.fetches[topic]
        frame = b"".join(fetch.parts[i][0] for i in range(fetch.manifest.count))
        if hashlib.sha256(frame).digest() != fetch.manifest.digest:  # every chunk matched its hash: a forged manifest
            raise ChunkError(f"chunk-digest: the frame on {topic} does not hash to its manifest's digest")
        if topic in self.keep_whole:
            self.whole[topic] = (fetch.manifest.digest, frame)
        self.fetched += 1
        return topic, frame, fetch.size + sum(got for _, got in fetch.parts.values())

    def _put_aside(self, topic: str, layout: Part, parts: dict[int, tuple[bytes, int]]) -> None:
        """Keep ``parts`` of the frame ``layout`` names (its digest), at most ``ASIDE`` frames per
        topic, each of one layout (so at most a frame's bytes): checked once its manifest comes."""
        frames = self.aside.setdefault(topic, {})
        first, held = frames.pop(layout.digest, (layout, {}))  # re-inserted last: the newest
        if (first.count, first.total, first.size) == (layout.count, layout.total, layout.size):
            held.update(parts)
        frames[layout.digest] = (first, held)
        while len(frames) > ASIDE:
            frames.pop(next(iter(frames)))

    def _leave(self, topic: str, fetch: Fetch) -> None:
        for index in range(fetch.manifest.count):
            if index not in fetch.parts:
                self.link.unsubscribe(chunk_topic(topic, index))
