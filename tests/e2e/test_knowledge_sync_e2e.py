"""ConFedMADE's knowledge downlink over a real Mosquitto, with separate aggregator and device
processes, over three tasks: each task-start frame carries only the entries a device lacks;
a device whose state was wiped mid-task rejoins, finds entries its frame relies on missing,
fetches the retained full frame once (counted, its bytes reported) and finishes the run; a
device restarted with its state intact rebuilds from its store and needs no resync."""

from __future__ import annotations

import json
import shutil

from support.fleet import Fleet

OVERRIDES = [
    "clients=3",
    "federation.rounds_per_task=3",
    "federation.rounds.quorum=1.0",  # every device in every round: the restarted ones report their resyncs
    "federation.rounds.deadline_s=60",
    "federation.rounds.resend_after_s=2",
]


def _wire(fleet: Fleet, name: str) -> dict:
    return json.loads((fleet.out / "clients" / name / "wire.json").read_text())


def test_a_wiped_device_fetches_the_full_knowledge_frame_once_and_a_restarted_one_none(
    mosquitto, tmp_path, repo_root
) -> None:
    scenario = repo_root / "configs/scenarios/digits_continual.yaml"
    fleet = Fleet(scenario, tmp_path / "run", mosquitto.url, OVERRIDES)
    try:
        fleet.start_all()
        fleet.wait_for_round(6)  # task 2 started: its frames rely on the entries of task 0 sent before
        fleet.kill("client-1")
        fleet.kill("client-2")
        shutil.rmtree(fleet.out / "clients" / "client-1" / "state")  # client-1 lost everything
        with fleet.paused("aggregator"):  # hold the round open while the devices boot
            fleet.start("client-1")
            fleet.start("client-2")
            fleet.wait_for_log("client-1", "fetching the full frame")
            fleet.wait_for_log("client-2", "resuming after round")
        codes = fleet.wait()
        assert set(codes.values()) == {0}, (codes, fleet.logs())
    finally:
        fleet.stop()
    summary = fleet.summary()
    wiped, restarted, steady = (_wire(fleet, f"client-{i}") for i in (1, 2, 0))
    assert wiped["knowledge_syncs"]["knowledge"] == 1 and wiped["knowledge_syncs"]["knowledge_bytes"] > 0, wiped
    assert restarted["knowledge_syncs"] == {} and steady["knowledge_syncs"] == {}
    assert summary["bytes"]["syncs"].get("knowledge") == 1
    frames = {(e["client"], e["task"]): e for e in fleet.events("knowledge")}
    # the frames of task 2 name four entries (two other devices, tasks 0 and 1) and carry two:
    # a frame of task 2 is smaller than one of task 1, which carried two entries too
    for client in ("client-0", "client-2"):
        assert len(frames[client, 2]["entries"]) == 4
        assert frames[client, 2]["bytes"] < 1.2 * frames[client, 1]["bytes"], frames
    # every knowledge byte a device received is counted: its frames and the full one it fetched
    sent = sum(e["bytes"] for e in fleet.events("knowledge") if e["task"] > 0)
    assert summary["bytes"]["down_by_kind"]["knowledge"] >= sent + wiped["knowledge_syncs"]["knowledge_bytes"]
