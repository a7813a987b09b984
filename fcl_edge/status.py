"""``fcl status``: the fleet as the broker's retained messages show it.

Read-only and light (paho, numpy for the codec; no torch): it connects with a random
client id and no last-will, subscribes to ``fcl/<fed>/status/+`` and ``fcl/<fed>/round``,
collects what arrives for ``--wait`` seconds, and prints one table per federation.
Every payload comes from the network, so nothing here may crash on it: a field that is
missing, of the wrong type or garbage is shown as ``?`` (``null`` in ``--json``).

The status payload (retained JSON on ``fcl/<fed>/status/<who>``, made by
``fclcore.transport._status_payload(state, **extra)``): ``STATUS_FIELDS`` below is the
contract.  ``state`` and ``time`` are always there; daemons add the rest through
``MqttLink.publish_status("online", task=..., round=..., ...)``.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

import paho.mqtt.client as mqtt

from fclcore import topics
from fclcore.capabilities import announced
from fclcore.codec import CodecError, CodecLimits, Kind, decode
from fclcore.errors import BrokerUnreachable
from fclcore.schema import parse_broker_url
from fclcore.transport import parse_status

STATUS_FIELDS: dict[str, str] = {
    "state": "online | stopped (clean shutdown) | dead (the broker's last-will) | another word the daemon uses",
    "time": "unix seconds when the daemon made the payload (for 'dead': when the session began)",
    "role": "client | aggregator",
    "task": "int: the task the device trains and serves / the aggregator's current task",
    "round": "int: the last round the client uploaded / the aggregator's round in progress",
    "bytes_up": "int: MQTT PUBLISH bytes the daemon sent since it started (WireMeter up.bytes)",
    "bytes_down": "int: MQTT PUBLISH bytes it received since it started (WireMeter down.bytes)",
    "version": "str: fcl-edge version",
    "health": "object (client): memory, last round's CPU, resyncs, its own byte meter, version (fclcore/health.py)",
    "expected": "list of str (aggregator): the devices of the round in progress; those with no status show as absent",
    "protocol": "int: the protocol version the daemon speaks (none: 1); also decodes (client), accepts (aggregator)",
    "nack": "object (client): the last NACK: why the aggregator dropped a frame of this device (docs/protocol.md)",
}
MAX_EXPECTED = 10_000  # ids in an aggregator's ``expected`` list; a longer list is garbage
MAX_STATUS_BYTES = 64 * 1024  # a status is a few hundred bytes; anything huge is garbage
ROUND_LIMITS = CodecLimits(max_frame_bytes=256 * 2**20)  # the largest frame WireSpec allows
UNKNOWN = "?"
ABSENT = "absent"  # expected by the aggregator, no status on the broker: never connected


@dataclass
class MemberStatus:
    """One daemon's retained status, sanitised: None wherever the payload did not say."""

    who: str
    state: str = UNKNOWN
    role: str | None = None
    task: int | None = None
    round: int | None = None
    bytes_up: int | None = None
    bytes_down: int | None = None
    status_time: float | None = None
    last_seen: float | None = None  # status_time, except for 'dead' (the will is written at connect)
    problem: str | None = None
    expected: list[str] | None = None  # the aggregator's: the devices of the round in progress
    nack: str | None = None  # a client's last NACK, as one line
    protocol: int | None = None  # the protocol version it says it speaks (None: it says none: 1)
    decodes: str | None = None  # what it says it does not decode (None: it decodes everything)


@dataclass
class RoundView:
    """The retained round announcement: the round in progress or the end of the run."""

    kind: str
    round: int
    task: int
    total_rounds: int | None = None
    attempt: int | None = None
    method: str | None = None
    sequence: int | None = None


@dataclass
class FederationView:
    name: str
    aggregator: MemberStatus | None = None
    round: RoundView | None = None
    clients: dict[str, MemberStatus] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


# -- payload parsing (never raises) ------------------------------------------------------------
def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63 else None


def _seconds(value: Any) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    return float(value) if ok else None


def _word(value: Any, limit: int = 32) -> str | None:
    return value if isinstance(value, str) and 0 < len(value) <= limit and value.isprintable() else None


def read_status(who: str, payload: bytes) -> MemberStatus:
    """A status payload as a MemberStatus; garbage gives state '?' and a ``problem``."""
    if len(payload) > MAX_STATUS_BYTES:
        return MemberStatus(who, problem=f"status payload of {len(payload)} bytes")
    try:
        raw = parse_status(payload)
    except RecursionError:  # deeply nested JSON; parse_status only catches ValueError
        raw = None
    if raw is None:
        return MemberStatus(who, problem="status payload is not a JSON object with a 'state' string")
    state = _word(raw.get("state"))
    status_time = _seconds(raw.get("time"))
    return MemberStatus(
        who,
        state=state or UNKNOWN,
        role=_word(raw.get("role")),
        task=_count(raw.get("task")),
        round=_count(raw.get("round")),
        bytes_up=_count(raw.get("bytes_up")),
        bytes_down=_count(raw.get("bytes_down")),
        status_time=status_time,
        last_seen=None if state == "dead" else status_time,
        problem=None if state else "state is not a short printable word",
        expected=_ids(raw.get("expected")),
        nack=nack_line(raw.get("nack")),
        protocol=_count(raw.get("protocol")),
        decodes=_lacks(raw),
    )


def _lacks(raw: dict) -> str | None:
    """What a device's status says it does not decode, in a few words (P-CAP-1)."""
    try:
        decodes = announced(raw)
    except (ValueError, TypeError):
        return "? (not a decodes object)"
    return None if decodes is None else decodes.brief()


def protocol_line(clients: dict[str, MemberStatus]) -> str:
    """The devices by the protocol version they speak (docs/protocol.md P-VER-5): what a rolling
    upgrade has reached.  A status that names none is a protocol-1 daemon's."""
    groups: dict[str, list[str]] = {}
    for who, s in sorted(clients.items()):
        if s.state != ABSENT:
            groups.setdefault(str(s.protocol) if s.protocol is not None else "1 (says none)", []).append(who)
    return "; ".join(f"protocol {v}: {', '.join(ids)}" for v, ids in sorted(groups.items()))


def nack_line(value: Any) -> str | None:
    """A device's last NACK (``edge_client.nacks``) as one printable line, or None."""
    if not isinstance(value, dict) or _word(value.get("reason")) is None:
        return None
    kind, rnd, detail = _word(value.get("kind")), _count(value.get("round")), value.get("detail")
    what = f"{kind} round {rnd}" if kind and rnd is not None else "a frame"
    text = detail[:120] if isinstance(detail, str) and detail.isprintable() else UNKNOWN
    return f"{what} dropped: {value['reason']}: {text}"


def _ids(value: Any) -> list[str] | None:
    """A list of valid client ids, or None for anything else."""
    if not isinstance(value, list) or len(value) > MAX_EXPECTED:
        return None
    try:
        return [topics.validate_id(v, "client id") for v in value]
    except ValueError:
        return None


def read_round(fed: str, payload: bytes) -> RoundView | str | None:
    """The round announcement's header and meta; None for the aggregator's other messages on
    the round topic (a REQUEST to re-send); else a one-line reason it is not an announcement."""
    try:
        frame = decode(payload, ROUND_LIMITS)
    except CodecError as exc:
        return f"round topic: not a frame: {exc}"
    h = frame.header
    if h.federation != fed or h.client != topics.AGGREGATOR_ID:
        return f"round topic: frame from {h.client!r} of {h.federation!r}"
    if h.kind is Kind.REQUEST:
        return None
    if h.kind not in (Kind.ROUND, Kind.FINISH):
        return f"round topic: {h.kind.name} frame"
    meta = frame.meta
    federation = meta.get("federation") if isinstance(meta.get("federation"), dict) else {}
    return RoundView(
        kind=h.kind.name.lower(),
        round=h.round,
        task=h.task,
        total_rounds=_count(meta.get("total_rounds")),
        attempt=_count(meta.get("attempt")),
        method=_word(federation.get("method"), 64),
        sequence=h.sequence,
    )


# -- collecting from the broker ------------------------------------------------------------------
class StatusError(BrokerUnreachable):
    """The broker could not be reached or refused us."""


@dataclass
class BrokerOptions:
    url: str
    username: str | None = None
    password: str | None = None
    ca_file: str | None = None
    connect_timeout_s: float = 5.0


def collect(options: BrokerOptions, federation: str | None, wait_s: float) -> list[tuple[str, bytes]]:
    """(topic, payload) of every message that arrived within ``wait_s`` of subscribing."""
    host, port = parse_broker_url(options.url)
    client = mqtt.Client(
        mqtt.CallbackAPIVersion.VERSION2,
        client_id=f"fcl-status-{uuid.uuid4().hex[:12]}",
        protocol=mqtt.MQTTv311,
        clean_session=True,
    )
    if options.username:
        client.username_pw_set(options.username, options.password)
    if options.url.startswith("mqtts://"):
        try:
            client.tls_set(ca_certs=options.ca_file)
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            raise ValueError(f"--ca-file {options.ca_file!r}: {exc}") from None
    fed = federation or "+"
    subscribed, refused = threading.Event(), []
    lock, received = threading.Lock(), []

    def on_connect(c, userdata, flags, reason_code, properties):
        if reason_code.is_failure:
            refused.append(str(reason_code))
            subscribed.set()
            return
        c.subscribe([(f"{topics.ROOT}/{fed}/status/+", 1), (f"{topics.ROOT}/{fed}/round", 1)])

    def on_message(c, userdata, message):
        with lock:
            received.append((message.topic, bytes(message.payload)))

    def on_connect_fail(c, userdata):  # paho calls this inside its ``except OSError``
        exc = sys.exc_info()[1]
        unreachable.append(getattr(exc, "strerror", None) or str(exc) or "connection failed")
        subscribed.set()

    unreachable: list[str] = []  # a refused or unresolvable address: retrying for the timeout would not help
    client.on_connect = on_connect
    client.on_connect_fail = on_connect_fail
    client.on_subscribe = lambda *args: subscribed.set()
    client.on_message = on_message
    try:
        client.connect_async(host, port, keepalive=30)
        client.loop_start()
        if not subscribed.wait(options.connect_timeout_s):
            raise StatusError(f"could not connect to {options.url} within {options.connect_timeout_s:g} s")
        if unreachable:
            raise StatusError(f"could not connect to {options.url}: {unreachable[0]}")
        if refused:
            raise StatusError(f"broker {options.url} refused the connection: {refused[0]}")
        time.sleep(wait_s)  # retained messages come right after SUBACK; live ones keep coming
    finally:
        client.disconnect()
        client.loop_stop()
    with lock:
        return list(received)


def build_views(messages: list[tuple[str, bytes]]) -> dict[str, FederationView]:
    """Fold messages (last one per topic wins) into one view per federation."""
    views: dict[str, FederationView] = {}
    for topic, payload in messages:
        parts = topic.split("/")
        if len(parts) < 3 or parts[0] != topics.ROOT:
            continue
        fed = parts[1]
        try:
            topics.validate_id(fed, "federation")
        except ValueError:
            continue  # not a topic an fcl daemon would publish
        view = views.setdefault(fed, FederationView(fed))
        if topic == topics.round_topic(fed):
            if payload:
                _apply_round(view, read_round(fed, payload))
            continue
        who = topics.parse_status_topic(fed, topic)
        if who is None or not payload:
            continue
        status = read_status(who, payload)
        if who == topics.AGGREGATOR_ID:
            view.aggregator = status
        else:
            view.clients[who] = status
    for view in views.values():
        _add_absent(view)
    return views


def _add_absent(view: FederationView) -> None:
    """Devices the aggregator expects that have no status on the broker: never connected."""
    for who in (view.aggregator.expected if view.aggregator else None) or ():
        view.clients.setdefault(who, MemberStatus(who, state=ABSENT))


def _apply_round(view: FederationView, result: RoundView | str | None) -> None:
    if result is None:
        return
    if isinstance(result, str):
        view.problems.append(result)
    elif view.round is None or (result.sequence or 0) >= (view.round.sequence or 0):
        view.round = result


# -- output ---------------------------------------------------------------------------------------
def to_json(views: dict[str, FederationView], broker: str, now: float) -> dict:
    out: dict[str, Any] = {"broker": broker, "time": round(now, 3), "status_fields": STATUS_FIELDS, "federations": {}}
    for name, view in sorted(views.items()):
        out["federations"][name] = {
            "aggregator": asdict(view.aggregator) if view.aggregator else None,
            "round": asdict(view.round) if view.round else None,
            "clients": {who: asdict(s) for who, s in sorted(view.clients.items())},
            "online": sum(s.state == "online" for s in view.clients.values()),
            "problems": view.problems + [f"{s.who}: {s.problem}" for s in view.clients.values() if s.problem],
        }
    return out


def _cell(value: Any) -> str:
    if value is None:
        return UNKNOWN
    return f"{value:,}" if isinstance(value, int) else str(value)


def _age(then: float | None, now: float) -> str:
    if then is None:
        return UNKNOWN
    seconds = max(0.0, now - then)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit} ago"
    return f"{seconds:.0f} s ago"


def _round_line(view: FederationView) -> str:
    r = view.round
    if r is None:
        return "no round announced"
    if r.kind == "finish":
        return f"run finished after {r.round} rounds"
    total = f"/{r.total_rounds}" if r.total_rounds is not None else ""
    extra = ", ".join(x for x in (f"attempt {r.attempt}" if r.attempt else "", r.method or "") if x)
    return f"round {r.round}{total} in progress, task {r.task}" + (f" ({extra})" if extra else "")


def print_table(views: dict[str, FederationView], now: float, out: TextIO) -> None:
    if not views:
        print("no fcl federations have retained status on this broker", file=out)
        return
    header = ("client", "state", "task", "round", "bytes up", "bytes down", "last seen")
    for name, view in sorted(views.items()):
        agg = view.aggregator.state if view.aggregator else "no status"
        online = sum(s.state == "online" for s in view.clients.values())
        print(
            f"federation {name}: aggregator {agg}; {_round_line(view)}; {online}/{len(view.clients)} clients online",
            file=out,
        )
        if (versions := protocol_line(view.clients)) != "":
            print(f"  devices by {versions}", file=out)
        lean = [f"{who} ({s.decodes})" for who, s in sorted(view.clients.items()) if s.decodes]
        if lean:
            print(f"  devices that decode less (frames made for them): {'; '.join(lean)}", file=out)
        rows = [header] + [
            (
                who,
                s.state,
                _cell(s.task),
                _cell(s.round),
                _cell(s.bytes_up),
                _cell(s.bytes_down),
                _age(s.last_seen, now),
            )
            for who, s in sorted(view.clients.items())
        ]
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        for row in rows:
            print(
                "  " + "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))),
                file=out,
            )
        for problem in view.problems + [f"{s.who}: {s.problem}" for s in view.clients.values() if s.problem]:
            print(f"  note: {problem}", file=out)
        for who, s in sorted(view.clients.items()):
            if s.nack:
                print(f"  last nack: {who}: {s.nack}", file=out)


def status(options: BrokerOptions, federation: str | None, wait_s: float, as_json: bool, out: TextIO) -> None:
    """Collect, fold and print; raises StatusError if the broker is unreachable."""
    views = build_views(collect(options, federation, wait_s))
    now = time.time()
    if as_json:
        json.dump(to_json(views, options.url, now), out, indent=2)
        out.write("\n")
    else:
        print_table(views, now, out)


def password_from_env() -> str | None:
    return os.environ.get("FCL_MQTT_PASSWORD") or None
