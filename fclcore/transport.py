"""One MQTT link for both the aggregator and the edge client (paho-mqtt, MQTT 3.1.1).

QoS 1 everywhere; subscriptions are (re)made in ``on_connect`` so they survive a broker
restart; paho reconnects with exponential backoff; a retained status topic carries
"online" on connect, "stopped" on a clean shutdown and the last-will "dead" otherwise.
``mqtts://`` urls use TLS with the CA and optional client certificate of the BrokerSpec.
With several broker urls (a cluster), the link connects to the first that answers and, when
its broker goes away or a connection attempt fails, aims paho's next reconnect at the next
url of the list (round-robin); subscriptions and the "online" status follow it there.

``WireMeter`` counts what crosses the wire per direction, as MQTT PUBLISH packets: fixed
header + variable header (topic, packet id) + payload.  The sizes are computed from the
topic and payload with the MQTT 3.1.1 rules, so they equal what a packet capture shows for
every PUBLISH that is sent once (a QoS 1 retransmission after a reconnect is not counted).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import random
import ssl
import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Sequence

import paho.mqtt.client as mqtt

from fclcore.errors import BrokerUnreachable
from fclcore.schema import BrokerSpec, parse_broker_urls

log = logging.getLogger(__name__)

QOS = 1
MessageHandler = Callable[[str, bytes, int], None]  # (topic, payload, publish packet bytes)


class _DropSocketGoneNoise(logging.Filter):
    """paho 2.x logs "Client is not connected" at ERROR whenever its loop runs after a
    disconnect, including a clean one; our on_disconnect already reports real losses."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Client is not connected")


_PAHO_LOG = logging.getLogger("paho")
_PAHO_LOG.addFilter(_DropSocketGoneNoise())


class TransportError(BrokerUnreachable):
    """The broker could not be reached or refused us."""


def publish_packet_bytes(topic: str, payload_len: int, qos: int = QOS) -> int:
    """Size of an MQTT 3.1.1 PUBLISH packet: fixed header + topic + packet id + payload."""
    remaining = 2 + len(topic.encode("utf-8")) + (2 if qos > 0 else 0) + payload_len
    length_bytes = 1
    while remaining >= 128**length_bytes:
        length_bytes += 1
    return 1 + length_bytes + remaining


@dataclass
class WireCount:
    packets: int = 0
    bytes: int = 0  # PUBLISH packet bytes
    payload: int = 0

    def add(self, packet_bytes: int, payload_bytes: int) -> None:
        self.packets += 1
        self.bytes += packet_bytes
        self.payload += payload_bytes


class WireMeter:
    """Thread-safe PUBLISH counters per direction, optionally broken down by a tag.

    ``classify(topic, payload)``: the tag of each message received (a device names every one,
    so that each byte it meters is attributed: ``edge_client.ledger``); without it, only status
    messages are tagged on the way in."""

    def __init__(self, classify: Callable[[str, bytes], str] | None = None) -> None:
        self._lock = threading.Lock()
        self._totals = {"up": WireCount(), "down": WireCount()}
        self._tagged: dict[tuple[str, str], WireCount] = defaultdict(WireCount)
        self.classify = classify

    def record(self, direction: str, topic: str, payload_len: int, tag: str | None = None) -> int:
        size = publish_packet_bytes(topic, payload_len)
        with self._lock:
            self._totals[direction].add(size, payload_len)
            if tag is not None:
                self._tagged[(direction, tag)].add(size, payload_len)
        return size

    def received(self, topic: str, payload: bytes, status_prefix: str) -> int:
        """Count one delivered message (its PUBLISH bytes are returned), tagged by ``classify``,
        else as ``status`` when its topic is under ``status_prefix``."""
        if self.classify is not None:
            tag = self.classify(topic, payload)
        else:
            tag = "status" if topic.startswith(status_prefix) else None
        return self.record("down", topic, len(payload), tag)

    def snapshot(self) -> dict:
        with self._lock:
            out = {d: vars(c).copy() for d, c in self._totals.items()}
            out["by_tag"] = {f"{d}:{t}": vars(c).copy() for (d, t), c in sorted(self._tagged.items())}
        return out


class MqttLink:
    """An MQTT session with status/last-will, resubscription and metering."""

    def __init__(
        self,
        broker: BrokerSpec,
        client_id: str,
        *,
        status_topic: str,
        subscriptions: Sequence[str],
        on_message: MessageHandler,
        meter: WireMeter | None = None,
    ) -> None:
        self.broker = broker
        self.client_id = client_id
        self.status_topic = status_topic
        self.subscriptions = list(subscriptions)
        self.meter = meter or WireMeter()
        self.connected = threading.Event()
        self._disconnected = threading.Event()
        self.connects = 0  # successful connections so far: a change tells a service the broker was away
        self.status_fields: dict[str, object] = {}  # sent with every status, also the one on reconnect
        self._on_message = on_message
        self._fatal: str | None = None  # why start() cannot succeed by retrying, once known
        self._last_error: str | None = None  # the latest failed connection attempt, for start()'s error
        self._settled = threading.Event()  # start() may return: connected, or failed for good
        self._closing = False  # close() has begun: no more subscription retries
        self._unsubscribed = threading.Event()
        self._addresses = parse_broker_urls(broker.url)  # (host, port) of each url, in the order tried
        self._index = 0  # the address in use (or tried next)
        self._client = self._make_client()

    @property
    def url(self) -> str:
        """The broker url this link is connected to (or tries next)."""
        return self.broker.urls[self._index]

    def _make_client(self) -> mqtt.Client:
        client = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2, client_id=self.client_id, protocol=mqtt.MQTTv311, clean_session=True
        )
        client.enable_logger(_PAHO_LOG)
        if self.broker.username:
            client.username_pw_set(self.broker.username, self.broker.password)
        if self.broker.tls:
            self._set_tls(client)
        elif self.broker.password and not all(_is_loopback(host) for host, _ in self._addresses):
            log.warning("broker %s: the password travels unencrypted; use an mqtts:// url", self.broker.url)
        client.will_set(self.status_topic, _status_payload("dead"), qos=QOS, retain=True)
        client.reconnect_delay_set(self.broker.reconnect_min_s, self.broker.reconnect_max_s)
        client.max_queued_messages_set(0)
        client.on_connect = self._handle_connect
        client.on_disconnect = self._handle_disconnect
        client.on_message = self._handle_message
        client.on_connect_fail = self._handle_connect_fail
        client.on_unsubscribe = lambda *_: self._unsubscribed.set()
        client.on_subscribe = self._handle_subscribe
        return client

    def _set_tls(self, client: mqtt.Client) -> None:
        """TLS with the broker's chain checked against ca_file (or the system CAs)."""
        spec = self.broker
        try:
            client.tls_set(
                ca_certs=spec.ca_file, certfile=spec.cert_file, keyfile=spec.key_file, keyfile_password=_no_key_password
            )
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError; never print file contents
            raise TransportError(f"broker TLS setup failed for {spec.redacted()}: {exc}") from None
        if spec.tls_insecure:
            client.tls_insecure_set(True)
            log.warning(
                "broker %s: tls_insecure is on, the server's host name is NOT checked "
                "(anyone with a certificate from this CA can pose as the broker)",
                spec.url,
            )

    def start(self, timeout: float | None = None) -> None:
        """Connect in the background; return once connected or raise TransportError after
        ``timeout`` seconds (default: the broker spec's ``connect_timeout_s``).

        What retrying cannot fix fails at once: bad credentials, not authorised, a broker
        certificate that does not verify against ca_file or does not match the url's host."""
        timeout = self.broker.connect_timeout_s if timeout is None else timeout
        host, port = self._addresses[self._index]
        self._client.connect_async(host, port, keepalive=self.broker.keepalive_s)
        self._client.loop_start()
        if self._settled.wait(timeout) and self.connected.is_set():
            return
        self._client.loop_stop()
        if self._fatal is not None:
            raise TransportError(self._fatal)
        last = f" (last error: {self._last_error})" if self._last_error else ""
        hint = " (TLS: check the port, and cert_file/key_file if the broker requires one)" if self.broker.tls else ""
        raise TransportError(f"could not connect to {' or '.join(self.broker.urls)} within {timeout:.0f} s{last}{hint}")

    def publish(
        self, topic: str, payload: bytes, *, retain: bool = False, tag: str | None = None
    ) -> mqtt.MQTTMessageInfo:
        info = self._client.publish(topic, payload, qos=QOS, retain=retain)
        if info.rc not in (mqtt.MQTT_ERR_SUCCESS, mqtt.MQTT_ERR_NO_CONN):
            raise TransportError(f"publish to {topic} failed: {mqtt.error_string(info.rc)}")
        self.meter.record("up", topic, len(payload), tag)
        return info

    def subscribe(self, topic: str) -> None:
        """Add a subscription (kept across reconnects); the broker sends its retained message."""
        if topic not in self.subscriptions:
            self.subscriptions.append(topic)
            if self.connected.is_set():
                self._client.subscribe(topic, qos=QOS)

    def unsubscribe(self, topic: str) -> None:
        if topic in self.subscriptions:
            self.subscriptions.remove(topic)
            self._client.unsubscribe(topic)

    def publish_status(self, state: str, **extra: object) -> mqtt.MQTTMessageInfo:
        """Retained status; ``extra`` fields are remembered and repeated in later statuses."""
        self.status_fields.update(extra)
        payload = _status_payload(state, **self.status_fields)
        return self.publish(self.status_topic, payload, retain=True, tag="status")

    def close(self, final_state: str = "stopped", timeout: float = 5.0) -> None:
        """Publish the final status, flush, disconnect."""
        self._closing = True
        if self.connected.is_set():
            try:
                self.publish_status(final_state).wait_for_publish(timeout)
            except (TransportError, RuntimeError, ValueError) as exc:
                log.warning("final status not delivered: %s", exc)
            self._quiesce(timeout)
        was_connected = self.connected.is_set()
        self._disconnected.clear()
        self._client.disconnect()
        # The DISCONNECT packet goes out on paho's loop thread: stopping the loop before it is
        # written closes the socket bare, and the broker then publishes the last-will "dead".
        if was_connected and not self._disconnected.wait(timeout):
            log.warning("broker did not see a clean disconnect within %.0f s", timeout)
        self._client.loop_stop()

    def _quiesce(self, timeout: float) -> None:
        """Stop the broker's deliveries before disconnecting: once the UNSUBACK is read, nothing
        unread is left on the socket, so closing it sends FIN, not RST (a reset can drop the
        DISCONNECT, and the broker would then publish the last-will "dead")."""
        if not self.subscriptions:
            return
        self._unsubscribed.clear()
        self._client.unsubscribe(list(self.subscriptions))
        if not self._unsubscribed.wait(timeout):
            log.warning("broker did not acknowledge the unsubscribe within %.0f s", timeout)

    def _handle_connect(self, client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            log.error("broker %s refused the connection: %s", self.url, reason_code)
            if reason_code.value in _PERMANENT_REFUSALS and not self._settled.is_set():
                self._fatal = f"broker {self.url} refused {self.broker.username or 'anonymous'}: {reason_code}"
                self._settled.set()
            return
        self._subscribe_all(client)
        self.publish_status("online")
        log.info("connected to %s as %s", self.url, self.client_id)
        self.connects += 1
        self.connected.set()
        self._settled.set()

    def _subscribe_all(self, client: mqtt.Client) -> None:
        if self.subscriptions:
            client.subscribe([(topic, QOS) for topic in self.subscriptions])

    def _handle_subscribe(self, client, userdata, mid, reason_codes, properties) -> None:
        """A refused subscription is asked for again until the broker grants it: a NATS node
        whose JetStream is re-electing its leaders (a peer just died) refuses QoS 1
        subscriptions for a few seconds, and a device left without its subscriptions would
        wait for a round announcement that never reaches it."""
        refused = [code for code in reason_codes if code.is_failure]
        if not refused or self._closing:
            return
        delay = self.broker.reconnect_min_s * random.uniform(1.0, 2.0)
        log.warning(
            "broker %s refused %d of %d subscription(s) (%s); subscribing again in %.1f s",
            self.url,
            len(refused),
            len(reason_codes),
            refused[0],
            delay,
        )
        retry = threading.Timer(delay, self._retry_subscribe)
        retry.daemon = True
        retry.start()

    def _retry_subscribe(self) -> None:
        if self.connected.is_set() and not self._closing:  # else the next on_connect subscribes
            self._subscribe_all(self._client)

    def _handle_connect_fail(self, client, userdata) -> None:
        # paho calls this from inside its ``except OSError`` around a connection attempt, so
        # the failure is the exception being handled (paho passes it no other way).
        exc = sys.exc_info()[1]
        if exc is None:
            return
        self._last_error = str(exc) or type(exc).__name__
        if len(self._addresses) > 1:
            self._last_error = f"{self.url}: {self._last_error}"
        if isinstance(exc, ssl.SSLCertVerificationError):  # retrying will not fix a certificate
            reason = f"TLS to {self.url}: broker certificate rejected: {exc.verify_message or exc}"
            log.warning("%s (ca_file=%s)", reason, self.broker.ca_file or "<system CAs>")
            if not self._settled.is_set():
                self._fatal = reason
                self._settled.set()
        self._fail_over(client)

    def _handle_disconnect(self, client, userdata, flags, reason_code, properties) -> None:
        self.connected.clear()
        self._disconnected.set()
        if reason_code != 0:
            # Jitter the first retry (paho doubles it from there): a fleet that lost the same
            # broker must not reconnect in one burst when it comes back.
            first = self.broker.reconnect_min_s * random.uniform(0.5, 1.5)
            client.reconnect_delay_set(first, max(first, self.broker.reconnect_max_s))
            lost = self.url
            self._fail_over(client)
            log.warning("disconnected from %s (%s); reconnecting to %s in %.1f s", lost, reason_code, self.url, first)

    def _fail_over(self, client: mqtt.Client) -> None:
        """Aim paho's next reconnect at the next url of the list (nothing to do with one url).

        Called on paho's loop thread after the socket is closed: ``connect_async`` only
        records the new address, and paho's reconnect loop (its backoff included) uses it."""
        if len(self._addresses) < 2:
            return
        self._index = (self._index + 1) % len(self._addresses)
        host, port = self._addresses[self._index]
        client.connect_async(host, port, keepalive=self.broker.keepalive_s)

    def _handle_message(self, client, userdata, message: mqtt.MQTTMessage) -> None:
        payload = bytes(message.payload)
        size = self.meter.received(message.topic, payload, self.status_topic.rsplit("/", 1)[0])
        try:
            self._on_message(message.topic, payload, size)
        except Exception:
            log.exception("message handler failed on %s", message.topic)


# CONNACK refusals (as paho's MQTT 5 reason codes) that a retry cannot fix: unsupported
# protocol, client id rejected, bad user name or password, not authorised.
_PERMANENT_REFUSALS = frozenset({132, 133, 134, 135})


def _no_key_password() -> str:
    """Called by ssl only for an encrypted key_file: fail instead of prompting on a terminal."""
    raise ValueError(
        "key_file is encrypted; a daemon cannot prompt for its passphrase: store it unencrypted with mode 0600"
    )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _status_payload(state: str, **extra: object) -> bytes:
    return json.dumps({"state": state, "time": round(time.time(), 3), **extra}).encode()


def parse_status(payload: bytes) -> dict | None:
    """A status payload as a dict, or None if it is not one (never raises)."""
    try:
        value = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):  # RecursionError: deeply nested JSON
        return None
    return value if isinstance(value, dict) and isinstance(value.get("state"), str) else None
