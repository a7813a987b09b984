"""FedAvgM's server step (``methods.fedavgm.strategy``) against a NumPy hand computation of
Hsu et al.'s momentum, and its momentum carried across a restart through the aggregator's
checkpoint.  The method contract (options, imports, a run through the daemons) is
``test_method_contract.py``'s, as for every registered method."""

from __future__ import annotations

import numpy as np
import pytest

from aggregator.state import Committed, StateStore
from fclcore.aggregation import weighted_average
from fclcore.codec import Frame, Header, Kind
from fclcore.errors import ConfigError
from fclcore.schema import FederationSpec, ModelSpec, TrainSpec
from fclcore.strategy import Update
from methods import REGISTRY, strategy_for

BETA, LR = 0.8, 0.7


def _strategy(**options):
    fed = FederationSpec(
        name="t",
        method="fedavgm",
        num_tasks=1,
        rounds_per_task=4,
        model=ModelSpec(hidden_sizes=[8], num_orders=2, mask_seed=1),
        train=TrainSpec(batch_size=8, lr=0.01),
        options={"server_lr": LR, "server_momentum": BETA, **options},
    )
    return strategy_for(fed, 6)


def _round(strategy, rnd: int, seed: int) -> list[Update]:
    """Three dense updates of every tensor, each with its own sample count."""
    rng = np.random.default_rng(seed)
    updates = []
    for i, n in enumerate((30, 10, 60)):
        tensors = {k: rng.normal(size=s).astype(np.float32) for k, s in strategy.shapes.items()}
        frame = Frame(Header(Kind.UPDATE, "t", rnd, 0, f"c{i}", 1), {"n_samples": n}, {})
        updates.append(Update(f"c{i}", frame, n, 0, 0, tensors))
    return updates


def test_the_momentum_step_is_hsu_et_al_by_hand():
    strategy = _strategy()
    w = strategy.initial_model()
    hand_w = {k: v.astype(np.float64) for k, v in w.items()}
    hand_v = {k: np.zeros_like(v) for k, v in hand_w.items()}
    for rnd in range(3):
        updates = _round(strategy, rnd, seed=rnd)
        w = strategy.aggregate(updates, w)
        total = sum(u.n_samples for u in updates)
        for k in hand_w:
            average = sum(u.n_samples * u.tensors[k].astype(np.float64) for u in updates) / total
            hand_v[k] = BETA * hand_v[k] + (hand_w[k] - average)
            hand_w[k] = hand_w[k] - LR * hand_v[k]
            assert w[k].dtype == np.float32
            np.testing.assert_allclose(w[k], hand_w[k], rtol=1e-5, atol=1e-5, err_msg=f"round {rnd}: {k}")


def test_without_momentum_at_rate_one_it_is_fedavg():
    """w - (w - w_avg): FedAvg's average, to float32 rounding."""
    strategy = _strategy(server_lr=1.0, server_momentum=0.0)
    w = strategy.initial_model()
    updates = _round(strategy, 0, seed=5)
    expected = weighted_average([(u.tensors, u.n_samples) for u in updates], w)
    for k, v in strategy.aggregate(updates, w).items():
        np.testing.assert_allclose(v, expected[k], rtol=0, atol=1e-6, err_msg=k)


def test_a_restart_resumes_the_momentum(tmp_path):
    """Two rounds, the aggregator's checkpoint written and read back into a fresh strategy: its
    third round equals the uninterrupted one's to the bit."""
    running = _strategy()
    w = running.initial_model()
    for rnd in range(2):
        w = running.aggregate(_round(running, rnd, seed=rnd), w)
    meta, arrays = running.state()
    store = StateStore(tmp_path)
    store.commit(Committed(fingerprint="f", round=1, strategy=meta, global_params=w, strategy_arrays=arrays))
    committed = store.load()
    restarted = _strategy()
    restarted.restore(committed.strategy, committed.strategy_arrays)
    third = _round(running, 2, seed=2)
    after_restart = restarted.aggregate(third, committed.global_params)
    uninterrupted = running.aggregate(third, w)
    for k, v in uninterrupted.items():
        np.testing.assert_array_equal(after_restart[k], v, err_msg=k)
    fresh = _strategy().aggregate(third, w)  # without the momentum the step differs
    assert any(not np.array_equal(fresh[k], v) for k, v in uninterrupted.items())


def test_a_velocity_of_another_shape_is_refused():
    with pytest.raises(ValueError, match="velocity/"):
        _strategy().restore({}, {"velocity/net.0.weight": np.zeros(3, np.float32)})


@pytest.mark.parametrize("options", [{"server_lr": 0.0}, {"server_momentum": 1.0}, {"server_momentum": -0.1}])
def test_options_are_checked(options):
    with pytest.raises(ConfigError, match="server_lr > 0 and server_momentum in"):
        REGISTRY["fedavgm"].parse_options(options, "s.yaml")
