"""A live fleet on Mosquitto (separate processes): with ``enrollment: open`` a device the
aggregator was not configured with enrolls by coming online and trains from the next round;
a device that dies leaves the roster after ``drop_after_missed`` rounds, and the quorum is a
share of the clients enrolled for each round."""

from __future__ import annotations

from support.fleet import Fleet

OVERRIDES = [
    "federation.method=confedmade",
    "federation.rounds_per_task=5",
    "federation.rounds.quorum=0.6",
    "federation.rounds.deadline_s=30",
    "federation.rounds.resend_after_s=5",
]
AGGREGATOR = {"expected_clients": ["client-0", "client-1"], "enrollment": "open", "drop_after_missed": 2}


def test_a_device_enrolls_mid_run_and_a_dead_one_leaves(mosquitto, tmp_path, repo_root) -> None:
    fleet = Fleet(
        repo_root / "configs/scenarios/quickstart.yaml",
        tmp_path / "run",
        mosquitto.url,
        OVERRIDES,
        aggregator=AGGREGATOR,
    )
    try:
        for name in ("client-0", "client-1", "aggregator"):
            fleet.start(name)
        fleet.wait_for_round(1)
        with fleet.paused("aggregator"):  # hold the rounds while the new device boots
            fleet.start("client-2")
            fleet.wait_for_log("client-2", "connected to")
        fleet.wait_for_round(4)
        with fleet.paused("aggregator"):
            fleet.kill("client-0")  # its last-will "dead": the rounds stop waiting for it
        codes = fleet.wait()
        assert codes["aggregator"] == 0 and codes["client-1"] == 0 and codes["client-2"] == 0, (codes, fleet.logs())
    finally:
        fleet.stop()

    rows = fleet.events("round_client")
    accepted = {(e["round"], e["client"]) for e in rows if e["status"] == "accepted"}
    joined = sorted(r for r, c in accepted if c == "client-2")
    assert joined and 2 <= joined[0] <= 4 and joined[-1] == 9, joined  # enrolled mid-run, to the end
    rounds = {e["round"]: e for e in fleet.events("round")}
    assert rounds[0]["expected"] == 2 and max(e["expected"] for e in rounds.values()) == 3
    dead_missed = sorted(e["round"] for e in rows if e["client"] == "client-0" and e["status"] == "missing")
    assert len(dead_missed) == 2 and rounds[9]["expected"] == 2, (dead_missed, rounds[9])  # then it left
    summary = fleet.summary()
    assert summary["client_ids"] == ["client-0", "client-1", "client-2"]
    assert "client-2" in summary["final"]["per_client"]  # evaluated like any other device
