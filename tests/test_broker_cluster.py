"""The clustered broker tier: a 3-node NATS cluster (MQTT over JetStream, stream replicas 3)
on free loopback ports, the quick scenario's aggregator and devices spread over its nodes, each
given all three urls, and the node that holds the aggregator (and one device) killed mid-round.
The run must finish with every update counted exactly once."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest
import yaml
from support.fleet import QUICK_OVERRIDES, QUICK_SCENARIO, Fleet, assert_each_round_once

from fcl_edge.nats_cluster import NatsCluster, nats_server_binary

pytestmark = pytest.mark.slow  # ~1 min: the cluster forms, then re-elects its JetStream leaders
ROUNDS, CLIENTS = 8, 3
KILLED = 0  # the aggregator's node


@pytest.fixture
def cluster(tmp_path: Path):
    if nats_server_binary() is None:
        pytest.skip("nats-server is not installed (apt-get install nats-server); .ci/run installs it")
    nodes = NatsCluster(tmp_path / "nats", 3).start(timeout=60)
    yield nodes
    nodes.stop()


def _spread(fleet: Fleet, urls: list[str]) -> dict[str, str]:
    """Give every participant all urls, each starting at its own node: the aggregator at node 0,
    device i at node (i + 1) % 3.  Returns the node url each one starts on."""
    first = {}
    for offset, name in enumerate(fleet.configs):  # "aggregator" first, then the clients
        path = fleet.configs[name][1]
        raw = yaml.safe_load(path.read_text())
        order = urls[offset % len(urls) :] + urls[: offset % len(urls)]
        raw["broker"]["url"] = order
        path.write_text(yaml.safe_dump(raw, sort_keys=False))
        first[name] = order[0]
    return first


def test_node_killed_mid_round_every_update_counted_once(cluster, repo_root, tmp_path):
    fleet = Fleet(repo_root / QUICK_SCENARIO, tmp_path / "run", cluster.urls[0], QUICK_OVERRIDES)
    first = _spread(fleet, cluster.urls)
    on_killed = sorted(n for n, url in first.items() if url == cluster.urls[KILLED])
    assert on_killed == ["aggregator", "client-2"]
    try:
        fleet.start_all()
        fleet.wait_for_round(1, timeout=120)  # rounds 0 and 1 closed, round 2 under way
        closed_before_kill = max(e["round"] for e in fleet.events("round"))
        cluster.kill_node(KILLED)
        codes = fleet.wait(timeout=240)
    finally:
        fleet.stop()
    assert set(codes.values()) == {0}, (codes, fleet.logs())
    # The fault landed on a run in progress, and the two cut-off participants moved on.
    assert closed_before_kill < ROUNDS - 1
    for name in on_killed:
        log = (fleet.out / "logs" / f"{name}.1.log").read_text()
        assert f"disconnected from {cluster.urls[KILLED]}" in log, log[-3000:]
        assert any(f"connected to {u} as" in log for u in cluster.urls[KILLED + 1 :]), log[-3000:]
    assert_each_round_once(fleet, ROUNDS, CLIENTS)
    summary = fleet.summary()
    assert summary["rounds"] == ROUNDS and summary["clients"] == CLIENTS
    per_client = collections.Counter(e["client"] for e in fleet.events("round_client"))
    assert per_client == {f"client-{i}": ROUNDS for i in range(CLIENTS)}, per_client
