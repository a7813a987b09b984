"""ConFedMADE / FedWeIT-MADE pieces: decomposed model, masked uploads, merge, knowledge base."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from conftest import autograd_penalty
from support import builders

from fclbases.made.decomposed_model import DecomposedMADE
from fclbases.made.options import upload_order
from fclcore.aggregation import weighted_average
from fclcore.codec import Frame, Header, Kind, SparseTensor, decode, encode
from fclcore.data import Dataset
from fclcore.made_spec import MadeConfig, input_degrees, input_order, made_masks, mask_for_param
from fclcore.masked_upload import pack, unpack
from fclcore.schedule import TaskSchedule
from fclcore.schema import FederationSpec, ModelSpec
from fclcore.strategy import Update
from methods import learner_for, strategy_for
from methods.confedmade.decomposed_learner import DecomposedLearner
from methods.confedmade.strategy import DecomposedStrategy, KnowledgeEntry

D = 10


def _fed(method: str = "confedmade", **options) -> FederationSpec:
    return builders.federation_spec(method=method, options=options)


def _made(fed: FederationSpec) -> MadeConfig:
    return fed.model.made_config(D)


def _place(rnd: int):
    return TaskSchedule.uniform(3, 2).place(rnd)


def _data(seed: int, n: int = 40, dim: int = D) -> Dataset:
    rng = np.random.default_rng(seed)
    return Dataset((rng.random((n, dim)) > 0.5).astype(np.float32), np.zeros(n, np.int64))


def _random_knowledge(model: DecomposedMADE, n: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {p: torch.randn((n, *l.weight.shape), generator=g) for p, l in model.layers.items()}


@pytest.mark.parametrize("n_kb", [0, 3])
@pytest.mark.parametrize("orders", [[0], [1, 2, 0], [2, 1]])
def test_autoregressive_with_knowledge_entries(n_kb, orders):
    cfg = MadeConfig(input_dim=D, hidden_sizes=(32, 32), num_orders=3, mask_seed=5, natural_order=False)
    torch.manual_seed(0)
    model = DecomposedMADE(cfg)
    model.add_task(_random_knowledge(model, n_kb, 1), mask_init=1.0, lambda3=2.0)
    model.add_task(_random_knowledge(model, n_kb, 2), mask_init=0.5, lambda3=3.0)
    with torch.no_grad():
        for layer in model.layers.values():
            for a in list(layer.attention) + list(layer.adaptive):
                a.add_(torch.randn_like(a))
    for k in orders:
        model.set_order(k)
        deg = input_degrees(input_order(cfg, k))
        for task in (0, 1):
            x = torch.rand(D)
            jac = torch.autograd.functional.jacobian(lambda v: model(v[None], task)[0], x)  # (D out, D in)
            forbidden = deg[None, :] >= deg[:, None]
            assert torch.all(jac[torch.from_numpy(forbidden)] == 0), (k, task)
            assert torch.count_nonzero(jac[torch.from_numpy(~forbidden)]) > 0


def test_settling_a_task_keeps_its_weights_bit_for_bit_and_drops_its_entries():
    cfg = MadeConfig(input_dim=D, hidden_sizes=(32,), num_orders=2, mask_seed=5, natural_order=False)
    torch.manual_seed(0)
    model = DecomposedMADE(cfg)
    model.add_task(_random_knowledge(model, 4, 1), mask_init=1.0, lambda3=2.0)
    with torch.no_grad():
        for layer in model.layers.values():
            layer.attention[0].add_(torch.randn_like(layer.attention[0]))
    before = {p: layer.composed(0).detach().clone() for p, layer in model.layers.items()}
    model.settle(0)
    for prefix, layer in model.layers.items():
        assert torch.equal(layer.composed(0), before[prefix]), prefix
        assert layer.knowledge[0].shape[0] == 0 and layer.settled[0].shape == layer.weight.shape
    with pytest.raises(ValueError, match="expected shape"):
        model.output.settle(0, torch.zeros(3))


def test_pack_unpack_round_trip_and_errors():
    rng = np.random.default_rng(0)
    values = rng.normal(size=(6, 5)).astype(np.float32)
    mask = (rng.random((6, 5)) > 0.5).astype(np.float32)
    units = np.array([1, 0, 1, 1, 0, 0], bool)
    tensors = pack("w", values, mask, units)
    sparse = unpack("w", tensors, (6, 5), mask)
    expected = np.where(units[:, None] & (mask > 0), values, 0)
    np.testing.assert_array_equal(sparse.to_dense(), expected)
    with pytest.raises(ValueError, match="values"):
        unpack("w", {**tensors, "w": tensors["w"][:-1]}, (6, 5), mask)
    with pytest.raises(ValueError, match="units"):
        unpack("w", {**tensors, "w#units": np.full(6, 2.0, np.float32)}, (6, 5), mask)
    with pytest.raises(ValueError, match="expected tensors"):
        unpack("w", {"w": tensors["w"]}, (6, 5), mask)


def _learner(client: int, fed: FederationSpec, strategy: DecomposedStrategy) -> DecomposedLearner:
    learner = learner_for(fed, D, client)
    learner.load_global(strategy.initial_model(), 0)
    return learner


def _update(client: str, rnd: int, tensors: dict, strategy: DecomposedStrategy, n: int = 40) -> Update:
    """Through the codec, as on the wire, then the aggregator's normaliser."""
    return builders.update(client, tensors, rnd=rnd, n_samples=n, strategy=strategy, wire_dtype="float16")


@pytest.mark.parametrize("rnd", [0, 1, 4])
def test_no_uploaded_element_lies_outside_the_made_mask(rnd):
    fed = _fed()
    strategy = strategy_for(fed, D)
    learner = _learner(0, fed, strategy)
    learner.start_task(0, None)
    learner.train_round([_data(0)], rnd, _place(rnd))
    task_end = (rnd + 1) % fed.rounds_per_task == 0
    update = _update("c0", rnd, learner.upload(rnd, _place(rnd)), strategy)
    assert any(n.startswith("kb:") for n in update.tensors) == task_end
    masks = made_masks(_made(fed), upload_order(_made(fed), strategy.options, rnd))
    for name, tensor in update.tensors.items():
        if name.endswith(".weight") and not name.startswith("kb:"):  # kb entries are the whole A_t
            mask = mask_for_param(masks, name).ravel()
            assert isinstance(tensor, SparseTensor) and np.all(mask[tensor.indices] == 1), name
            kept_rows = np.unique(tensor.indices // tensor.shape[1])
            assert len(kept_rows) <= round(0.5 * tensor.shape[0])  # keep_units = 0.5


def test_upload_is_gated_base_and_merge_restores_it():
    """One client: aggregate(upload) then merge gives back the same base (B <- G / sigmoid(m))."""
    fed = _fed()
    strategy = strategy_for(fed, D)
    learner = _learner(0, fed, strategy)
    learner.start_task(0, None)
    learner.train_round([_data(0)], 0, _place(0))
    before = {p: l.weight.detach().clone() for p, l in learner.model.layers.items()}
    gates = {p: torch.sigmoid(l.unit_logits[0]).detach() for p, l in learner.model.layers.items()}
    global_model = strategy.initial_model()
    frame_tensors = learner.upload(0, _place(0))
    sparse = strategy.normalize(Frame(Header(Kind.UPDATE, "t", 0, 0, "c0", 1), {}, frame_tensors))
    for prefix in before:
        t = sparse[f"{prefix}.weight"]
        expected = (before[prefix] * gates[prefix][:, None]).numpy().ravel()[t.indices]
        np.testing.assert_allclose(t.values, expected, rtol=1e-6)
    merged = weighted_average([(sparse, 1.0)], global_model)
    learner.load_global(merged, 1)
    for prefix, layer in learner.model.layers.items():
        torch.testing.assert_close(layer.weight.detach(), before[prefix], rtol=1e-5, atol=1e-6)


def test_knowledge_base_round_trip_through_the_wire():
    fed = _fed(kb_threshold=0.01)
    strategy = strategy_for(fed, D)
    learners = [_learner(i, fed, strategy) for i in range(2)]
    for rnd in range(fed.rounds_per_task):  # task 0 for both clients
        updates = []
        for i, learner in enumerate(learners):
            if rnd == 0:
                learner.start_task(0, None)
            learner.train_round([_data(i)], rnd, _place(rnd))
            updates.append(_update(f"c{i}", rnd, learner.upload(rnd, _place(rnd)), strategy))
        merged = strategy.aggregate(updates, strategy.initial_model())
        for learner in learners:
            learner.load_global(merged, rnd + 1)
    sent_a = {p: l.adaptive[0].detach().numpy().copy() for p, l in learners[1].model.layers.items()}
    meta, tensors = strategy.client_downlinks(2, ["c0", "c1"])["c0"]  # round 2 starts task 1
    assert [e["id"] for e in meta["entries"]] == ["c1/t0"]  # only the other client's entry
    wire = decode(encode(Frame(Header(Kind.KNOWLEDGE, "t", 2, 1, "aggregator", 9), meta, tensors)))
    learners[0].start_task(1, wire)
    for prefix, layer in learners[0].model.layers.items():
        expected = np.where(np.abs(sent_a[prefix]) < 0.01, 0, sent_a[prefix]).astype(np.float16)  # sent as fp16
        np.testing.assert_array_equal(layer.knowledge[1][0].numpy(), expected.astype(np.float32))
        assert layer.attention[1].shape == (1,) and layer.unit_logits[0].requires_grad is False


@pytest.mark.parametrize("policy,k,expected", [("all", 1, 4), ("recent", 2, 2), ("random", 2, 2)])
def test_knowledge_selection_policies(policy, k, expected):
    fed = _fed(kb_policy=policy, kb_k=k)
    strategy = strategy_for(fed, D)
    strategy.knowledge = [KnowledgeEntry(c, t, {}) for t in range(2) for c in "abc"]
    chosen = strategy.client_downlinks(4, ["a", "b", "c"])["a"][0]["entries"]  # round 4 starts task 2
    assert len(chosen) == expected  # "all" ignores k: b and c, tasks 0 and 1
    assert all(e["client"] != "a" for e in chosen)
    if policy == "recent":
        assert [e["task"] for e in chosen] == [1, 1]


def test_fedweit_made_draws_independent_masks():
    fed = dataclasses.replace(_fed(), method="fedweit-made")
    a, b = (learner_for(fed, D, i) for i in range(2))
    assert not torch.equal(a.model.output.mask, b.model.output.mask)
    star = dataclasses.replace(_fed(), method="fedweit-made-star")
    c, d = (learner_for(star, D, i) for i in range(2))
    assert torch.equal(c.model.output.mask, d.model.output.mask)


@pytest.mark.parametrize("budget_mb", [0.002, 0.01])
def test_the_knowledge_budget_bounds_every_frame_with_many_clients_and_tasks(budget_mb):
    fed = dataclasses.replace(_fed(kb_budget_mb=budget_mb), num_tasks=6)
    strategy, unbounded = strategy_for(fed, D), strategy_for(dataclasses.replace(_fed(), num_tasks=6), D)
    rng = np.random.default_rng(0)
    shapes = {n: s for n, s in strategy.shapes.items() if n.endswith(".weight")}
    clients = [f"c{i}" for i in range(40)]
    entries = []
    for t in range(5):
        for c in clients:
            sparse = {
                n: SparseTensor.from_dense(np.where(rng.random(s) < 0.3, rng.standard_normal(s), 0))
                for n, s in shapes.items()
            }
            entries.append(KnowledgeEntry(c, t, sparse))
    strategy.knowledge = unbounded.knowledge = entries
    start = 10  # round 10 starts task 5 (2 rounds per task)
    header = Header(Kind.KNOWLEDGE, "t", start, 5, "aggregator", 1)
    frames = strategy.client_downlinks(start, clients)
    full = unbounded.client_downlinks(start, clients[:1])["c0"]
    full_bytes = sum(t.values.nbytes + t.indices.nbytes for t in full[1].values())
    for client, (meta, tensors) in frames.items():
        payload = encode(Frame(header, meta, tensors), strategy.fed.value_coding)  # the budget is in its dtype
        overhead = len(encode(Frame(header, meta, {}), "float32")) + 64 * len(tensors)  # header, names, counts
        assert len(payload) <= budget_mb * 1e6 + overhead, client
        tasks = [e["task"] for e in meta["entries"]]
        assert tasks == sorted(tasks) and (not tasks or max(tasks) == 4)  # the most recent task first
        assert all(e["client"] != client for e in meta["entries"])
    # unbounded, the frame would hold 39 x 5 entries: more than the budget, and more tensors than a
    # frame may carry, so the strategy caps it at the most recent entries that fit
    assert full_bytes > 2 * budget_mb * 1e6
    assert len(full[1]) <= 256 and {4, 3} <= {e["task"] for e in full[0]["entries"]}


def test_catch_up_rounds_add_the_furthest_moved_entries_outside_the_selection():
    fed = _fed(catchup_every=2, catchup_share=0.1)
    strategy = strategy_for(fed, D)
    learner = _learner(0, fed, strategy)
    learner.start_task(0, None)
    sizes = {}
    for rnd in (0, 1):
        learner.train_round([_data(rnd)], rnd, _place(rnd))
        before = {
            p: (layer.weight * torch.sigmoid(layer.unit_logits[0])[:, None]).detach().numpy().copy()
            for p, layer in learner.model.layers.items()
        }
        tensors = learner.upload(rnd, _place(rnd))
        extras = {n: t for n, t in tensors.items() if n.endswith("#extra")}
        assert bool(extras) == (rnd == 1)  # every second round
        update = _update("c0", rnd, tensors, strategy)
        for name, extra in extras.items():
            weight = name[: -len("#extra")]
            prefix = weight.rsplit(".", 1)[0]
            merged = update.tensors[weight]  # the selection and the catch-up entries, one sparse tensor
            assert set(extra.indices) <= set(merged.indices) and np.all(np.diff(merged.indices) > 0)
            selection = np.setdiff1d(merged.indices, extra.indices)
            assert not np.isin(extra.indices, selection).any()
            assert 0 < extra.nnz <= round(0.1 * np.prod(extra.shape))  # catchup_share of the weight at most
            moved = np.abs(before[prefix] - learner.global_weight[prefix]).reshape(-1)
            moved[selection] = 0  # the chosen ones moved at least as far as any other outside entry
            assert moved[extra.indices].min() >= np.delete(moved, extra.indices).max()
            sizes[weight] = extra.nnz
        learner.load_global(
            {
                k: v.to_dense() if isinstance(v, SparseTensor) else v
                for k, v in strategy.aggregate([update], strategy.initial_model()).items()
            },
            rnd,
        )
    assert sizes and all(n > 0 for n in sizes.values())
    overlap = _update("c0", 1, tensors, strategy).tensors  # a forged overlap with the selection is refused
    name = next(iter(extras))
    weight = name[: -len("#extra")]
    inside = overlap[weight].indices[:1]
    with pytest.raises(ValueError, match="inside the round's selection"):
        _update("c0", 1, {**tensors, name: SparseTensor(extras[name].shape, inside, [1.0])}, strategy)


@pytest.mark.parametrize("method", ["confedmade", "fedweit-made-star"])
def test_hand_written_penalty_gradients_equal_autograd_bit_for_bit(method):
    """The regulariser without a kept graph gives the gradients (and, closely, the value) of the
    plain autograd formula, at every task, so training is unchanged bit for bit."""
    fed = dataclasses.replace(_fed(method, lambda2=50.0, lambda1=0.01), num_tasks=5)
    learner = _learner(0, fed, strategy_for(fed, D))
    batch = torch.from_numpy(_data(9, 16).x)
    for task in range(5):
        learner.start_task(task, None)
        learner.train_round([_data(task)], 2 * task, _place(0))
        learner.model.set_order(task)
        grads = []
        for penalty in (autograd_penalty, DecomposedLearner._regularizer):
            learner.optimizer.zero_grad(set_to_none=True)
            reg = penalty(learner)
            (learner.model.nll(batch, task).mean() + reg).backward()
            grads.append([None if p.grad is None else p.grad.clone() for p in learner.model.parameters()])
            value = float(reg.detach())
        assert float(autograd_penalty(learner).detach()) == pytest.approx(value, rel=1e-5)
        assert sum(g is not None for g in grads[0]) > 3 + task  # B, every A_i, ... have gradients
        for reference, ours in zip(*grads):
            assert (reference is None) == (ours is None)
            assert reference is None or torch.equal(reference, ours), task


def test_masked_moments_is_confedmades_default_and_not_the_fedweit_baselines():
    for method, on in (("confedmade", True), ("fedweit-made-star", False), ("fedweit-made", False)):
        fed = _fed(method)
        assert _learner(0, fed, strategy_for(fed, D)).hold is on, method
        fed = _fed(method, masked_moments=not on)  # a scenario's setting wins
        assert _learner(0, fed, strategy_for(fed, D)).hold is not on, method


def test_masked_moments_hold_the_entries_outside_the_rounds_made_mask():
    """``masked_moments``: in a round whose MADE mask differs from the last one's, the entries
    of B and A_t outside it keep their value and Adam moments (off: stale momentum moves
    them); everything else trains as without the option.  At the first task nothing outside
    the mask reaches the loss, so the two learners agree everywhere else bit for bit.  (The
    hold spans the round, ``Adam.holding_outside``: ``order_per: round``; 16 inputs and 32
    hidden units, so each weight's size is a multiple of the fused kernel's vector width.)"""
    learners = {}
    dim = 16
    for on in (False, True):
        model = ModelSpec(hidden_sizes=[32], num_orders=3, mask_seed=3)
        fed = dataclasses.replace(_fed(masked_moments=on), model=model)
        learners[on] = learner = learner_for(fed, dim, 0)
        learner.load_global(strategy_for(fed, dim).initial_model(), 0)
        learner.start_task(0, None)
        learner.train_round([_data(0, dim=dim)], 0, _place(0))
    plain, held = learners[False], learners[True]
    assert all(torch.equal(a, b) for a, b in zip(plain.model.parameters(), held.model.parameters()))

    def tracked(learner):
        """(parameter, its moments) of B and A_0 per layer."""
        out = {}
        for prefix, layer in learner.model.layers.items():
            for name, p in (("weight", layer.weight), ("adaptive", layer.adaptive[0])):
                state = learner.optimizer.state[p]
                out[prefix, name] = [t.detach().clone() for t in (p, state["exp_avg"], state["exp_avg_sq"])]
        return out

    before = tracked(held)
    made = plain.fed.model.made_config(dim)
    orders = [upload_order(made, plain.opts, r) for r in (0, 1)]
    assert orders[0] != orders[1]
    for learner in (plain, held):
        learner.train_round([_data(1, dim=dim)], 1, _place(1))
    masks = made_masks(made, orders[1])
    after_plain, after_held = tracked(plain), tracked(held)
    moved = 0
    for (prefix, name), old in before.items():
        outside = torch.from_numpy(mask_for_param(masks, f"{prefix}.weight") == 0)
        for t_plain, t_held, t_old in zip(after_plain[prefix, name], after_held[prefix, name], old):
            assert torch.equal(t_held[outside], t_old[outside])  # held: value and moments
            assert torch.equal(t_held[~outside], t_plain[~outside])  # inside: as without the option
            moved += int((t_plain[outside] != t_old[outside]).sum())
    assert moved > 0  # without the option the round did move entries outside its mask
    tracked_ids = {id(t) for layer in held.model.layers.values() for t in (layer.weight, layer.adaptive[0])}
    for a, b in zip(plain.model.parameters(), held.model.parameters()):
        if id(b) not in tracked_ids:  # biases, unit logits, attention: the same training
            assert torch.equal(a, b)
