"""Partial sums between aggregators: a site's frame, merged at the root, gives the flat result;
a malformed one is refused with a reason; methods that are not a plain sum are refused a hierarchy."""

from __future__ import annotations

import numpy as np
import pytest
import yaml
from support.timescale import scaled

import methods
from aggregator.partial import Sites, check_hierarchy, decode_partial, encode_partial
from aggregator.service import AggregatorService
from fclcore.aggregation import RunningSum, weighted_average
from fclcore.codec import Frame, Header, Kind, SparseTensor, decode, encode
from fclcore.config import load_config, to_dict
from fclcore.errors import ConfigError
from fclcore.exitcodes import ExitCode
from fclcore.schema import AggregatorConfig, Scenario

SHAPES = {"w": (6, 5), "b": (5,), "never": (3,)}


def _updates(rng: np.random.Generator, n: int) -> list[tuple[dict, float]]:
    """Dense, sparse and missing tensors mixed; weights like sample counts; ``never`` is never sent."""
    out = []
    for i in range(n):
        w = rng.normal(size=SHAPES["w"]).astype(np.float32) * 10 ** rng.uniform(-3, 3)
        tensors = {"w": SparseTensor.from_dense(w, rng.random(w.shape) < 0.3) if i % 2 else w}
        if i % 3:
            tensors["b"] = rng.normal(size=SHAPES["b"]).astype(np.float32)
        out.append((tensors, float(rng.integers(1, 500))))
    return out


def _through_the_wire(running: RunningSum) -> RunningSum:
    meta, tensors = encode_partial(running)
    frame = decode(encode(Frame(Header(Kind.UPDATE, "f", 0, 0, "site-a", 1), meta, tensors)))
    return decode_partial(frame, running.shapes)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sites_merged_at_the_root_equal_the_flat_average(seed: int) -> None:
    rng = np.random.default_rng(seed)
    updates = _updates(rng, 9)
    previous = {name: rng.normal(size=shape).astype(np.float32) for name, shape in SHAPES.items()}
    root = RunningSum(SHAPES)
    for share in (updates[:4], updates[4:5], updates[5:]):  # three sites, one with a single device
        site = RunningSum(SHAPES)
        for tensors, weight in share:
            site.add(tensors, weight)
        root.merge(_through_the_wire(site))
    got = root.result(previous)
    expected = weighted_average(updates, previous)
    for name in SHAPES:
        np.testing.assert_array_max_ulp(got[name], expected[name], maxulp=1)
    assert np.array_equal(got["never"], previous["never"])  # nobody sent it: the previous value stays
    assert root.count == len(updates)


def test_a_dense_only_site_is_sent_dense_and_a_sparse_one_sparse() -> None:
    site = RunningSum(SHAPES)
    site.add({"w": np.ones(SHAPES["w"], np.float32)}, 3.0)
    _, tensors = encode_partial(site)
    assert isinstance(tensors["mean:w"], np.ndarray) and isinstance(tensors["weight.lo:w"], np.ndarray)
    assert isinstance(tensors["mean:b"], SparseTensor) and tensors["mean:b"].indices.size == 0


def _frame(tensors: dict, meta: dict | None = None) -> Frame:
    return Frame(
        Header(Kind.UPDATE, "f", 0, 0, "site-a", 1), meta or {"n_samples": 5, "partial": {"updates": 2}}, tensors
    )


def _good() -> dict:
    site = RunningSum(SHAPES)
    site.add({"w": SparseTensor.from_dense(np.arange(30, dtype=np.float32).reshape(6, 5))}, 5.0)
    return encode_partial(site)[1]


def _with(**changes) -> dict:
    tensors = _good()
    tensors.update({k.replace("__", ":").replace("_lo", ".lo"): v for k, v in changes.items()})
    return {k: v for k, v in tensors.items() if v is not None}


@pytest.mark.parametrize(
    "tensors,meta,match",
    [
        (_with(mean__w=None), None, "missing"),
        ({**_good(), "extra": np.zeros(2, np.float32)}, None, "unexpected"),
        (_with(weight_lo__w=SparseTensor((6, 5), [1, 2], [0.0, -9.0])), None, "weights in"),
        (_good(), {"n_samples": 5, "partial": {"updates": 0}}, "updates"),
        (_good(), {"n_samples": 5}, "updates"),
    ],
)
def test_a_malformed_partial_sum_is_refused_with_a_reason(tensors: dict, meta: dict | None, match: str) -> None:
    frame = decode(encode(_frame(tensors, meta)))
    with pytest.raises(ValueError, match=match):
        decode_partial(frame, SHAPES)


def _fed(method: str):
    sc = load_config(
        Scenario, "configs/scenarios/quickstart.yaml", [f"federation.method={method}", "federation.options={}"]
    )
    return methods.resolve(sc.federation, "test")


@pytest.mark.parametrize("method", ["fedet", "filver", "confedmade", "fedweit-made", "ngfl", "fedseit"])
def test_a_method_that_is_not_a_plain_sum_is_refused_a_hierarchy(method: str, repo_root) -> None:
    spec, _, fed = _fed(method)
    with pytest.raises(ConfigError, match=f"method '{method}' cannot run under a hierarchy of aggregators"):
        check_hierarchy(spec.strategy_class(), fed.method)


@pytest.mark.parametrize("method", ["fedavg", "fedprox", "fedcurv"])
def test_the_fedavg_family_may_run_under_sites(method: str) -> None:
    spec, _, fed = _fed(method)
    strategy = methods.strategy_for(fed, 64)
    sites = Sites(["site-a"], strategy, method)
    assert "site-a" in sites and "client-0" not in sites
    assert sites.shapes == {k: v.shape for k, v in strategy.initial_model().items()}


def test_without_sites_the_root_normalizes_as_before() -> None:
    spec, _, fed = _fed("fedavg")
    strategy = methods.strategy_for(fed, 64)
    assert Sites([], strategy, "fedavg").normalizer(strategy.normalize) == strategy.normalize


@pytest.mark.e2e  # starts `fcl site` in a fresh interpreter
@pytest.mark.parametrize("method", ["fedet", "filver"])
def test_fcl_site_refuses_a_batch_method_in_one_line(method: str, tmp_path, repo_root) -> None:
    from conftest import run_fcl

    sc = load_config(
        Scenario,
        repo_root / "configs/scenarios/quickstart.yaml",
        [f"federation.method={method}", "federation.options={}"],
    )
    path = tmp_path / "site.yaml"
    raw = {"federation": to_dict(sc.federation), "site_id": "site-a", "expected_clients": ["d0"]}
    path.write_text(yaml.safe_dump({**raw, "out_dir": str(tmp_path / "out")}))
    done = run_fcl("site", "--config", str(path), timeout=scaled(120))
    assert done.returncode == ExitCode.BAD_INPUT, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"method '{method}' cannot run under a hierarchy" in lines[0], done.stderr


def test_the_root_refuses_sites_for_a_method_that_is_not_a_plain_sum(tmp_path) -> None:
    sc = load_config(Scenario, "configs/scenarios/quickstart.yaml", ["federation.method=confedmade"])
    cfg = AggregatorConfig(sc.federation, ["site-a", "d0"], out_dir=str(tmp_path), sites=["site-a"])
    with pytest.raises(ConfigError, match="method 'confedmade' cannot run under a hierarchy"):
        AggregatorService(cfg)
    with pytest.raises(ValueError, match="sites: expected ids from expected_clients"):
        AggregatorConfig(sc.federation, ["d0"], sites=["site-a"])
