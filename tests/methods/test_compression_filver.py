"""FIL-VER with the compression stage (its default): error feedback loses nothing of the
encoder's and the classifier's changes, through int8 coding too; the aggregator's true model
is what the decoded deltas add up to and each announcement moves at most the top-k entries;
hostile compressed uploads are rejected with a counted reason and change nothing; residuals
and the true model survive their checkpoints bit for bit; either side can be turned off."""

from __future__ import annotations

import copy
import dataclasses
import math
import struct

import numpy as np
import pytest
from support.frames import reseal
from test_filver import OPTS, SIDE, data, fed, frame, place

import methods
from aggregator.inbox import Inbox, Rejection
from aggregator.runlog import RunLog
from fclcore import checkpoint
from fclcore.codec import Frame, Header, Kind, SparseTensor, ValueCoding, decode, encode
from fclcore.schema import WireSpec
from fclcore.sparsify import DELTA, kept_count
from fclcore.strategy import Update
from methods.filver.wire import CLS, COMPRESSION, ENC, density

P0 = OPTS["phase0_rounds"]
NAME = "cls.fc2.weight"  # (16, 16): 256 entries
SPARSE = {"density": 0.02, "down_density": 0.02}  # 6 of NAME's entries: an index list of u16 (10%: a bitmap)


def _fed(**wire):
    return dataclasses.replace(fed(), wire=WireSpec(**wire))


def _learner(f, index: int = 0):
    lr = methods.learner_for(f, SIDE * SIDE, index)
    lr.allow_embedding_upload = True
    return lr


def _round(s, learners, rnd: int, params: dict, coding: ValueCoding = ValueCoding()) -> tuple[dict, list]:
    """One round as the services run it: every device loads what was announced (and the frozen
    encoder when it is due), trains, uploads through the codec and is told what was decoded;
    the strategy checks and aggregates.  Returns (announced model, the decoded updates)."""
    downs = s.client_downlinks(rnd, [f"c{i}" for i in range(len(learners))])
    updates = []
    for i, lr in enumerate(learners):
        lr.load_global(params, rnd)
        if f"c{i}" in downs:
            meta, tensors = downs[f"c{i}"]
            lr.receive_frame(Frame(Header(Kind.KNOWLEDGE, "t", rnd, 0, "aggregator", 1), meta, tensors), rnd)
        n, _ = lr.train_round([data(seed=i)] * (s.schedule.task_of(rnd) + 1), rnd, place(s, rnd))
        tensors = lr.upload(rnd, place(s, rnd))
        meta = {**lr.report(place(s, rnd)), "allow_embedding_upload": True}
        payload = encode(frame(f"c{i}", rnd, s.schedule.task_of(rnd), tensors, meta), coding)
        got = decode(payload)
        if lr.reads_upload:
            lr.uploaded(got.tensors)
        checked = s.normalize(got)
        updates.append(Update(f"c{i}", got, n, len(payload), len(payload), checked.tensors, checked.parsed))
    return s.aggregate(updates, params), updates


@pytest.mark.parametrize("coding", [ValueCoding(), ValueCoding("int8")], ids=["float32", "int8"])
def test_sent_plus_residual_is_the_sum_of_the_changes_and_the_true_model_their_mean(coding) -> None:
    """Hand bookkeeping over phase 0 (encoder + classifier) and two classifier rounds, two
    devices, SST off: per device, sum of decoded uploads + residual = sum of (trained - held);
    the aggregator's true model = start + sum of the rounds' sample-weighted mean deltas, and
    no announcement changes more than the top-k of a tensor."""
    f = dataclasses.replace(fed(sst_steps=0), wire=WireSpec(value_dtype=coding.dtype))
    s, learners = methods.strategy_for(f, SIDE * SIDE), [_learner(f, 0), _learner(f, 1)]
    params = s.initial_model()
    changes = [{} for _ in learners]
    sent = [{} for _ in learners]
    true = {k: v.astype(np.float64) for k, v in params.items()}
    for rnd in range(P0 + 2):
        if rnd == P0:  # phase 0 is over: the encoder's residuals are gone, on both sides
            assert not any(k.startswith(ENC) for k in s.true.values)
            np.testing.assert_allclose(s.encoder["enc.fc1.weight"], true["enc.fc1.weight"], atol=1e-5)
            true = {k: v for k, v in true.items() if k.startswith(CLS)}
        new, updates = _round(s, learners, rnd, params, coding)
        weights = np.array([u.n_samples for u in updates], np.float64)
        assert all(any(k.startswith(ENC) for k in lr.residuals.residuals) == (rnd < P0) for lr in learners)
        for i, (lr, u) in enumerate(zip(learners, updates)):
            local = lr_params(lr)  # what it would send uncompressed: its change from what it was announced
            for k in true:
                changes[i][k] = changes[i].get(k, 0) + (local[k] - params[k]).astype(np.float64)
                sent[i][k] = sent[i].get(k, 0) + _dense(u.tensors[k + DELTA])
                np.testing.assert_allclose(sent[i][k] + lr.residuals.residuals[k], changes[i][k], atol=2e-6, err_msg=k)
        for k in true:
            deltas = [_dense(u.tensors[k + DELTA]) for u in updates]
            true[k] = true[k] + np.tensordot(weights / weights.sum(), np.stack(deltas), axes=1)
            if k in new:
                moved = np.count_nonzero(new[k] != params[k])
                assert moved <= kept_count(params[k].size, density(k, COMPRESSION.down_density, s.o)), k
                np.testing.assert_allclose(s.true.values[k], true[k], atol=1e-5, err_msg=k)
        params = new


def _dense(t) -> np.ndarray:
    return (t.to_dense() if isinstance(t, SparseTensor) else np.asarray(t)).astype(np.float64)


def lr_params(lr) -> dict[str, np.ndarray]:
    from methods.filver.model import get_params

    return {**get_params(lr.encoder, ENC), **get_params(lr.classifier, CLS)}


def _post_phase0(devices: int = 1, **wire):
    f = _fed(**wire)
    s = methods.strategy_for(f, SIDE * SIDE)
    learners = [_learner(f, i) for i in range(devices)]
    params = s.initial_model()
    for rnd in range(P0):
        params, _ = _round(s, learners, rnd, params)
    return f, s, learners, params


def _good():
    """c0's real compressed upload of round P0 (the first after phase 0), at density 2%."""
    f, s, (lr,), params = _post_phase0(**SPARSE)
    downs = s.client_downlinks(P0, ["c0"])
    lr.load_global(params, P0)
    meta, tensors = downs["c0"]
    lr.receive_frame(Frame(Header(Kind.KNOWLEDGE, "t", P0, 0, "aggregator", 1), meta, tensors), P0)
    lr.train_round([data()], P0, place(s, P0))
    tensors = lr.upload(P0, place(s, P0))
    meta = {**lr.report(place(s, P0)), "allow_embedding_upload": True, "n_samples": 100}
    return s, params, frame("c0", P0, 0, tensors, meta)


def _record_at(payload: bytes, name: str) -> int:
    """Offset of the byte after tensor ``name``'s name in an encoded frame (its layout byte)."""
    key = bytes([len(name)]) + name.encode()
    return payload.index(key) + len(key)


def _patched(payload: bytes, offset: int, data_: bytes) -> bytes:
    body = bytearray(payload[:-4])
    body[offset : offset + len(data_)] = data_
    return reseal(bytes(body))


def _codec_cases(good: Frame) -> dict[str, bytes]:
    payload, int8 = encode(good), encode(good, ValueCoding("int8"))
    at = _record_at(payload, NAME + DELTA)
    assert payload[at] == 1  # an index list
    dims_end = at + 3 + 8
    nnz = struct.unpack_from("<I", payload, dims_end)[0]
    index_at, values_at = dims_end + 4, dims_end + 4 + 2 * nnz
    first = struct.unpack_from("<H", payload, index_at)[0]
    scale_at = _record_at(int8, NAME + DELTA) + 3 + 8 + 4 + 2 * nnz + 2  # past the block size
    return {
        "index out of range": _patched(payload, index_at, struct.pack("<H", 300)),
        "duplicate index": _patched(payload, index_at + 2, struct.pack("<H", first)),
        "wrong count": _patched(payload, dims_end, struct.pack("<I", nnz + 1)),
        "NaN value": _patched(payload, values_at, struct.pack("<f", float("nan"))),
        "NaN scale": _patched(int8, scale_at, struct.pack("<f", float("nan"))),
    }


def test_hostile_compressed_uploads_are_rejected_with_a_counted_reason_and_no_side_effects(tmp_path) -> None:
    s, params, good = _good()
    assert isinstance(good.tensors[NAME + DELTA], SparseTensor)
    before = (copy.deepcopy(s.true.values), s.buffer.arrays(), copy.deepcopy(s.encoder))
    inbox = Inbox("t", frozenset({"c0"}), s.normalize, 2)
    log = RunLog(tmp_path)
    cases = _codec_cases(good)
    dense = good.tensors[NAME + DELTA].to_dense()
    bound = kept_count(dense.size, SPARSE["density"])
    over = SparseTensor(dense.shape, np.arange(bound + 1), np.ones(bound + 1, np.float32))

    def with_(**tensors) -> bytes:
        return encode(Frame(good.header, good.meta, {**good.tensors, **tensors}))

    cases["density above the bound"] = with_(**{NAME + DELTA: over})
    cases["delta of another shape"] = with_(**{NAME + DELTA: SparseTensor((8, 32), np.arange(3), np.ones(3))})
    without = {k: v for k, v in good.tensors.items() if k != NAME + DELTA}
    cases["dense classifier where a delta is due"] = encode(Frame(good.header, good.meta, {**without, NAME: dense}))
    cases["an encoder delta after phase 0"] = with_(**{"enc.mu.bias" + DELTA: SparseTensor((4,), [0], [1.0])})
    reasons = {}
    for why, payload in cases.items():
        result = inbox.check("c0", payload, len(payload), P0, set())
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
        "dense classifier where a delta is due": "content",
        "an encoder delta after phase 0": "content",
    }
    assert log.rejections == {"codec": 5, "compression": 2, "content": 2}
    assert inbox.last_seq == {} and s.true.values.keys() == before[0].keys()
    assert all(np.array_equal(s.true.values[k], before[0][k]) for k in before[0])
    assert all(np.array_equal(v, before[1][k]) for k, v in s.buffer.arrays().items())
    assert all(np.array_equal(v, before[2][k]) for k, v in s.encoder.items())
    ok = encode(good)
    assert isinstance(inbox.check("c0", ok, len(ok), P0, set()), Update)


def test_device_residuals_and_the_announced_model_survive_a_checkpoint_bit_identically(tmp_path) -> None:
    f, s, (lr,), params = _post_phase0()
    params, _ = _round(s, [lr], P0, params)
    meta, arrays = lr.state()
    residuals = {k: v for k, v in arrays.items() if k.startswith("residual/")}
    assert residuals.keys() == {"residual/" + k for k in s.cls_shapes} and any(v.any() for v in residuals.values())
    assert {k for k in arrays if k.startswith("held/")} == {"held/" + k for k in s.cls_shapes}
    checkpoint.save(tmp_path / "client.npz", meta, arrays)
    meta2, arrays2 = checkpoint.load(tmp_path / "client.npz")
    again = _learner(f)
    again.start_task(0, None)
    again.load_state(meta2, arrays2)
    for key, value in again.state()[1].items():
        assert value.tobytes() == arrays[key].tobytes(), key
    a, b = lr.upload(P0 + 1, place(s, P0 + 1)), again.upload(P0 + 1, place(s, P0 + 1))
    assert a.keys() == b.keys() and all(a[k] == b[k] for k in a if k.endswith(DELTA))
    with pytest.raises(ValueError, match="does not fit"):
        again.load_state(meta2, {**arrays2, "held/" + NAME: np.zeros((2, 2), np.float32)})


def test_the_aggregators_true_model_survives_a_restart() -> None:
    """A round after restoring the strategy from its checkpointed state gives the same
    announcement, true model and buffer, bit for bit, as the round in one go."""
    f, s, learners, params = _post_phase0(devices=2)
    params, _ = _round(s, learners, P0, params)
    meta, arrays = s.state()
    assert {k for k in arrays if k.startswith("true/")} == {"true/" + k for k in s.cls_shapes}
    again = methods.strategy_for(f, SIDE * SIDE)
    again.restore(copy.deepcopy(meta), {k: v.copy() for k, v in arrays.items()})
    twins = copy.deepcopy(learners)
    one, _ = _round(s, learners, P0 + 1, params)
    two, _ = _round(again, twins, P0 + 1, params)
    for name in one:
        assert one[name].tobytes() == two[name].tobytes(), name
        assert s.true.values[name].tobytes() == again.true.values[name].tobytes(), name
    assert s.buffer.z.tobytes() == again.buffer.z.tobytes()


@pytest.mark.parametrize("off", ["sparsify", "down_sparsify", "both"])
def test_either_side_can_be_turned_off(off) -> None:
    wire = {"sparsify": "none", "down_sparsify": "none"} if off == "both" else {off: "none"}
    f, s, learners, params = _post_phase0(**wire)
    new, updates = _round(s, learners, P0, params)
    compressed_up = any(k.endswith(DELTA) for k in updates[0].tensors)
    assert compressed_up == (off == "down_sparsify")
    moved = np.count_nonzero(new[NAME] != params[NAME])
    if off == "sparsify":  # a dense upload; the announcement moves by the top-k, the rest held back
        assert moved == kept_count(params[NAME].size, COMPRESSION.down_density)
        assert np.count_nonzero(s.true.values[NAME] != new[NAME]) > 0
    else:  # devices get the true model (no residual on the aggregator), or no stage at all
        assert moved > kept_count(params[NAME].size, COMPRESSION.down_density)
        assert (s.true is None) == (off == "both")
        if s.true is not None:
            np.testing.assert_array_equal(new[NAME], s.true.values[NAME])


@pytest.mark.parametrize("share", [1.0, 0.2], ids=["whole", "top-k"])
def test_phase0s_encoder_goes_at_its_own_density_and_the_classifier_at_the_stages(tmp_path, share) -> None:
    """Phase 0 with int8 values: each encoder tensor's change goes up whole (``encoder_density``
    1.0, the default), or as its own top-k; the classifier's as the stage's top-k either way;
    the announcement moves the encoder likewise.  An encoder delta beyond its density is
    refused (``compression``), a NaN in a whole one by the codec."""
    options = {} if share == 1.0 else {"encoder_density": share}
    f = dataclasses.replace(fed(**options), wire=WireSpec(value_dtype="int8"))
    s, lr = methods.strategy_for(f, SIDE * SIDE), _learner(f)
    assert lr.o.encoder_density == share
    params = s.initial_model()
    lr.load_global(params, 0)
    lr.train_round([data()], 0, place(s, 0))
    change = {k: v - params[k] for k, v in lr_params(lr).items()}
    tensors = lr.upload(0, place(s, 0))
    meta = {**lr.report(place(s, 0)), "allow_embedding_upload": True, "n_samples": 100}
    payload = encode(frame("c0", 0, 0, tensors, meta), ValueCoding("int8"))
    for name, shape in {**s.enc_shapes, **s.cls_shapes}.items():
        sent, at = _dense(tensors[name + DELTA]), _record_at(payload, name + DELTA)
        assert payload[at + 1] == 3, name  # int8 blocks
        if name.startswith(ENC) and share == 1.0:
            np.testing.assert_array_equal(sent, change[name], err_msg=name)
        else:
            bound = kept_count(math.prod(shape), COMPRESSION.up_density if name.startswith(CLS) else share)
            assert np.count_nonzero(sent) == bound < math.prod(shape), name
    got = decode(payload)
    lr.uploaded(got.tensors)
    checked = s.normalize(got)
    new = s.aggregate([Update("c0", got, 100, len(payload), len(payload), checked.tensors, checked.parsed)], params)
    for name, value in new.items():
        moved = np.count_nonzero(value != params[name])
        if name.startswith(ENC) and share == 1.0:
            np.testing.assert_array_equal(value, s.true.values[name], err_msg=name)
            assert moved > kept_count(value.size, COMPRESSION.down_density), name
        else:
            assert moved <= kept_count(value.size, COMPRESSION.down_density if name.startswith(CLS) else share), name

    inbox = Inbox("t", frozenset({"c0"}), s.normalize, 2)
    name = "enc.fc2.weight"
    whole = encode(frame("c0", 0, 0, {**tensors, name + DELTA: np.ones(s.enc_shapes[name], np.float32)}, meta))
    if share == 1.0:
        at = _record_at(whole, name + DELTA)
        assert whole[at] == 0  # the dense layout: its values follow the dims
        hostile, reason = _patched(whole, at + 3 + 4 * 2, struct.pack("<f", float("nan"))), "codec"
    else:
        hostile, reason = whole, "compression"
    result = inbox.check("c0", hostile, len(hostile), 0, set())
    assert isinstance(result, Rejection) and result.reason == reason


@pytest.mark.parametrize("share", [0.0, 1.5])
def test_an_encoder_density_outside_0_1_is_a_config_error(share) -> None:
    with pytest.raises(ValueError, match=r"encoder_density in \(0, 1\]"):
        methods.strategy_for(fed(encoder_density=share), SIDE * SIDE)
