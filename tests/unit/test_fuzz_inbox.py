"""100,000+ generated hostile messages through the decoder and the aggregator's message
handler: nothing crashes, and no rejected message changes any state that feeds the model
(the open round's accepted updates, the journal, the per-device sequence marks)."""

from __future__ import annotations

import json
import logging
import struct
import time
import zlib

import numpy as np
import pytest

from aggregator.service import AggregatorService
from fclcore import topics
from fclcore.codec import CodecError, Frame, Header, Kind, SparseTensor, decode, encode
from fclcore.config import from_dict
from fclcore.schema import AggregatorConfig
from fclcore.strategy import Update

N_DECODER, N_HANDLER = 55_000, 45_000  # 100,000 generated inputs in all
FED, OPEN = "fuzz", 3


def _service(tmp_path) -> AggregatorService:
    cfg = from_dict(
        AggregatorConfig,
        {
            "federation": {
                "name": FED,
                "method": "fedavg",
                "num_tasks": 2,
                "rounds_per_task": 4,
                "model": {"hidden_sizes": [8]},
                "wire": {"max_frame_mb": 1},
                "rounds": {"max_update_norm": 1000.0},
            },
            "expected_clients": ["c0", "c1"],
            "out_dir": str(tmp_path / "agg"),
            "input_dim": 6,
        },
        "test",
    )
    return AggregatorService(cfg)


def _valid(service: AggregatorService, client: str, seq: int, rng: np.random.Generator) -> bytes:
    tensors = {k: (v + rng.normal(0, 0.01, v.shape)).astype(np.float32) for k, v in service.global_params.items()}
    if rng.random() < 0.5:  # some tensors sparse
        name = sorted(tensors)[0]
        tensors[name] = SparseTensor.from_dense(tensors[name] * (rng.random(tensors[name].shape) > 0.5))
    meta = {"n_samples": int(rng.integers(1, 100)), "eval": {"round": OPEN - 1, "task": 0, "nll": [1.0]}}
    return encode(Frame(Header(Kind.UPDATE, FED, OPEN, 0, client, seq), meta, tensors))


def _reseal(body: bytes) -> bytes:
    return body + struct.pack("<I", zlib.crc32(body))


def _mutate(frame: bytes, rng: np.random.Generator) -> bytes:
    """One of several damage patterns; most keep a valid CRC so deeper checks are reached."""
    body = bytearray(frame[:-4])
    choice = rng.integers(0, 9)
    if choice == 0:
        return bytes(rng.integers(0, 256, int(rng.integers(0, 400)), dtype=np.uint8))
    if choice == 1:
        return frame[: int(rng.integers(0, len(frame)))]
    if choice == 2:  # flip bits anywhere, CRC fixed up
        for _ in range(int(rng.integers(1, 6))):
            i = int(rng.integers(0, len(body)))
            body[i] ^= 1 << int(rng.integers(0, 8))
        return _reseal(bytes(body))
    if choice == 3:  # overwrite a header field (kind, flags, round, task, sequence)
        offset = int(rng.choice([5, 6, 8, 12, 16]))
        body[offset : offset + 4] = rng.integers(0, 256, 4, dtype=np.uint8).tobytes()
        return _reseal(bytes(body))
    if choice == 4:  # a hostile float: NaN/Inf/huge inside the tensor data
        bad = rng.choice([np.nan, np.inf, -np.inf, 3e38])
        at = int(rng.integers(len(body) // 2, len(body) - 4))
        body[at : at + 4] = np.float32(bad).tobytes()
        return _reseal(bytes(body))
    if choice == 5:  # insert or delete bytes in the middle
        i = int(rng.integers(0, len(body)))
        if rng.random() < 0.5:
            del body[i : i + int(rng.integers(1, 16))]
        else:
            body[i:i] = rng.integers(0, 256, int(rng.integers(1, 16)), dtype=np.uint8).tobytes()
        return _reseal(bytes(body))
    if choice == 6:  # huge length prefixes
        i = int(rng.integers(0, len(body) - 4))
        body[i : i + 4] = struct.pack("<I", int(rng.choice([2**31, 2**32 - 1, 10**6])))
        return _reseal(bytes(body))
    if choice == 7:
        return b"FCLS" + bytes(rng.integers(0, 256, 40, dtype=np.uint8)) + frame
    return _reseal(bytes(body)) + bytes(int(rng.integers(1, 8)))  # trailing bytes


def _hostile_frame(service: AggregatorService, rng: np.random.Generator) -> bytes:
    """Well-formed frames with wrong content: meta, shapes, names, kinds, rounds, senders."""
    g = service.global_params
    name = sorted(g)[int(rng.integers(0, len(g)))]
    choice = rng.integers(0, 8)
    tensors = {k: v.copy() for k, v in g.items()}
    meta: dict = {"n_samples": 5}
    header = Header(Kind.UPDATE, FED, OPEN, 0, "c0", int(rng.integers(1, 2**40)))
    if choice == 0:
        tensors[name] = np.zeros(tuple(int(d) + 1 for d in g[name].shape), np.float32)
    elif choice == 1:
        tensors.pop(name)
    elif choice == 2:
        tensors["extra"] = np.zeros(3, np.float32)
    elif choice == 3:
        meta = {"n_samples": rng.choice([0, -1, 2**40, 1.5, "x", None, True])}
        meta = json.loads(json.dumps(meta, default=str))
    elif choice == 4:
        meta = {
            "n_samples": 3,
            "eval": {
                "round": int(rng.integers(-5, 9)),
                "task": int(rng.integers(-1, 4)),
                "nll": [float(rng.normal())] * int(rng.integers(0, 4)),
            },
        }
    elif choice == 5:
        header = Header(Kind(int(rng.choice([1, 3, 4, 5, 6, 7, 8]))), FED, OPEN, 0, "c0", header.sequence)
    elif choice == 6:
        header = Header(
            Kind.UPDATE,
            rng.choice([FED + "x", ""]) or "f",
            int(rng.integers(0, 10)),
            0,
            str(rng.choice(["c1", "c2", "aggregator"])),
            header.sequence,
        )
    else:
        tensors[name] = tensors[name] + 5000.0  # far outside max_update_norm
    return encode(Frame(header, meta, tensors))


def test_decoder_never_crashes() -> None:
    rng = np.random.default_rng(0)
    seed_frames = [
        encode(
            Frame(
                Header(Kind.UPDATE, "f", 1, 0, "c", 1),
                {"a": [1, 2]},
                {
                    "w": np.ones((3, 4), np.float32),
                    "s": SparseTensor((300,), np.array([1, 7, 299]), np.ones(3, np.float32)),
                },
            )
        )
    ]
    outcomes = {"ok": 0, "error": 0}
    for _ in range(N_DECODER):
        data = _mutate(seed_frames[0], rng)
        try:
            decode(data)
            outcomes["ok"] += 1
        except CodecError:
            outcomes["error"] += 1
    assert outcomes["error"] > N_DECODER * 0.7, outcomes  # the generator does produce damage


@pytest.mark.e2e  # 45,000 messages through the aggregator service (8 s): out of the inner loop
def test_message_handler_rejects_without_side_effects(tmp_path) -> None:
    logging.getLogger("aggregator").setLevel(logging.ERROR)
    service = _service(tmp_path)
    rng = np.random.default_rng(1)
    before = {k: v.copy() for k, v in service.global_params.items()}
    base = _valid(service, "c0", time.time_ns() // 1000, rng)  # devices number frames on the aggregator's clock
    update_topic = topics.update_topic(FED, "c0")
    counts = {"rejected": 0, "accepted": 0}
    reasons: dict[str, int] = {}
    for i in range(N_HANDLER):
        kind = i % 3
        if kind == 0:
            topic, payload = update_topic, _mutate(base, rng)
        elif kind == 1:
            topic, payload = update_topic, _hostile_frame(service, rng)
        else:  # wrong or hostile topics, garbage status messages
            topic = str(
                rng.choice(
                    [
                        topics.update_topic(FED, "intruder"),
                        topics.update_topic(FED, "c1"),
                        topics.status_topic(FED, "c0"),
                        f"fcl/{FED}/update/",
                        "fcl/other/update/c0",
                    ]
                )
            )
            payload = _mutate(base, rng) if rng.random() < 0.7 else bytes(rng.integers(0, 256, 50, np.uint8))
        received: dict[str, Update] = {}
        seq_before = dict(service.inbox.last_seq)
        service.intake.put(topic, payload, len(payload) + 20)
        service.intake.drain(OPEN, received, 0, service.global_params)
        if received:  # a mutation that is still a valid update (e.g. a flipped value bit)
            counts["accepted"] += 1
            service.inbox.last_seq.clear()
            service.store.clear_journal()
            service.intake.round_sum = None  # the round's running sum (fedavg streams): start it afresh too
        else:
            counts["rejected"] += 1
            assert service.inbox.last_seq == seq_before
            assert service.store.journaled(OPEN) == []
            assert service.intake.round_sum is None  # nothing was folded
    for reason, n in service.runlog.rejections.items():
        reasons[reason] = n
    assert sum(counts.values()) == N_HANDLER >= 45_000 and counts["rejected"] > N_HANDLER * 0.8, counts
    for k in before:
        np.testing.assert_array_equal(service.global_params[k], before[k])
    # every kind of check was reached by the generated inputs
    for reason in ("codec", "unknown-client", "sender", "kind", "content", "norm", "federation"):
        assert reasons.get(reason, 0) > 0, reasons
    # and the round still works afterwards: a clean update is accepted
    service.inbox.last_seq.clear()
    service.intake.round_sum = None
    received = {}
    good = _valid(service, "c0", time.time_ns() // 1000 + 1, rng)
    service.intake.put(update_topic, good, len(good) + 20)
    service.intake.drain(OPEN, received, 0, service.global_params)
    assert set(received) == {"c0"}
    service.runlog.close()
