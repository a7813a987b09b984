"""The in-process broker and link: MQTT semantics the services rely on, without a broker process."""

from __future__ import annotations

import logging
import queue
import threading
import time

import paho.mqtt.client as mqtt
import pytest

from fclcore.inproc import InProcessBroker, InProcessLink, check_filter, link_factory, topic_matches
from fclcore.transport import TransportError, parse_status, publish_packet_bytes

WAIT = 2.0  # seconds; everything here is delivered in milliseconds


class Inbox:
    """A message handler that queues what it gets, for waits with a timeout."""

    def __init__(self) -> None:
        self.queue: queue.Queue = queue.Queue()

    def __call__(self, topic: str, payload: bytes, size: int) -> None:
        self.queue.put((topic, payload, size))

    def take(self, n: int) -> list[tuple[str, bytes, int]]:
        try:
            return [self.queue.get(timeout=WAIT) for _ in range(n)]
        except queue.Empty:
            pytest.fail(f"fewer than {n} messages arrived within {WAIT} s")

    def until(self, topic: str) -> list[tuple[str, bytes, int]]:
        """Everything up to and including the first message on ``topic``."""
        got: list = []
        while not got or got[-1][0] != topic:
            got += self.take(1)
        return got


def states(messages, topic: str) -> list[str]:
    return [parse_status(p)["state"] for t, p, _ in messages if t == topic]


@pytest.fixture
def broker():
    b = InProcessBroker()
    yield b
    b.stop()


def open_link(broker: InProcessBroker, cid: str, subscriptions=(), inbox=None) -> InProcessLink:
    link = InProcessLink(
        broker,
        cid,
        status_topic=f"t/status/{cid}",
        subscriptions=subscriptions,
        on_message=inbox if inbox is not None else Inbox(),
    )
    link.start()
    return link


@pytest.mark.parametrize(
    "pattern,topic,expected",
    [
        ("a/b", "a/b", True),
        ("a/b", "a/c", False),
        ("a/b", "a/b/c", False),
        ("a/+", "a/b", True),
        ("a/+", "a/b/c", False),
        ("a/+", "a/", True),  # + matches an empty level
        ("+/+", "/x", True),
        ("+", "/x", False),
        ("a/+/c", "a/b/c", True),
        ("a/+/c", "a/b/d", False),
        ("a/#", "a", True),  # # includes the parent level
        ("a/#", "a/b/c", True),
        ("a/#", "b/c", False),
        ("#", "a/b/c", True),
        ("+/b/#", "x/b", True),
        ("+/b/#", "x/c/b", False),
        ("#", "$SYS/x", False),  # wildcards at the start never match $ topics
        ("$SYS/#", "$SYS/x", True),
    ],
)
def test_wildcard_matching(pattern, topic, expected):
    assert topic_matches(pattern, topic) is expected


@pytest.mark.parametrize("pattern", ["", "a/#/b", "a#", "a/b+", "a/+b/c"])
def test_invalid_filters_are_refused(broker, pattern):
    with pytest.raises(ValueError):
        check_filter(pattern)
    session = broker.connect("s", lambda t, p: None)
    with pytest.raises(ValueError):
        session.subscribe(pattern)


def test_retained_late_subscriber_replace_and_delete(broker):
    broker.publish("r/x", b"one", retain=True)
    broker.publish("r/x", b"two", retain=True)  # replaces
    broker.publish("r/y", b"other", retain=True)
    broker.publish("q/z", b"unrelated", retain=True)
    inbox = Inbox()
    open_link(broker, "late", ["r/+"], inbox)
    assert sorted((t, p) for t, p, _ in inbox.take(2)) == [("r/x", b"two"), ("r/y", b"other")]
    assert broker.retained("r/x") == b"two"

    broker.publish("r/x", b"", retain=True)  # deletes, and reaches current subscribers
    assert inbox.take(1)[0][:2] == ("r/x", b"")
    assert broker.retained("r/x") is None
    again = Inbox()
    open_link(broker, "later", ["r/+"], again)
    broker.publish("r/end", b"marker")
    assert [(t, p) for t, p, _ in again.until("r/end")] == [("r/y", b"other"), ("r/end", b"marker")]


def test_per_publisher_order_over_1000_messages(broker):
    inbox = Inbox()
    open_link(broker, "sub", ["o/#"], inbox)
    publishers = [open_link(broker, f"p{i}") for i in range(3)]
    go = threading.Barrier(len(publishers))

    def run(link: InProcessLink) -> None:
        go.wait()
        for i in range(1000):
            link.publish(f"o/{link.client_id}", str(i).encode())

    threads = [threading.Thread(target=run, args=(p,)) for p in publishers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    got = inbox.take(3000)
    for p in publishers:
        assert [int(m) for t, m, _ in got if t == f"o/{p.client_id}"] == list(range(1000))


def test_slow_subscriber_blocks_no_publisher_and_loses_nothing(broker):
    release, slow_got = threading.Event(), []

    def slow(topic: str, payload: bytes, size: int) -> None:
        if not slow_got:  # stuck on the first message until released
            release.wait(WAIT)
        slow_got.append(payload)

    fast = Inbox()
    open_link(broker, "slow", ["d"], slow)
    open_link(broker, "fast", ["d"], fast)
    pub = open_link(broker, "pub")
    started = time.monotonic()
    infos = [pub.publish("d", str(i).encode()) for i in range(500)]
    assert time.monotonic() - started < WAIT / 2 and all(i.is_published() for i in infos)
    assert [p for _, p, _ in fast.take(500)] == [str(i).encode() for i in range(500)]
    assert slow_got == []  # still stuck on the first message while the others went through
    release.set()
    deadline = time.monotonic() + WAIT
    while len(slow_got) < 500 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert slow_got == [str(i).encode() for i in range(500)]


def test_last_will_on_drop_and_kill_not_on_close(broker):
    watch = Inbox()
    watcher = open_link(broker, "watch", ["t/status/+"], watch)
    watch.until("t/status/watch")
    dropped, killed, closed = (open_link(broker, cid) for cid in ("dropped", "killed", "closed"))
    dropped.drop()
    assert broker.kill("killed") and not broker.kill("nobody")
    closed.close()
    assert not (dropped.connected.is_set() or killed.connected.is_set() or closed.connected.is_set())
    watcher.publish("t/status/marker", b"{}")  # a will fires before drop()/kill() return: it precedes this
    got = watch.until("t/status/marker")
    assert states(got, "t/status/dropped") == ["online", "dead"]
    assert states(got, "t/status/killed") == ["online", "dead"]
    assert states(got, "t/status/closed") == ["online", "stopped"]
    assert parse_status(broker.retained("t/status/closed"))["state"] == "stopped"
    assert broker.sessions() == ["watch"]


def test_client_id_takeover_fires_the_old_sessions_will(broker):
    watch = Inbox()
    open_link(broker, "watch", ["t/status/+"], watch)
    old_inbox, new_inbox = Inbox(), Inbox()
    old = open_link(broker, "dev", ["x"], old_inbox)
    new = open_link(broker, "dev", ["x"], new_inbox)
    assert new.connected.is_set() and not old.connected.is_set()
    assert broker.sessions() == ["dev", "watch"]
    assert states(watch.until("t/status/dev") + watch.take(2), "t/status/dev") == ["online", "dead", "online"]
    assert parse_status(broker.retained("t/status/dev"))["state"] == "online"
    broker.publish("x", b"after")
    assert new_inbox.until("x")[-1][1] == b"after"
    assert old.publish("x", b"from-old").rc == mqtt.MQTT_ERR_NO_CONN  # its session is gone
    assert old_inbox.queue.empty()


def test_meter_matches_publish_packet_bytes_both_ways(broker):
    inbox = Inbox()
    rx = open_link(broker, "rx", ["t/status/+", "data/#"], inbox)
    tx = open_link(broker, "tx")
    sent = [("data/a", b"x" * 10), ("data/b", b"y" * 200), ("data/long/" + "z" * 50, b"w" * 20_000)]
    for i, (topic, payload) in enumerate(sent):
        tx.publish(topic, payload, tag=f"update:{i}")
    got = inbox.take(5)  # its own "online", tx's "online", three data messages
    assert [t for t, _, _ in got] == ["t/status/rx", "t/status/tx"] + [t for t, _ in sent]
    assert all(size == publish_packet_bytes(t, len(p)) for t, p, size in got)

    down = rx.meter.snapshot()
    assert down["down"] == {"packets": 5, "bytes": sum(s for _, _, s in got), "payload": sum(len(p) for _, p, _ in got)}
    assert down["by_tag"]["down:status"]["bytes"] == sum(s for t, _, s in got[:2])
    assert "down:status" not in tx.meter.snapshot()["by_tag"]

    up = tx.meter.snapshot()
    status_size = publish_packet_bytes("t/status/tx", len(got[1][1]))
    assert up["up"]["packets"] == 4
    assert up["up"]["bytes"] == status_size + sum(publish_packet_bytes(t, len(p)) for t, p in sent)
    assert up["by_tag"]["up:status"]["bytes"] == status_size
    assert up["by_tag"]["up:update:2"]["bytes"] == publish_packet_bytes(sent[2][0], 20_000)


def test_handler_exception_does_not_stop_later_deliveries(broker, caplog):
    inbox = Inbox()

    def handler(topic: str, payload: bytes, size: int) -> None:
        if payload == b"boom":
            raise RuntimeError("handler bug")
        inbox(topic, payload, size)

    link = open_link(broker, "h", ["m"], handler)
    with caplog.at_level(logging.ERROR, logger="fclcore.inproc"):
        for payload in (b"a", b"boom", b"b"):
            broker.publish("m", payload)
        assert [p for _, p, _ in inbox.take(2)] == [b"a", b"b"]
    assert any("message handler failed on m" in r.getMessage() and r.exc_info for r in caplog.records)
    assert link.connected.is_set()


def test_reconnect_gets_retained_again_and_sends_what_queued_offline(broker):
    broker.publish("k/1", b"kept", retain=True)
    inbox, other = Inbox(), Inbox()
    open_link(broker, "other", ["up"], other)
    link = open_link(broker, "dev", ["k/#"], inbox)
    assert [(t, p) for t, p, _ in inbox.take(1)] == [("k/1", b"kept")]
    assert link.connects == 1

    link.drop()
    assert not link.connected.is_set()
    broker.publish("k/live", b"missed")  # not retained: a disconnected session never gets it
    info = link.publish("up", b"while-offline")  # queued and sent after the reconnect, as paho does
    assert info.rc == mqtt.MQTT_ERR_NO_CONN
    with pytest.raises(RuntimeError):
        info.wait_for_publish(0.1)

    link.reconnect()
    assert link.connected.is_set() and link.connects == 2
    broker.publish("k/end", b"marker")
    assert [(t, p) for t, p, _ in inbox.until("k/end")] == [("k/1", b"kept"), ("k/end", b"marker")]
    assert other.until("up")[-1][1] == b"while-offline"
    assert link.meter.snapshot()["up"]["packets"] == 3  # online, the offline publish (once), online again


def test_start_after_stop_raises_and_stop_ends_delivery_threads(broker):
    link = open_link(broker, "a", ["x"])
    assert any(t.name == "inproc-a" for t in threading.enumerate())
    started = time.monotonic()
    broker.stop()
    assert time.monotonic() - started < 1.0
    assert not any(t.name.startswith("inproc-") and t.is_alive() for t in threading.enumerate())
    assert not link.connected.is_set() and broker.sessions() == []
    with pytest.raises(TransportError):
        InProcessLink(broker, "b", status_topic="t/status/b", subscriptions=[], on_message=Inbox()).start()
    with pytest.raises(TransportError):
        link.reconnect()


def test_link_factory_has_mqttlinks_signature(broker):
    factory = link_factory(broker)
    inbox = Inbox()
    link = factory(object(), "f", status_topic="t/status/f", subscriptions=["t/status/+"], on_message=inbox)
    assert isinstance(link, InProcessLink)
    link.start()
    link.publish_status("training", round=3)
    got = inbox.take(2)
    assert [parse_status(p) | {"time": 0} for _, p, _ in got] == [
        {"state": "online", "time": 0},
        {"state": "training", "time": 0, "round": 3},
    ]
    link.close()
    assert parse_status(broker.retained("t/status/f")) | {"time": 0} == {"state": "stopped", "time": 0, "round": 3}


def test_overlapping_filters_deliver_a_message_once(broker):
    inbox = Inbox()
    open_link(broker, "o", ["a/#", "a/+", "a/b", "end"], inbox)
    broker.publish("a/b", b"once")
    broker.publish("end", b"marker")
    assert [(t, p) for t, p, _ in inbox.until("end")] == [("a/b", b"once"), ("end", b"marker")]


def test_nothing_is_delivered_after_the_session_ends(broker):
    entered, release, got = threading.Event(), threading.Event(), []

    def blocked(topic: str, payload: bytes, size: int) -> None:
        entered.set()
        release.wait(WAIT)
        got.append(payload)

    link = open_link(broker, "d", ["q"], blocked)
    for payload in (b"1", b"2", b"3"):
        broker.publish("q", payload)
    assert entered.wait(WAIT)
    link.drop()  # 2 and 3 are still queued for the ended session
    release.set()
    broker.stop()  # joins the delivery thread
    assert got == [b"1"]
