"""Every shipped config loads with the schema it is written for."""

from __future__ import annotations

from pathlib import Path

import pytest

from fclcore.config import ConfigError, load_config
from fclcore.schema import AggregatorConfig, ClientConfig, Scenario, SiteConfig

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("path", sorted((ROOT / "configs/scenarios").glob("*.yaml")), ids=lambda p: p.name)
def test_scenarios_load(path: Path) -> None:
    assert load_config(Scenario, path).clients >= 1


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
