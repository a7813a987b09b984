"""Large retained frames in chunks, so that a device whose link drops halfway through one
fetches only what it lacks (docs/protocol.md, section 16).

A retained frame longer than ``wire.chunk_bytes`` is published as ``count`` chunks, each its
own retained message on ``<topic>/chunk/<index>``, and then a *manifest* on ``<topic>`` itself,
where the whole frame would have been.  Every chunk and the manifest carry the whole frame's
SHA-256; the manifest also carries each chunk's SHA-256.  A device that gets a manifest
subscribes to the chunks it lacks, one topic each, and leaves each topic once its chunk is in:
after a reconnect its session subscribes again only to the chunks still missing, and the broker
sends only those.  The frame is decoded, once whole and checked, exactly as if it had come in
one message.

A chunk message (little-endian)::

    0   4  magic "FCLC"
    4   1  format: 1
    5   1  the whole frame's kind (where a frame has its kind: meters classify both alike)
    6   2  flags: 0
    8   4  index: 0 .. count - 1, or 0xFFFFFFFF for the manifest
    12  4  count: chunks of the frame (>= 2)
    16  8  total: the whole frame's bytes
    24  4  size: bytes per chunk (the last holds the rest)
    28 32  SHA-256 of the whole frame
    60  n  data: the chunk's bytes; in the manifest, count x 32 bytes, each chunk's SHA-256
    -4  4  CRC-32 (as a frame's: P-4.6) of every byte before it
"""

from __future__ import annotations

import hashlib
import math
import struct
import zlib
from dataclasses import dataclass

CHUNK_MAGIC = b"FCLC"
FORMAT = 1
MANIFEST = 0xFFFFFFFF
MAX_CHUNKS = 4096
MIN_CHUNK_BYTES = 1024
DEFAULT_CHUNK_BYTES = 256 * 1024  # wire.chunk_bytes: a drop costs at most ~2 s of a 1 Mbit/s link
_HEAD = struct.Struct("<4sBBHIIQI32s")  # magic .. whole frame's digest: 60 bytes
_CRC = 4
_DIGEST = 32


class ChunkError(ValueError):
    """A chunk message that must be dropped; the text starts with the reason counted."""


@dataclass(frozen=True)
class Part:
    """One decoded chunk message (``data`` empty in a manifest, whose ``hashes`` it fills)."""

    kind: int
    index: int
    count: int
    total: int
    size: int
    digest: bytes
    data: bytes = b""
    hashes: tuple[bytes, ...] = ()

    @property
    def is_manifest(self) -> bool:
        return self.index == MANIFEST

    def length_of(self, index: int) -> int:
        """The bytes chunk ``index`` of this frame holds."""
        return self.size if index < self.count - 1 else self.total - self.size * (self.count - 1)


def chunk_topic(topic: str, index: int) -> str:
    return f"{topic}/chunk/{index}"


def parse_chunk_topic(topic: str) -> tuple[str, int] | None:
    """(the whole frame's topic, index) of a chunk topic, or None."""
    main, sep, index = topic.rpartition("/chunk/")
    if not sep or not index.isdigit() or len(index) > 4:
        return None
    return main, int(index)


def split(payload: bytes, chunk_bytes: int) -> tuple[bytes, list[bytes]]:
    """(manifest, chunks) of ``payload``, a frame longer than ``chunk_bytes``."""
    if len(payload) <= chunk_bytes or chunk_bytes < MIN_CHUNK_BYTES:
        raise ValueError(f"split: a frame of {len(payload)} bytes is not split into chunks of {chunk_bytes}")
    count = math.ceil(len(payload) / chunk_bytes)
    if count > MAX_CHUNKS:
        raise ValueError(f"split: {count} chunks of {chunk_bytes} bytes exceed {MAX_CHUNKS}; raise wire.chunk_bytes")
    kind, digest = payload[5] if len(payload) > 5 else 0, hashlib.sha256(payload).digest()
    datas = [payload[i * chunk_bytes : (i + 1) * chunk_bytes] for i in range(count)]

    def message(index: int, data: bytes) -> bytes:
        head = _HEAD.pack(CHUNK_MAGIC, FORMAT, kind, 0, index, count, len(payload), chunk_bytes, digest)
        body = head + data
        return body + struct.pack("<I", zlib.crc32(body))

    manifest = message(MANIFEST, b"".join(hashlib.sha256(d).digest() for d in datas))
    return manifest, [message(i, d) for i, d in enumerate(datas)]


def parse(raw: bytes, max_total: int) -> Part:
    """A chunk message checked on its own: layout, CRC, sizes (``max_total``: the frame size limit)."""
    if len(raw) < _HEAD.size + _CRC or raw[:4] != CHUNK_MAGIC:
        raise ChunkError(f"chunk-codec: not a chunk message ({len(raw)} bytes)")
    (crc,) = struct.unpack_from("<I", raw, len(raw) - _CRC)
    if zlib.crc32(raw[:-_CRC]) != crc:
        raise ChunkError("chunk-codec: CRC mismatch")
    _, fmt, kind, flags, index, count, total, size, digest = _HEAD.unpack_from(raw)
    if fmt != FORMAT or flags != 0:
        raise ChunkError(f"chunk-codec: format {fmt} flags {flags}, expected format {FORMAT} flags 0")
    if total > max_total:
        raise ChunkError(f"chunk-size: a frame of {total} bytes exceeds the limit of {max_total}")
    if not 2 <= count <= MAX_CHUNKS or size < 1 or count != math.ceil(total / size):
        raise ChunkError(f"chunk-count: {count} chunks of {size} bytes do not make {total} bytes")
    data = raw[_HEAD.size : -_CRC]
    if index == MANIFEST:
        if len(data) != count * _DIGEST:
            raise ChunkError(f"chunk-codec: a manifest of {count} chunks holds {len(data)} bytes of hashes")
        hashes = tuple(data[i : i + _DIGEST] for i in range(0, len(data), _DIGEST))
        return Part(kind, index, count, total, size, digest, hashes=hashes)
    part = Part(kind, index, count, total, size, digest, data)
    if index >= count:
        raise ChunkError(f"chunk-index: index {index} of {count} chunks")
    if len(data) != part.length_of(index):
        raise ChunkError(f"chunk-size: chunk {index} holds {len(data)} bytes, expected {part.length_of(index)}")
    return part
