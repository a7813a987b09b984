"""Stragglers and churn with separate processes on Mosquitto: a device joins in the middle of
a task and gets the current global model and its knowledge-base entries; a device that dies
is marked by its last-will and the rounds go on with the quorum; an update for a closed
round is counted and dropped."""

from __future__ import annotations

import time

import paho.mqtt.client as mqtt
from support.fleet import Fleet

from fclcore.codec import Frame, Header, Kind, encode

OVERRIDES = [
    "federation.method=confedmade",
    "federation.rounds_per_task=6",
    "federation.rounds.quorum=0.6",
    "federation.rounds.deadline_s=20",
    "federation.rounds.start_timeout_s=3",
    "federation.rounds.resend_after_s=5",
]


def test_late_join_and_dead_device(mosquitto, tmp_path, repo_root) -> None:
    fleet = Fleet(repo_root / "configs/scenarios/quickstart.yaml", tmp_path / "run", mosquitto.url, OVERRIDES)
    try:
        for name in ("client-0", "client-1"):
            fleet.start(name)
        for name in ("client-0", "client-1"):
            fleet.wait_for_log(name, "connected to")
        fleet.start("aggregator")  # gives up waiting for client-2 after start_timeout_s
        fleet.wait_for_round(6)  # task 1 (rounds 6-11) has begun without client-2
        with fleet.paused("aggregator"):  # hold the round open while the device boots
            fleet.start("client-2")
            fleet.wait_for_log("client-2", "connected to")
        fleet.wait_for_round(8)
        with fleet.paused("aggregator"):
            fleet.kill("client-0")  # no clean shutdown: the broker publishes its last-will
            late = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="straggler")
            late.connect("127.0.0.1", mosquitto.port)
            late.loop_start()
            now_us = time.time_ns() // 1000  # on the aggregator's clock: dropped for its round, not its sequence
            stale = encode(Frame(Header(Kind.UPDATE, "quickstart", 1, 0, "client-1", now_us), {"n_samples": 3}, {}))
            late.publish("fcl/quickstart/update/client-1", stale, qos=1).wait_for_publish(5)
            late.loop_stop()
        codes = fleet.wait()
        assert codes["aggregator"] == 0 and codes["client-1"] == 0 and codes["client-2"] == 0, (codes, fleet.logs())
    finally:
        fleet.stop()

    rows = fleet.events("round_client")
    accepted = {(e["round"], e["client"]) for e in rows if e["status"] == "accepted"}
    joined = sorted(r for r, c in accepted if c == "client-2")
    assert joined and 6 <= joined[0] <= 8 and joined[-1] == 11, joined  # from mid-task 1 to the end
    knowledge = [e for e in fleet.events("knowledge") if e["client"] == "client-2" and e["task"] == 1]
    assert knowledge  # its entries for task 1 were retained for it (confedmade waits for them)
    last = [e for e in rows if e["client"] == "client-0" and e["round"] == 11]
    assert last and last[0]["status"] == "missing"
    assert all(e["accepted"] >= 2 for e in fleet.events("round"))
    log = (tmp_path / "run/logs/aggregator.1.log").read_text()
    assert "client client-0 is dead" in log
    assert fleet.summary()["rejected"].get("late", 0) >= 1
