"""Every shipped config loads with the schema it is written for."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import methods
from fclcore.config import ConfigError, load_config
from fclcore.schema import AggregatorConfig, ClientConfig, Scenario, SiteConfig

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = sorted((ROOT / "configs/scenarios").glob("*.yaml"))
QUICKSTART = ROOT / "configs/scenarios/quickstart.yaml"


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.name)
def test_scenarios_load(path: Path) -> None:
    assert load_config(Scenario, path).clients >= 1


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.name)
def test_scenario_options_resolve_against_each_of_its_methods(path: Path) -> None:
    """The scenario's method, each ``compare:`` method and each ``method_options`` entry: the
    options that method's run would get are ones it has (methods.resolve raises otherwise)."""
    sc = load_config(Scenario, path)
    for name in {sc.federation.method, *(sc.compare or ()), *sc.method_options}:
        run = dataclasses.replace(sc, federation=dataclasses.replace(sc.federation, method=name))
        spec, _, fed = methods.resolve(run.run_federation(), str(path))
        assert spec.name == name and fed.method == name


@pytest.mark.parametrize("name", methods.names())
def test_the_quickstart_runs_any_method_alone(name: str) -> None:
    """``--set compare=[] --set federation.method=NAME``: ConFedMADE's own options stay with it."""
    sc = load_config(Scenario, QUICKSTART, ["compare=[]", f"federation.method={name}"])
    _, _, fed = methods.resolve(sc.run_federation(), str(QUICKSTART))
    assert fed.method == name
    if name == "confedmade":
        assert fed.options["keep_units"] == 0.5


def test_shared_options_are_laid_over_a_methods_own() -> None:
    """``federation.options`` (what ``--set federation.options.K=V`` sets) wins over ``method_options``."""
    sc = load_config(Scenario, QUICKSTART, ["federation.method=confedmade", "federation.options.kb_k=3"])
    assert sc.run_federation().options == {"keep_units": 0.5, "kb_k": 3}
    sc = load_config(Scenario, QUICKSTART, ["federation.method=confedmade", "federation.options.keep_units=0.25"])
    assert sc.run_federation().options == {"keep_units": 0.25}
    assert load_config(Scenario, QUICKSTART).run_federation().options == {}  # fedavg has none of its own here


@pytest.mark.parametrize(
    "entry, says",
    [
        ("method_options.confedmad.keep_units=0.5", "method_options: unknown method 'confedmad'"),
        ("method_options.confedmade.keep_unitz=0.5", "method_options.confedmade.keep_unitz: unknown key"),
    ],
)
def test_a_misspelled_method_options_entry_fails_whichever_method_runs(entry: str, says: str) -> None:
    from fcl_edge.simulate import plan

    with pytest.raises(ConfigError, match=says):
        plan(str(QUICKSTART), ["compare=[]", "federation.method=fedavg", entry])


@pytest.mark.parametrize(
    "name,cls",
    [("aggregator.yaml", AggregatorConfig), ("client.yaml", ClientConfig), ("site.yaml", SiteConfig)],
)
def test_service_configs_load_with_secret_from_env(name: str, cls: type, monkeypatch) -> None:
    path = ROOT / "configs/services" / name
    monkeypatch.delenv("FCL_MQTT_PASSWORD", raising=False)
    with pytest.raises(ConfigError, match="FCL_MQTT_PASSWORD"):
        load_config(cls, path)
    monkeypatch.setenv("FCL_MQTT_PASSWORD", "s3cret")
    cfg = load_config(cls, path)
    assert cfg.broker.password == "s3cret"
    assert "s3cret" not in str(cfg.broker.redacted())
