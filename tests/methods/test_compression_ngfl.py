"""NGFL with the compression stage (its default): hostile compressed uploads are rejected
with a counted reason and change nothing; the device's residuals and the aggregator's true
extractor survive their checkpoints bit for bit; compression off is the dense path."""

from __future__ import annotations

import copy
import dataclasses
import struct

import numpy as np
import pytest
from support.frames import reseal
from test_ngfl import TASK1, D, data, fed, frame, good_frame, run_round, seeded_global, setup, step

import methods
from aggregator.inbox import Inbox, Rejection
from aggregator.runlog import RunLog
from fclcore import checkpoint
from fclcore.codec import SparseTensor, ValueCoding, decode, encode
from fclcore.schema import WireSpec
from fclcore.sparsify import DELTA, kept_count
from fclcore.strategy import Update

NAME = "extractor.0.weight"  # (8, 16): 128 entries, 7 kept at density 0.05, an index list of u16


def _record_at(payload: bytes, name: str) -> int:
    """Offset of the byte after tensor ``name``'s name in an encoded frame (its layout byte)."""
    key = bytes([len(name)]) + name.encode()
    return payload.index(key) + len(key)


def _patched(payload: bytes, offset: int, data: bytes) -> bytes:
    body = bytearray(payload[:-4])
    body[offset : offset + len(data)] = data
    return reseal(bytes(body))


def _hostile(good, coding_int8: bytes) -> dict[str, bytes]:
    payload = encode(good)
    at = _record_at(payload, NAME + DELTA)
    layout, dims_end = payload[at], at + 3 + 8
    assert layout == 1  # an index list
    nnz = struct.unpack_from("<I", payload, dims_end)[0]
    index_at, values_at = dims_end + 4, dims_end + 4 + 2 * nnz
    first = struct.unpack_from("<H", payload, index_at)[0]
    int8_at = _record_at(coding_int8, NAME + DELTA) + 3 + 8 + 4 + 2 * nnz + 2  # past the block size
    return {
        "index out of range": _patched(payload, index_at, struct.pack("<H", 500)),
        "duplicate index": _patched(payload, index_at + 2, struct.pack("<H", first)),
        "wrong count": _patched(payload, dims_end, struct.pack("<I", nnz + 1)),
        "NaN value": _patched(payload, values_at, struct.pack("<f", float("nan"))),
        "NaN scale": _patched(coding_int8, int8_at, struct.pack("<f", float("nan"))),
    }


def test_hostile_compressed_uploads_are_rejected_with_a_counted_reason_and_no_side_effects(tmp_path):
    s, _, good = good_frame()
    assert isinstance(good.tensors[NAME + DELTA], SparseTensor)
    before = (s.table.to_meta(), copy.deepcopy(s.true.values))
    inbox = Inbox("t", frozenset({"c0"}), s.normalize, 3, min_samples=s.min_samples)
    log = RunLog(tmp_path)
    int8 = encode(good, ValueCoding("int8"))
    cases = _hostile(good, int8)
    bound = kept_count(8 * D, 0.05)
    dense = good.tensors[NAME + DELTA].to_dense()
    flat = np.flatnonzero(dense == 0)[:1]
    over = SparseTensor(dense.shape, np.union1d(good.tensors[NAME + DELTA].indices, flat), np.ones(bound + 1))
    cases["density above the bound"] = encode(frame("c0", TASK1, good.meta, {**good.tensors, NAME + DELTA: over}))
    other_shape = SparseTensor((16, 8), np.arange(3), np.ones(3))
    cases["delta of another shape"] = encode(frame("c0", TASK1, good.meta, {**good.tensors, NAME + DELTA: other_shape}))
    cases["dense extractor where a delta is due"] = encode(
        frame("c0", TASK1, good.meta, {**{k: v for k, v in good.tensors.items() if k != NAME + DELTA}, NAME: dense})
    )
    reasons = {}
    for why, payload in cases.items():
        result = inbox.check("c0", payload, len(payload), TASK1, set())
        assert isinstance(result, Rejection), why
        log.rejected(result.reason, result.detail)
        reasons[why] = result.reason
    assert reasons == {
        "index out of range": "codec",
        "duplicate index": "codec",
        "wrong count": "codec",
        "NaN value": "codec",
        "NaN scale": "codec",
        "density above the bound": "compression",
        "delta of another shape": "compression",
        "dense extractor where a delta is due": "content",
    }
    assert log.rejections == {"codec": 5, "compression": 2, "content": 1}
    assert inbox.last_seq == {} and s.table.to_meta() == before[0] and s.true.values == before[1]
    ok = encode(good)
    assert isinstance(inbox.check("c0", ok, len(ok), TASK1, set()), Update)


def test_device_residuals_survive_a_checkpoint_bit_identically(tmp_path):
    f, s, (lr,), params = setup()
    train = [None, data(["2", "3"])]
    step(s, lr, train, TASK1, params, "c0")
    lr.uploaded(decode(encode(frame("c0", TASK1, {}, lr.upload(TASK1, s.schedule.place(TASK1))))).tensors)
    meta, arrays = lr.state()
    residuals = {k: v for k, v in arrays.items() if k.startswith("residual/")}
    assert residuals and any(v.any() for v in residuals.values())
    checkpoint.save(tmp_path / "client.npz", meta, arrays)
    meta2, arrays2 = checkpoint.load(tmp_path / "client.npz")
    again = methods.learner_for(f, D, 0)
    again.load_state(meta2, arrays2)
    for key, value in again.state()[1].items():
        assert value.tobytes() == arrays[key].tobytes(), key
    place = s.schedule.place(TASK1 + 1)
    a, b = lr.upload(TASK1 + 1, place), again.upload(TASK1 + 1, place)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name] == b[name] if isinstance(a[name], SparseTensor) else np.array_equal(a[name], b[name])


def test_the_aggregators_true_extractor_survives_a_restart():
    """Two rounds, with the strategy rebuilt from its checkpointed state in between, give the
    same global model bit for bit as two rounds in one go."""
    f, s, learners, params = setup(devices=2)
    trains = [[None, data(["2", "3"], seed=0)], [None, data(["2", "3"], seed=1)]]
    first = run_round(s, learners, trains, TASK1, params)
    meta, arrays = s.state()
    assert any(k.startswith("true/") for k in arrays)
    again = methods.strategy_for(f, D)
    again.restore(copy.deepcopy(meta), {k: v.copy() for k, v in arrays.items()})
    twin = copy.deepcopy(learners)
    one = run_round(s, learners, trains, TASK1 + 1, first)
    two = run_round(again, twin, trains, TASK1 + 1, first)
    for name in one:
        assert one[name].tobytes() == two[name].tobytes(), name


@pytest.mark.parametrize("off", ["sparsify", "down_sparsify"])
def test_either_side_can_be_turned_off(off):
    f = dataclasses.replace(fed(), wire=WireSpec(**{off: "none"}))
    s = methods.strategy_for(f, D)
    lr, params = methods.learner_for(f, D, 0), seeded_global(s, ("0", "1"))
    up = step(s, lr, [None, data(["2", "3"])], TASK1, params, "c0")
    compressed_up = any(k.endswith(DELTA) for k in up.tensors)
    assert compressed_up == (off != "sparsify")
    out = s.aggregate(
        [Update("c0", up, up.meta["n_samples"], 0, 0, s.normalize(up).tensors, s.normalize(up).parsed)], params
    )
    if off == "down_sparsify":  # devices get the true extractor: no residual on the aggregator
        np.testing.assert_array_equal(out[NAME], s.true.values[NAME])
    else:  # a dense upload, an announcement of the top-k of its change: the rest held back
        assert int(np.count_nonzero(out[NAME] != params[NAME])) == kept_count(8 * D, 0.05)
        assert np.count_nonzero(s.true.values[NAME] != out[NAME]) > 0
