"""NGFL end to end without a broker: the real ``NGFLLearner`` devices and ``NGFLStrategy``
aggregator, frames through the codec (and the ``Inbox`` where validation is what is tested).

Hostile uploads rejected under ``table`` with the global table unchanged, duplicates ignored,
one global row per class whoever adds it, pre- and post-alignment giving the same global
model, self-attention over the table's rows, partial fusion sending fewer rows, the device's
own task clock, checkpoints, the served model and its ONNX export, the aggregator's restarts
(reading notes 3.4 G2-G3, G7-G9, G13-G14)."""

from __future__ import annotations

import copy
import zlib

import numpy as np
import pytest
import torch

import methods
from aggregator.inbox import Inbox, Rejection
from aggregator.runlog import RunLog
from export.formats import export_served
from export.image_runtime import ImageClassifierRuntime
from fclcore.codec import Frame, Header, Kind, decode, encode
from fclcore.config import from_dict
from fclcore.data import Dataset
from fclcore.schema import FederationSpec
from fclcore.strategy import Rejected, Update
from methods.ngfl.table import GlobalTable
from methods.ngfl.wire import HEAD_B, HEAD_W, ROWS_B, ROWS_W

torch.set_num_threads(1)
D = 16  # 4x4 images, so the served model is an image classifier
HIDDEN = [8, 4]
DIM = HIDDEN[-1]
TASK1 = 4  # the first round of the federation's task 1 (task_rounds [4, 4, 4])


def fed(method: str = "ngfl", epochs: int = 2, **options) -> FederationSpec:
    raw = {
        "name": "t",
        "method": method,
        "seed": 3,
        "num_tasks": 3,
        "task_rounds": [4, 4, 4],
        "train": {"batch_size": 64, "lr": 0.3, "local_epochs": epochs, "optimizer": "sgd"},  # one batch per epoch
        "options": {"hidden": HIDDEN, "base_rounds": 1, "rounds_per_task": 2, "momentum": 0.5, **options},
    }
    return methods.resolve(from_dict(FederationSpec, raw, "test"))[2]


def data(labels, n: int = 6, seed: int = 0) -> Dataset:
    """``n`` rows per class; each class lights its own pixel (chosen by its name)."""
    rng = np.random.default_rng(seed)
    y = np.repeat(np.arange(len(labels)), n)
    x = rng.random((len(y), D), dtype=np.float32) * 0.3
    x[np.arange(len(y)), [zlib.crc32(labels[k].encode()) % D for k in y]] += 1.0
    return Dataset(x, y.astype(np.int64), tuple(labels))


def frame(client: str, rnd: int, meta: dict, tensors: dict, seq: int | None = None) -> Frame:
    return Frame(
        Header(Kind.UPDATE, "t", rnd, 0 if rnd < TASK1 else 1, client, rnd + 1 if seq is None else seq), meta, tensors
    )


def step(s, learner, train, rnd: int, params: dict, client: str) -> Frame:
    """One device round as the daemon runs it: load, train, upload, report; through the codec."""
    place = s.schedule.place(rnd)
    learner.load_global(params, rnd, s.announce_meta(rnd))
    n, _ = learner.train_round(train, rnd, place)
    tensors = learner.upload(rnd, place)
    return decode(encode(frame(client, rnd, {"n_samples": n, **learner.report(place)}, tensors)))


def accept(s, f: Frame) -> Update:
    checked = s.normalize(f)
    return Update(f.header.client, f, f.meta["n_samples"], 0, 0, checked.tensors, checked.parsed)


def run_round(s, learners, trains, rnd: int, params: dict) -> dict:
    frames = [step(s, lr, tr, rnd, params, f"c{i}") for i, (lr, tr) in enumerate(zip(learners, trains))]
    return s.aggregate([accept(s, f) for f in frames], params)


def seeded_global(s, labels) -> dict:
    """A global model whose head holds ``labels`` (random rows), the strategy's table to match."""
    if not labels:
        return s.initial_model()
    s.restore({"table": GlobalTable(list(labels), [(0, "c0")] * len(labels), version=1).to_meta()}, {})
    rng = np.random.default_rng(11)
    params = s.initial_model()
    params[HEAD_W] = rng.normal(0, 0.5, (len(labels), DIM)).astype(np.float32)
    params[HEAD_B] = rng.normal(0, 0.5, len(labels)).astype(np.float32)
    return params


def by_label(s, params: dict) -> dict[str, np.ndarray]:
    return {lab: np.append(params[HEAD_W][r], params[HEAD_B][r]) for r, lab in enumerate(s.table.labels)}


def setup(method: str = "ngfl", devices: int = 1, labels=("0", "1"), epochs: int = 2, **options):
    f = fed(method, epochs, **options)
    s = methods.strategy_for(f, D)
    return f, s, [methods.learner_for(f, D, i) for i in range(devices)], seeded_global(s, labels)


def good_frame():
    """A strategy with the global table [0, 1] and c0's real upload of task {2, 3} at round TASK1."""
    _, s, (lr,), params = setup()
    return s, params, step(s, lr, [None, data(["2", "3"])], TASK1, params, "c0")


# ---------------------------------------------------------------- hostile uploads


def _table(labels, current, viewed=None) -> dict:
    return {"labels": labels, "current": current, "viewed": current if viewed is None else viewed, "base_version": 1}


def _rows(n: int) -> dict:
    return {ROWS_W: np.zeros((n, DIM), np.float32), ROWS_B: np.zeros(n, np.float32)}


HOSTILE = [
    ("duplicate labels", _table(["2", "2"], ["2"]), _rows(2)),
    ("label count differs from the head rows", _table(["2", "3", "0"], ["2", "3"]), _rows(2)),
    ("current outside the labels", _table(["2", "3"], ["9"], ["2", "3", "9"]), _rows(2)),
    ("10,000 labels", _table([str(i) for i in range(10_000)], []), _rows(10_000)),
    ("non-string labels", _table([2, 3], []), _rows(2)),
    ("unprintable label", _table(["2", "\x1b[2J"], ["2"]), _rows(2)),
    ("no table", None, _rows(2)),
]


@pytest.mark.parametrize("why, table, rows", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_a_hostile_table_is_rejected_and_the_global_table_is_unchanged(why, table, rows) -> None:
    s, params, good = good_frame()
    before = s.table.to_meta()
    meta = copy.deepcopy(good.meta)
    meta["ngfl"]["table"] = table
    tensors = {**good.tensors, **rows}
    with pytest.raises(Rejected) as info:
        s.normalize(frame("c0", TASK1, meta, tensors))
    assert info.value.reason == "table", str(info.value)
    assert s.table.to_meta() == before
    out = s.aggregate([accept(s, good)], params)  # the honest upload still goes through
    assert s.table.labels == ["0", "1", "2", "3"] and out[HEAD_W].shape == (4, DIM)


def _skip(n_samples: int = 0, announce=()) -> dict:
    return {"n_samples": n_samples, "ngfl": {"skip": True, "announce": list(announce)}}


HOSTILE_SKIPS = [
    ("a skip notice carrying tensors", _skip(), True),
    ("a skip notice claiming samples", _skip(n_samples=5), False),
    ("announcing 2,000 classes", _skip(announce=map(str, range(2000))), False),
    ("announcing duplicates", _skip(announce=["7", "7"]), False),
    ("ngfl metadata not an object", {"n_samples": 0, "ngfl": ["skip"]}, False),
]


@pytest.mark.parametrize("why, meta, tensors", HOSTILE_SKIPS, ids=[h[0] for h in HOSTILE_SKIPS])
def test_a_hostile_skip_notice_is_rejected(why, meta, tensors) -> None:
    s, _, good = good_frame()
    before = s.table.to_meta()
    with pytest.raises(Rejected) as info:
        s.normalize(frame("c0", TASK1, meta, dict(good.tensors) if tensors else {}))
    assert info.value.reason == "table", str(info.value)
    assert s.table.to_meta() == before


def test_a_wrong_extractor_shape_is_a_content_error() -> None:
    s, _, good = good_frame()
    bad = {**good.tensors, "extractor.0.weight": np.zeros((HIDDEN[0], D - 1), np.float32)}
    with pytest.raises(ValueError, match="extractor.0.weight") as info:
        s.normalize(frame("c0", TASK1, good.meta, bad))
    assert not isinstance(info.value, Rejected)
    with pytest.raises(ValueError, match="rows.weight"):
        s.normalize(frame("c0", TASK1, good.meta, {**good.tensors, ROWS_W: np.zeros((2, DIM + 1), np.float32)}))


def test_the_inbox_counts_a_hostile_table_under_table(tmp_path) -> None:
    s, _, good = good_frame()
    before = s.table.to_meta()
    inbox = Inbox("t", frozenset({"c0", "c1"}), s.normalize, 3, min_samples=s.min_samples)
    log = RunLog(tmp_path)
    meta = copy.deepcopy(good.meta)
    meta["ngfl"]["table"]["labels"] = ["3", "3"]
    hostile = encode(frame("c0", TASK1, meta, good.tensors, seq=1))
    shapes = encode(frame("c1", TASK1, good.meta, {**good.tensors, "extractor.1.bias": np.zeros(DIM + 1)}, seq=1))
    for client, payload in (("c0", hostile), ("c1", shapes)):
        result = inbox.check(client, payload, len(payload), TASK1, set())
        assert isinstance(result, Rejection), result
        log.rejected(result.reason, result.detail)
    assert log.rejections == {"table": 1, "content": 1}
    assert s.table.to_meta() == before and inbox.last_seq == {}  # nothing advanced
    ok = encode(frame("c0", TASK1, good.meta, good.tensors, seq=2))
    assert isinstance(inbox.check("c0", ok, len(ok), TASK1, set()), Update)


# ---------------------------------------------------------------- duplicates


def test_a_duplicate_upload_is_ignored() -> None:
    _, s, learners, params = setup(devices=2)
    trains = [[None, data(["2", "3"], seed=0)], [None, data(["2", "3"], seed=1)]]
    frames = [step(s, lr, tr, TASK1, params, f"c{i}") for i, (lr, tr) in enumerate(zip(learners, trains))]
    inbox = Inbox("t", frozenset({"c0", "c1"}), s.normalize, 3, min_samples=s.min_samples)
    accepted, received = [], set()
    for f in (frames[0], frames[0], frames[1]):
        payload = encode(f)
        result = inbox.check(f.header.client, payload, len(payload), TASK1, received)
        if isinstance(result, Update):
            accepted.append(result)
            received.add(result.client)
        else:
            assert result.reason == "duplicate" and result.client == "c0", result
    assert [u.client for u in accepted] == ["c0", "c1"]
    once = copy.deepcopy(s).aggregate([accept(s, f) for f in frames], params)
    got = copy.deepcopy(s).aggregate(accepted, params)
    twice = copy.deepcopy(s).aggregate([accept(s, frames[0]), *accepted], params)
    for name in once:
        np.testing.assert_array_equal(got[name], once[name])
    assert not np.allclose(twice["extractor.0.weight"], once["extractor.0.weight"])  # counting it would matter


# ---------------------------------------------------------------- one row per class, kept rows


def test_two_devices_adding_the_same_class_end_in_one_row_and_untrained_rows_are_kept() -> None:
    _, s, learners, params = setup(devices=2)
    trains = [[None, data(["2", "3"], seed=0)], [None, data(["3", "4"], seed=1)]]
    frames = [step(s, lr, tr, TASK1, params, f"c{i}") for i, (lr, tr) in enumerate(zip(learners, trains))]
    rows = [
        {
            lab: np.append(f.tensors[ROWS_W][i], f.tensors[ROWS_B][i])
            for i, lab in enumerate(f.meta["ngfl"]["table"]["labels"])
        }
        for f in frames
    ]
    assert sorted(rows[0]) == ["2", "3"] and sorted(rows[1]) == ["3", "4"]  # partial fusion: current rows only
    old = by_label(s, params)
    out = s.aggregate([accept(s, f) for f in frames], params)
    assert s.table.labels == ["0", "1", "2", "3", "4"] and out[HEAD_W].shape == (5, DIM)
    assert s.table.added[3] == (TASK1, "c0")  # credited to the first sender (sorted)
    new = by_label(s, out)
    np.testing.assert_allclose(new["3"], (rows[0]["3"] + rows[1]["3"]) / 2, rtol=1e-6)
    np.testing.assert_allclose(new["2"], rows[0]["2"])
    np.testing.assert_allclose(new["4"], rows[1]["4"])
    for lab in ("0", "1"):  # nobody trained them this round: partial fusion keeps them
        np.testing.assert_array_equal(new[lab], old[lab])
    for lr in learners:  # on download both devices have one row for "3"
        lr.load_global(out, TASK1 + 1, s.announce_meta(TASK1 + 1))
        assert lr.table.labels == ["0", "1", "2", "3", "4"] and lr.head.rows == 5


# ---------------------------------------------------------------- pre- vs post-alignment


def aligned(method: str, alignment: str, tasks) -> tuple[object, dict]:
    """Devices with tasks ``tasks`` (one each) starting from the same global model [0, 1]."""
    _, s, learners, params = setup(method, devices=len(tasks), alignment=alignment)
    trains = [[None, data(t, seed=i)] for i, t in enumerate(tasks)]
    rnd = TASK1
    if alignment == "pre":  # first the announcements (skip notices), then the pre-extended head
        frames = [step(s, lr, tr, rnd, params, f"c{i}") for i, (lr, tr) in enumerate(zip(learners, trains))]
        assert all(f.meta["n_samples"] == 0 and not f.tensors and f.meta["ngfl"]["skip"] for f in frames)
        before = params
        params = s.aggregate([accept(s, f) for f in frames], params)
        new = sorted({lab for t in tasks for lab in t})
        assert s.table.pending == set(new) and s.table.labels[2:] == new
        assert not params[HEAD_W][2:].any() and not params[HEAD_B][2:].any()
        for name in before:  # the model is kept, the new rows appended
            np.testing.assert_array_equal(params[name][: len(before[name])], before[name])
        rnd += 1
    out = run_round(s, learners, trains, rnd, params)
    assert not s.table.pending
    return s, out


@pytest.mark.parametrize("method", ["ngfl", "ngfl-ta-tf"])
def test_pre_and_post_alignment_agree_when_everyone_brings_the_same_classes(method) -> None:
    tasks = [["2", "3"], ["2", "3"]]
    post_s, post = aligned(method, "post", tasks)
    pre_s, pre = aligned(method, "pre", tasks)
    assert pre_s.table.labels == post_s.table.labels == ["0", "1", "2", "3"]
    assert set(pre) == set(post)
    for name in post:
        np.testing.assert_allclose(pre[name], post[name], rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("method", ["ngfl-ta-pf", "ngfl-ta-tf"])
def test_the_pending_rule_makes_pre_alignment_equal_post_with_different_classes(method) -> None:
    tasks = [["4", "5"], ["2", "3"]]  # c0 announces the classes that sort last
    post_s, post = aligned(method, "post", tasks)
    pre_s, pre = aligned(method, "pre", tasks)
    assert pre_s.table.labels == post_s.table.labels == ["0", "1", "2", "3", "4", "5"]  # sorted, whoever announced
    for name in post:
        np.testing.assert_allclose(pre[name], post[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_a_non_holder_leaves_pending_rows_out_of_its_softmax() -> None:
    _, s, (a, b), params = setup("ngfl-ta-pf", devices=2, alignment="pre")
    trains = [[None, data(["2", "3"], seed=0)], [None, data(["4", "5"], seed=1)]]
    params = run_round(s, [a, b], trains, TASK1, params)  # announcements
    a.load_global(params, TASK1 + 1, s.announce_meta(TASK1 + 1))
    assert a.pending_global == {"2", "3", "4", "5"} and a.table.labels == ["0", "1", "2", "3", "4", "5"]
    a.train_round(trains[0], TASK1 + 1, s.schedule.place(TASK1 + 1))
    assert not a.head.weight.detach()[4:].any() and not a.head.bias.detach()[4:].any()  # no gradient reached them
    assert a.head.weight.detach()[2:4].any()


# ---------------------------------------------------------------- self-attention rows


def test_self_attention_uses_the_tables_rows_for_the_current_task() -> None:
    _, s, (lr,), params = setup(labels=("2", "3", "0", "1"), epochs=1, weight_decay=0.0)  # one step
    task = data(["2", "3"])
    lr.load_global(params, TASK1, s.announce_meta(TASK1))
    assert lr.table.labels == ["2", "3", "0", "1"]  # the task's classes are rows 0-1, not the last rows
    h = task.x.astype(np.float64)
    for i in range(len(HIDDEN)):
        h = np.maximum(h @ params[f"extractor.{i}.weight"].T + params[f"extractor.{i}.bias"], 0)
    z = (h @ params[HEAD_W].T + params[HEAD_B])[:, [0, 1]]
    expected = np.mean(np.log(np.exp(z).sum(1)) - z[np.arange(len(z)), task.y])
    train = [None, task]
    place = s.schedule.place(TASK1)
    n, loss = lr.train_round(train, TASK1, place)
    assert n == len(task) and lr.table.current == ["2", "3"]
    assert loss == pytest.approx(expected, rel=1e-5)
    head = lr.head.weight.detach().numpy()
    np.testing.assert_array_equal(head[2:], params[HEAD_W][2:])  # rows outside the task's softmax: untouched
    assert not np.allclose(head[:2], params[HEAD_W][:2])
    up = lr.upload(TASK1, place)
    np.testing.assert_array_equal(up[ROWS_W], head[:2])


# ---------------------------------------------------------------- partial vs total uploads


def test_partial_fusion_uploads_fewer_head_rows_than_total_fusion() -> None:
    sizes = {}
    for method in ("ngfl", "ngfl-sa-tf"):
        _, s, (lr,), params = setup(method, labels=())
        train = [data(["0", "1"]), None]
        params = run_round(s, [lr], [train], 0, params)  # the base task
        f = step(s, lr, [train[0], data(["2", "3"], seed=1)], TASK1, params, "c0")
        sizes[method] = (f.meta["ngfl"]["table"]["labels"], s.bytes_by_kind(f.tensors, f.meta), len(encode(f)))
    (pf_labels, pf, pf_frame), (tf_labels, tf, tf_frame) = sizes["ngfl"], sizes["ngfl-sa-tf"]
    assert pf_labels == ["2", "3"] and tf_labels == ["0", "1", "2", "3"]
    assert pf["head"] == 2 * (DIM + 1) * 4 and tf["head"] == 4 * (DIM + 1) * 4
    assert pf["extractor"] == tf["extractor"] and pf_frame < tf_frame


# ---------------------------------------------------------------- the device's own clock


def test_two_arrivals_in_one_round_train_together_and_their_union_is_current() -> None:
    _, s, (lr,), params = setup(labels=())
    first, second = data(["0", "1"]), data(["1", "2"], n=4, seed=1)  # overlapping classes: a union, not a concatenation
    f = step(s, lr, [first, second], 0, params, "c0")
    assert f.meta["n_samples"] == len(first) + len(second)
    table = f.meta["ngfl"]["table"]
    assert table["current"] == table["labels"] == ["0", "1", "2"] and f.meta["ngfl"]["coverage"] == ["none", "none"]
    params = s.aggregate([accept(s, f)], params)  # the aggregator takes it
    assert s.table.labels == ["0", "1", "2"]
    f = step(s, lr, [first, second], 1, params, "c0")  # the newest task stays active, alone
    assert f.meta["n_samples"] == len(second) and f.meta["ngfl"]["table"]["current"] == ["1", "2"]


def test_with_no_active_task_an_idle_device_skips() -> None:
    f, s, (lr,), params = setup(labels=())
    joiner = methods.learner_for(f, D, 1)  # no task has arrived yet
    assert joiner.train_round([None, None], 0, s.schedule.place(0)) == (0, None) and not joiner.upload(
        0, s.schedule.place(0)
    )
    train = [data(["0", "1"])]
    params = run_round(s, [lr], [train], 0, params)  # base_rounds 1: the only trained round
    place = s.schedule.place(1)
    lr.load_global(params, 1, s.announce_meta(1))
    assert lr.train_round(train, 1, place) == (0, None)
    assert lr.upload(1, place) == {} and lr.report(place) == {"ngfl": {"skip": True, "announce": []}}
    f = decode(encode(frame("c0", 1, {"n_samples": 0, **lr.report(place)}, {})))  # what the daemon sends
    out = s.aggregate([accept(s, f)], params)  # a round of skip notices keeps the model
    for name in params:
        np.testing.assert_array_equal(out[name], params[name])


def test_with_idle_train_a_device_trains_its_last_task_again() -> None:
    _, s, (lr,), _ = setup(labels=(), idle="train")
    train = [data(["0", "1"]), data(["2", "3"], n=3, seed=1)]
    assert lr.train_round(train, 0, s.schedule.place(0))[0] == len(train[0]) + len(train[1])
    assert lr.train_round(train, 1, s.schedule.place(1))[0] == len(train[1])  # task 1 active for rounds_per_task 2
    for rnd in (2, 3):
        assert lr.train_round(train, rnd, s.schedule.place(rnd))[0] == len(train[1])  # idle: the last task again
        assert lr.table.current == ["2", "3"] and lr.upload(rnd, s.schedule.place(rnd))


def test_a_task_stays_active_for_its_trained_rounds() -> None:
    _, s, (lr,), _ = setup(labels=(), rounds_per_task=3, base_rounds=2)
    base, later = data(["0", "1"]), data(["2", "3"], n=3, seed=1)
    trained = []
    for rnd in range(8):
        train = [base, later if rnd >= 3 else None]  # task 1 arrives before round 3
        trained.append(lr.train_round(train, rnd, s.schedule.place(rnd))[0])
    assert trained == [12, 12, 0, 6, 6, 6, 0, 0]


def test_pre_alignment_announces_and_waits_then_starts() -> None:
    _, s, (lr,), params = setup(alignment="pre")
    train = [None, data(["2", "9"])]
    f = step(s, lr, train, TASK1, params, "c0")
    assert f.meta["ngfl"] == {"skip": True, "announce": ["2", "9"]} and f.meta["n_samples"] == 0
    params = s.aggregate([accept(s, f)], params)
    f = step(s, lr, train, TASK1 + 1, params, "c0")
    assert f.meta["n_samples"] == len(train[1]) and f.meta["ngfl"]["coverage"] == ["full"]


# ---------------------------------------------------------------- checkpoints


def trained_device():
    f, s, (lr,), params = setup(devices=1, labels=("1", "0"))  # the table's order, not sorted
    train = [None, data(["2", "3"]), None]
    params = run_round(s, [lr], [train], TASK1, params)
    step(s, lr, [None, train[1], data(["cat", "3"], seed=2)], TASK1 + 1, params, "c0")
    return f, s, lr


def test_a_learner_state_round_trips() -> None:
    f, s, lr = trained_device()
    assert lr.table.labels == ["1", "0", "2", "3", "cat"]  # "cat" not yet at the aggregator
    meta, arrays = lr.state()
    again = methods.learner_for(f, D, 0)
    again.load_state(copy.deepcopy(meta), {k: v.copy() for k, v in arrays.items()})
    tests = [data(["0", "1"], seed=7), data(["2", "3"], seed=8), data(["cat", "3"], seed=9)]
    assert again.evaluate(tests) == lr.evaluate(tests)
    place = s.schedule.place(TASK1 + 1)
    a, b = lr.upload(TASK1 + 1, place), again.upload(TASK1 + 1, place)
    assert a.keys() == b.keys() and again.report(place)["ngfl"]["table"] == lr.report(place)["ngfl"]["table"]
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])
    train = [None, None, data(["cat", "3"], seed=2)]
    place = s.schedule.place(TASK1 + 2)
    assert again.train_round(train, TASK1 + 2, place) == lr.train_round(train, TASK1 + 2, place)  # it continues alike
    a, b = lr.upload(TASK1 + 2, place), again.upload(TASK1 + 2, place)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])


def _corrupt(meta: dict, arrays: dict, what: str) -> None:
    table = meta["table"]
    if what == "duplicate labels":
        table["labels"][1] = table["labels"][0]
    elif what == "table not an object":
        meta["table"] = ["0", "1"]
    elif what == "non-string label":
        table["labels"][0] = 0
    elif what == "one slot too few":
        table["added"].pop()
    elif what == "current class without a head row":
        table["current"] = ["zz"]
    elif what == "task class without a head row":
        meta["slot_labels"]["2"] = ["cat", "zz"]
    elif what == "active task never started":
        meta["active"] = 7
    elif what == "head rows differ from the table":
        arrays[HEAD_W] = arrays[HEAD_W][:-1]


@pytest.mark.parametrize(
    "what",
    [
        "duplicate labels",
        "table not an object",
        "non-string label",
        "one slot too few",
        "current class without a head row",
        "task class without a head row",
        "active task never started",
        "head rows differ from the table",
    ],
)
def test_a_corrupted_learner_state_is_refused(what) -> None:
    f, _, lr = trained_device()
    meta, arrays = lr.state()
    meta, arrays = copy.deepcopy(meta), {k: v.copy() for k, v in arrays.items()}
    _corrupt(meta, arrays, what)
    with pytest.raises(ValueError, match="ngfl checkpoint"):
        methods.learner_for(f, D, 0).load_state(meta, arrays)


# ---------------------------------------------------------------- what the device serves


def test_the_served_model_names_its_classes_by_the_table_and_exports(tmp_path) -> None:
    _, s, lr = trained_device()
    served = lr.served_model(task=1)
    assert served is not None and served.image_side == 4
    assert list(served.class_names) == lr.table.labels == ["1", "0", "2", "3", "cat"]
    x = np.random.default_rng(5).random((10, D), dtype=np.float32)
    np.testing.assert_allclose(served.logits(x), lr.logits(x), rtol=1e-5, atol=1e-5)
    export_served(served, tmp_path / "ngfl.onnx", parity_inputs=x)
    runtime = ImageClassifierRuntime(tmp_path / "ngfl.onnx")
    assert runtime.class_names == ["1", "0", "2", "3", "cat"]
    logits, labels = runtime.classify(x)
    np.testing.assert_allclose(logits, lr.logits(x), rtol=1e-4, atol=1e-4)
    assert [p["class"] for p in runtime.predictions(x)] == [lr.table.labels[i] for i in labels]


# ---------------------------------------------------------------- the aggregator's restarts


def test_the_strategy_state_round_trips_the_global_table() -> None:
    f, s, (a, b), params = setup("ngfl", devices=2, alignment="pre")
    trains = [[None, data(["2", "3"], seed=0)], [None, data(["dog", "3"], seed=1)]]
    params = run_round(s, [a, b], trains, TASK1, params)  # announcements: pending rows
    frames = [step(s, lr, tr, TASK1 + 1, params, f"c{i}") for i, (lr, tr) in enumerate(zip([a, b], trains))]
    frames[1] = decode(encode(frame("c1", TASK1 + 1, _skip(), {})))
    params = s.aggregate([accept(s, x) for x in frames], params)  # c1 skipped: "dog" stays pending
    assert s.table.pending == {"dog"} and s.table.version > 1
    meta, arrays = s.state()
    again = methods.strategy_for(f, D)
    again.restore(copy.deepcopy(meta), arrays)
    assert again.table.to_meta() == s.table.to_meta() and again.announce_meta(9) == s.announce_meta(9)
    assert again.table.row("dog") == s.table.row("dog") and again.fits(params)
    f2 = step(s, b, trains[1], TASK1 + 2, params, "c1")
    one, two = s.aggregate([accept(s, f2)], params), again.aggregate([accept(again, f2)], params)
    for name in one:
        np.testing.assert_array_equal(one[name], two[name])
    assert again.table.to_meta() == s.table.to_meta() and not s.table.pending
    with pytest.raises(ValueError, match="ngfl checkpoint"):
        again.restore({"table": {**meta["table"], "pending": ["nowhere"]}}, {})


def test_placed_on_the_cpu_a_device_uploads_bit_for_bit_what_an_unplaced_one_does() -> None:
    """``train.device``: the CPU path is today's (the daemon never places it; placed, the same bits)."""
    runs = []
    for placed in (False, True):
        _, s, (lr,), params = setup(loss="self")
        if placed:
            lr.place(torch.device("cpu"), "off")
        train = [data(["0", "1"]), data(["2", "3"], n=3, seed=1)]
        uploads = [step(s, lr, train, rnd, params, "c0").tensors for rnd in (0, 1, TASK1)]
        runs.append((uploads, lr.evaluate(train)))
    assert runs[0][1] == runs[1][1]
    for a, b in zip(runs[0][0], runs[1][0]):
        assert a.keys() == b.keys()
        for name in a:
            np.testing.assert_array_equal(np.asarray(a[name]), np.asarray(b[name]))


def test_placed_on_another_device_the_extractor_and_the_growing_head_live_there() -> None:
    _, s, (lr,), params = setup()
    with pytest.raises(ValueError, match="float32 only"):
        lr.place(torch.device("cpu"), "bf16")
    lr.place(torch.device("meta"), "off")
    lr.load_global(params, 0, s.announce_meta(0))  # the head rebuilt from host arrays
    lr._start_arrivals([data(["0", "1"]), data(["2", "3"], n=3, seed=1)], 0)  # grown by two rows
    assert lr.head.rows == 4
    assert {p.device.type for p in [*lr.extractor.parameters(), *lr.head.parameters()]} == {"meta"}
