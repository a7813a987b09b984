"""Hand-built wire frames, written from the codec's documented layout and not by its encoder."""

from __future__ import annotations

import math
import struct
import zlib

import numpy as np

from fclcore.codec import MAGIC, VERSION


def reseal(body: bytes) -> bytes:
    """Append a correct CRC so that checks behind the checksum are exercised."""
    return bytes(body) + struct.pack("<I", zlib.crc32(body))


def mutated(frame: bytes, edits) -> bytes:
    """``frame`` (CRC dropped) with (op, pos, byte) edits applied: "insert", "set" or delete,
    resealed with a valid CRC so the decoder's own checks are what the edits hit."""
    body = bytearray(frame[:-4])
    for op, pos, byte in edits:
        pos %= len(body) + 1
        if op == "insert":
            body.insert(pos, byte)
        elif pos < len(body):
            if op == "set":
                body[pos] = byte
            else:
                del body[pos]
    return reseal(bytes(body))


def raw_frame(
    *,
    magic=MAGIC,
    version=VERSION,
    kind=2,
    flags=0,
    fed=b"f",
    client=b"c",
    meta=b"{}",
    tensors=(),
    count=None,
    extra=b"",
) -> bytes:
    """Build a frame by hand, independently of the encoder, with a valid CRC."""
    out = struct.pack("<4sBBHIIQ", magic, version, kind, flags, 1, 0, 9)
    out += bytes([len(fed)]) + fed + bytes([len(client)]) + client
    out += struct.pack("<I", len(meta)) + meta
    out += struct.pack("<H", len(tensors) if count is None else count) + b"".join(tensors) + extra
    return reseal(out)


def rec(name=b"t", layout=0, dtype=1, dims=(4,), nnz=None, data=None) -> bytes:
    """One tensor record; default data is valid for a dense float32 tensor."""
    out = bytes([len(name)]) + name + struct.pack("<BBB", layout, dtype, len(dims))
    out += struct.pack(f"<{len(dims)}I", *dims)
    if nnz is not None:
        out += struct.pack("<I", nnz)
    if data is None:
        data = np.ones(math.prod(dims), "<f4").tobytes()
    return out + data


def f32(*xs) -> bytes:
    return np.array(xs, "<f4").tobytes()


def u16(*xs) -> bytes:
    return np.array(xs, "<u2").tobytes()
