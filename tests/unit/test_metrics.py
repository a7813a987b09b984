"""The aggregator's Prometheus endpoint, scraped over HTTP and parsed as the exposition format."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.mosquitto import free_port

from aggregator.metrics import AggregatorMetrics
from fclcore.errors import ConfigError


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} from http://127.0.0.1:port/metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def fed(**labels: str) -> tuple:
    return tuple(sorted({"federation": "home", **labels}.items()))


@pytest.fixture
def metrics():
    m = AggregatorMetrics("home", port=free_port())
    yield m
    m.close()


def test_endpoint_reports_what_the_round_loop_told_it(metrics):
    metrics.clients_online(3)
    metrics.round_started(0, 0)
    metrics.round_done(0, 0, accepted=3, duration_s=1.5)
    metrics.add_bytes(up=30_000, down=45_000)
    metrics.round_started(1, 0)
    metrics.round_done(1, 0, accepted=2, duration_s=40.0)
    metrics.add_bytes(up=20_000, down=45_000)
    metrics.round_started(2, 1)
    for reason in ("codec", "codec", "late"):
        metrics.rejected(reason)
    metrics.clients_online(2)

    got = scrape(metrics.port)
    assert got[("fcl_rounds_total", fed())] == 2
    assert got[("fcl_accepted_updates_total", fed())] == 5
    assert got[("fcl_clients_connected", fed())] == 2
    assert got[("fcl_bytes_up_total", fed())] == 50_000
    assert got[("fcl_bytes_down_total", fed())] == 90_000
    assert got[("fcl_rejected_updates_total", fed(reason="codec"))] == 2
    assert got[("fcl_rejected_updates_total", fed(reason="late"))] == 1
    assert got[("fcl_current_round", fed())] == 2  # the round in progress
    assert got[("fcl_current_task", fed())] == 1
    assert got[("fcl_round_latency_seconds_count", fed())] == 2
    assert got[("fcl_round_latency_seconds_sum", fed())] == pytest.approx(41.5)
    assert got[("fcl_round_latency_seconds_bucket", fed(le="2.0"))] == 1
    assert got[("fcl_round_latency_seconds_bucket", fed(le="60.0"))] == 2


def test_loopback_only_by_default_and_close_frees_the_port(metrics):
    port = metrics.port
    assert metrics._server.server_address[0] == "127.0.0.1"
    metrics.close()
    assert metrics.port is None
    with pytest.raises(urllib.error.URLError):
        scrape(port)
    with socket.socket() as s:  # the port is free again
        s.bind(("127.0.0.1", port))


def test_two_federations_in_one_process_do_not_collide():
    a, b = AggregatorMetrics("a", port=0), AggregatorMetrics("b", port=0)
    try:
        a.round_done(0, 0, 1, 0.1)
        assert scrape(a.port)[("fcl_rounds_total", (("federation", "a"),))] == 1
        assert ("fcl_rounds_total", (("federation", "b"),)) not in scrape(b.port)
    finally:
        a.close()
        b.close()


def test_port_in_use_is_a_config_error():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        with pytest.raises(ConfigError, match="metrics_port"):
            AggregatorMetrics("home", port=holder.getsockname()[1])


def test_no_port_no_server_but_the_registry_counts():
    from prometheus_client import generate_latest

    m = AggregatorMetrics("home")
    m.round_done(4, 0, 3, 2.0)
    assert m.port is None
    assert 'fcl_rounds_total{federation="home"} 1.0' in generate_latest(m.registry).decode()
    m.close()


def test_without_prometheus_client_it_is_a_no_op(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_prometheus(name, *args, **kwargs):
        if name.startswith("prometheus_client"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_prometheus)
    m = AggregatorMetrics("home")
    assert not m.enabled
    m.round_done(0, 0, 1, 1.0)
    m.rejected("codec")
    with pytest.raises(ConfigError, match="prometheus-client"):
        AggregatorMetrics("home", port=9999)
