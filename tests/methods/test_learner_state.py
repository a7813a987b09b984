"""A learner checkpointed mid-run and rebuilt continues exactly as if it had never stopped."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.builders import binary_rows, made_federation

from fclcore.codec import Frame, Header, Kind, SparseTensor
from fclcore.data import Dataset
from fclcore.made_spec import init_params
from fclcore.schedule import TaskSchedule
from fclcore.schema import FederationSpec
from methods import learner_for

D = 10
METHODS = ["fedavg", "fedprox", "fedcurv", "confedmade", "fedweit-made"]


def _fed(method: str) -> FederationSpec:
    return made_federation(method, num_tasks=3)


def _data(seed: int, n: int = 32) -> Dataset:
    return binary_rows(seed, D, n)


def _knowledge(task: int, made) -> Frame | None:
    """One knowledge-base entry per task after the first (for the decomposed methods)."""
    if task == 0:
        return None
    rng = np.random.default_rng(task)
    tensors = {
        f"other/t{task - 1}|{name}": SparseTensor.from_dense(
            (rng.normal(size=shape) * (rng.random(shape) > 0.7)).astype(np.float32)
        )
        for name, shape in {n: v.shape for n, v in init_params(made, 0).items()}.items()
        if name.endswith("weight")
    }
    meta = {"for_task": task, "entries": [{"id": f"other/t{task - 1}", "client": "other", "task": task - 1}]}
    return Frame(Header(Kind.KNOWLEDGE, "t", task * 2, task, "aggregator", 1), meta, tensors)


def _step(learner, rnd: int, data: list[Dataset], global_params: dict) -> dict:
    place = TaskSchedule.uniform(3, 2).place(rnd)
    learner.load_global(global_params, rnd)
    learner.train_round(data, rnd, place)
    return learner.upload(rnd, place)


def _as_dense(tensors: dict) -> dict[str, np.ndarray]:
    return {k: v.to_dense() if isinstance(v, SparseTensor) else np.asarray(v) for k, v in tensors.items()}


@pytest.mark.parametrize("method", METHODS)
def test_restored_learner_continues_identically(method: str) -> None:
    torch.set_num_threads(1)
    fed = _fed(method)
    made = fed.model.made_config(D)
    data = [_data(t) for t in range(3)]
    g = init_params(made, 0)
    learner = learner_for(fed, D, 0)
    # into the third task, so there are earlier-task masks, anchors, Fisher terms and a
    # finished task's settled knowledge term (task 1's entry)
    for rnd in range(5):
        task = rnd // 2
        if task != learner.task:
            learner.start_task(task, _knowledge(task, made))
        _step(learner, rnd, data[: task + 1], g)
    meta, arrays = learner.state()

    rebuilt = learner_for(fed, D, 0)
    for t in range(learner.task + 1):
        rebuilt.start_task(t, _knowledge(t, made))
    rebuilt.load_state(meta, arrays)

    g2 = {k: v + 0.01 for k, v in g.items()}  # the next round's global model
    expected = _as_dense(_step(learner, 5, data, g2))
    got = _as_dense(_step(rebuilt, 5, data, g2))
    assert expected.keys() == got.keys()
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
    assert rebuilt.evaluate(data) == learner.evaluate(data)


def test_state_from_another_structure_is_refused() -> None:
    fed = _fed("confedmade")
    made = fed.model.made_config(D)
    learner = learner_for(fed, D, 0)
    learner.start_task(0, None)
    meta, arrays = learner.state()
    other = learner_for(fed, D, 0)
    other.start_task(0, None)
    other.start_task(1, _knowledge(1, made))
    with pytest.raises(ValueError):
        other.load_state(meta, arrays)
    with pytest.raises(ValueError, match="does not fit"):
        broken = dict(arrays)
        broken.pop(next(k for k in broken if k.startswith("model/")))
        fresh = learner_for(fed, D, 0)
        fresh.start_task(0, None)
        fresh.load_state(meta, broken)


def test_confedmade_restored_through_the_daemons_state_file_continues_identically(tmp_path) -> None:
    """The memory layout of issue 20 (penalty without a kept graph, gradients freed between
    rounds, optimiser and anchors dropped at a task start, the checkpoint streamed to its
    file): a device written to its state file by the daemon's store and rebuilt from it trains
    the next round bit for bit as the one that never stopped."""
    from edge_client.state import ClientState, ClientStateStore

    torch.set_num_threads(1)
    fed = _fed("confedmade")
    made = fed.model.made_config(D)
    data = [_data(t) for t in range(3)]
    g = init_params(made, 0)
    learner = learner_for(fed, D, 0)
    for rnd in range(5):
        if rnd // 2 != learner.task:
            learner.start_task(rnd // 2, _knowledge(rnd // 2, made))
        _step(learner, rnd, data[: learner.task + 1], g)
    meta, arrays = learner.state()
    store = ClientStateStore(tmp_path)
    store.save(ClientState("c0", {}, learner.task, 4, 1, learner_meta=meta, learner_arrays=arrays, input_dim=D))
    loaded = store.load()

    rebuilt = learner_for(fed, D, 0)
    for t in range(loaded.task + 1):
        rebuilt.start_task(t, _knowledge(t, made))
    rebuilt.load_state(loaded.learner_meta, loaded.learner_arrays)
    g2 = {k: v + 0.01 for k, v in g.items()}
    expected, got = _as_dense(_step(learner, 5, data, g2)), _as_dense(_step(rebuilt, 5, data, g2))
    assert expected.keys() == got.keys()
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
    for a, b in zip(learner.model.parameters(), rebuilt.model.parameters()):
        assert torch.equal(a, b)
    assert all(p.grad is None for p in learner.model.parameters())  # nothing held between rounds
