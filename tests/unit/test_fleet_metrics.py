"""Per-device series and the device's health field: what a device's status and the round loop
put in, what the endpoint serves (parsed as the exposition format), the bounds on labels and
devices, hostile statuses, and the health field's size on the device."""

from __future__ import annotations

import gzip
import json
import re
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.agg_parts import FED, RecordingLink, federation

from aggregator.clients import ClientSet
from aggregator.fleet_metrics import PER_DEVICE, REJECTION_REASONS, DeviceBook
from aggregator.inbox import Inbox
from aggregator.intake import Intake
from aggregator.metrics import AggregatorMetrics
from aggregator.partial import Sites
from aggregator.report import RunReport
from aggregator.runlog import RunLog
from aggregator.state import StateStore
from edge_client.status import RoundStats
from fclcore import topics
from fclcore.codec import CodecLimits, Frame, Header, Kind, encode
from fclcore.health import daemon_version, read_health

REPO = Path(__file__).resolve().parents[2]
HEALTH = {"rss_mb": 200.5, "peak_mb": 240.0, "budget_mb": 512, "cpu_s": 1.5, "resyncs": 2, "daemon": "0.1.0"}
SERIES_PER_DEVICE = 19  # PER_DEVICE but the GPU's, 6 byte counters, the info series (docs/monitoring.md)


def _intake(tmp_path: Path) -> Intake:
    """An intake of clients c0 and c1 with closed enrollment (as tests/unit/test_agg_intake.py builds one)."""
    fed, strategy = federation()
    clients = ClientSet(["c0", "c1"])
    runlog, metrics = RunLog(tmp_path / "out"), AggregatorMetrics(FED)
    report = RunReport(strategy, runlog, metrics, RecordingLink(), fed, CodecLimits())
    inbox = Inbox(FED, clients, strategy.normalize, fed.num_tasks)
    sites = Sites([], strategy, fed.method)
    return Intake(FED, strategy, clients, inbox, sites, StateStore(tmp_path / "state"), runlog, metrics, report)


def _update(model: dict, client: str, n_samples: int) -> bytes:
    header = Header(Kind.UPDATE, FED, 0, 0, client, 1)  # counted from the run's start, as devices do (P-SEQ-1)
    return encode(Frame(header, {"n_samples": n_samples}, dict(model)))


def samples(text: str) -> list:
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def by_device(text: str, name: str) -> dict[str, float]:
    return {s.labels["device"]: s.value for s in samples(text) if s.name == name}


def test_a_devices_status_and_rounds_become_its_series() -> None:
    book = DeviceBook("home")
    book.status("d0", {"state": "online", "task": 1, "protocol": 2, "health": HEALTH})
    book.status("d1", {"state": "dead"})
    book.update("d0", 4)
    book.round_closed("d0", True, 900, 5000, {"model": 800, "control": 100}, {"model": 4000, "control": 1000})
    book.round_closed("d1", False, 0, 5000, {}, {"model": 4000, "control": 1000})
    book.closed_round = 6
    book.rejected("d0", "signature")
    book.rejected("d0", "something-new")
    text = book.render()
    assert by_device(text, "fcl_device_online") == {"d0": 1, "d1": 0}
    assert by_device(text, "fcl_device_rounds_participated_total") == {"d0": 1, "d1": 0}
    assert by_device(text, "fcl_device_rounds_missed_total") == {"d0": 0, "d1": 1}
    assert by_device(text, "fcl_device_model_lag_rounds") == {"d0": 2, "d1": 7}  # d1 never uploaded
    assert by_device(text, "fcl_device_peak_rss_bytes") == {"d0": 240 * 2**20}  # d1 said nothing of itself
    assert by_device(text, "fcl_device_memory_budget_bytes") == {"d0": 512 * 2**20}
    assert by_device(text, "fcl_device_round_cpu_seconds") == {"d0": 1.5}
    assert by_device(text, "fcl_device_task") == {"d0": 1, "d1": -1}
    assert by_device(text, "fcl_device_last_round_up_bytes") == {"d0": 900, "d1": 0}
    kinds = {
        (s.labels["device"], s.labels["direction"], s.labels["kind"]): s.value
        for s in samples(text)
        if s.name == "fcl_device_bytes_total"
    }
    assert kinds[("d0", "up", "model")] == 800 and kinds[("d1", "down", "control")] == 1000
    reasons = {s.labels["reason"]: s.value for s in samples(text) if s.name == "fcl_device_rejected_total"}
    assert reasons == {"signature": 1, "other": 1}
    info = {s.labels["device"]: (s.labels["version"], s.labels["protocol"]) for s in samples(text) if "info" in s.name}
    assert info == {"d0": ("0.1.0", "2"), "d1": ("unknown", "unknown")}
    assert time.time() - by_device(text, "fcl_device_last_seen_timestamp_seconds")["d0"] < 60


def test_series_per_device_are_as_documented() -> None:
    book = DeviceBook("home")
    for d in ("a", "b"):
        book.status(d, {"state": "online", "task": 0, "health": HEALTH})
    per_device = len([s for s in samples(book.render()) if s.labels.get("device") == "a"])
    assert per_device == SERIES_PER_DEVICE == len(PER_DEVICE) - 1 + 6 + 1
    doc = (REPO / "docs" / "monitoring.md").read_text()
    assert f"**{SERIES_PER_DEVICE} series per device**" in doc
    assert f"{SERIES_PER_DEVICE * 10_000:,} series" in doc


@pytest.mark.parametrize(
    "status",
    [
        {"state": "online", "health": "nope"},
        {"state": "online", "health": {"peak_mb": float("nan"), "cpu_s": -1, "resyncs": 1.5, "daemon": 'a"b\n'}},
        {"state": "online", "health": {"peak_mb": 1e300, "budget_mb": True, "daemon": "x" * 500}, "task": "3"},
        {"state": "online", "protocol": {"v": 1}, "task": 2**40, "health": {"up": "x", "down": [1]}},
        {"state": 'on"line\\', "health": None},
    ],
)
def test_a_hostile_status_adds_nothing_but_its_state(status: dict) -> None:
    book = DeviceBook('fed"x')
    book.status("d0", status)
    text = book.render()  # parses: labels are escaped
    values = {s.name: s.value for s in samples(text)}
    assert values["fcl_device_online"] == (status["state"] == "online")
    assert "fcl_device_peak_rss_bytes" not in values and "fcl_device_memory_budget_bytes" not in values
    assert values["fcl_device_task"] == -1
    info = [s.labels for s in samples(text) if s.name == "fcl_device_info"]
    assert info == [{"federation": 'fed"x', "device": "d0", "version": "unknown", "protocol": "unknown"}]


def test_the_book_never_tracks_more_than_max_devices() -> None:
    book = DeviceBook("home", max_devices=3)
    for i in range(10):
        book.status(f"d{i}", {"state": "online"})
        book.rejected(f"d{i}", "codec")
    assert len(book) == 3
    assert set(by_device(book.render(), "fcl_device_online")) == {"d0", "d1", "d2"}


def test_every_rejection_reason_in_the_code_is_in_the_closed_set() -> None:
    pattern = re.compile(r'Reject(?:ion|ed)\(\s*"([a-z-]+)"')
    found = {m for path in REPO.glob("[!t]*/**/*.py") for m in pattern.findall(path.read_text())}
    found |= {"late", "round", "duplicate", "replay", "sequence", "norm", "status"}  # made from variables
    assert found and found <= REJECTION_REASONS, found - REJECTION_REASONS


def test_the_intake_tracks_enrolled_devices_only(tmp_path: Path) -> None:
    intake = _intake(tmp_path)
    try:
        status = json.dumps({"state": "online", "task": 0, "health": HEALTH}).encode()
        for who in ("c0", "stranger"):
            intake.put(topics.status_topic(FED, who), status, len(status))
        model = intake.strategy.initial_model()
        bad = b"not a frame"
        for who in ("c1", "stranger"):
            intake.put(topics.update_topic(FED, who), bad, len(bad))
        good = _update(model, "c0", 3)
        intake.put(topics.update_topic(FED, "c0"), good, len(good))
        received: dict = {}
        while not intake.queue.empty():
            intake.drain(0, received, 0, model)
        assert set(received) == {"c0"}
        text = intake.metrics.devices.render()
        assert set(by_device(text, "fcl_device_online")) == {"c0", "c1"}  # c1: enrolled, its update rejected
        assert by_device(text, "fcl_device_peak_rss_bytes") == {"c0": 240 * 2**20}
        assert {(s.labels["device"], s.labels["reason"]) for s in samples(text) if "rejected" in s.name} == {
            ("c1", "codec")
        }
        assert intake.metrics.devices.get("c0").last_round == 0
    finally:
        intake.runlog.close()


def test_the_endpoint_serves_both_gzipped_on_request_and_nothing_else() -> None:
    metrics = AggregatorMetrics("home", port=0)
    try:
        metrics.devices.status("d0", {"state": "online", "health": HEALTH})
        url = f"http://127.0.0.1:{metrics.port}/metrics"
        request = urllib.request.Request(url, headers={"Accept-Encoding": "gzip"})
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.headers["Content-Encoding"] == "gzip"
            text = gzip.decompress(response.read()).decode()
        assert by_device(text, "fcl_device_online") == {"d0": 1}
        assert any(s.name == "fcl_total_rounds" or s.name == "fcl_run_failed" for s in samples(text))
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(f"http://127.0.0.1:{metrics.port}/other", timeout=10)
    finally:
        metrics.close()


def test_learning_gauges_follow_the_evaluations(tmp_path: Path) -> None:
    log = RunLog(tmp_path)
    try:
        for client, nll in (("a", [30.0, 20.0]), ("b", [34.0, 22.0])):
            log.evaluation(client, {"round": 3, "task": 1, "nll": [nll[0], None]})
            log.evaluation(client, {"round": 7, "task": 1, "nll": nll})
        assert log.round_means(3) == ("nll", {0: 32.0})
        assert log.round_means(7) == ("nll", {0: 32.0, 1: 21.0})
        assert log.round_means(5) is None
        metrics = AggregatorMetrics("home")
        metrics.learning("nll", {0: 32.0, 1: 21.0}, log.fleet_scores(["a", "b"], [3, 7]), 2)
        values = {(s.name, s.labels.get("task")): s.value for s in samples(metrics.exposition().decode())}
        assert values[("fcl_task_metric", "1")] == 21.0
        assert values[("fcl_learning_average", None)] == pytest.approx(26.5)  # mean of 32 and 21 after task 1
        assert values[("fcl_learning_forgetting", None)] == pytest.approx(0.0)  # task 0: 32 then 32
    finally:
        log.close()


def test_the_devices_health_is_a_few_hundred_bytes_and_reads_back() -> None:
    stats = RoundStats()
    for rnd in range(500):  # a long-lived device: the field does not grow with rounds
        stats.round_done(rnd, 1.234567, 0.2, 1.0)
        stats.downlink("fcl/home-fleet/round", 123_456)
        stats.downlink("fcl/home-fleet/knowledge/client-0", 10_000)
    meter = {"by_tag": {f"up:update:{r}": {"bytes": 50_000} for r in range(500)} | {"up:status": {"bytes": 9000}}}
    health = stats.health({"full": 1, "catchup": 2, "knowledge": 1, "bytes": 10**9}, meter, 1024.0)
    size = len(json.dumps({"health": health}, separators=(",", ":")))
    assert size <= 400, (size, health)
    assert health["up"] == {"update": 25_000_000, "status": 9000}
    assert health["down"] == {"round": 61_728_000, "knowledge": 5_000_000}
    assert read_health(health) == {
        "peak_rss_mb": health["peak_mb"],
        "budget_mb": 1024.0,
        "cpu_s": 1.235,
        "resyncs": 4,
        "version": daemon_version(),
    }


def test_a_failed_run_is_served_while_the_endpoint_lingers_and_sigterm_cuts_it_short() -> None:
    import threading

    stop = threading.Event()
    metrics = AggregatorMetrics("home", port=0, linger_s=30, stop=stop)
    metrics.run_failed()
    closer = threading.Thread(target=metrics.close)
    closer.start()
    time.sleep(0.3)
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics.port}/metrics", timeout=10) as response:
        values = {s.name: s.value for s in samples(response.read().decode())}
    assert values["fcl_run_failed"] == 1 and closer.is_alive()  # still serving, 30 s to go
    stop.set()
    closer.join(5)
    assert not closer.is_alive() and metrics.port is None
