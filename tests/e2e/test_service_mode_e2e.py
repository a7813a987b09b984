"""The daemons as services, with separate processes on Mosquitto: systemd's notify socket
gets READY / STATUS / STOPPING; the Prometheus endpoint is scraped during a run; SIGTERM
stops either daemon cleanly (status "stopped", exit 130) and a restart carries on to the
same numbers as an undisturbed run."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
import urllib.request

import paho.mqtt.client as mqtt
from prometheus_client.parser import text_string_to_metric_families
from support.fleet import QUICK_OVERRIDES as OVERRIDES
from support.fleet import QUICK_SCENARIO as SCENARIO
from support.fleet import Fleet, assert_each_round_once, matrices
from support.mosquitto import free_port

from fclcore.exitcodes import ExitCode


def _scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name + ("{" + sample.labels["reason"] + "}" if "reason" in sample.labels else "")
            out[key] = sample.value
    return out


def _retained_status(port: int, topic: str) -> dict:
    got: list[dict] = []
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="status-reader")
    client.on_connect = lambda c, *_: c.subscribe(topic, qos=1)
    client.on_message = lambda c, u, m: got.append(json.loads(m.payload))
    client.connect("127.0.0.1", port)
    client.loop_start()
    deadline = time.monotonic() + 5
    while not got and time.monotonic() < deadline:
        time.sleep(0.05)
    client.loop_stop()
    return got[-1]


def test_notify_metrics_and_sigterm(mosquitto, tmp_path, repo_root, quickstart_reference) -> None:
    port = free_port()
    sock_path = tmp_path / "notify.sock"
    manager = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    manager.bind(str(sock_path))
    manager.settimeout(0.1)
    messages: list[str] = []
    listening = threading.Event()
    listening.set()

    def listen() -> None:  # what systemd does: read every datagram as it comes
        while listening.is_set():
            try:
                messages.append(manager.recv(4096).decode())
            except socket.timeout:
                continue

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    fleet = Fleet(repo_root / SCENARIO, tmp_path / "run", mosquitto.url, OVERRIDES, aggregator={"metrics_port": port})
    scrapes = []
    try:
        # a short watchdog (a ping every 0.3 s): this aggregator may live under a second before
        # the SIGTERM below, and a 2 s watchdog's first ping (after 1 s) could come too late
        fleet.start("aggregator", env={"NOTIFY_SOCKET": str(sock_path), "WATCHDOG_USEC": "600000"})
        for name in ("client-0", "client-1", "client-2"):
            fleet.start(name)
        fleet.wait_for_round(1)
        scrapes.append(_scrape(port))
        fleet.wait_for_round(2)

        # SIGTERM the aggregator mid-run: it stops cleanly and says so, then resumes
        fleet.procs["aggregator"].send_signal(signal.SIGTERM)
        assert fleet.procs["aggregator"].wait(30) == ExitCode.INTERRUPTED
        assert _retained_status(mosquitto.port, "fcl/quickstart/status/aggregator")["state"] == "stopped"
        fleet.start("aggregator", env={"NOTIFY_SOCKET": str(sock_path)})
        fleet.wait_for_round(4)

        # SIGTERM a client: it finishes the round in hand, says "stopped", and resumes later
        fleet.procs["client-2"].send_signal(signal.SIGTERM)
        assert fleet.procs["client-2"].wait(60) == ExitCode.INTERRUPTED
        status = _retained_status(mosquitto.port, "fcl/quickstart/status/client-2")
        assert status["state"] == "stopped" and status["role"] == "client" and status["round"] >= 3
        assert status["bytes_up"] > 0 and status["task"] in (0, 1)
        fleet.start("client-2")
        fleet.wait_for_round(6)
        scrapes.append(_scrape(port))
        codes = fleet.wait()
        assert set(codes.values()) == {0}, (codes, fleet.logs())
    finally:
        fleet.stop()

    time.sleep(0.3)
    listening.clear()
    listener.join(5)
    manager.close()
    assert messages.count(f"READY=1\nSTATUS=connected to {mosquitto.url}") == 2, messages
    assert sum("STOPPING=1" in m for m in messages) == 2, messages
    assert any(m.startswith("STATUS=round ") for m in messages)
    assert any(m == "WATCHDOG=1" for m in messages)

    first, later = scrapes
    assert first["fcl_clients_connected"] == 3
    assert first["fcl_rounds_total"] >= 1 and later["fcl_rounds_total"] > first["fcl_rounds_total"]
    assert later["fcl_bytes_up_total"] > first["fcl_bytes_up_total"] > 0
    assert_each_round_once(fleet, rounds=8, clients=3)
    assert matrices(fleet.summary()) == quickstart_reference
