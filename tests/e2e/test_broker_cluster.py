"""The clustered broker tier: a 3-node NATS cluster (MQTT over JetStream, stream replicas 3)
on free loopback ports, the quick scenario's aggregator and devices spread over its nodes, each
given all three urls, and the node that holds the aggregator (and one device) killed mid-round.
The run must finish with every update counted exactly once.  And, on one node, the MQTT
features our protocol relies on, with the limits of nats-server 2.9's MQTT gateway."""

from __future__ import annotations

import collections
import time
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
import yaml
from support.fleet import QUICK_OVERRIDES, QUICK_SCENARIO, Fleet, assert_each_round_once
from support.timescale import scaled

from fcl_edge.nats_cluster import NatsCluster, nats_server_binary

ROUNDS, CLIENTS = 8, 3
KILLED = 0  # the aggregator's node


@pytest.fixture
def cluster(tmp_path: Path):
    if nats_server_binary() is None:
        pytest.skip("nats-server is not installed (apt-get install nats-server); .ci/run installs it")
    nodes = NatsCluster(tmp_path / "nats", 3).start(timeout=scaled(60))
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


@pytest.mark.slow  # ~25-60 s: the cluster forms, then re-elects its JetStream leaders after the kill
def test_node_killed_mid_round_every_update_counted_once(cluster, repo_root, tmp_path):
    fleet = Fleet(repo_root / QUICK_SCENARIO, tmp_path / "run", cluster.urls[0], QUICK_OVERRIDES)
    first = _spread(fleet, cluster.urls)
    on_killed = sorted(n for n, url in first.items() if url == cluster.urls[KILLED])
    assert on_killed == ["aggregator", "client-2"]
    try:
        fleet.start_all()
        fleet.wait_for_round(1, timeout=scaled(120))  # rounds 0 and 1 closed, round 2 under way
        closed_before_kill = max(e["round"] for e in fleet.events("round"))
        cluster.kill_node(KILLED)
        codes = fleet.wait(timeout=scaled(240))
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


@pytest.fixture
def single_node(tmp_path: Path):
    if nats_server_binary() is None:
        pytest.skip("nats-server is not installed (apt-get install nats-server); .ci/run installs it")
    node = NatsCluster(tmp_path / "nats1", 1).start(timeout=scaled(60))
    yield node
    node.stop()


def _client(port: int, cid: str, events: list, will: str | None = None) -> mqtt.Client:
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=cid)
    client.reconnect_delay_set(30, 30)  # no reconnect within a check: one connection, one verdict
    client.on_connect = lambda c, u, f, rc, p: events.append(("connack", rc.value))
    client.on_disconnect = lambda c, u, f, rc, p: events.append(("gone", rc.value))
    client.on_subscribe = lambda c, u, mid, rcs, p: events.append(("suback", [r.value for r in rcs]))
    client.on_message = lambda c, u, m: events.append(("msg", m.topic, bytes(m.payload), m.retain))
    if will:
        client.will_set(will, b"dead", qos=1, retain=True)
    client.connect("127.0.0.1", port, keepalive=5)
    client.loop_start()
    return client


def _until(events: list, kind: str, timeout: float = 10) -> tuple:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [e for e in events if e[0] == kind]
        if found:
            return found[0]
        time.sleep(0.02)
    raise AssertionError(f"no {kind} in {timeout} s: {events}")


def test_nats_mqtt_serves_what_our_protocol_uses(single_node):
    """QoS 1 retained messages reach a later subscriber, a last-will is published on an abnormal
    close; and the two limits docs/scaling-out.md names: QoS 2 is granted as QoS 1, and a '.'
    in a topic (a federation or client id with a dot) ends the connection."""
    port = single_node.ports[0].mqtt
    pub_events, sub_events, dot_events, dying_events = [], [], [], []
    pub = _client(port, "fcl-pub", pub_events)
    _until(pub_events, "connack")
    pub.publish("fcl/f-x/round", b"announce", qos=1, retain=True).wait_for_publish(5)
    dying = _client(port, "fcl-dying", dying_events, will="fcl/f-x/status/dying")
    _until(dying_events, "connack")
    dying.loop_stop()
    dying.socket().close()  # no DISCONNECT: the server must publish the will
    sub = _client(port, "fcl-sub", sub_events)
    _until(sub_events, "connack")
    sub.subscribe([("fcl/f-x/round", 1), ("fcl/f-x/status/+", 2)])
    assert _until(sub_events, "suback")[1] == [1, 1]  # QoS 2 downgraded to QoS 1
    deadline = time.monotonic() + 20
    while len([e for e in sub_events if e[0] == "msg"]) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    received = {(e[1], e[2]) for e in sub_events if e[0] == "msg"}
    assert received == {("fcl/f-x/round", b"announce"), ("fcl/f-x/status/dying", b"dead")}, sub_events
    dotted = _client(port, "fcl-dot", dot_events)
    _until(dot_events, "connack")
    dotted.publish("fcl/f.x/round", b"announce", qos=1)
    _until(dot_events, "gone")  # the server closes the connection
    for client in (pub, sub, dotted):
        client.loop_stop()
        client.disconnect()


def test_shipped_node_configs_are_the_generators(repo_root, tmp_path):
    """deploy/nats/ holds what ``python -m fcl_edge.nats_cluster write DIR --store /var/lib/nats/fcl``
    writes; regenerate them with that command after changing the generator."""
    from fcl_edge.nats_cluster import main

    assert main(["write", str(tmp_path), "--store", "/var/lib/nats/fcl"]) == 0
    for index in range(3):
        name = f"node-{index}.conf"
        assert (repo_root / "deploy/nats" / name).read_text() == (tmp_path / name).read_text(), name


@pytest.mark.parametrize(
    "args,words",
    [
        (["--nodes", "2"], ["--nodes", "odd", "2"]),
        (["--mqtt-port", "65535"], ["ports", "65535"]),
        (["--route-port", "4223"], ["overlap"]),
    ],
)
def test_generator_refuses_bad_layouts_in_one_line(args, words, tmp_path, capsys):
    from fcl_edge.nats_cluster import main

    assert main(["write", str(tmp_path / "out"), *args]) == 2
    message = capsys.readouterr().err.strip()
    assert "\n" not in message and all(w in message for w in words), message
    assert not (tmp_path / "out").exists()
