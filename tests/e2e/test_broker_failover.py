"""Several broker urls: how a list is read and refused, and the link's round-robin failover
between real Mosquitto brokers (one dead from the start, one killed while connected)."""

from __future__ import annotations

import threading
import time

import paho.mqtt.client as mqtt
import pytest
from support.mosquitto import Mosquitto, free_port
from support.mqtt_counter import MqttCounter

from fclcore.config import ConfigError, from_dict
from fclcore.schema import AggregatorConfig, BrokerSpec, parse_broker_urls
from fclcore.transport import MqttLink, TransportError, parse_status

SUBACK = 9
FED = {"federation": {"name": "t"}, "expected_clients": ["a"]}


def test_one_url_reads_as_before():
    spec = from_dict(AggregatorConfig, {**FED, "broker": {"url": "mqtt://10.0.0.1:1884"}}, "cfg").broker
    assert spec.url == "mqtt://10.0.0.1:1884" and spec.urls == ("mqtt://10.0.0.1:1884",)
    assert parse_broker_urls(spec.url) == [("10.0.0.1", 1884)]


def test_a_list_keeps_its_order():
    urls = ["mqtt://n2:1885", "mqtt://n0", "mqtt://n1:1884"]
    spec = from_dict(AggregatorConfig, {**FED, "broker": {"url": urls}}, "cfg").broker
    assert spec.urls == tuple(urls) and not spec.tls
    assert parse_broker_urls(spec.url) == [("n2", 1885), ("n0", 1883), ("n1", 1884)]
    assert BrokerSpec(url=["mqtts://a:8883", "mqtts://b:8883"]).tls


@pytest.mark.parametrize(
    "value,words",
    [
        ([], ["broker", "non-empty list"]),
        (["mqtt://a:1883", "mqtts://b:8883"], ["one scheme", "mqtt and mqtts"]),
        (["mqtt://a:1883", "mqtt://a:1883"], ["listed twice", "mqtt://a:1883"]),
        (["mqtt://a:1883", "mqtt://a"], ["listed twice"]),  # the default port is the same address
        (["mqtt://a:1883", "http://b:1883"], ["mqtt://host[:port]", "http://b:1883"]),
        (["mqtt://a:1883", 5], ["broker.url", "expected str or a list"]),
        (["mqtt://u:pw@a:1883"], ["credentials go in broker.username"]),
        ({"host": "a"}, ["broker.url", "expected str or a list"]),
    ],
)
def test_bad_url_lists_fail_in_one_line(value, words):
    with pytest.raises(ConfigError) as err:
        from_dict(AggregatorConfig, {**FED, "broker": {"url": value}}, "cfg")
    message = str(err.value)
    assert "\n" not in message and all(w in message for w in words), message
    assert "pw" not in message  # a password typed into a url is never echoed


def _link(urls: list[str], name: str, got: list, event: threading.Event) -> MqttLink:
    def on_message(topic: str, payload: bytes, size: int) -> None:
        got.append(payload)
        event.set()

    spec = BrokerSpec(url=urls, reconnect_min_s=0.2, reconnect_max_s=1.0)
    return MqttLink(spec, name, status_topic=f"f/status/{name}", subscriptions=["f/data"], on_message=on_message)


def _publish(port: int, payload: bytes) -> None:
    pub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"pub-{port}")
    pub.connect("127.0.0.1", port)
    pub.loop_start()
    pub.publish("f/data", payload, qos=1).wait_for_publish(5)
    pub.loop_stop()
    pub.disconnect()


def _retained_status(port: int, topic: str) -> dict | None:
    got: list[dict | None] = []
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"look-{port}")
    client.on_message = lambda c, u, m: got.append(parse_status(m.payload))
    client.connect("127.0.0.1", port)
    client.subscribe(topic, qos=1)
    deadline = time.monotonic() + 5
    while not got and time.monotonic() < deadline:
        client.loop(0.1)
    client.disconnect()
    return got[0] if got else None


def test_skips_a_dead_url_then_fails_over_round_robin(tmp_path):
    first, second = Mosquitto(tmp_path / "m1").start(), Mosquitto(tmp_path / "m2").start()
    dead = f"mqtt://127.0.0.1:{free_port()}"
    got, event = [], threading.Event()
    link = _link([dead, first.url, second.url], "dev", got, event)
    try:
        link.start(10)
        assert link.url == first.url  # the first url that answered
        assert (_retained_status(first.port, "f/status/dev") or {}).get("state") == "online"
        first.kill()
        deadline = time.monotonic() + 15
        while (link.url != second.url or not link.connected.is_set()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert link.url == second.url and link.connected.is_set() and link.connects == 2
        assert (_retained_status(second.port, "f/status/dev") or {}).get("state") == "online"
        time.sleep(0.3)  # the SUBSCRIBE follows the CONNACK
        _publish(second.port, b"after-failover")
        assert event.wait(10) and got == [b"after-failover"], "subscription not renewed on the next broker"
        link.close()
        assert (_retained_status(second.port, "f/status/dev") or {}).get("state") == "stopped"
    finally:
        link.close()
        first.stop()
        second.stop()


def test_a_list_of_dead_urls_names_them_all():
    urls = [f"mqtt://127.0.0.1:{free_port()}", f"mqtt://127.0.0.1:{free_port()}"]
    link = _link(urls, "x", [], threading.Event())
    with pytest.raises(TransportError) as err:
        link.start(2)
    assert all(u in str(err.value) for u in urls), err.value


class SubackRefuser(MqttCounter):
    """A relay in front of a real Mosquitto that turns the first ``refusals`` SUBACKs into
    refusals (return code 0x80), as a NATS node whose JetStream is re-electing answers."""

    def __init__(self, upstream_port: int, refusals: int) -> None:
        super().__init__(upstream_port)
        self.refusals = refusals
        self.refused = 0
        self.subacks = 0

    def rewrite(self, packet: bytes, direction: str) -> bytes:
        if direction != "down" or packet[0] >> 4 != SUBACK:
            return packet
        self.subacks += 1
        if self.refused >= self.refusals:
            return packet
        self.refused += 1
        header = len(packet) - packet[1]  # a SUBACK of a few topics has a one-byte length
        return packet[: header + 2] + b"\x80" * (len(packet) - header - 2)  # keep the packet id


def test_a_refused_subscription_is_asked_for_again(mosquitto):
    """A refused SUBSCRIBE must not leave the link connected but deaf: it asks again until granted."""
    relay = SubackRefuser(mosquitto.port, refusals=2)
    got, event = [], threading.Event()
    link = _link([f"mqtt://127.0.0.1:{relay.port}"], "deaf", got, event)
    try:
        link.start(10)
        deadline = time.monotonic() + 10
        while relay.subacks < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert relay.subacks == 3 and relay.refused == 2, "a refused subscription was not asked for again"
        _publish(mosquitto.port, b"granted")
        assert event.wait(5) and got == [b"granted"]
        assert link.connects == 1  # the same connection: no reconnect was needed
    finally:
        link.close()
        relay.close()
