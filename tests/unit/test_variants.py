"""Frames made for a device that decodes less (docs/protocol.md section 17): for each thing a
device may leave out, the encoding the aggregator picks, and that the model it brings is the
global model to the bit (P-CAP-3); the shared bytes where the device reads them; who gets what
on which topic (P-CAP-2); and what cannot be served (P-CAP-5)."""

from __future__ import annotations

import numpy as np
import pytest
from support.agg_parts import FED, RecordingLink

from aggregator.outbox import Outbox
from aggregator.variants import Shared, Variants
from fclcore import topics
from fclcore.capabilities import Decodes, device_capabilities
from fclcore.codec import CodecLimits, Frame, Header, Kind, SparseTensor, ValueCoding, decode, encode
from fclcore.model_sync import ModelRef, apply, catchup, changes, delta, model_digest, model_hash

LIMITS = CodecLimits()
HEADER = Header(Kind.ROUND, FED, 5, 0, "aggregator", 9)


def _models() -> tuple[dict, dict, dict]:
    rng = np.random.default_rng(0)
    prev = {"w": rng.normal(size=(40, 30)).astype(np.float32), "b": rng.normal(size=30).astype(np.float32)}
    served = {k: v.copy() for k, v in prev.items()}
    pos = {"w": rng.random((40, 30)) < 0.3}
    served["w"][pos["w"]] += rng.normal(size=int(pos["w"].sum())).astype(np.float32)
    served["w"][0, :3] += 1.0  # changes outside the derived positions too
    served["b"][:4] -= 0.25
    return prev, served, pos


def _shared(coding: str | ValueCoding = "float32") -> tuple[Shared, dict, dict]:
    prev, served, pos = _models()
    tensors, derived, removed = delta(prev, served, pos, 1)
    ref = ModelRef(5, 4, model_hash(served), derived, removed, model_digest(served))
    meta = {"run": "run-1", "model": ref.to_meta()}
    payload = encode(Frame(HEADER, meta, tensors), coding, LIMITS)
    return Shared(HEADER, meta, payload, served, changes(prev, served), "round:5"), prev, served


def _wire(payload: bytes) -> tuple[int, set[tuple[int, int]]]:
    """(frame version, {(layout, dtype)} of its tensors), read off the bytes."""
    frame = decode(payload)
    kinds = set()
    for t in frame.tensors.values():
        if isinstance(t, SparseTensor):
            kinds.add("bitmap" if getattr(t, "bitmap", None) is not None else "index")
        else:
            kinds.add("dense")
    return payload[4], kinds


CASES = {  # what the device leaves out -> the shared frame's coding that needs a variant
    "no derived positions": (Decodes(derived_positions=False), "float32"),
    "no int8": (Decodes(frames=(1,), dtypes=("float32", "float16")), "int8"),
    "no float16, no int8": (Decodes(dtypes=("float32",)), "int8"),
    "dense only": (Decodes(layouts=("dense",), derived_positions=False), "float32"),
    "no bitmap": (Decodes(layouts=("dense", "index"), derived_positions=False), "float16"),
}


# docs/protocol.md P-CAP-3
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_variant_is_coded_within_the_declaration_and_brings_the_global_model_exactly(case: str) -> None:
    decodes, coding = CASES[case]
    shared, prev, served = _shared(coding)
    payload = Variants(Outbox(RecordingLink(), FED, "run-1"), FED, LIMITS).frame_for(decodes, shared)
    assert payload != shared.payload
    frame = decode(payload, decodes.limits(LIMITS))  # it reads it: versions, dtypes, layouts it declared
    ref = ModelRef.of(frame.meta)
    assert ref.derived == () and ref.digest == model_digest(served) and ref.base == 4
    assert model_digest(apply(prev, ref, frame.tensors)) == model_digest(served)
    version, layouts = _wire(payload)
    assert version == 1 and layouts <= set(decodes.layouts)
    assert frame.meta["run"] == "run-1" and frame.header == HEADER


def test_a_device_that_reads_the_shared_frame_gets_its_bytes() -> None:
    shared, _, _ = _shared("int8")
    variants = Variants(Outbox(RecordingLink(), FED, "run-1"), FED, LIMITS)
    assert variants.frame_for(Decodes(chunks=False), shared) is shared.payload
    assert variants.frame_for(Decodes(layouts=("dense", "index", "bitmap")), shared) is shared.payload


def test_a_variant_of_a_first_announcement_is_the_full_model() -> None:
    _, served, _ = _models()
    ref = ModelRef(0, None, model_hash(served), digest=model_digest(served))
    meta = {"run": "run-1", "model": ref.to_meta()}
    payload = encode(Frame(HEADER, meta, served), "int8", LIMITS)
    shared = Shared(HEADER, meta, payload, served, None, "round:0")
    variant = Variants(Outbox(RecordingLink(), FED, "run-1"), FED, LIMITS).frame_for(Decodes(frames=(1,)), shared)
    frame = decode(variant, Decodes(frames=(1,)).limits())
    assert ModelRef.of(frame.meta).base is None
    assert model_digest(apply(None, ModelRef.of(frame.meta), frame.tensors)) == model_digest(served)


def _status(decodes: Decodes, protocol: int = 4) -> dict:
    return {"state": "online", **device_capabilities(decodes), "protocol": protocol}


# docs/protocol.md P-CAP-1, P-CAP-2
def test_only_devices_that_declare_less_get_their_own_topic_whole_and_at_once() -> None:
    link = RecordingLink()
    outbox = Outbox(link, FED, "run-1", chunk_bytes=1024)
    variants = Variants(outbox, FED, LIMITS)
    shared, _, _ = _shared("int8")
    assert variants.on_status("all", _status(Decodes())) is None
    assert variants.on_status("old", _status(Decodes(chunks=False), protocol=3)) is None  # reads the shared topics
    sent = variants.announce(shared)
    assert sent == {} and link.sent == []
    assert variants.on_status("lean", _status(Decodes(frames=(1,), chunks=False))) is None  # at once: the latest
    assert [(t, r) for t, _, r, _ in link.sent] == [(topics.downlink_topic(FED, "lean"), True)]  # whole: no chunks
    assert len(link.sent[0][1]) > 1024 and link.sent[0][1][4] == 1
    link.sent.clear()
    sent = variants.announce(shared)
    assert list(sent) == ["lean"] and sent["lean"].payload_bytes == len(link.sent[0][1])
    assert 0 < sent["lean"].model_bytes < sent["lean"].payload_bytes
    link.sent.clear()
    variants.request(b"request", ["all", "lean"], "request:5")
    assert link.sent == [(topics.downlink_topic(FED, "lean"), b"request", False, "request:5")]
    assert variants.on_status("lean", _status(Decodes())) is None  # declares everything again: shared topics
    assert variants.declared == {}


# docs/protocol.md P-CAP-5
@pytest.mark.parametrize(
    "decodes, says",
    [
        ({"frames": [2]}, "version 1"),
        ({"dtypes": ["float16", "int8"]}, "float32"),
        ({"layouts": ["index", "bitmap"]}, "dense"),
        ({"frames": [1], "chunks": "no"}, "chunks"),
        ({"frames": [1], "colour": True}, "colour"),
    ],
)
def test_what_cannot_be_served_is_named(decodes: dict, says: str) -> None:
    variants = Variants(Outbox(RecordingLink(), FED, "run-1"), FED, LIMITS)
    problem = variants.on_status("odd", {"state": "online", "protocol": 4, "decodes": decodes})
    assert problem is not None and says in problem and "odd" not in variants.declared


# docs/protocol.md P-CAP-6
def test_a_knowledge_frame_is_coded_within_the_declaration_with_the_values_others_decode() -> None:
    variants = Variants(Outbox(RecordingLink(), FED, "run-1"), FED, LIMITS)
    variants.on_status("lean", _status(Decodes(frames=(1,), chunks=False)))
    values = np.linspace(-1, 1, 300, dtype=np.float32)
    header = Header(Kind.KNOWLEDGE, FED, 2, 1, "aggregator", 3)
    payload = encode(Frame(header, {"for_task": 1}, {"kb": values}), "int8", LIMITS)
    assert variants.knowledge("other", payload) == (payload, False)
    mine, whole = variants.knowledge("lean", payload)
    assert whole and mine[4] == 1
    np.testing.assert_array_equal(decode(mine).tensors["kb"], decode(payload).tensors["kb"])


# docs/protocol.md P-CAP-6
def test_sync_frames_are_coded_within_what_every_such_device_reads() -> None:
    prev, served, _ = _models()
    tensors = catchup([changes(prev, served)], served, 4)
    variants = Variants(Outbox(RecordingLink(), FED, "run-1"), FED, LIMITS)
    assert variants.sync(tensors, served, "float16", HEADER) == (tensors, ValueCoding("float16"), False)
    variants.on_status("lean", _status(Decodes(layouts=("dense",), dtypes=("float32", "int8"), chunks=False)))
    out, coding, whole = variants.sync(tensors, served, "float16", HEADER)
    assert whole and coding == ValueCoding("float32", sparse_layouts=())
    frame = decode(encode(Frame(HEADER, {}, out), coding), Decodes(layouts=("dense",)).limits())
    ref = ModelRef(5, 4, model_hash(served))
    assert model_digest(apply(prev, ref, frame.tensors)) == model_digest(served)
