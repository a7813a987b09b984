"""The MQTT link against a real Mosquitto: meter exactness, resubscription, last-will."""

from __future__ import annotations

import threading
import time

import paho.mqtt.client as mqtt
import pytest
from support.mqtt_counter import MqttCounter

from fclcore.schema import BrokerSpec
from fclcore.transport import MqttLink, TransportError, parse_status, publish_packet_bytes


@pytest.mark.parametrize(
    "topic,payload,qos,expected",
    [
        ("a/b", 10, 1, 1 + 1 + (2 + 3 + 2 + 10)),
        ("a/b", 0, 0, 1 + 1 + (2 + 3)),
        ("a/b", 120, 1, 1 + 1 + 127),  # remaining length 127: one length byte
        ("a/b", 121, 1, 1 + 2 + 128),  # 128: two length bytes
        ("t", 16_378, 1, 1 + 2 + 16_383),  # 16383: still two
        ("t", 16_379, 1, 1 + 3 + 16_384),  # 16384: three
        ("é", 5, 1, 1 + 1 + (2 + 2 + 2 + 5)),  # topic length counts UTF-8 bytes
    ],
)
def test_publish_packet_bytes(topic, payload, qos, expected):
    assert publish_packet_bytes(topic, payload, qos) == expected


def _sink(received: list, event: threading.Event):
    def on_message(topic: str, payload: bytes, size: int) -> None:
        received.append((topic, len(payload), size))
        event.set()

    return on_message


def test_meter_equals_an_independent_parse_of_the_stream(mosquitto):
    counter = MqttCounter(mosquitto.port)
    got, event = [], threading.Event()
    spec = BrokerSpec(url=f"mqtt://127.0.0.1:{counter.port}")
    rx = MqttLink(spec, "rx", status_topic="t/status/rx", subscriptions=["t/data"], on_message=_sink(got, event))
    tx = MqttLink(spec, "tx", status_topic="t/status/tx", subscriptions=[], on_message=lambda *a: None)
    rx.start(10)
    tx.start(10)
    sizes = [0, 1, 100, 121, 20_000, 300_000]
    for n in sizes:
        tx.publish("t/data", bytes(n)).wait_for_publish(5)
    deadline = time.monotonic() + 10
    while len(got) < len(sizes) and time.monotonic() < deadline:
        time.sleep(0.05)
    tx.close()
    rx.close()
    time.sleep(0.3)
    assert [n for _, n, _ in got] == sizes
    assert tx.meter.snapshot()["up"]["bytes"] == counter.publish_bytes("tx", "up")
    assert rx.meter.snapshot()["down"]["bytes"] == counter.publish_bytes("rx", "down")
    assert rx.meter.snapshot()["up"]["bytes"] == counter.publish_bytes("rx", "up")  # its status messages
    counter.close()


# docs/protocol.md P-2.3, P-10.1
def test_status_online_stopped_and_last_will(mosquitto):
    states: list[dict] = []
    watcher = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="watcher")
    watcher.on_message = lambda c, u, m: states.append(parse_status(m.payload) or {})
    watcher.connect("127.0.0.1", mosquitto.port)
    watcher.subscribe("w/status/#", qos=1)
    watcher.loop_start()
    spec = BrokerSpec(url=mosquitto.url, keepalive_s=5)
    link = MqttLink(spec, "dev", status_topic="w/status/dev", subscriptions=[], on_message=lambda *a: None)
    link.start(10)
    link.close("stopped")
    crashing = MqttLink(spec, "dev2", status_topic="w/status/dev2", subscriptions=[], on_message=lambda *a: None)
    crashing.start(10)
    crashing._client._sock.close()  # the process dies without a DISCONNECT: the broker sends the will
    deadline = time.monotonic() + 20
    while "dead" not in [s.get("state") for s in states] and time.monotonic() < deadline:
        time.sleep(0.1)
    watcher.loop_stop()
    assert [s.get("state") for s in states[:2]] == ["online", "stopped"]
    assert "dead" in [s.get("state") for s in states]


# docs/protocol.md P-2.2
def test_resubscribes_after_broker_restart(mosquitto):
    got, event = [], threading.Event()
    spec = BrokerSpec(url=mosquitto.url, reconnect_min_s=0.2, reconnect_max_s=1.0)
    link = MqttLink(spec, "re", status_topic="r/status/re", subscriptions=["r/data"], on_message=_sink(got, event))
    link.start(10)
    mosquitto.stop()
    mosquitto.start()
    deadline = time.monotonic() + 20
    while not link.connected.is_set() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)
    pub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="pub")
    pub.connect("127.0.0.1", mosquitto.port)
    pub.loop_start()
    pub.publish("r/data", b"after-restart", qos=1).wait_for_publish(5)
    assert event.wait(10), "no message after the broker came back: subscription not renewed"
    pub.loop_stop()
    link.close()


def test_unreachable_broker_raises_transport_error():
    from support.mosquitto import free_port

    spec = BrokerSpec(url=f"mqtt://127.0.0.1:{free_port()}")
    link = MqttLink(spec, "x", status_topic="x/status", subscriptions=[], on_message=lambda *a: None)
    with pytest.raises(TransportError, match="could not connect"):
        link.start(1.5)
