#!/usr/bin/env python
"""Synthetic devices for bench_fleet.py: many real MQTT connections in one process, one selector.

Each device is its own paho client (its own TCP connection, client id, retained status and
last will), but no device has a thread: paho's external-loop hooks (``on_socket_open`` ...
``on_socket_unregister_write``) put every socket on one ``selectors`` loop that calls
``loop_read`` / ``loop_write``, and ``loop_misc`` runs once a second for keep-alives.

A device follows the round protocol: it comes online (retained status), subscribes to the
round topic once the round is announced, reads the retained announcement (the whole frame:
every device receives the model's bytes), and answers with an UPDATE frame for that round,
numbered as docs/protocol.md says (P-SEQ-2: the run's start plus the device's counter, one
frame a round here), with its ``n_samples``.  Once the
broker acknowledged the update (PUBACK), the device unsubscribes from the round topic: the
benchmark times one round's uplink, so the next global model is fanned out to the watchers
only.  At most ``window`` devices per broker connect, or download-and-send, at a time.

The update's tensors are encoded once (``UpdateFrames``): a device's frame is its own header
and metadata in front of the same tensor records, with the CRC32 over the whole, which is the
codec's frame layout (``fclcore/codec.py``); the first frame is decoded and compared before any
is sent.  With ``"health": true`` in the spec a device's status also carries the ``health``
field a real device sends (``fclcore.health``), for the aggregator's per-device series.  Run by
bench_fleet.py as ``python fleet_devices.py SPEC_JSON``; prints one JSON line of counts when
SIGTERM ends it.
"""

from __future__ import annotations

import json
import selectors
import signal
import struct
import sys
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import paho.mqtt.client as mqtt

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # allow `python benchmarks/fleet_devices.py` without installing
    sys.path.insert(0, str(REPO))

from fclcore import topics  # noqa: E402
from fclcore.codec import CodecLimits, Frame, Header, Kind, SparseTensor, decode, encode  # noqa: E402
from fclcore.health import device_health  # noqa: E402
from fclcore.runid import started_us  # noqa: E402
from fclcore.transport import publish_packet_bytes  # noqa: E402

LIMITS = CodecLimits(max_frame_bytes=64 * 2**20)
_TRAILER = 2 + 4  # an empty frame ends with a u16 tensor count (0) and the CRC32


class UpdateFrames:
    """UPDATE frames that differ only in header and metadata, around one encoding of the tensors."""

    def __init__(self, federation: str, shapes: dict[str, tuple[int, ...]], density: float, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.federation, self.tensors = federation, {}
        for name, shape in shapes.items():
            index = np.flatnonzero(rng.random(int(np.prod(shape))) < density)
            self.tensors[name] = SparseTensor(shape, index, rng.normal(0, 0.01, index.size).astype(np.float32))
        probe = Header(Kind.UPDATE, federation, 0, 0, "probe", 1)
        whole = encode(Frame(probe, {}, self.tensors), "float32", LIMITS)
        self.body = whole[len(self._head(probe, {})) : -4]  # tensor count + tensor records

    @staticmethod
    def _head(header: Header, meta: dict) -> bytes:
        return encode(Frame(header, meta, {}), "float32", LIMITS)[:-_TRAILER]

    def frame(self, client: str, rnd: int, task: int, sequence: int, n_samples: int) -> bytes:
        head = self._head(Header(Kind.UPDATE, self.federation, rnd, task, client, sequence), {"n_samples": n_samples})
        crc = zlib.crc32(self.body, zlib.crc32(head))
        return b"".join((head, self.body, struct.pack("<I", crc)))

    def check(self) -> None:
        """Decode one spliced frame and compare it with what ``encode`` was given."""
        got = decode(self.frame("check", 3, 1, 12345, 7), LIMITS)
        assert got.header == Header(Kind.UPDATE, self.federation, 3, 1, "check", 12345), got.header
        assert got.meta == {"n_samples": 7} and got.tensors.keys() == self.tensors.keys()
        assert all(got.tensors[k] == t for k, t in self.tensors.items()), "spliced tensors differ"


@dataclass
class Device:
    cid: str
    n_samples: int
    client: mqtt.Client
    state: str = "new"  # new -> connecting -> online -> fetching -> sending -> done
    update_mid: int | None = None
    up: int = 0  # PUBLISH packet bytes sent (status + update)
    down: int = 0  # PUBLISH packet bytes received (the round announcement)
    acked_at: float | None = None


@dataclass
class Group:
    """The devices of one broker, and the watcher that learns when their round is announced."""

    port: int
    devices: list[Device]
    watcher: mqtt.Client | None = None
    announcement: bytes | None = None
    rnd: int = 0
    task: int = 0
    run: str = ""
    waiting: list[Device] = field(default_factory=list)  # online, not yet fetching


class DeviceFleet:
    def __init__(self, spec: dict) -> None:
        self.fed, self.window, self.name = spec["federation"], spec["window"], spec["name"]
        self.frames = UpdateFrames(self.fed, {k: tuple(v) for k, v in spec["shapes"].items()}, *spec["update"])
        self.frames.check()
        self.selector = selectors.DefaultSelector()
        self.stop = threading.Event()
        self.groups = [
            Group(g["port"], [Device(cid, n, self._client(cid)) for cid, n in g["devices"]]) for g in spec["groups"]
        ]
        self.disconnects = 0
        # with ``health``, each status carries what a real device's does (bench_fleet.py --scrape)
        self.extra = {"task": 0, "health": device_health(1.0, {}, {"update": 0}, {"round": 0}, 1024.0)}
        self.extra = self.extra if spec.get("health") else {}

    # -- paho on one selector -----------------------------------------------------------
    def _client(self, cid: str) -> mqtt.Client:
        client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=cid, clean_session=True)
        client.on_socket_open = lambda c, u, sock: self.selector.register(sock, selectors.EVENT_READ, c)
        client.on_socket_close = lambda c, u, sock: self._forget(sock)
        client.on_socket_register_write = lambda c, u, sock: self.selector.modify(
            sock, selectors.EVENT_READ | selectors.EVENT_WRITE, c
        )
        client.on_socket_unregister_write = lambda c, u, sock: self.selector.modify(sock, selectors.EVENT_READ, c)
        return client

    def _forget(self, sock) -> None:
        try:
            self.selector.unregister(sock)
        except (KeyError, ValueError):
            pass

    def _connect(self, client: mqtt.Client, port: int) -> None:
        client.connect_async("127.0.0.1", port, keepalive=120)
        client.reconnect()

    # -- the protocol ---------------------------------------------------------------------
    def _start_group(self, group: Group, index: int) -> None:
        watcher = self._client(f"{self.name}-watch-{index}")
        watcher.on_connect = lambda c, u, f, rc, p: c.subscribe(topics.round_topic(self.fed), qos=1)
        watcher.on_message = lambda c, u, m: self._on_announcement(group, m.payload)
        group.watcher = watcher
        self._connect(watcher, group.port)
        for device in group.devices:
            device.client.on_connect = lambda c, u, f, rc, p, d=device, g=group: self._online(g, d, rc)
            device.client.on_message = lambda c, u, m, d=device, g=group: self._fetched(g, d, m.payload)
            device.client.on_publish = lambda c, u, mid, rc, p, d=device: self._acked(d, mid)
            device.client.on_disconnect = lambda c, u, f, rc, p: self._lost(rc)
            status = topics.status_topic(self.fed, device.cid)
            device.client.will_set(status, json.dumps({"state": "dead"}), qos=1, retain=True)

    def _on_announcement(self, group: Group, payload: bytes) -> None:
        if not payload or group.announcement is not None:
            return
        frame = decode(payload, LIMITS)
        if frame.header.kind is Kind.ROUND:
            group.rnd, group.task, group.run = frame.header.round, frame.header.task, frame.meta["run"]
            group.announcement = payload

    def _online(self, group: Group, device: Device, rc) -> None:
        if rc.is_failure:
            self.disconnects += 1
            return
        status = json.dumps({"state": "online", "time": round(time.time(), 3), **self.extra}).encode()
        topic = topics.status_topic(self.fed, device.cid)
        device.client.publish(topic, status, qos=1, retain=True)
        device.up += publish_packet_bytes(topic, len(status))
        device.state = "online"
        group.waiting.append(device)

    def _fetched(self, group: Group, device: Device, payload: bytes) -> None:
        """The retained announcement arrived: answer it (a frame that differs is decoded)."""
        topic = topics.round_topic(self.fed)
        device.down += publish_packet_bytes(topic, len(payload))
        if device.state != "fetching" or not payload:
            return
        rnd, task = group.rnd, group.task
        if payload != group.announcement:
            header = decode(payload, LIMITS).header
            if header.kind is not Kind.ROUND:
                return
            rnd, task = header.round, header.task
        sequence = started_us(group.run) + rnd + 1
        frame = self.frames.frame(device.cid, rnd, task, sequence, device.n_samples)
        update_topic = topics.update_topic(self.fed, device.cid)
        device.update_mid = device.client.publish(update_topic, frame, qos=1).mid
        device.up += publish_packet_bytes(update_topic, len(frame))
        device.state = "sending"

    def _acked(self, device: Device, mid: int) -> None:
        if mid == device.update_mid and device.state == "sending":
            device.state, device.acked_at = "done", time.time()
            device.client.unsubscribe(topics.round_topic(self.fed))

    def _lost(self, rc) -> None:
        if rc.is_failure:
            self.disconnects += 1

    # -- the loop -------------------------------------------------------------------------
    def _admit(self, group: Group) -> None:
        """Start connects, then fetches, keeping at most ``window`` of each in progress."""
        busy = sum(d.state == "connecting" for d in group.devices)
        for device in group.devices:
            if busy >= self.window:
                break
            if device.state == "new":
                device.state, busy = "connecting", busy + 1
                self._connect(device.client, group.port)
        if group.announcement is None:
            return
        fetching = sum(d.state in ("fetching", "sending") for d in group.devices)
        while group.waiting and fetching < self.window:
            device = group.waiting.pop(0)
            device.state, fetching = "fetching", fetching + 1
            device.client.subscribe(topics.round_topic(self.fed), qos=1)

    def run(self) -> dict:
        for i, group in enumerate(self.groups):
            self._start_group(group, i)
        clients = [g.watcher for g in self.groups] + [d.client for g in self.groups for d in g.devices]
        misc_at = time.monotonic() + 1
        while not self.stop.is_set():
            for group in self.groups:
                self._admit(group)
            for key, mask in self.selector.select(timeout=0.05):
                if mask & selectors.EVENT_READ:
                    key.data.loop_read()
                if mask & selectors.EVENT_WRITE:
                    key.data.loop_write()
            if time.monotonic() >= misc_at:
                for client in clients:
                    client.loop_misc()
                misc_at = time.monotonic() + 1
        for client in clients:
            client.disconnect()
            client.loop_write()
        return self.report()

    def report(self) -> dict:
        devices = [d for g in self.groups for d in g.devices]
        acked = [d.acked_at for d in devices if d.acked_at is not None]
        return {
            "devices": len(devices),
            "acked": len(acked),
            "first_ack": min(acked, default=None),
            "last_ack": max(acked, default=None),
            "up_bytes": sum(d.up for d in devices),
            "down_bytes": sum(d.down for d in devices),
            "disconnects": self.disconnects,
        }


def main() -> int:
    spec = json.loads(sys.argv[1])
    fleet = DeviceFleet(spec)
    signal.signal(signal.SIGTERM, lambda *_: fleet.stop.set())
    print(json.dumps(fleet.run()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
