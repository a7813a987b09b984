"""Shaped links (fcl_edge/links.py): a device's namespace limits its bandwidth to the profile's
rates, the relay adds the profile's delay and cuts the link while the device is offline, and
``links:`` in a scenario runs a federation through them and the real broker."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml
from support.timescale import scaled

from fcl_edge.links import PROFILES, LinkRelay, Namespace, parse_profile, profiles_of
from fclcore.errors import ConfigError

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="shaping needs root (CI runs as root)")


class Sink:
    """A TCP server on loopback that counts what it receives and echoes one byte per 'p'."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.received = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        with conn:
            while chunk := conn.recv(65536):
                self.received += len(chunk)
                if chunk == b"p":
                    conn.sendall(b"p")


SENDER = """
import socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])))
start = time.monotonic()
s.sendall(b"p"); s.recv(1)
rtt = time.monotonic() - start
start = time.monotonic()
s.sendall(b"x" * int(sys.argv[3]))
s.shutdown(socket.SHUT_WR)
s.recv(1)
print(rtt, time.monotonic() - start)
"""


def test_a_transfer_takes_the_time_the_rate_implies_and_the_round_trip_the_profile_says() -> None:
    profile = dataclasses.replace(PROFILES["lte-m"], up_kbit=400, rtt_ms=300)
    sink = Sink()
    size = 150_000  # 3 s at 400 kbit/s
    with Namespace(0, profile) as space:
        relay = LinkRelay(space.host_ip, ("127.0.0.1", sink.port), profile)
        try:
            argv = space.wrap([sys.executable, "-c", SENDER, space.host_ip, str(relay.port), str(size)])
            done = subprocess.run(argv, capture_output=True, text=True, timeout=scaled(120))
        finally:
            relay.close()
    assert done.returncode == 0, done.stderr
    rtt, seconds = (float(x) for x in done.stdout.split())
    assert rtt >= 0.3, rtt  # the relay's half round trip each way
    assert seconds >= 0.85 * size * 8 / 400_000, seconds  # never faster than the rate (tbf)
    assert seconds < scaled(30), seconds
    assert sink.received == size + 1


def test_offline_cuts_the_connection_and_refuses_new_ones() -> None:
    profile = dataclasses.replace(PROFILES["farm-wifi"], stall_rate=0.0, online_s=0.6, offline_s=30.0)
    sink = Sink()
    relay = LinkRelay("127.0.0.1", ("127.0.0.1", sink.port), profile, seed=3)
    try:
        conn = socket.create_connection(("127.0.0.1", relay.port), timeout=scaled(10))
        conn.settimeout(scaled(10))
        assert conn.recv(1) == b""  # cut when the link goes offline (at most 0.6 s in)
        assert not relay.online and relay.offline_cuts == 1
        again = socket.create_connection(("127.0.0.1", relay.port), timeout=scaled(10))
        again.settimeout(scaled(10))
        assert again.recv(1) == b""  # offline: refused
    finally:
        relay.close()


def test_profiles_and_cycles_parse_and_bad_ones_say_why() -> None:
    assert parse_profile("lte-m@60/120").online_s == 60 and parse_profile("lte-m").online_s is None
    assert set(profiles_of({"default": "3g", "c1": "satellite"}, ["c0", "c1"])) == {"c0", "c1"}
    assert profiles_of({"default": "3g", "c1": "satellite"}, ["c0", "c1"])["c1"].name == "satellite"
    for bad, says in [
        ({"default": "5g"}, "unknown link profile"),
        ({"c9": "3g"}, "not clients"),
        ({"c0": "3g@x"}, "NAME@"),
    ]:
        with pytest.raises(ConfigError, match=says):
            profiles_of(bad, ["c0"])


@pytest.mark.slow
def test_a_federation_runs_behind_shaped_links(tmp_path: Path, repo_root: Path, mosquitto) -> None:
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "fcl_edge.cli", "simulate", str(repo_root / "configs/scenarios/quickstart.yaml")]
    argv += [
        "--out",
        str(out),
        "--broker",
        mosquitto.url,
        "--set",
        "compare=[]",
        "--set",
        "federation.rounds_per_task=1",
    ]
    argv += ["--set", "links.default=lte-m", "--set", "links.client-2=satellite"]
    before = _namespaces()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=scaled(600))
    assert done.returncode == 0, done.stderr[-3000:]
    urls = {
        c: yaml.safe_load((out / "configs" / f"{c}.yaml").read_text())["broker"]["url"]
        for c in ("client-0", "client-2")
    }
    assert all(u.startswith("mqtt://10.") for u in urls.values()) and len(set(urls.values())) == 2, urls
    rounds = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"event": "round"' in x]
    assert len(rounds) == 2 and all(r["accepted"] == 3 for r in rounds)
    assert "client-2: behind a satellite link" in done.stderr
    assert _namespaces() == before  # the run removed its namespaces and veth pairs


def _namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.startswith("fcl")}


@pytest.mark.slow
def test_a_slow_device_cannot_hold_a_round_open_past_its_deadline(tmp_path: Path, repo_root: Path, mosquitto) -> None:
    """P-11.2: client-2 sits behind an nb-iot link (30 kbit/s down, 60 up, 1.6 s round trip: a
    dense FedAvg round of this federation takes it about 30 s) and stays online, so the round
    cannot end early without it; each round still closes at its 10 s deadline with the others."""
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "fcl_edge.cli", "simulate", str(repo_root / "configs/scenarios/quickstart.yaml")]
    argv += ["--out", str(out), "--broker", mosquitto.url]
    for item in (
        "compare=[]",
        "federation.method=fedavg",
        "federation.rounds_per_task=1",
        "federation.rounds.deadline_s=10",
        "federation.rounds.quorum=0.6",
        "links.client-2=nb-iot",
    ):
        argv += ["--set", item]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=scaled(600))
    assert done.returncode == 0, done.stderr[-3000:]
    events = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rounds = [e for e in events if e.get("event") == "round"]
    assert len(rounds) == 2 and all(r["accepted"] >= 2 for r in rounds), rounds
    slow = [r for r in rounds if r["accepted"] < r["expected"]]
    assert slow, "client-2 replied in time: the link did not slow it down"
    assert all(r["duration_s"] <= 10 + scaled(20) for r in slow), slow  # the deadline, plus folding and announcing
