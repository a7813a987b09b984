"""An in-process stand-in for the MQTT broker and ``MqttLink``, for simulations, benchmarks and tests.

The aggregator and the device daemons only see ``MqttLink``'s interface, so running them as
threads of one process needs just a broker with the MQTT behaviour they rely on: wildcard
subscriptions, retained messages (an empty retained payload deletes one), at-least-once
delivery in publish order on a per-session thread (as paho's network thread), clean sessions,
the last will on an abnormal end, and client id takeover as Mosquitto does it.  The meter
counts the PUBLISH packets a real broker would carry, so wire numbers stay comparable.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence

import paho.mqtt.client as mqtt

from fclcore.transport import MessageHandler, TransportError, WireMeter, _status_payload

log = logging.getLogger(__name__)

Will = tuple[str, bytes, bool]  # topic, payload, retain


def topic_matches(pattern: str, topic: str) -> bool:
    """MQTT 3.1.1 filter matching: ``+`` is one level (maybe empty), a final ``#`` any number
    of levels including none ("a/#" matches "a"); wildcards at the start never match "$" topics."""
    if topic.startswith("$") and pattern[:1] in ("+", "#"):
        return False
    levels, names = pattern.split("/"), topic.split("/")
    for i, level in enumerate(levels):
        if level == "#":
            return True
        if i >= len(names) or level not in ("+", names[i]):
            return False
    return len(levels) == len(names)


def check_filter(pattern: str) -> None:
    """A broker disconnects a client that subscribes to an invalid filter; here it is a bug: raise."""
    levels = pattern.split("/") if pattern else []
    if not levels or any(("+" in lv or "#" in lv) and len(lv) > 1 for lv in levels) or "#" in levels[:-1]:
        raise ValueError(f"invalid topic filter {pattern!r}")


def _check_topic(topic: str) -> None:
    if not topic or "+" in topic or "#" in topic:  # paho raises the same for a publish
        raise ValueError(f"invalid publish topic {topic!r}")


class Session:
    """One connected client: its filters, its will and the thread that delivers to it."""

    def __init__(
        self,
        broker: InProcessBroker,
        client_id: str,
        deliver: Callable[[str, bytes], None],
        will: Will | None,
        on_end: Callable[[Session], None] | None,
    ) -> None:
        self.broker, self.client_id, self.will = broker, client_id, will
        self.filters: list[str] = []
        self.alive = True
        self._deliver, self.on_end = deliver, on_end
        self.queue: queue.SimpleQueue[tuple[str, bytes] | None] = queue.SimpleQueue()  # unbounded: QoS 1 loses nothing
        self.thread = threading.Thread(target=self._run, name=f"inproc-{client_id}", daemon=True)

    def subscribe(self, pattern: str) -> None:
        self.broker._subscribe(self, pattern)

    def unsubscribe(self, pattern: str) -> None:
        with self.broker._lock:
            if pattern in self.filters:
                self.filters.remove(pattern)

    def publish(self, topic: str, payload: bytes, retain: bool = False) -> bool:
        """False if the session has ended (the message was not handed to the broker)."""
        return self.broker._publish(topic, payload, retain, self)

    def disconnect(self) -> None:
        """A clean DISCONNECT: the will is discarded."""
        self.broker._end(self, fire_will=False)

    def drop(self) -> None:
        """An abnormal end (socket gone, keepalive missed): the broker publishes the will."""
        self.broker._end(self, fire_will=True)

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            if item is None or not self.alive:  # a disconnected session receives nothing more
                return
            try:
                self._deliver(*item)
            except Exception:  # like paho's network thread, survive a handler bug
                log.exception("delivery to %s failed on %s", self.client_id, item[0])


class InProcessBroker:
    """A thread-safe in-memory MQTT broker (QoS 1, clean sessions, retained messages, wills).

    Messages are routed under one lock, so each subscriber sees every publisher's messages in
    publish order; a message matching several filters of one session is delivered once to it."""

    def __init__(self) -> None:
        self._lock = threading.RLock()  # re-entered when an ending session publishes its will
        self._sessions: dict[str, Session] = {}
        self._retained: dict[str, bytes] = {}
        self._threads: list[threading.Thread] = []
        self._stopped = False

    def connect(
        self,
        client_id: str,
        deliver: Callable[[str, bytes], None],
        *,
        will: Will | None = None,
        on_end: Callable[[Session], None] | None = None,
    ) -> Session:
        """A new session; a live one with the same id is taken over (ended abnormally: its will fires).
        ``on_end`` is called under the broker lock when the session ends, so it must not block."""
        with self._lock:
            if self._stopped:
                raise TransportError("the in-process broker is stopped")
            old = self._sessions.get(client_id)
            if old is not None:
                log.info("client id %s connected again: ending its old session", client_id)
                self._end(old, fire_will=True)
            session = Session(self, client_id, deliver, will, on_end)
            self._sessions[client_id] = session
            self._threads = [t for t in self._threads if t.is_alive()] + [session.thread]
            session.thread.start()
            return session

    def publish(self, topic: str, payload: bytes, retain: bool = False) -> None:
        """Publish as an anonymous client (tests, benchmarks)."""
        if not self._publish(topic, payload, retain, None):
            raise TransportError("the in-process broker is stopped")

    def retained(self, topic: str) -> bytes | None:
        with self._lock:
            return self._retained.get(topic)

    def kill(self, client_id: str) -> bool:
        """End a client's session abnormally (its will fires); False if it had none."""
        with self._lock:
            session = self._sessions.get(client_id)
            if session is not None:
                self._end(session, fire_will=True)
            return session is not None

    def sessions(self) -> list[str]:
        """The client ids with a live session."""
        with self._lock:
            return sorted(self._sessions)

    def stop(self, timeout: float = 2.0) -> None:
        """End every session (no wills: the broker itself is gone) and join the delivery threads."""
        with self._lock:
            self._stopped = True
            for session in list(self._sessions.values()):
                self._end(session, fire_will=False)
            threads = list(self._threads)
        deadline = time.monotonic() + timeout
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))

    def _publish(self, topic: str, payload: bytes, retain: bool, sender: Session | None) -> bool:
        _check_topic(topic)
        payload = bytes(payload)
        with self._lock:
            if self._stopped or (sender is not None and not sender.alive):
                return False
            if retain and payload:
                self._retained[topic] = payload
            elif retain:
                self._retained.pop(topic, None)  # still delivered to current subscribers, as in MQTT
            for session in self._sessions.values():
                if any(topic_matches(f, topic) for f in session.filters):
                    session.queue.put((topic, payload))
            return True

    def _subscribe(self, session: Session, pattern: str) -> None:
        check_filter(pattern)
        with self._lock:
            if not session.alive:
                return
            if pattern not in session.filters:
                session.filters.append(pattern)
            for topic, payload in self._retained.items():  # every SUBSCRIBE gets the retained matches
                if topic_matches(pattern, topic):
                    session.queue.put((topic, payload))

    def _end(self, session: Session, *, fire_will: bool) -> None:
        with self._lock:
            if not session.alive:
                return
            session.alive = False
            if self._sessions.get(session.client_id) is session:
                del self._sessions[session.client_id]
            session.queue.put(None)  # wakes the delivery thread so it can exit
            if fire_will and session.will is not None and not self._stopped:
                self._publish(*session.will, None)
            if session.on_end is not None:
                session.on_end(session)


class PublishInfo:
    """What ``publish`` returns, like paho's MQTTMessageInfo.  Published once the broker has it;
    a publish while disconnected gets rc MQTT_ERR_NO_CONN as with paho (``wait_for_publish``
    raises RuntimeError) and, as with paho, is still sent after the next connect."""

    def __init__(self, mid: int, rc: int = mqtt.MQTT_ERR_SUCCESS) -> None:
        self.mid, self.rc = mid, rc
        self._published = threading.Event()

    def is_published(self) -> bool:
        self._check()
        return self._published.is_set()

    def wait_for_publish(self, timeout: float | None = None) -> None:
        self._check()
        self._published.wait(timeout)

    def _check(self) -> None:
        if self.rc != mqtt.MQTT_ERR_SUCCESS:
            raise RuntimeError(f"Message publish failed: {mqtt.error_string(self.rc)}")


class InProcessLink:
    """Drop-in for ``MqttLink`` on an ``InProcessBroker``: status, last will, metering, resubscription.

    The connection does not come back by itself: ``drop()`` simulates a loss, ``reconnect()`` the
    return (what paho's automatic reconnect would do)."""

    def __init__(
        self,
        broker: InProcessBroker,
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
        self.connects = 0
        self.status_fields: dict[str, object] = {}
        self._on_message = on_message
        self._lock = threading.RLock()  # keeps this link's publishes in order with the offline queue
        self._session: Session | None = None
        self._offline: list[tuple[str, bytes, bool, PublishInfo]] = []
        self._mid = 0

    def start(self, timeout: float | None = None) -> None:
        """Connect; in-process this is immediate (``timeout`` is kept for MqttLink's signature)."""
        self._connect()

    def reconnect(self) -> None:
        """Connect again (a live session of this link is taken over, so its will fires)."""
        self._connect()

    def drop(self) -> None:
        """Lose the connection abnormally: the broker publishes the will "dead"."""
        session = self._session
        if session is not None:
            session.drop()

    def publish(self, topic: str, payload: bytes, *, retain: bool = False, tag: str | None = None) -> PublishInfo:
        _check_topic(topic)
        payload = bytes(payload)
        with self._lock:
            self._mid = self._mid % 65535 + 1
            info = PublishInfo(self._mid)
            if not self._send(topic, payload, retain, info):
                info.rc = mqtt.MQTT_ERR_NO_CONN
                self._offline.append((topic, payload, retain, info))
        self.meter.record("up", topic, len(payload), tag)
        return info

    def subscribe(self, topic: str) -> None:
        """Add a subscription (kept across reconnects); the broker sends its retained message."""
        with self._lock:
            if topic not in self.subscriptions:
                self.subscriptions.append(topic)
                if self._session is not None:
                    self._session.subscribe(topic)

    def unsubscribe(self, topic: str) -> None:
        with self._lock:
            if topic in self.subscriptions:
                self.subscriptions.remove(topic)
                if self._session is not None:
                    self._session.unsubscribe(topic)

    def publish_status(self, state: str, **extra: object) -> PublishInfo:
        """Retained status; ``extra`` fields are remembered and repeated in later statuses."""
        self.status_fields.update(extra)
        return self.publish(self.status_topic, _status_payload(state, **self.status_fields), retain=True, tag="status")

    def close(self, final_state: str = "stopped", timeout: float = 5.0) -> None:
        """Publish the final status, then disconnect cleanly (no will); no handler runs afterwards."""
        if self.connected.is_set():
            try:
                self.publish_status(final_state).wait_for_publish(timeout)
            except (TransportError, RuntimeError, ValueError) as exc:
                log.warning("final status not delivered: %s", exc)
        with self._lock:
            session, self._session = self._session, None
            self._offline.clear()
        self.connected.clear()
        if session is not None:
            session.disconnect()
            if session.thread is not threading.current_thread():
                session.thread.join(timeout)

    def _connect(self) -> None:
        """What MqttLink does on connect: will, subscriptions, "online", then the offline queue."""
        will = (self.status_topic, _status_payload("dead"), True)
        with self._lock:
            self._session = self.broker.connect(
                self.client_id, self._handle_message, will=will, on_end=self._handle_end
            )
            for topic in self.subscriptions:
                self._session.subscribe(topic)
            self.publish_status("online")
            offline, self._offline = self._offline, []
            for topic, payload, retain, info in offline:
                self._send(topic, payload, retain, info)
            self.connects += 1
            self.connected.set()
        log.info("connected to the in-process broker as %s", self.client_id)

    def _send(self, topic: str, payload: bytes, retain: bool, info: PublishInfo) -> bool:
        session = self._session
        if session is None or not session.publish(topic, payload, retain):
            return False
        info._published.set()
        return True

    def _handle_end(self, session: Session) -> None:
        if session is self._session:  # runs under the broker lock: must not take self._lock
            self.connected.clear()

    def _handle_message(self, topic: str, payload: bytes) -> None:
        size = self.meter.received(topic, payload, self.status_topic.rsplit("/", 1)[0])
        try:
            self._on_message(topic, payload, size)
        except Exception:  # a handler bug must not kill the delivery thread
            log.exception("message handler failed on %s", topic)


def link_factory(broker: InProcessBroker) -> Callable[..., InProcessLink]:
    """``MqttLink``'s constructor on ``broker``: the first argument (a BrokerSpec) is ignored."""

    def factory(
        _spec: object,
        client_id: str,
        *,
        status_topic: str,
        subscriptions: Sequence[str],
        on_message: MessageHandler,
        meter: WireMeter | None = None,
    ) -> InProcessLink:
        return InProcessLink(
            broker,
            client_id,
            status_topic=status_topic,
            subscriptions=subscriptions,
            on_message=on_message,
            meter=meter,
        )

    return factory
