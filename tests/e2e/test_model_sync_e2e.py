"""The sparse model downlink over a real Mosquitto, with separate aggregator and device processes:
a device killed mid-run and restarted fetches the full model once, from the retained sync frame,
and finishes the run.  That over a multi-task ConFedMADE run every device applies every
announced delta (no hash ever differs, no resync) is checked on the quickstart's ConFedMADE run
(test_e2e_quickstart.py), one fleet run less."""

from __future__ import annotations

import json

from support.fleet import Fleet

OVERRIDES = [
    "federation.method=confedmade",
    "federation.rounds.deadline_s=60",
    "federation.rounds.resend_after_s=2",
]


def _syncs(fleet: Fleet, name: str) -> dict:
    return json.loads((fleet.out / "clients" / name / "wire.json").read_text())["model_syncs"]


def test_a_restarted_device_resyncs_from_the_retained_full_model(mosquitto, tmp_path, repo_root) -> None:
    overrides = [*OVERRIDES, "federation.rounds_per_task=10", "federation.rounds.quorum=0.6"]
    fleet = Fleet(repo_root / "configs/scenarios/quickstart.yaml", tmp_path / "run", mosquitto.url, overrides)
    try:
        fleet.start_all()
        fleet.wait_for_round(1)
        fleet.kill("client-1")  # its model replica dies with it; its checkpoint survives
        fleet.wait_for_round(2)  # the others go on without it
        with fleet.paused("aggregator"):  # hold the round open while the device boots and resyncs
            fleet.start("client-1")
            fleet.wait_for_log("client-1", "fetching the full model")
        codes = fleet.wait()
        assert set(codes.values()) == {0}, (codes, fleet.logs())
    finally:
        fleet.stop()
    syncs = _syncs(fleet, "client-1")
    assert syncs.get("full") == 1 and syncs["bytes"] > 0, syncs
    assert "hash_mismatch" not in syncs and "bad_delta" not in syncs
    assert fleet.summary()["bytes"]["syncs"].get("full") == 1
    assert _syncs(fleet, "client-0") == {}
