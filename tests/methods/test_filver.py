"""FIL-VER's pieces, without a broker: the reparameterisation and the KL, phase 0 and the
frozen encoder, the rehearsal store, what goes up, the server's buffer and SST, and the
validation of hostile embedding uploads (each rejected under its own counted reason)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import methods
from fclcore.codec import Frame, Header, Kind
from fclcore.data import Dataset
from fclcore.schedule import RoundPlace
from fclcore.schema import FederationSpec, TrainSpec
from fclcore.sparsify import DELTA
from fclcore.strategy import Rejected, Update
from methods.filver.model import kl_standard_normal, sample, ver_loss
from methods.filver.strategy import Buffer, Embeddings
from methods.filver.wire import CLS, EMB_LOG_SIGMA, EMB_MU, EMB_Y, EMB_Z, ENC

SIDE = 12  # padding 2 keeps two conv + pool stages valid on 12x12 images
OPTS = {"hidden": 16, "latent": 4, "padding": 2, "channels": [2, 3], "phase0_rounds": 2, "sst_steps": 5}


def fed(method: str = "filver", **options) -> FederationSpec:
    return FederationSpec(
        name="t",
        method=method,
        num_tasks=2,
        task_rounds=[4, 3],
        train=TrainSpec(batch_size=8, lr=0.05, optimizer="sgd"),
        options={**OPTS, **options},
    )


def data(n: int = 100, seed: int = 0) -> Dataset:
    rng = np.random.default_rng(seed)
    y = np.arange(n) % 10
    x = rng.random((n, SIDE * SIDE), dtype=np.float32) * 0.2
    x[np.arange(n), y * 7] += 1.0  # a learnable pixel per class
    return Dataset(x, y.astype(np.int64))


def learner(method: str = "filver", index: int = 0, **options):
    out = methods.learner_for(fed(method, **options), SIDE * SIDE, index)
    out.allow_embedding_upload = True
    return out


def strategy(method: str = "filver", **options):
    return methods.strategy_for(fed(method, **options), SIDE * SIDE)


def frame(client: str, rnd: int, task: int, tensors: dict, meta: dict) -> Frame:
    return Frame(Header(Kind.UPDATE, "t", rnd, task, client, 1), meta, tensors)


def place(s, rnd: int) -> RoundPlace:
    return s.schedule.place(rnd)


def run_phase0(s, learners) -> dict:
    """Phase 0 through the strategy, then every learner gets the frozen encoder."""
    params = s.initial_model()
    for rnd in range(OPTS["phase0_rounds"]):
        ups = []
        for i, lr in enumerate(learners):
            lr.load_global(params, rnd)
            n, _ = lr.train_round([data(seed=i)], rnd, place(s, rnd))
            f = frame(f"c{i}", rnd, 0, lr.upload(rnd, place(s, rnd)), {**lr.report(place(s, rnd))})
            checked = s.normalize(f)
            ups.append(Update(f"c{i}", f, n, 0, 0, checked.tensors, checked.parsed))
        params = s.aggregate(ups, params)
    downs = s.client_downlinks(OPTS["phase0_rounds"], [f"c{i}" for i in range(len(learners))])
    for i, lr in enumerate(learners):
        meta, tensors = downs[f"c{i}"]
        lr.receive_frame(Frame(Header(Kind.KNOWLEDGE, "t", 2, 0, "aggregator", 1), meta, tensors), 2)
        lr.load_global(params, OPTS["phase0_rounds"])
    return params


def test_reparameterisation_is_mu_plus_sigma_eps() -> None:
    mu, log_sigma = torch.tensor([[1.0, -2.0, 0.5]]), torch.tensor([[0.0, math.log(2.0), -1.0]])
    eps = torch.randn((1, 3), generator=torch.Generator().manual_seed(7))
    z = sample(mu, log_sigma, torch.Generator().manual_seed(7))
    torch.testing.assert_close(z, torch.tensor([[1.0, -2.0, 0.5]]) + torch.tensor([[1.0, 2.0, math.exp(-1)]]) * eps)
    assert sample(mu, None) is mu  # a deterministic encoder (EBR): z = mu


def test_kl_matches_the_closed_form_by_hand_and_torch() -> None:
    mu, log_sigma = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, math.log(2.0)]])
    by_hand = (0.5 * (1 + 1 - 1) - 0.0) + (0.5 * (0 + 4 - 1) - math.log(2.0))  # 2 - ln 2
    assert float(kl_standard_normal(mu, log_sigma)[0]) == pytest.approx(by_hand, rel=1e-6)
    q = torch.distributions.Normal(mu, log_sigma.exp())
    p = torch.distributions.Normal(torch.zeros(2), torch.ones(2))
    assert float(kl_standard_normal(mu, log_sigma)[0]) == pytest.approx(
        float(torch.distributions.kl_divergence(q, p).sum()), rel=1e-6
    )
    logits, y = torch.tensor([[2.0, 0.0]]), torch.tensor([0])
    ce = float(torch.nn.functional.cross_entropy(logits, y))
    assert float(ver_loss(logits, y, mu, log_sigma, 0.1)) == pytest.approx(ce + 0.1 * by_hand, rel=1e-6)
    assert float(ver_loss(logits, y, mu, None, 0.1)) == pytest.approx(ce)


def test_phase0_trains_the_encoder_then_it_is_frozen_and_gets_no_gradient() -> None:
    s, lr = strategy(), learner()
    start = {k: v.copy() for k, v in s.initial_model().items() if k.startswith(ENC)}
    params = run_phase0(s, [lr])
    assert set(params) == {k for k in s.initial_model() if k.startswith(CLS)}  # rounds carry the classifier only
    assert any(not np.allclose(s.encoder[k], start[k]) for k in start), "phase 0 did not train the encoder"
    before = {n: p.detach().clone() for n, p in lr.encoder.named_parameters()}
    lr.train_round([data()], 2, place(s, 2))
    for n, p in lr.encoder.named_parameters():
        assert p.grad is None and not p.requires_grad, n
        torch.testing.assert_close(p.detach(), before[n])
        np.testing.assert_array_equal(p.detach().numpy(), s.encoder[ENC + n])


def test_rehearsal_keeps_stats_not_images_and_each_item_goes_up_once() -> None:
    s, lr = strategy(), learner()
    run_phase0(s, [lr])
    sent = []
    for rnd in (2, 3):  # task 0's rounds after phase 0
        lr.train_round([data()], rnd, place(s, rnd))
        up = lr.upload(rnd, place(s, rnd))
        assert lr.report(place(s, rnd)) == {"filver": {"task": 0, "form": "z"}}
        sent.append(up[EMB_Y])
        assert up[EMB_Z].shape == (len(up[EMB_Y]), OPTS["latent"])
    labels = np.concatenate(sent)
    assert sorted(labels.tolist()) == list(range(10)) == sorted(lr.pending.y.tolist())  # 10% of 100, class-balanced
    lr.start_task(1, None)
    assert len(lr.store) == 10 and len(lr.pending) == 0
    _, arrays = lr.state()
    assert all(a.ndim < 2 or a.shape[1] != SIDE * SIDE for k, a in arrays.items() if not k.startswith(ENC))
    assert arrays["store/mu"].shape == (10, OPTS["latent"]) and "store/log_sigma" in arrays
    n, _ = lr.train_round([data(), data(seed=5)], 4, place(s, 4))
    assert n == 100 + 10  # the current task's rows plus the kept items
    vanilla = learner("filver-vanilla")
    run_phase0(strategy("filver-vanilla"), [vanilla])
    vanilla.start_task(1, None)
    assert vanilla.train_round([data(), data(seed=5)], 4, place(s, 4))[0] == 100


def test_a_device_that_has_not_opted_in_uploads_no_embeddings() -> None:
    s, lr = strategy(), learner()
    lr.allow_embedding_upload = False
    run_phase0(s, [lr])
    lr.train_round([data()], 2, place(s, 2))
    up = lr.upload(2, place(s, 2))
    assert not any(k.startswith("emb:") for k in up) and lr.report(place(s, 2))["filver"]["form"] == "none"


def test_restore_continues_with_the_same_store() -> None:
    s, lr = strategy(), learner()
    run_phase0(s, [lr])
    lr.train_round([data()], 2, place(s, 2))
    lr.upload(2, place(s, 2))
    meta, arrays = lr.state()
    again = learner()
    again.start_task(0, None)
    again.load_state(meta, arrays)
    assert again.items_sent == lr.items_sent and again.frozen
    np.testing.assert_array_equal(again.pending.mu, lr.pending.mu)
    for (_, a), (_, b) in zip(again.encoder.named_parameters(), lr.encoder.named_parameters()):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="uploaded"):
        again.load_state({**meta, "uploaded": 99}, arrays)


def _update(s, client: str, rnd: int, tensors: dict, meta: dict, n: int = 10) -> Update:
    f = frame(client, rnd, s.schedule.task_of(rnd), tensors, meta)
    checked = s.normalize(f)
    return Update(client, f, n, 0, 0, checked.tensors, checked.parsed)


def _post_phase0(method: str = "filver", **options):
    s = strategy(method, **options)
    lr = learner(method, **options)
    params = run_phase0(s, [lr])
    return s, lr, params


def test_sst_changes_only_the_classifier_and_fills_the_buffer_once_per_round() -> None:
    s, lr, params = _post_phase0()
    encoder = {k: v.copy() for k, v in s.encoder.items()}
    lr.train_round([data()], 2, place(s, 2))
    tensors = lr.upload(2, place(s, 2))
    meta = {**lr.report(place(s, 2)), "allow_embedding_upload": True}
    u = _update(s, "c0", 2, tensors, meta)
    assert len(s.buffer) == 0  # normalising (also a journal replay) never adds items
    fedavg = {k: s.true.values[k] + tensors[k + DELTA].to_dense() for k in params}  # one device: its change
    out = s.aggregate([u], params)
    assert set(out) == set(params) and len(s.buffer) == 5
    assert any(not np.allclose(s.true.values[k], fedavg[k]) for k in params), "SST left the FedAvg result unchanged"
    for k, v in encoder.items():
        np.testing.assert_array_equal(s.encoder[k], v)
    meta_s, arrays = s.state()
    again = strategy()
    again.restore(meta_s, arrays)
    np.testing.assert_array_equal(again.buffer.z, s.buffer.z)
    assert again.has_encoder == {"c0"} and again.encoder is not None
    np.testing.assert_array_equal(
        s.aggregate([u], params)["cls.out.bias"], again.aggregate([u], params)["cls.out.bias"]
    )


def test_the_encoder_goes_to_each_device_once() -> None:
    s, _, _ = _post_phase0()
    assert s.client_downlinks(3, ["c0", "c1"]).keys() == {"c1"}  # c0 had it at round 2
    assert s.announce_meta(3) == {"client_frames": ["c1"]}
    assert s.client_downlinks(4, ["c0", "c1", "c2"]).keys() == {"c2"}


HOSTILE = [
    ("wrong dimension", {EMB_Z: np.zeros((2, 5), np.float32)}, {}, "embeddings"),
    ("NaN", {EMB_Z: np.full((2, 4), np.nan, np.float32)}, {}, "nonfinite"),
    ("label out of range", {EMB_Y: np.array([0.0, 10.0], np.float32)}, {}, "labels"),
    ("fractional label", {EMB_Y: np.array([0.5, 1.0], np.float32)}, {}, "labels"),
    ("over the budget", {EMB_Y: np.zeros(65, np.float32), EMB_Z: np.zeros((65, 4), np.float32)}, {}, "budget"),
    ("no consent", {}, {"allow_embedding_upload": False}, "consent"),
    ("the wrong form", {EMB_MU: np.zeros((2, 4), np.float32)}, {}, "embeddings"),
    ("labels without values", {EMB_Z: None}, {}, "embeddings"),
]


@pytest.mark.parametrize("why, change, meta_change, reason", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_embedding_uploads_are_rejected_with_a_reason(why, change, meta_change, reason) -> None:
    s, lr, params = _post_phase0()
    tensors = {k + DELTA: np.zeros_like(v) for k, v in params.items()}  # no change of the classifier
    tensors.update({EMB_Y: np.array([1.0, 2.0], np.float32), EMB_Z: np.zeros((2, 4), np.float32)})
    for k, v in change.items():
        if v is None:
            tensors.pop(k)
        else:
            tensors[k] = v
    meta = {"filver": {"task": 0, "form": "z"}, "allow_embedding_upload": True, **meta_change}
    with pytest.raises(Rejected) as info:
        s.normalize(frame("c0", 2, 0, tensors, meta))
    assert info.value.reason == reason, str(info.value)


def test_stats_form_and_log_sigma_bounds() -> None:
    s, lr, params = _post_phase0("filver-stats")
    lr.train_round([data()], 2, place(s, 2))
    tensors = lr.upload(2, place(s, 2))
    assert EMB_MU in tensors and EMB_LOG_SIGMA in tensors and EMB_Z not in tensors
    meta = {**lr.report(place(s, 2)), "allow_embedding_upload": True}
    s.aggregate([_update(s, "c0", 2, tensors, meta)], params)
    assert s.buffer.log_sigma is not None and len(s.buffer) == 5
    bad = {**tensors, EMB_LOG_SIGMA: np.full_like(tensors[EMB_LOG_SIGMA], 9.0)}
    with pytest.raises(Rejected, match="outside"):
        s.normalize(frame("c0", 2, 0, bad, meta))


def test_phase0_updates_need_the_encoder_and_embeddings_are_refused_then() -> None:
    s = strategy()
    params = s.initial_model()
    meta = {"filver": {"task": 0, "form": "none"}}
    with pytest.raises(ValueError, match="enc.conv1.weight"):
        s.normalize(frame("c0", 0, 0, {k: v for k, v in params.items() if k.startswith(CLS)}, meta))
    tensors = {k + DELTA: np.zeros_like(v) for k, v in params.items()}
    tensors.update({EMB_Y: np.zeros(1, np.float32), EMB_Z: np.zeros((1, 4), np.float32)})
    with pytest.raises(Rejected) as info:
        s.normalize(frame("c0", 0, 0, tensors, {"filver": {"task": 0, "form": "z"}, "allow_embedding_upload": True}))
    assert info.value.reason == "embeddings"


def test_buffer_is_bounded_and_evicts_the_oldest_of_the_largest_group() -> None:
    b = Buffer(latent=2, stats=False, cap=5)
    b.add(Embeddings(np.zeros((4, 2), np.float32), None, np.array([0, 0, 0, 1])), task=0, client="a")
    b.add(Embeddings(np.ones((3, 2), np.float32), None, np.array([0, 1, 2])), task=1, client="b")
    assert len(b) == 5 and b.evicted == 2
    groups = sorted(zip(b.task.tolist(), b.y.tolist()))
    assert groups == [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)]  # (task 0, class 0) lost its two oldest
    assert b.seq.tolist() == [2, 3, 4, 5, 6] and b.client.tolist() == [0, 0, 1, 1, 1] and b.clients == ["a", "b"]


def test_phase0_must_leave_task_one_a_round() -> None:
    with pytest.raises(ValueError, match="phase0_rounds"):
        methods.strategy_for(fed(phase0_rounds=4), SIDE * SIDE)


def _run_placed(placed: bool) -> tuple[list[dict], list]:
    s, lr = strategy(), learner()
    if placed:
        lr.place(torch.device("cpu"), "off")
    params = run_phase0(s, [lr])
    uploads = []
    for rnd in (2, 3):
        lr.load_global(params, rnd)
        lr.train_round([data()], rnd, place(s, rnd))
        uploads.append(lr.upload(rnd, place(s, rnd)))
    return uploads, lr.evaluate([data(seed=5)])


def test_placed_on_the_cpu_a_device_uploads_bit_for_bit_what_an_unplaced_one_does() -> None:
    """``train.device``: the CPU path is today's (the daemon never places it; placed, the same bits)."""
    plain, placed = _run_placed(False), _run_placed(True)
    assert plain[1] == placed[1]
    for a, b in zip(plain[0], placed[0], strict=True):
        assert a.keys() == b.keys()
        for name in a:
            x, y = (t.to_dense() if hasattr(t, "to_dense") else np.asarray(t) for t in (a[name], b[name]))
            np.testing.assert_array_equal(x, y)


def test_placed_on_another_device_the_encoder_and_classifier_live_there_and_draws_stay_seeded() -> None:
    lr = learner()
    with pytest.raises(ValueError, match="float32 only"):
        lr.place(torch.device("cpu"), "fp16")
    lr.place(torch.device("meta"), "off")
    params = [*lr.encoder.parameters(), *lr.classifier.parameters()]
    assert {p.device.type for p in params} == {"meta"}
    mu = torch.zeros(2, 4, device="meta")
    assert sample(mu, torch.zeros(2, 4, device="meta"), torch.Generator().manual_seed(7)).device.type == "meta"
