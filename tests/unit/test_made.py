"""Tests for the MADE spec (numpy, aggregator side) and model (torch, client side)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fclcore.made_spec import (
    MadeConfig,
    MadeMasks,
    hidden_degrees,
    init_params,
    input_degrees,
    input_order,
    made_masks,
    mask_for_param,
    order_schedule,
    param_shapes,
)
from fclcore.models.made import MADE

CONFIGS = {
    "natural_1layer": MadeConfig(12, (32,), direct=True, natural_order=True, mask_seed=0),
    "natural_2layer_nodirect": MadeConfig(10, (24, 24), direct=False, natural_order=True, mask_seed=1),
    "seeded_1layer": MadeConfig(16, (32,), direct=True, natural_order=False, mask_seed=7),
    "seeded_2layer": MadeConfig(14, (24, 24), direct=True, natural_order=False, mask_seed=123),
    "multi_order_natural": MadeConfig(12, (32,), direct=True, natural_order=True, num_orders=4, mask_seed=3),
    "multi_order_seeded_2layer": MadeConfig(
        20, (24, 24), direct=False, natural_order=False, num_orders=3, mask_seed=42
    ),
    "connectivity_agnostic_2layer": MadeConfig(
        14, (24, 24), direct=True, natural_order=True, num_orders=4, mask_seed=5, connectivity_agnostic=True
    ),
    # docs/protocol.md P-7.9: orders and degrees drawn from SplitMix64
    "splitmix64_2layer": MadeConfig(
        14, (24, 24), direct=True, natural_order=False, num_orders=4, mask_seed=5, mask_rng="splitmix64"
    ),
    "splitmix64_connectivity_agnostic": MadeConfig(
        12, (16,), direct=True, num_orders=3, mask_seed=9, connectivity_agnostic=True, mask_rng="splitmix64"
    ),
}
# Order switches, including going back and forth and indices >= num_orders (wrap around).
ORDER_SEQUENCES = [[0], [1, 2, 0, 2, 1, 1, 0], [3, 0, 5, 2, 0]]


def _model(cfg: MadeConfig, seed: int = 0) -> MADE:
    torch.manual_seed(seed)
    model = MADE(cfg)
    # Random, non-zero weights and biases everywhere so no dependency vanishes by accident.
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p).abs().add_(0.1) * torch.sign(torch.randn_like(p)))
    return model


def _jacobian(model: MADE, x: torch.Tensor) -> np.ndarray:
    """(D, D) matrix J[d, j] = d logits[d] / d x[j] at x (1-D, real-valued)."""
    return torch.autograd.functional.jacobian(lambda v: model(v[None])[0], x).numpy()


def _connectivity(masks: MadeMasks) -> np.ndarray:
    """Boolean (D, D): path[d, j] iff some masked path joins input j to output d."""
    path = masks.hidden[0] > 0
    for m in masks.hidden[1:]:
        path = (m.astype(np.int64) @ path.astype(np.int64)) > 0
    path = (masks.output.astype(np.int64) @ path.astype(np.int64)) > 0
    if masks.direct is not None:
        path |= masks.direct > 0
    return path


def _check_autoregressive(model: MADE, cfg: MadeConfig, k: int) -> None:
    order = input_order(cfg, k)
    deg = input_degrees(order)
    forbidden = deg[None, :] >= deg[:, None]  # forbidden[d, j]: deg(j) >= deg(d)
    gen = torch.Generator().manual_seed(k)
    jac = sum(np.abs(_jacobian(model, torch.randn(cfg.input_dim, generator=gen))) for _ in range(3))
    assert np.all(jac[forbidden] == 0), "output depends on a non-earlier input"
    path = _connectivity(made_masks(cfg, k))
    assert not path[forbidden].any(), "mask product has a forbidden path"
    first = order[0]
    assert np.all(jac[first] == 0) and not path[first].any(), "first output must depend on nothing"
    # Not trivially disconnected: many allowed dependencies exist, in masks and in gradients.
    assert path[~forbidden].mean() > 0.5
    assert (jac[~forbidden] != 0).mean() > 0.3


@pytest.mark.parametrize("seq", ORDER_SEQUENCES, ids=str)
@pytest.mark.parametrize("name", CONFIGS)
def test_autoregressive_property_across_order_switches(name: str, seq: list[int]) -> None:
    cfg = CONFIGS[name]
    model = _model(cfg)
    for idx in seq:
        model.set_order(idx)
        k = idx % cfg.num_orders
        assert model.order_index == k
        _check_autoregressive(model, cfg, k)


@pytest.mark.parametrize("name", CONFIGS)
def test_masks_match_paper_definition(name: str) -> None:
    """Masks against an independent, loop-based transcription of Germain et al. (2015)."""
    cfg = CONFIGS[name]
    for k in range(cfg.num_orders):
        order, masks = input_order(cfg, k), made_masks(cfg, k)
        deg = {int(d): p + 1 for p, d in enumerate(order)}
        prev = [deg[j] for j in range(cfg.input_dim)]
        for m_l, mask in zip(hidden_degrees(cfg, k), masks.hidden):
            for u, mu in enumerate(m_l):
                assert list(mask[u]) == [float(mu >= mj) for mj in prev]
            prev = list(m_l)
        for d in range(cfg.input_dim):
            assert list(masks.output[d]) == [float(deg[d] > mk) for mk in prev]
            if cfg.direct:
                assert list(masks.direct[d]) == [float(deg[d] > deg[j]) for j in range(cfg.input_dim)]


def test_connectivity_agnostic_redraws_hidden_degrees_per_order() -> None:
    """Each order index gets its own hidden degrees, order 0 keeps the default ones (so a
    served model is the same), and without the switch degrees never change."""
    agnostic = CONFIGS["connectivity_agnostic_2layer"]
    fixed = MadeConfig(14, (24, 24), direct=True, natural_order=True, num_orders=4, mask_seed=5)
    for a, b in zip(hidden_degrees(agnostic, 0), hidden_degrees(fixed, 0)):
        np.testing.assert_array_equal(a, b)
    for k in (1, 2, 3):
        assert any(not np.array_equal(a, b) for a, b in zip(hidden_degrees(agnostic, k), hidden_degrees(fixed, k)))
        for a, b in zip(hidden_degrees(fixed, k), hidden_degrees(fixed, 0)):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(hidden_degrees(agnostic, k), hidden_degrees(agnostic, k + 4)):  # the cycle
            np.testing.assert_array_equal(a, b)
    assert not np.array_equal(made_masks(agnostic, 1).hidden[1], made_masks(fixed, 1).hidden[1])


def test_orders_differ_and_natural_order_is_identity() -> None:
    cfg = CONFIGS["multi_order_seeded_2layer"]
    orders = [input_order(cfg, k) for k in range(cfg.num_orders)]
    for k, o in enumerate(orders):
        assert sorted(o.tolist()) == list(range(cfg.input_dim))
        np.testing.assert_array_equal(o, input_order(cfg, k + cfg.num_orders))  # cycle
    assert not np.array_equal(orders[0], orders[1]) and not np.array_equal(orders[1], orders[2])
    assert not np.array_equal(orders[0], np.arange(cfg.input_dim))
    np.testing.assert_array_equal(input_order(CONFIGS["multi_order_natural"], 0), np.arange(12))
    assert not np.array_equal(input_order(CONFIGS["multi_order_natural"], 1), np.arange(12))


def test_input_and_hidden_degrees() -> None:
    np.testing.assert_array_equal(input_degrees(np.array([2, 0, 1])), [2, 3, 1])
    cfg = CONFIGS["seeded_2layer"]
    degs = hidden_degrees(cfg)
    assert [len(m) for m in degs] == list(cfg.hidden_sizes)
    assert degs[0].min() >= 1 and degs[0].max() <= cfg.input_dim - 1
    assert degs[1].min() >= degs[0].min() and degs[1].max() <= cfg.input_dim - 1
    with pytest.raises(ValueError):
        input_degrees(np.array([0, 0, 1]))


def _buffers(model: MADE) -> dict[str, np.ndarray]:
    return {n: b.numpy().copy() for n, b in model.named_buffers()}


def _spec_buffers(cfg: MadeConfig, k: int) -> dict[str, np.ndarray]:
    masks = made_masks(cfg, k)
    out = {f"{n.rsplit('.', 1)[0]}.mask": mask_for_param(masks, n) for n in param_shapes(cfg) if n.endswith("weight")}
    return out


@pytest.mark.parametrize("name", CONFIGS)
def test_aggregator_and_client_derive_identical_masks(name: str) -> None:
    cfg = CONFIGS[name]
    a, b = _model(cfg, seed=0), MADE(cfg)
    for k in [*range(cfg.num_orders), 0, cfg.num_orders - 1]:
        a.set_order(k)
        b.set_order(k)
        ba, bb, spec = _buffers(a), _buffers(b), _spec_buffers(cfg, k)
        assert ba.keys() == bb.keys() == spec.keys()
        for n in spec:
            assert ba[n].dtype == np.float32 and set(np.unique(ba[n])) <= {0.0, 1.0}
            np.testing.assert_array_equal(ba[n], spec[n])
            np.testing.assert_array_equal(bb[n], spec[n])


@pytest.mark.parametrize("name", CONFIGS)
def test_different_mask_seed_gives_different_masks(name: str) -> None:
    cfg = CONFIGS[name]
    other = dataclasses.replace(cfg, mask_seed=cfg.mask_seed + 1000)
    m1, m2 = made_masks(cfg, 0), made_masks(other, 0)
    assert any(not np.array_equal(x, y) for x, y in zip(m1.hidden, m2.hidden))
    assert not np.array_equal(m1.output, m2.output)


def test_masks_shapes_and_direct() -> None:
    cfg = CONFIGS["seeded_2layer"]
    masks = made_masks(cfg, 0)
    assert [m.shape for m in masks.hidden] == [(24, 14), (24, 24)]
    assert masks.output.shape == (14, 24) and masks.direct.shape == (14, 14)
    assert made_masks(CONFIGS["natural_2layer_nodirect"], 0).direct is None
    assert mask_for_param(masks, "hidden.0.bias") is None and mask_for_param(masks, "output.bias") is None
    with pytest.raises(ValueError):
        mask_for_param(masks, "hidden.5.weight")
    with pytest.raises(ValueError):
        mask_for_param(made_masks(CONFIGS["natural_2layer_nodirect"], 0), "direct.weight")


@pytest.mark.parametrize("name", CONFIGS)
def test_param_shapes_match_named_parameters(name: str) -> None:
    cfg = CONFIGS[name]
    model = MADE(cfg)
    assert [(n, tuple(p.shape)) for n, p in model.named_parameters()] == list(param_shapes(cfg).items())
    assert model.direct is None if not cfg.direct else model.direct.bias is None


def test_init_params_deterministic_and_shaped() -> None:
    cfg = CONFIGS["seeded_2layer"]
    p1, p2, p3 = init_params(cfg, 5), init_params(cfg, 5), init_params(cfg, 6)
    assert list(p1) == list(param_shapes(cfg))
    for n, shape in param_shapes(cfg).items():
        assert p1[n].shape == shape and p1[n].dtype == np.float32
        np.testing.assert_array_equal(p1[n], p2[n])
        bound = 1 / np.sqrt(shape[-1] if n.endswith("weight") else param_shapes(cfg)[n[:-4] + "weight"][1])
        assert np.abs(p1[n]).max() <= bound
    assert any(not np.array_equal(p1[n], p3[n]) for n in p1)
    MADE(cfg).set_params(p1)  # the aggregator's initial model loads on the client


def test_get_set_params_round_trip_and_validation() -> None:
    cfg = CONFIGS["seeded_2layer"]
    src, dst = _model(cfg, seed=1), MADE(cfg)
    params = src.get_params()
    assert all(v.dtype == np.float32 for v in params.values())
    dst.set_params(params)
    for n, v in dst.get_params().items():
        np.testing.assert_array_equal(v, params[n])
    x = torch.randint(0, 2, (5, cfg.input_dim)).float()
    torch.testing.assert_close(src(x), dst(x))
    params["output.bias"][0] = 99.0  # get_params returns copies
    assert src.get_params()["output.bias"][0] != 99.0

    bad = dict(params, **{"hidden.1.weight": np.zeros((24, 23), np.float32)})
    with pytest.raises(ValueError, match=r"hidden\.1\.weight.*\(24, 24\).*\(24, 23\)"):
        dst.set_params(bad)
    missing = {k: v for k, v in params.items() if k != "direct.weight"}
    with pytest.raises(ValueError, match="direct.weight"):
        dst.set_params(missing)
    with pytest.raises(ValueError, match="extra"):
        dst.set_params(dict(params, extra=np.zeros(1, np.float32)))


def test_nll_matches_manual_computation() -> None:
    cfg = MadeConfig(3, (4,), direct=True, mask_seed=0)
    model = _model(cfg, seed=2)
    x = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    logits = model(x)
    p = torch.sigmoid(logits)
    manual = -(x * torch.log(p) + (1 - x) * torch.log(1 - p)).sum(dim=1)
    nll = model.nll(x)
    assert nll.shape == (2,)
    torch.testing.assert_close(nll, manual, rtol=1e-5, atol=1e-5)
    # Output of the first input in the order is input-independent (its bias only).
    torch.testing.assert_close(logits[:, 0], model.output.bias[0].expand(2))


def test_manual_forward_matches_masked_layers() -> None:
    cfg = CONFIGS["seeded_2layer"]
    model = _model(cfg)
    model.set_order(0)
    masks, params = made_masks(cfg, 0), {n: torch.tensor(v) for n, v in model.get_params().items()}
    x = torch.randint(0, 2, (4, cfg.input_dim)).float()
    h = x
    for i in range(len(cfg.hidden_sizes)):
        h = F.relu(h @ (params[f"hidden.{i}.weight"] * torch.tensor(masks.hidden[i])).T + params[f"hidden.{i}.bias"])
    out = h @ (params["output.weight"] * torch.tensor(masks.output)).T + params["output.bias"]
    out = out + x @ (params["direct.weight"] * torch.tensor(masks.direct)).T
    torch.testing.assert_close(model(x), out)


@pytest.mark.parametrize("name", ["natural_1layer", "multi_order_seeded_2layer"])
def test_sample_shape_and_values(name: str) -> None:
    cfg = CONFIGS[name]
    model = _model(cfg)
    model.set_order(cfg.num_orders - 1)
    s1 = model.sample(7, generator=torch.Generator().manual_seed(0))
    s2 = model.sample(7, generator=torch.Generator().manual_seed(0))
    assert s1.shape == (7, cfg.input_dim)
    assert set(torch.unique(s1).tolist()) <= {0.0, 1.0}
    torch.testing.assert_close(s1, s2)


def test_sample_follows_model_distribution() -> None:
    # With huge biases and zero weights every dimension is (almost) deterministic.
    cfg = MadeConfig(6, (8,), mask_seed=0)
    model = MADE(cfg)
    params = {n: np.zeros_like(v) for n, v in model.get_params().items()}
    params["output.bias"] = np.array([30, -30, 30, -30, 30, -30], np.float32)
    model.set_params(params)
    s = model.sample(5, generator=torch.Generator().manual_seed(1))
    assert (s == torch.tensor([1.0, 0, 1, 0, 1, 0])).all()


def _all_binary(d: int) -> torch.Tensor:
    return torch.tensor([[(i >> j) & 1 for j in range(d)] for i in range(2**d)], dtype=torch.float32)


@pytest.mark.parametrize("k", [0, 1, 2])
def test_likelihood_normalises_over_all_binary_vectors(k: int) -> None:
    # Only an autoregressive model gives sum_x p(x) == 1 for arbitrary weights.
    cfg = MadeConfig(5, (16, 16), natural_order=False, num_orders=3, mask_seed=9)
    model = _model(cfg)
    model.set_order(k)
    total = torch.exp(-model.nll(_all_binary(cfg.input_dim)).double()).sum()
    assert abs(total.item() - 1.0) < 1e-4


@pytest.mark.parametrize("k", [0, 1])
def test_sample_matches_exact_distribution(k: int) -> None:
    # Sampling in the wrong order (or ignoring earlier samples) shifts these frequencies.
    cfg = MadeConfig(3, (16,), natural_order=False, num_orders=2, mask_seed=4)
    model = _model(cfg, seed=3)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2.0)
    model.set_order(k)
    xs = _all_binary(cfg.input_dim)
    exact = torch.exp(-model.nll(xs)).detach()
    n = 20000
    s = model.sample(n, generator=torch.Generator().manual_seed(0))
    codes = (s * torch.tensor([1.0, 2.0, 4.0])).sum(1).long()
    freq = torch.bincount(codes, minlength=8).float() / n
    assert (freq - exact).abs().max() < 0.02, (freq, exact)


def test_order_schedule_deterministic_and_in_range() -> None:
    cfg = CONFIGS["multi_order_natural"]
    seen = set()
    for r in range(5):
        for step in range(20):
            k = order_schedule(cfg, r, step)
            assert k == order_schedule(cfg, r, step)
            assert 0 <= k < cfg.num_orders
            seen.add(k)
    assert seen == set(range(cfg.num_orders))
    assert all(order_schedule(CONFIGS["natural_1layer"], r, s) == 0 for r in range(3) for s in range(10))
    with pytest.raises(ValueError):
        order_schedule(cfg, -1, 0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"input_dim": 0},
        {"input_dim": 2.5},
        {"input_dim": True},
        {"input_dim": 4, "hidden_sizes": ()},
        {"input_dim": 4, "hidden_sizes": (8, 0)},
        {"input_dim": 4, "num_orders": 0},
        {"input_dim": 4, "mask_seed": -1},
        {"input_dim": 4, "direct": "yes"},
    ],
    ids=str,
)
def test_config_validation(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        MadeConfig(**kwargs)


def test_config_normalises_list_hidden_sizes() -> None:
    cfg = MadeConfig(4, [8, 8])  # e.g. from YAML
    assert cfg.hidden_sizes == (8, 8) and hash(cfg) == hash(MadeConfig(4, (8, 8)))


def test_set_order_is_noop_when_unchanged() -> None:
    cfg = CONFIGS["multi_order_natural"]
    model = MADE(cfg)
    model.set_order(2)
    model.hidden[0].mask.fill_(7.0)  # sentinel: a no-op must not overwrite it
    model.set_order(2 + cfg.num_orders)
    assert (model.hidden[0].mask == 7.0).all()
    model.set_order(1)
    np.testing.assert_array_equal(model.hidden[0].mask.numpy(), made_masks(cfg, 1).hidden[0])


def test_made_spec_does_not_import_torch() -> None:
    code = (
        "import sys, fclcore.made_spec as s; s.made_masks(s.MadeConfig(5, (8,)), 0); assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])
