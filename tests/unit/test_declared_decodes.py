"""A device holds itself to what it declared it decodes (docs/protocol.md P-CAP-1, P-CAP-4):
its decoder refuses the rest, it drops chunk messages, and it reads its own topic."""

from __future__ import annotations

import numpy as np
import pytest

from edge_client.chunkfetch import ChunkFetch
from fclcore import topics
from fclcore.capabilities import Decodes
from fclcore.chunks import ChunkError, split
from fclcore.codec import CodecError, Frame, Header, Kind, SparseTensor, decode, encode

HEADER = Header(Kind.ROUND, "fed", 1, 0, "aggregator", 2)
VALUES = np.linspace(-1, 1, 64, dtype=np.float32)


def _frame(coding: str, sparse: bool = False) -> bytes:
    tensor = SparseTensor((64,), np.array([3, 9]), VALUES[:2]) if sparse else VALUES
    return encode(Frame(HEADER, {}, {"w": tensor}), coding)


# docs/protocol.md P-CAP-4
@pytest.mark.parametrize(
    "declared, payload, says",
    [
        ({"frames": [1]}, _frame("int8"), "header.version"),
        ({"dtypes": ["float32"]}, _frame("float16"), "dtype"),
        ({"dtypes": ["float32", "float16"]}, _frame("int8"), "dtype"),
        ({"layouts": ["dense", "bitmap"]}, _frame("float32", sparse=True), "layout"),
    ],
)
def test_the_decoder_refuses_what_the_device_did_not_declare(declared: dict, payload: bytes, says: str) -> None:
    decode(payload)  # everyone else reads it
    with pytest.raises(CodecError, match=says):
        decode(payload, Decodes.of(declared).limits())


# docs/protocol.md P-CAP-1, P-CAP-2
def test_a_declaration_less_than_everything_reads_its_own_topic() -> None:
    assert Decodes.of({}).everything and Decodes.of(None).announcements("f", "d") == topics.round_topic("f")
    lean = Decodes.of({"chunks": False})
    assert not lean.everything and lean.announcements("f", "d") == topics.downlink_topic("f", "d") == "fcl/f/down/d"
    assert not Decodes.of({"frames": [1]}).int8 and Decodes.of({"dtypes": ["float32", "int8"]}).int8
    with pytest.raises(ValueError, match="decodes.layouts"):
        Decodes.of({"layouts": ["sparse"]})


class Link:
    subscriptions: set = set()

    def subscribe(self, topic: str) -> None:
        raise AssertionError(f"subscribed to {topic}")


def test_a_device_that_reads_no_chunks_drops_them() -> None:
    manifest, chunks = split(bytes(5000), 1024)
    fetch = ChunkFetch(Link(), 2**20, reads=False)
    for topic, message in [("fcl/f/down/d", manifest), ("fcl/f/down/d/chunk/0", chunks[0])]:
        with pytest.raises(ChunkError, match="chunk-declared"):
            fetch.take(topic, message, len(message))
