"""Broker security against real Mosquitto processes on free loopback ports.

The shipped ``deploy/mosquitto/mosquitto.conf`` and ``acl`` run as shipped, with only the
listener ports, file paths and log destination rewritten; certificates come from the
shipped ``scripts/make-dev-certs.sh`` and passwords from ``mosquitto_passwd``, as the
deploy README tells an operator to make them.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from support.mosquitto import Mosquitto
from support.timescale import scaled

from fclcore import topics
from fclcore.codec import CodecLimits
from fclcore.config import ConfigError, load_config
from fclcore.schema import BrokerSpec, ClientConfig, WireSpec, parse_broker_url
from fclcore.transport import MqttLink, TransportError, parse_status

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "mosquitto"
ACL = DEPLOY / "acl"
MAKE_CERTS = ROOT / "scripts" / "make-dev-certs.sh"
FED = "f"
PASSWORDS = {"c0": "pw-c0", "c1": "pw-c1", "aggregator": "pw-aggregator"}

ROUND = topics.round_topic(FED)
KB0, KB1 = topics.knowledge_topic(FED, "c0"), topics.knowledge_topic(FED, "c1")
KBF0, KBF1 = topics.knowledge_full_topic(FED, "c0"), topics.knowledge_full_topic(FED, "c1")
UP0, UP1 = topics.update_topic(FED, "c0"), topics.update_topic(FED, "c1")
ST0, ST1 = topics.status_topic(FED, "c0"), topics.status_topic(FED, "c1")
ST_AGG = topics.status_topic(FED, topics.AGGREGATOR_ID)
NACK0, NACK1 = topics.nack_topic(FED, "c0"), topics.nack_topic(FED, "c1")
DOWN0, DOWN1 = topics.downlink_topic(FED, "c0"), topics.downlink_topic(FED, "c1")


# ------------------------------------------------------------------ helpers


class Inbox:
    """A message handler that records (topic, payload) and lets a test wait for one."""

    def __init__(self) -> None:
        self.items: list[tuple[str, bytes]] = []
        self._cond = threading.Condition()

    def __call__(self, topic: str, payload: bytes, size: int) -> None:
        with self._cond:
            self.items.append((topic, payload))
            self._cond.notify_all()

    def wait_for(self, match: Callable[[str, bytes], bool], timeout: float = 10.0) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: any(match(t, p) for t, p in self.items), timeout)

    def wait_payload(self, topic: str, payload: bytes, timeout: float = 10.0) -> bool:
        return self.wait_for(lambda t, p: t == topic and p == payload, timeout)

    def wait_state(self, topic: str, state: str, timeout: float = 10.0) -> bool:
        return self.wait_for(lambda t, p: t == topic and (parse_status(p) or {}).get("state") == state, timeout)

    def topics(self) -> set[str]:
        with self._cond:
            return {t for t, _ in self.items}

    def payloads(self, topic: str | None = None) -> list[bytes]:
        with self._cond:
            return [p for t, p in self.items if topic is None or t == topic]


class Links:
    """Makes MqttLinks with the test users' credentials and closes them after the test."""

    def __init__(self) -> None:
        self.opened: list[MqttLink] = []

    def make(
        self,
        url: str,
        user: str | None,
        *,
        who: str | None = None,
        subs: tuple[str, ...] = (),
        inbox: Inbox | None = None,
        password: str | None = None,
        **tls: object,
    ) -> MqttLink:
        spec = BrokerSpec(
            url=url,
            username=user,
            password=password or PASSWORDS.get(user or ""),
            keepalive_s=5,
            reconnect_min_s=0.1,
            reconnect_max_s=0.5,
            **tls,
        )
        who = who or user or "anonymous"
        link = MqttLink(
            spec,
            f"test-{who}-{len(self.opened)}",
            status_topic=topics.status_topic(FED, who),
            subscriptions=list(subs),
            on_message=inbox or (lambda *a: None),
        )
        self.opened.append(link)
        return link

    def open(self, *args, timeout: float = 10.0, **kwargs) -> MqttLink:
        link = self.make(*args, **kwargs)
        link.start(timeout)
        return link

    def close_all(self) -> None:
        """Close every link while its broker still runs: a link that has not seen its broker go
        would wait out its final status (5 s) and its clean disconnect (5 s) in the teardown."""
        while self.opened:
            self.opened.pop().close()


def _rewrite_shipped_conf(*, port: int, tls_port: int, passwd: Path, pki: Path, db: Path) -> str:
    """The shipped mosquitto.conf with only ports, paths and logging changed for a test.

    Every rewritten line must exist exactly once, so a change to the shipped file's shape
    fails here instead of silently testing something else."""
    rewrites = {
        "password_file /etc/mosquitto/fcl/passwd": f"password_file {passwd}",
        "acl_file /etc/mosquitto/fcl/acl": f"acl_file {ACL}",  # the shipped ACL, verbatim
        "persistence_location /var/lib/mosquitto/": f"persistence_location {db}",
        "cafile /etc/mosquitto/certs/ca.crt": f"cafile {pki / 'ca.crt'}",
        "certfile /etc/mosquitto/certs/server.crt": f"certfile {pki / 'server.crt'}",
        "keyfile /etc/mosquitto/certs/server.key": f"keyfile {pki / 'server.key'}",
        "listener 8883": f"listener {tls_port} 127.0.0.1",
        "#listener 1883 127.0.0.1": f"listener {port} 127.0.0.1",  # the optional aggregator listener, enabled
        "log_dest syslog": "log_dest stdout",
    }
    lines = (DEPLOY / "mosquitto.conf").read_text().splitlines()
    for old in rewrites:
        assert lines.count(old) == 1, f"shipped mosquitto.conf: expected one line {old!r}"
    out = [rewrites.get(line, line) for line in lines]
    if os.geteuid() == 0:
        out.append("user root")  # as root it would drop to "mosquitto", who cannot read pytest's tmp dirs
    return "\n".join(out) + "\n"


class ShippedMosquitto(Mosquitto):
    """The shipped configuration: TLS listener on ``tls_port``, loopback plain listener on ``port``."""

    def __init__(self, workdir: Path, passwd: Path, pki: Path) -> None:
        super().__init__(
            workdir,
            password_file=passwd,
            acl_file=ACL,
            persistence_dir=workdir / "db",
            tls=(pki / "ca.crt", pki / "server.crt", pki / "server.key"),
        )
        self._pki = pki

    def config_text(self) -> str:
        assert self.persistence_dir is not None and self.password_file is not None
        return _rewrite_shipped_conf(
            port=self.port, tls_port=self.tls_port, passwd=self.password_file, pki=self._pki, db=self.persistence_dir
        )


def _require(tool: str) -> str:
    path = shutil.which(tool) or next((p for p in (f"/usr/bin/{tool}", f"/usr/sbin/{tool}") if Path(p).exists()), None)
    if path is None:
        pytest.fail(f"{tool} is not installed (apt-get install mosquitto openssl)")
    return path


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """Two unrelated CAs made by the shipped script: good/ (server cert for localhost and
    127.0.0.1, client certs c0 and aggregator) and other/ (server cert for broker.example)."""
    _require("openssl")
    base = tmp_path_factory.mktemp("pki")
    for name, servers, clients in (
        ("good", "localhost,127.0.0.1", ["c0", "aggregator"]),
        ("other", "broker.example", ["c0"]),
    ):
        done = subprocess.run(
            ["bash", str(MAKE_CERTS), str(base / name), servers, *clients],
            check=False,
            capture_output=True,
            text=True,
            timeout=scaled(60),
        )
        assert done.returncode == 0, done.stderr
    return base


@pytest.fixture(scope="module")
def passwd(tmp_path_factory) -> Path:
    tool = _require("mosquitto_passwd")
    path = tmp_path_factory.mktemp("auth") / "passwd"
    for i, (user, password) in enumerate(PASSWORDS.items()):
        create = [] if i else ["-c"]
        subprocess.run(
            [tool, *create, "-b", str(path), user, password], check=True, capture_output=True, timeout=scaled(30)
        )
    return path


@pytest.fixture
def links():
    made = Links()
    yield made
    made.close_all()


@pytest.fixture
def shipped(tmp_path, passwd, pki):
    _require("mosquitto")
    broker = ShippedMosquitto(tmp_path / "shipped", passwd, pki / "good").start()
    yield broker
    broker.stop()


def _tls(pki: Path, name: str = "good") -> dict:
    return {"ca_file": str(pki / name / "ca.crt")}


# ------------------------------------------------------------------ the shipped files


def test_shipped_conf_matches_the_code():
    conf = {}
    for line in (DEPLOY / "mosquitto.conf").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition(" ")
            conf.setdefault(key, value)
    assert conf["allow_anonymous"] == "false" and conf["persistence"] == "true"
    assert "password_file" in conf and "acl_file" in conf and conf["listener"] == "8883"
    frame = CodecLimits().max_frame_bytes
    assert frame == int(WireSpec().max_frame_mb * 2**20)
    assert int(conf["message_size_limit"]) >= frame, "frames the codec accepts would be dropped by the broker"
    # 1,000 devices x 4 messages per round x 5 rounds of slack at least; the default 1000 drops updates
    assert int(conf["max_queued_messages"]) >= 20_000
    assert int(conf["max_inflight_messages"]) >= 20


def test_make_dev_certs_writes_a_verifiable_chain(pki):
    good = pki / "good"
    for name in ("server", "c0", "aggregator"):
        done = subprocess.run(
            ["openssl", "verify", "-CAfile", str(good / "ca.crt"), str(good / f"{name}.crt")],
            check=False,
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert (good / f"{name}.key").stat().st_mode & 0o077 == 0, "private keys must be 0600"
    text = subprocess.run(
        ["openssl", "x509", "-in", str(good / "server.crt"), "-noout", "-text"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert "DNS:localhost" in text and "IP Address:127.0.0.1" in text
    bad = subprocess.run(
        ["bash", str(MAKE_CERTS), str(pki / "x"), "h", "no/slash"], check=False, capture_output=True, text=True
    )
    assert bad.returncode == 2 and "client id" in bad.stderr


# ------------------------------------------------------------------ ACL: what a device may write


# docs/protocol.md P-3.4
def test_device_writes_only_its_own_update_and_status(shipped, pki, links):
    agg_in, c1_in = Inbox(), Inbox()
    agg = links.open(
        shipped.url, "aggregator", subs=(topics.update_filter(FED), topics.status_filter(FED)), inbox=agg_in
    )
    links.open(shipped.tls_url, "c1", subs=(ROUND, KB1), inbox=c1_in, **_tls(pki))
    c0 = links.open(shipped.tls_url, "c0", **_tls(pki))

    c0.publish(UP0, b"update-1").wait_for_publish(5)
    for topic in (UP1, ROUND, KB1, ST1, ST_AGG):  # MQTT 3.1.1: acknowledged, then dropped
        c0.publish(topic, b"forged", retain=topic != UP1).wait_for_publish(5)
    c0.publish(UP0, b"marker").wait_for_publish(5)
    agg.publish(ROUND, b"round-marker", retain=True).wait_for_publish(5)

    assert agg_in.wait_payload(UP0, b"marker"), "the allowed update did not arrive"
    assert c1_in.wait_payload(ROUND, b"round-marker")
    assert agg_in.payloads(UP0) == [b"update-1", b"marker"]
    assert b"forged" not in agg_in.payloads() and b"forged" not in c1_in.payloads()
    late = Inbox()  # a forged retained message was not stored either
    links.open(shipped.tls_url, "c1", who="c1-late", subs=(ROUND,), inbox=late, **_tls(pki))
    assert late.wait_payload(ROUND, b"round-marker") and b"forged" not in late.payloads()


# ------------------------------------------------------------------ ACL: what a device may read


# docs/protocol.md P-3.4
def test_device_reads_only_the_round_and_its_own_kb(shipped, pki, links):
    agg = links.open(shipped.url, "aggregator")
    c1 = links.open(shipped.tls_url, "c1", **_tls(pki))
    agg.publish(KB1, b"kb-of-c1", retain=True).wait_for_publish(5)  # retained before c0 subscribes
    agg.publish(KB0, b"kb-of-c0", retain=True).wait_for_publish(5)
    agg.publish(KBF1, b"kb-full-of-c1", retain=True).wait_for_publish(5)
    agg.publish(KBF0, b"kb-full-of-c0", retain=True).wait_for_publish(5)
    c0_in = Inbox()
    links.open(
        shipped.tls_url,
        "c0",
        subs=(KB1, KBF1, f"fcl/{FED}/update/#", topics.status_filter(FED), "#", KB0, KBF0),
        inbox=c0_in,
        **_tls(pki),
    )  # Mosquitto grants every SUBSCRIBE and filters on delivery

    c1.publish(UP1, b"update-of-c1").wait_for_publish(5)
    agg.publish(KB1, b"kb-live-c1").wait_for_publish(5)
    agg.publish(ROUND, b"round-marker", retain=True).wait_for_publish(5)

    assert c0_in.wait_payload(ROUND, b"round-marker")
    assert c0_in.wait_payload(KB0, b"kb-of-c0")
    assert c0_in.wait_payload(KBF0, b"kb-full-of-c0")
    assert c0_in.topics() == {ROUND, KB0, KBF0}, f"c0 read more than it may: {c0_in.topics()}"


def test_a_device_reads_only_its_own_nacks_and_writes_none(shipped, pki, links):
    """P-NACK-1: only the aggregator writes fcl/<fed>/nack/<id>, and only <id> reads it."""
    agg = links.open(shipped.url, "aggregator")
    c0_in, c1_in = Inbox(), Inbox()
    links.open(shipped.tls_url, "c0", subs=(NACK1, f"fcl/{FED}/nack/+", NACK0), inbox=c0_in, **_tls(pki))
    c1 = links.open(shipped.tls_url, "c1", subs=(NACK1,), inbox=c1_in, **_tls(pki))
    c1.publish(NACK0, b"forged-nack").wait_for_publish(5)  # acknowledged and dropped
    agg.publish(NACK1, b"nack-for-c1").wait_for_publish(5)
    agg.publish(NACK0, b"nack-for-c0").wait_for_publish(5)

    assert c0_in.wait_payload(NACK0, b"nack-for-c0") and c1_in.wait_payload(NACK1, b"nack-for-c1")
    assert c0_in.payloads() == [b"nack-for-c0"], f"c0 read more than its own NACK: {c0_in.items}"


def test_a_device_reads_only_its_own_downlink_topic_and_writes_none(shipped, pki, links):
    """P-CAP-2: only the aggregator writes fcl/<fed>/down/<id> (and its chunks), only <id> reads it."""
    agg = links.open(shipped.url, "aggregator")
    c0_in, c1_in = Inbox(), Inbox()
    c0_subs = (DOWN1, f"fcl/{FED}/down/+", f"fcl/{FED}/down/#", DOWN0, f"{DOWN0}/chunk/0")
    links.open(shipped.tls_url, "c0", subs=c0_subs, inbox=c0_in, **_tls(pki))
    c1 = links.open(shipped.tls_url, "c1", subs=(DOWN1,), inbox=c1_in, **_tls(pki))
    c1.publish(DOWN0, b"forged-round", retain=True).wait_for_publish(5)  # acknowledged and dropped
    agg.publish(DOWN1, b"round-for-c1", retain=True).wait_for_publish(5)
    agg.publish(f"{DOWN1}/chunk/0", b"chunk-for-c1", retain=True).wait_for_publish(5)
    agg.publish(f"{DOWN0}/chunk/0", b"chunk-for-c0", retain=True).wait_for_publish(5)
    agg.publish(DOWN0, b"round-for-c0", retain=True).wait_for_publish(5)

    assert c0_in.wait_payload(DOWN0, b"round-for-c0") and c1_in.wait_payload(DOWN1, b"round-for-c1")
    assert c0_in.wait_payload(f"{DOWN0}/chunk/0", b"chunk-for-c0")
    assert c0_in.topics() == {DOWN0, f"{DOWN0}/chunk/0"}, f"c0 read more than its own: {c0_in.items}"
    assert b"forged-round" not in c0_in.payloads()


# ------------------------------------------------------------------ authentication


@pytest.mark.parametrize(
    "user,password",
    [("c0", "wrong"), ("nobody", "pw"), (None, None)],
    ids=["wrong-password", "unknown-user", "anonymous"],
)
def test_bad_credentials_are_refused_at_once(shipped, links, user, password):
    link = links.make(shipped.url, user, password=password or "")
    started = time.monotonic()
    with pytest.raises(TransportError, match=r"refused .*(Not authorized|Bad user name or password)"):
        link.start(10)
    assert time.monotonic() - started < 5, "a refusal must not wait for the start timeout"
    assert "wrong" not in str(link._fatal)  # the password is never in the error


# ------------------------------------------------------------------ last will

_DEVICE = """
import sys, time
from fclcore.schema import BrokerSpec
from fclcore.transport import MqttLink
url, user, password, ca, status = sys.argv[1:6]
spec = BrokerSpec(url=url, username=user, password=password, ca_file=ca, keepalive_s=5)
link = MqttLink(spec, "proc-" + status.replace("/", "-"), status_topic=status, subscriptions=[],
                on_message=lambda *a: None)
link.start(10)
print("ready", flush=True)
time.sleep(120)
"""


def _device_process(url: str, user: str, ca: Path, status: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen(
        [sys.executable, "-c", _DEVICE, url, user, PASSWORDS[user], str(ca), status],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )


def test_last_will_of_a_killed_device_is_delivered_on_its_own_status_only(shipped, pki, links):
    agg_in = Inbox()
    links.open(shipped.url, "aggregator", subs=(topics.status_filter(FED),), inbox=agg_in)
    ca = pki / "good" / "ca.crt"
    impostor = _device_process(shipped.tls_url, "c0", ca, ST1)  # c0's credentials, a will on c1's status
    honest = _device_process(shipped.tls_url, "c0", ca, ST0)
    try:
        ready = {
            name: proc.stdout.readline().strip() == "ready"
            for name, proc in (("impostor", impostor), ("honest", honest))
        }
        assert ready["honest"]
        assert agg_in.wait_state(ST0, "online")
        if ready["impostor"]:  # Mosquitto 2.0 accepts the connection and drops the will on delivery
            impostor.send_signal(signal.SIGKILL)
            impostor.wait(10)
            time.sleep(0.3)
        honest.send_signal(signal.SIGKILL)  # no DISCONNECT: the broker publishes the will
        honest.wait(10)
        assert agg_in.wait_state(ST0, "dead"), "the will of a killed device was not delivered"
        assert ST1 not in agg_in.topics(), "a device's will reached another device's status topic"
    finally:
        for proc in (impostor, honest):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


# ------------------------------------------------------------------ TLS


@pytest.fixture(scope="module")
def tls_broker(tmp_path_factory, passwd, pki):
    _require("mosquitto")
    good = pki / "good"
    broker = Mosquitto(
        tmp_path_factory.mktemp("tls"),
        password_file=passwd,
        acl_file=ACL,
        tls=(good / "ca.crt", good / "server.crt", good / "server.key"),
    ).start()
    yield broker
    broker.stop()


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_mqtts_link_connects_and_delivers_with_the_ca(tls_broker, pki, links, host):
    url = tls_broker.tls_url.replace("127.0.0.1", host)
    assert parse_broker_url(url)[1] == tls_broker.tls_port
    agg_in = Inbox()
    links.open(url, "aggregator", subs=(topics.update_filter(FED),), inbox=agg_in, **_tls(pki))
    links.open(url, "c0", **_tls(pki)).publish(UP0, b"over-tls").wait_for_publish(5)
    assert agg_in.wait_payload(UP0, b"over-tls")


@pytest.mark.parametrize("ca", ["system", "other"])
def test_mqtts_without_the_right_ca_fails_fast(tls_broker, pki, links, ca):
    tls = {} if ca == "system" else _tls(pki, "other")
    link = links.make(tls_broker.tls_url, "c0", **tls)
    started = time.monotonic()
    with pytest.raises(TransportError, match="certificate rejected: .*(unable to get local issuer|self.signed)"):
        link.start(10)
    assert time.monotonic() - started < 5
    assert not link.connected.is_set()


def test_host_name_is_checked_unless_tls_insecure(tmp_path, passwd, pki, links, caplog):
    other = pki / "other"  # its server certificate names broker.example, not 127.0.0.1
    broker = Mosquitto(
        tmp_path / "b",
        password_file=passwd,
        acl_file=ACL,
        tls=(other / "ca.crt", other / "server.crt", other / "server.key"),
    ).start()
    try:
        with pytest.raises(TransportError, match="(?i)(hostname|IP address) mismatch"):
            links.make(broker.tls_url, "c0", **_tls(pki, "other")).start(10)
        with caplog.at_level(logging.WARNING, logger="fclcore.transport"):
            link = links.open(broker.tls_url, "c0", tls_insecure=True, **_tls(pki, "other"))
        assert link.connected.is_set()
        assert any("host name is NOT checked" in r.getMessage() for r in caplog.records)
    finally:
        links.close_all()
        broker.stop()


def test_require_certificate(tmp_path, passwd, pki, links):
    good, other = pki / "good", pki / "other"
    broker = Mosquitto(
        tmp_path / "b",
        password_file=passwd,
        acl_file=ACL,
        require_certificate=True,
        tls=(good / "ca.crt", good / "server.crt", good / "server.key"),
    ).start()
    try:
        with pytest.raises(TransportError, match="could not connect"):
            links.make(broker.tls_url, "c0", **_tls(pki)).start(1.5)
        foreign = {"cert_file": str(other / "c0.crt"), "key_file": str(other / "c0.key")}
        with pytest.raises(TransportError, match="could not connect"):
            links.make(broker.tls_url, "c0", **_tls(pki), **foreign).start(1.5)
        own = {"cert_file": str(good / "c0.crt"), "key_file": str(good / "c0.key")}
        assert links.open(broker.tls_url, "c0", **_tls(pki), **own).connected.is_set()
    finally:
        links.close_all()
        broker.stop()


def test_tls_setup_errors_never_show_key_contents(pki, tmp_path):
    good = pki / "good"
    secret = (good / "server.key").read_text()
    spec = BrokerSpec(
        url="mqtts://127.0.0.1:1",
        ca_file=str(good / "ca.crt"),
        cert_file=str(good / "c0.crt"),
        key_file=str(good / "server.key"),
    )  # key of another cert
    with pytest.raises(TransportError, match="TLS setup failed") as info:
        MqttLink(spec, "x", status_topic="x/status", subscriptions=[], on_message=lambda *a: None)
    assert "PRIVATE KEY" not in str(info.value) and secret not in str(info.value)
    encrypted = tmp_path / "enc.key"
    subprocess.run(
        ["openssl", "pkey", "-in", str(good / "c0.key"), "-aes256", "-passout", "pass:pw", "-out", str(encrypted)],
        check=True,
        capture_output=True,
    )
    spec = BrokerSpec(
        url="mqtts://127.0.0.1:1", ca_file=str(good / "ca.crt"), cert_file=str(good / "c0.crt"), key_file=str(encrypted)
    )
    with pytest.raises(TransportError, match="encrypted"):  # instead of prompting on a terminal
        MqttLink(spec, "x", status_topic="x/status", subscriptions=[], on_message=lambda *a: None)
    red = BrokerSpec(
        url="mqtts://h",
        username="u",
        password="s3cret",
        ca_file=str(good / "ca.crt"),
        cert_file=str(good / "c0.crt"),
        key_file=str(good / "c0.key"),
    ).redacted()
    assert red["password"] == "***" and red["key_file"] == str(good / "c0.key")
    assert "s3cret" not in repr(red) and "PRIVATE KEY" not in repr(red)


# ------------------------------------------------------------------ BrokerSpec validation


def test_broker_url_schemes():
    assert parse_broker_url("mqtts://broker.local") == ("broker.local", 8883)
    assert parse_broker_url("mqtts://broker.local:9883") == ("broker.local", 9883)
    assert parse_broker_url("mqtt://broker.local") == ("broker.local", 1883)
    assert BrokerSpec(url="mqtts://broker.local").redacted()["ca_file"] == "<system CAs>"
    assert "ca_file" not in BrokerSpec().redacted()  # plain mqtt:// stays as it was


@pytest.mark.parametrize(
    "fields,expected",
    [
        ({"url": "mqtts://h", "ca_file": "/nonexistent/ca.crt"}, "ca_file: expected an existing PEM file"),
        ({"url": "mqtts://h", "cert_file": "CERT"}, "key_file: a client certificate needs both"),
        ({"url": "mqtts://h", "key_file": "KEY"}, "cert_file: a client certificate needs both"),
        (
            {"url": "mqtts://h", "cert_file": "CERT", "key_file": "/nonexistent/c0.key"},
            "key_file: expected an existing PEM file",
        ),
        ({"url": "mqtt://h", "ca_file": "CA"}, "ca_file: TLS settings need an mqtts:// url"),
        ({"url": "mqtt://h", "tls_insecure": True}, "tls_insecure: TLS settings need an mqtts:// url"),
        ({"url": "mqtts://c0:s3cret@h"}, "credentials go in broker.username"),
        ({"url": "tls://c0:s3cret@h"}, "credentials go in broker.username"),
        ({"url": "tls://h"}, "expected mqtt://host[:port] or mqtts://host[:port]"),
    ],
    ids=[
        "missing-ca",
        "cert-without-key",
        "key-without-cert",
        "missing-key",
        "ca-on-plain",
        "insecure-on-plain",
        "password-in-url",
        "password-in-bad-url",
        "bad-scheme",
    ],
)
def test_broker_spec_errors_are_one_clear_line(tmp_path, pki, fields, expected):
    files = {"CA": pki / "good" / "ca.crt", "CERT": pki / "good" / "c0.crt", "KEY": pki / "good" / "c0.key"}
    fields = {k: str(files.get(v, v)) if isinstance(v, str) else v for k, v in fields.items()}
    with pytest.raises(ValueError) as direct:
        BrokerSpec(**fields)
    assert expected in str(direct.value)
    path = tmp_path / "client.yaml"
    path.write_text("client_id: c0\nfederation: f\ndata: {}\nbroker: " + json.dumps(fields) + "\n")
    with pytest.raises(ConfigError) as loaded:
        load_config(ClientConfig, path)
    message = str(loaded.value)
    assert "\n" not in message and str(path) in message and "broker" in message and expected in message
    assert "s3cret" not in message


# ------------------------------------------------------------------ kill and restart


def test_links_reconnect_after_kill_and_restart_and_retained_state_survives(tmp_path, passwd, links):
    broker = Mosquitto(tmp_path / "b", password_file=passwd, acl_file=ACL, persistence_dir=tmp_path / "db").start()
    try:
        agg_in = Inbox()
        agg = links.open(broker.url, "aggregator", subs=(topics.update_filter(FED),), inbox=agg_in)
        dev = links.open(broker.url, "c0")
        dev.publish(UP0, b"before").wait_for_publish(5)
        assert agg_in.wait_payload(UP0, b"before")
        published = time.time()
        agg.publish(ROUND, b"round-1", retain=True).wait_for_publish(5)
        db = tmp_path / "db" / "mosquitto.db"
        deadline = time.monotonic() + 10  # autosave_interval is 1 s: wait until the retained message is on disk
        while not (db.exists() and db.stat().st_mtime > published) and time.monotonic() < deadline:
            time.sleep(0.1)

        broker.kill()
        assert not broker.running
        deadline = time.monotonic() + 5
        while (dev.connected.is_set() or agg.connected.is_set()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not dev.connected.is_set() and not agg.connected.is_set(), "a link did not notice the broker died"
        broker.restart()
        for link in (agg, dev):
            assert link.connected.wait(10), "a link did not reconnect by itself"

        # the aggregator's SUBSCRIBE may still be on its way: publish until one gets through
        deadline = time.monotonic() + 10
        while True:
            dev.publish(UP0, b"after").wait_for_publish(5)
            if agg_in.wait_payload(UP0, b"after", timeout=0.5) or time.monotonic() > deadline:
                break
        assert agg_in.wait_payload(UP0, b"after", timeout=0), "no update after the restart (subscription not renewed?)"
        late = Inbox()
        links.open(broker.url, "c1", subs=(ROUND,), inbox=late)
        assert late.wait_payload(ROUND, b"round-1"), "the retained round did not survive kill + restart"
    finally:
        links.close_all()
        broker.stop()
