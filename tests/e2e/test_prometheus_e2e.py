"""The shipped monitoring against a real Prometheus: Debian's ``prometheus`` runs the shipped
deploy/prometheus/ configuration (its target port templated) and scrapes an aggregator during a
short quickstart run over Mosquitto with separate daemon processes; then its HTTP API must give
every per-device and learning series with the right labels and plausible values, every PromQL
expression of the Grafana dashboard must return data, and every alert rule must load, find its
series, and stay quiet on this healthy run.  The device's own view (``fcl ctl status``) gives the
same facts, and so does its retained status (``fcl status --device``)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
import yaml
from conftest import run_fcl
from support.fleet import QUICK_SCENARIO, Fleet
from support.mosquitto import free_port
from support.prometheus import DEPLOY, PrometheusProcess
from support.timescale import scaled

from aggregator.fleet_metrics import PER_DEVICE
from fclcore.health import daemon_version

FED = "quickstart"
ROUNDS = 20
# more local epochs than the quickstart: the run must span several scrapes even on a quiet machine
OVERRIDES = [
    f"federation.rounds_per_task={ROUNDS // 2}",
    "federation.rounds.resend_after_s=2",
    "federation.train.local_epochs=12",
]
BUDGET_MB = 4096
DEVICES = {"client-0", "client-1", "client-2"}
DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "fcl-fleet.json"
RULE_SERIES = re.compile(r"\b(fcl_[a-z_]+|up)\b")


def dashboard_exprs() -> list[str]:
    """Every target's PromQL, with the dashboard's variables set as Grafana would set them."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    exprs = [t["expr"] for p in panels for t in p.get("targets", [])]
    return [e.replace("$federation", FED).replace("$__rate_interval", "20s") for e in exprs]


def rule_exprs() -> dict[str, str]:
    groups = yaml.safe_load((DEPLOY / "fcl-alerts.yml").read_text())["groups"]
    return {r["alert"]: r["expr"] for g in groups for r in g["rules"]}


def _reject_one(broker_port: int) -> None:
    """A garbage update on client-0's topic: the aggregator drops it (reason ``codec``)."""
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="garbage-sender")
    client.connect("127.0.0.1", broker_port)
    client.loop_start()
    client.publish(f"fcl/{FED}/update/client-0", b"not a frame", qos=1).wait_for_publish(10)
    client.loop_stop()
    client.disconnect()


@pytest.fixture
def run(mosquitto, tmp_path, repo_root):
    """(Prometheus, the run's fleet, a unix time late in the run when every series is there,
    ``fcl ctl status`` of client-0 and ``fcl status --device client-1`` after round 3)."""
    port = free_port()
    prom = PrometheusProcess(tmp_path / "prometheus", port, interval="1s").start()
    fleet = Fleet(repo_root / QUICK_SCENARIO, tmp_path / "run", mosquitto.url, OVERRIDES, {"metrics_port": port})
    for name, (kind, path) in fleet.configs.items():
        if kind == "client":
            path.write_text(yaml.safe_dump({**yaml.safe_load(path.read_text()), "memory_budget_mb": BUDGET_MB}))
    try:
        # the aggregator first, and the devices once Prometheus has scraped it: on a quiet machine
        # a whole run can end before Prometheus's first scrape
        fleet.start("aggregator")
        _wait_scraped(prom)
        for name in fleet.configs:
            if name != "aggregator":
                fleet.start(name)
        fleet.wait_for_round(1)
        _reject_one(mosquitto.port)
        fleet.wait_for_round(3)
        state = Path(yaml.safe_load(fleet.configs["client-0"][1].read_text())["out_dir"]) / "state"
        device_view = run_fcl("ctl", str(state / "control.sock"), "status")
        retained_view = run_fcl("status", "--broker", mosquitto.url, "--federation", FED, "--device", "client-1")
        (tmp_path / "device_view.txt").write_text(retained_view.stdout)  # what docs/monitoring.md shows
        assert set(fleet.wait(300).values()) == {0}, fleet.logs()
        (last,) = [e for e in fleet.events("round") if e["round"] == ROUNDS - 1]
        at = last["last_update_t"]  # the last round's updates are in; rounds before it were scraped
        time.sleep(2)  # Prometheus's samples up to ``at`` are queryable
        yield prom, fleet, at, (device_view, retained_view)
    finally:
        fleet.stop()
        prom.stop()


def _wait_scraped(prom: PrometheusProcess) -> None:
    """Until Prometheus holds a sample of the aggregator's endpoint (``up`` is 1)."""
    deadline = time.monotonic() + scaled(60)
    while time.monotonic() < deadline:
        if any(r["value"] == 1 for r in prom.query("up", time.time())):
            return
        time.sleep(0.25)
    raise AssertionError("Prometheus did not scrape the aggregator within 60 s")


def _by_device(prom: PrometheusProcess, expr: str, at: float) -> dict[str, float]:
    return {r["metric"]["device"]: r["value"] for r in prom.query(expr, at)}


# the default suite's 10 min; promtool checks of the shipped files: tests/unit/test_prometheus_files.py
@pytest.mark.slow
def test_prometheus_sees_the_fleet_and_every_shipped_expression_returns_data(run) -> None:
    prom, fleet, at, (device_view, retained_view) = run
    sel = f'{{federation="{FED}"}}'

    # every per-device series, labelled by federation and device, for each device (no GPU here)
    for name, _kind, _attr, _help in PER_DEVICE:
        if name != "fcl_device_gpu_peak_bytes":
            assert set(_by_device(prom, name + sel, at)) == DEVICES, name
    assert not prom.query("fcl_device_gpu_peak_bytes", at)
    value = {name: _by_device(prom, name + sel, at) for name, *_ in PER_DEVICE}
    done = max(
        (e["round"] for e in fleet.events("round") if e["last_update_t"] <= at - 2), default=-1
    )  # scraped by ``at``
    for device in DEVICES:
        assert value["fcl_device_online"][device] == 1
        assert at - 30 < value["fcl_device_last_seen_timestamp_seconds"][device] <= at + 1
        assert done - 5 <= value["fcl_device_rounds_participated_total"][device] <= ROUNDS
        assert value["fcl_device_rounds_missed_total"][device] == 0
        assert value["fcl_device_last_round_up_bytes"][device] > 1000
        assert value["fcl_device_last_round_down_bytes"][device] > 1000
        assert value["fcl_device_model_lag_rounds"][device] <= 1
        assert value["fcl_device_task"][device] == 1
        assert 20 * 2**20 < value["fcl_device_peak_rss_bytes"][device] < BUDGET_MB * 2**20
        assert value["fcl_device_memory_budget_bytes"][device] == BUDGET_MB * 2**20
        assert 0 < value["fcl_device_round_cpu_seconds"][device] < 60
        assert value["fcl_device_resyncs_total"][device] == 0
    kinds = prom.query(f"fcl_device_bytes_total{sel}", at)
    assert len(kinds) == 3 * 6 and {(r["metric"]["direction"], r["metric"]["kind"]) for r in kinds} == {
        (d, k) for d in ("up", "down") for k in ("model", "knowledge", "control")
    }
    assert all(r["value"] > 0 for r in kinds if r["metric"]["kind"] in ("model", "control"))
    rejected = prom.query(f"fcl_device_rejected_total{sel}", at)
    assert [(r["metric"]["device"], r["metric"]["reason"], r["value"]) for r in rejected] == [("client-0", "codec", 1)]
    info = prom.query(f"fcl_device_info{sel}", at)
    assert {r["metric"]["version"] for r in info} == {daemon_version()} and len(info) == 3

    # the federation and learning, live
    fed = {name: prom.query(name + sel, at) for name in ("fcl_total_rounds", "fcl_current_task", "fcl_run_failed")}
    assert [r["value"] for r in fed["fcl_total_rounds"]] == [ROUNDS] and fed["fcl_run_failed"][0]["value"] == 0
    tasks = {
        r["metric"]["task"]: r["value"] for r in prom.query(f'fcl_task_metric{{metric="nll",federation="{FED}"}}', at)
    }
    assert set(tasks) == {"0", "1"} and all(5 < v < 200 for v in tasks.values()), tasks
    (average,) = prom.query(f"fcl_learning_average{sel}", at)
    (forgetting,) = prom.query(f"fcl_learning_forgetting{sel}", at)
    assert average["value"] == pytest.approx(tasks["0"], abs=5) and abs(forgetting["value"]) < 50

    # the device's own view (its control socket) says what its series say
    assert device_view.returncode == 0, device_view.stderr
    health = json.loads(device_view.stdout)["health"]
    assert health["budget_mb"] == BUDGET_MB and health["daemon"] == daemon_version() and health["resyncs"] == 0
    assert 20 < health["peak_mb"] < BUDGET_MB and health["cpu_s"] > 0 and health["up"]["update"] > 0
    assert health["down"]["round"] > 0
    retained = json.loads(device_view.stdout)["retained_status"]
    assert retained["health"]["budget_mb"] == BUDGET_MB and retained["round"] >= 2
    assert retained_view.returncode == 0, retained_view.stderr
    lines = retained_view.stdout.splitlines()
    assert re.match(rf"client-1 of {FED}: (online|stopped), task [01], round \d+, last seen", lines[0]), lines
    assert "of a 4096.0 MiB budget" in lines[1]
    assert re.search(r"bytes up: [\d,]+ \(status [\d,]+, update [\d,]+\)", retained_view.stdout), lines
    assert f"daemon {daemon_version()}" in retained_view.stdout

    for expr in dashboard_exprs():
        assert prom.query(expr, at), f"dashboard expression returns nothing: {expr}"

    rules = {r["name"]: r for g in prom.api("rules")["groups"] for r in g["rules"]}
    assert set(rules) == set(rule_exprs())
    for name, expr in rule_exprs().items():
        assert rules[name]["health"] == "ok", rules[name]
        for series in set(RULE_SERIES.findall(expr)):
            assert prom.query(series, at), f"{name}: no {series} series"
        assert prom.query(expr, at) == [], f"{name} fires on a healthy run"
