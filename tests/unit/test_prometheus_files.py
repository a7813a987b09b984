"""The shipped monitoring files: promtool accepts the scrape config and the rules, the rules'
unit tests pass (each alert fires when it should and stays quiet on a healthy fleet), and the
Grafana dashboard asks only for series the aggregator exports."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.prometheus import DEPLOY, binary, shipped_config
from support.timescale import scaled

from aggregator.metrics import AggregatorMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "fcl-fleet.json"
SERIES = re.compile(r"\b(fcl_[a-z_]+)")


def promtool(*args: str, cwd: Path = DEPLOY) -> subprocess.CompletedProcess:
    try:
        tool = binary("promtool")
    except RuntimeError as exc:
        pytest.fail(str(exc))
    return subprocess.run([tool, *args], cwd=cwd, capture_output=True, text=True, timeout=scaled(120))


@pytest.mark.parametrize(
    "args", [("check", "config", "prometheus.yml"), ("check", "rules", "fcl-alerts.yml")], ids=["config", "rules"]
)
def test_promtool_accepts_the_shipped_files(args) -> None:
    done = promtool(*args)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_templated_config_is_valid_too(tmp_path) -> None:
    (tmp_path / "prometheus.yml").write_text(shipped_config(19108, "1s"))
    (tmp_path / "fcl-alerts.yml").write_text((DEPLOY / "fcl-alerts.yml").read_text())
    done = promtool("check", "config", "prometheus.yml", cwd=tmp_path)
    assert done.returncode == 0 and "127.0.0.1:19108" in (tmp_path / "prometheus.yml").read_text(), done.stdout


def test_every_alert_is_unit_tested_and_the_tests_pass() -> None:
    rules = (DEPLOY / "fcl-alerts.yml").read_text()
    tests = (DEPLOY / "fcl-alerts.test.yml").read_text()
    for alert in re.findall(r"alert: (\w+)", rules):
        fires = re.search(rf"alertname: {alert}\n\s+exp_alerts:\n\s+- exp_labels", tests)
        quiet = re.search(rf"alertname: {alert}, exp_alerts: \[\]", tests)
        assert fires and quiet, f"{alert}: needs a case where it fires and one where it stays quiet"
    done = promtool("test", "rules", "fcl-alerts.test.yml")
    assert done.returncode == 0 and "SUCCESS" in done.stdout, done.stdout + done.stderr


def test_a_broken_expectation_fails_promtool(tmp_path) -> None:
    """The unit tests can fail: an alert expected where the rule stays quiet is reported."""
    (tmp_path / "fcl-alerts.yml").write_text((DEPLOY / "fcl-alerts.yml").read_text())
    tests = (DEPLOY / "fcl-alerts.test.yml").read_text()
    broken = tests.replace(
        "severity: warning, federation: f, device: d1,", "severity: page, federation: f, device: d1,"
    )
    assert broken != tests
    (tmp_path / "t.yml").write_text(broken)
    done = promtool("test", "rules", "t.yml", cwd=tmp_path)
    assert done.returncode != 0 and "FclDeviceOffline" in done.stdout + done.stderr


def exported_names() -> set[str]:
    """Every sample name the endpoint serves once each kind of event happened."""
    m = AggregatorMetrics("f")
    m.configure(10, 60)
    m.round_started(0, 0, 1)
    m.round_done(0, 0, 1, 1.0)
    m.add_bytes(1, 1, 1, 1)
    m.learning("nll", {0: 1.0}, {"avg_nll": 1.0, "forgetting": 0.0}, 1)
    m.rejected("codec")
    health = {"peak_mb": 1.0, "gpu_mb": 1.0, "budget_mb": 2.0, "cpu_s": 1.0, "resyncs": 0, "daemon": "1"}
    m.devices.status("d", {"state": "online", "task": 0, "health": health})
    m.devices.rejected("d", "codec")
    text = m.exposition().decode()
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def test_the_dashboard_and_rules_ask_only_for_exported_series() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs.append((DEPLOY / "fcl-alerts.yml").read_text())
    known = exported_names()
    for text in exprs:
        for name in SERIES.findall(text):
            assert name in known, f"{name} is not a series the aggregator exports"
    assert all(p.get("description") for p in dashboard["panels"] if p["type"] != "row")
    assert {v["name"] for v in dashboard["templating"]["list"]} == {"datasource", "federation"}
