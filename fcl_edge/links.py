"""Slow, lossy, intermittent links between devices and the broker, on one machine.

A real fleet's devices sit behind cellular, farm Wi-Fi or satellite links; this puts each
simulated device behind one, through the real broker (``links:`` in a scenario, docs/links.md):

* **Bandwidth** (``Namespace``): the device process runs in its own network namespace,
  joined to the host by a veth pair; the kernel's ``tbf`` qdisc limits the device side's
  egress to the profile's uplink rate and the host side's to its downlink rate.  (``netem`` is
  not available on every kernel; ``tbf`` is.)  Needs root and iproute2.
* **Latency, stalls, availability** (``LinkRelay``): the device connects to a TCP relay on
  the host end of its veth pair, which forwards to the broker.  Every chunk is delivered half
  the profile's round-trip time after it was read, in order; a chunk is held back a further
  ``stall_ms`` with probability ``stall_rate`` (what a lost segment costs TCP: a
  retransmission timeout); while the availability schedule says offline, the relay cuts every
  connection and refuses new ones, as a device that loses coverage sees it.

Profiles (``PROFILES``) name typical links; ``name@ON/OFF`` adds an availability cycle of ON
seconds online and OFF seconds offline, its phase seeded per device.
"""

from __future__ import annotations

import dataclasses
import heapq
import os
import random
import select
import shutil
import socket
import struct
import subprocess
import threading
import time
from typing import Sequence

from fclcore.errors import ConfigError

CHUNK = 16384  # bytes read at a time


@dataclasses.dataclass(frozen=True)
class LinkProfile:
    name: str
    up_kbit: int  # device -> broker
    down_kbit: int  # broker -> device
    rtt_ms: int  # round trip the relay adds (half each way)
    stall_rate: float = 0.0  # share of chunks held back as a lost segment would be
    stall_ms: int = 0  # how long such a chunk is held back
    online_s: float | None = None  # availability: online this long, then offline ``offline_s`` (None: always on)
    offline_s: float | None = None

    @property
    def describe(self) -> str:
        cycle = f", online {self.online_s:g} s / offline {self.offline_s:g} s" if self.online_s else ""
        stalls = f", {self.stall_rate:.1%} of chunks stall {self.stall_ms} ms" if self.stall_rate else ""
        return f"{self.up_kbit} kbit/s up, {self.down_kbit} kbit/s down, {self.rtt_ms} ms RTT{stalls}{cycle}"


PROFILES = {
    p.name: p
    for p in (
        LinkProfile("lte-m", up_kbit=375, down_kbit=1000, rtt_ms=150),
        LinkProfile("nb-iot", up_kbit=60, down_kbit=30, rtt_ms=1600, stall_rate=0.01, stall_ms=2000),
        LinkProfile("3g", up_kbit=384, down_kbit=2000, rtt_ms=300, stall_rate=0.005, stall_ms=500),
        LinkProfile("farm-wifi", up_kbit=2000, down_kbit=5000, rtt_ms=60, stall_rate=0.01, stall_ms=300),
        LinkProfile("satellite", up_kbit=1000, down_kbit=5000, rtt_ms=600, stall_rate=0.002, stall_ms=1500),
    )
}


def parse_profile(text: str) -> LinkProfile:
    """``lte-m`` or ``lte-m@60/120`` (online 60 s, offline 120 s); ConfigError naming the choices."""
    name, _, cycle = str(text).partition("@")
    if name not in PROFILES:
        raise ConfigError(f"links: unknown link profile {name!r} (expected one of: {', '.join(PROFILES)})")
    if not cycle:
        return PROFILES[name]
    try:
        on, off = (float(x) for x in cycle.split("/"))
    except ValueError:
        raise ConfigError(f"links: {text!r}: expected NAME@ONLINE_S/OFFLINE_S, e.g. lte-m@60/120") from None
    if not (on > 0 and off >= 0):
        raise ConfigError(f"links: {text!r}: expected online seconds > 0 and offline seconds >= 0")
    return dataclasses.replace(PROFILES[name], online_s=on, offline_s=off)


def profiles_of(links: dict[str, str] | None, clients: Sequence[str]) -> dict[str, LinkProfile]:
    """Client id -> its link, from a scenario's ``links:`` (``default`` for the clients not named)."""
    if not links:
        return {}
    unknown = set(links) - {"default", *clients}
    if unknown:
        raise ConfigError(f"links: {sorted(unknown)} are not clients of this scenario (nor 'default')")
    chosen = {c: links.get(c, links.get("default")) for c in clients}
    return {c: parse_profile(p) for c, p in chosen.items() if p}


def check_can_shape() -> None:
    """ConfigError unless this process may create namespaces and qdiscs (root, ``ip``, ``tc``)."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None and not os.path.exists(f"/usr/sbin/{tool}")]
    if missing or os.geteuid() != 0:
        why = f"{' and '.join(missing)} not found (apt-get install iproute2)" if missing else "not running as root"
        raise ConfigError(f"links: shaping a device's link needs root and iproute2 (ip, tc): {why}")


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")


class Namespace:
    """One device's network namespace and veth pair, bandwidth-limited both ways by ``tbf``."""

    def __init__(self, index: int, profile: LinkProfile) -> None:
        tag = f"{os.getpid() % 100000}x{index}"
        self.name, self.host_if, self.dev_if = f"fcl{tag}", f"fh{tag}", f"fd{tag}"
        octet = (index % 64) * 4  # a /30 per device: 10.200.0.0/30, 10.200.4.0/30, ...
        self.host_ip = f"10.{200 + index // 64}.{octet}.1"
        self.dev_ip = f"10.{200 + index // 64}.{octet}.2"
        self.profile = profile

    def __enter__(self) -> Namespace:
        p, ns = self.profile, self.name
        _run("ip", "netns", "add", ns)
        try:
            _run("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.dev_if)
            _run("ip", "link", "set", self.dev_if, "netns", ns)
            _run("ip", "addr", "add", f"{self.host_ip}/30", "dev", self.host_if)
            _run("ip", "link", "set", self.host_if, "up")
            _run("ip", "netns", "exec", ns, "ip", "addr", "add", f"{self.dev_ip}/30", "dev", self.dev_if)
            _run("ip", "netns", "exec", ns, "ip", "link", "set", self.dev_if, "up")
            _run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            _run("tc", "qdisc", "add", "dev", self.host_if, "root", *_tbf(p.down_kbit))
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", self.dev_if, "root", *_tbf(p.up_kbit))
        except Exception:
            self.close()
            raise
        return self

    def link_bytes(self) -> dict[str, int]:
        """The bytes that crossed the link so far (IP packets, after the qdisc), ``down`` to the
        device and ``up`` from it: the host end's counters."""
        stats = f"/sys/class/net/{self.host_if}/statistics"
        return {way: int(open(f"{stats}/{name}_bytes").read()) for way, name in (("down", "tx"), ("up", "rx"))}

    def wrap(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

    def close(self) -> None:
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)  # takes the veth pair with it
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True)

    def __exit__(self, *exc: object) -> None:
        self.close()


def _tbf(kbit: int) -> list[str]:
    """A token bucket at ``kbit``: a burst of 20 ms of traffic (at least 4 kB), a queue of up to
    a second (beyond it the kernel drops, and TCP backs off as on a real link)."""
    burst = max(4096, kbit * 1000 // 8 // 50)
    return ["tbf", "rate", f"{kbit}kbit", "burst", str(burst), "latency", "1000ms"]


class LinkRelay:
    """A TCP relay on ``listen`` forwarding to ``upstream`` with the profile's delay, stalls and
    availability; ``port`` is where it listens.  ``offline_cuts`` counts connections it cut."""

    def __init__(self, listen: str, upstream: tuple[str, int], profile: LinkProfile, seed: int = 0) -> None:
        self.upstream, self.profile = upstream, profile
        self.rng = random.Random(seed)
        self.server = socket.create_server((listen, 0))
        self.port = self.server.getsockname()[1]
        self.lock = threading.Lock()
        self.conns: list[socket.socket] = []
        self.online = True
        self.offline_cuts = 0
        self._stop = threading.Event()
        threading.Thread(target=self._accept, name="link-accept", daemon=True).start()
        if profile.online_s:
            threading.Thread(target=self._availability, name="link-availability", daemon=True).start()

    def close(self) -> None:
        self._stop.set()
        self.server.close()
        self._cut()

    def set_online(self, online: bool) -> None:
        """Come into or go out of coverage now; going out cuts every connection.  The profile's
        cycle calls this, and so may a caller replaying its own availability trace (a profile
        without ``online_s``), e.g. benchmarks/bench_async.py."""
        self.online = online
        if not online:
            self._cut()

    def _availability(self) -> None:
        p = self.profile
        wait = self.rng.uniform(0, p.online_s)  # seeded phase: devices do not all drop together
        while not self._stop.wait(wait):
            self.set_online(not self.online)
            wait = p.online_s if self.online else p.offline_s

    def cut(self) -> None:
        """Drop every connection now, as a link that fails for a moment does: reset, so what is
        still in flight is lost (the device may connect again at once)."""
        with self.lock:
            conns, self.conns = self.conns, []
        for conn in conns:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()

    def _cut(self) -> None:
        with self.lock:
            conns, self.conns = self.conns, []
            if conns and not self._stop.is_set():
                self.offline_cuts += 1
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                down, _ = self.server.accept()
            except OSError:
                return
            if not self.online:
                down.close()  # out of coverage: the connection attempt fails
                continue
            try:
                up = socket.create_connection(self.upstream, timeout=10)
            except OSError:
                down.close()
                continue
            with self.lock:
                self.conns += [down, up]
            half = self.profile.rtt_ms / 2000
            for src, dst in ((down, up), (up, down)):
                threading.Thread(target=self._pump, args=(src, dst, half), name="link-pump", daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, delay: float) -> None:
        """Read ``src``, deliver each chunk to ``dst`` ``delay`` (+ a stall) later, in order."""
        pending: list[tuple[float, int, bytes]] = []
        due_last, seq, closed = 0.0, 0, False
        try:
            while not (closed and not pending):
                now = time.monotonic()
                wait = max(0.0, pending[0][0] - now) if pending else None
                if not closed and select.select([src], [], [], 0.5 if wait is None else min(wait, 0.5))[0]:
                    chunk = src.recv(CHUNK)
                    if not chunk:
                        closed = True
                    else:
                        stall = self.profile.stall_ms / 1000 if self.rng.random() < self.profile.stall_rate else 0.0
                        due_last = max(due_last, time.monotonic() + delay + stall)  # in order, as TCP delivers
                        heapq.heappush(pending, (due_last, seq, chunk))
                        seq += 1
                now = time.monotonic()
                while pending and pending[0][0] <= now:
                    dst.sendall(heapq.heappop(pending)[2])
                if closed and pending:
                    time.sleep(max(0.0, min(pending[0][0] - time.monotonic(), 0.5)))
        except (OSError, ValueError):  # ValueError: the link went offline, its sockets closed under the pump
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


class Links:
    """Every shaped device of a run: its namespace, its relay, the broker URL it uses and the
    command line that starts it inside its namespace."""

    def __init__(self, profiles: dict[str, LinkProfile], broker_port: int, seed: int = 0) -> None:
        check_can_shape()
        self.profiles = profiles
        self.spaces: dict[str, Namespace] = {}
        self.relays: dict[str, LinkRelay] = {}
        try:
            for index, (client, profile) in enumerate(sorted(profiles.items())):
                space = Namespace(index, profile).__enter__()
                self.spaces[client] = space
                relay_seed = seed * 1_000_003 + index
                self.relays[client] = LinkRelay(space.host_ip, ("127.0.0.1", broker_port), profile, relay_seed)
        except Exception:
            self.close()
            raise

    def url(self, client: str, default: str) -> str:
        relay, space = self.relays.get(client), self.spaces.get(client)
        return default if relay is None else f"mqtt://{space.host_ip}:{relay.port}"

    def wrap(self, client: str, argv: list[str]) -> list[str]:
        space = self.spaces.get(client)
        return argv if space is None else space.wrap(argv)

    def close(self) -> None:
        for relay in self.relays.values():
            relay.close()
        for space in self.spaces.values():
            space.close()
