"""NACKs over a real Mosquitto, with the aggregator service and the device daemons as threads of
this process (``test_wedge_e2e.Run``): a device whose checkpoint was lost mid-run numbers its
update below its mark, reads why in a NACK, renumbers the update and the run finishes with
every update accepted once; garbage flooded under a device's name is answered with a burst of
NACKs only.  Rules cited are docs/protocol.md's."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import paho.mqtt.client as mqtt
from test_wedge_e2e import FED, Run, Running

from aggregator.nacks import PER_DEVICE_BURST
from edge_client.daemon import ClientDaemon
from fclcore import topics
from fclcore.exitcodes import ExitCode
from fclcore.runid import started_us

OVERRIDES = ["federation.method=fedavg", "federation.rounds.quorum=1.0"]


class Watcher:
    """Every NACK and status of the federation, as (topic, decoded JSON)."""

    def __init__(self, port: int) -> None:
        self.got: list[tuple[str, dict]] = []
        self.lock = threading.Lock()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="nack-watcher")
        self.client.on_connect = lambda c, *a: c.subscribe(
            [(f"{topics.ROOT}/{FED}/nack/+", 1), (topics.status_filter(FED), 1)]
        )
        self.client.on_message = self._on_message
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()

    def _on_message(self, client, userdata, msg) -> None:
        if msg.payload:
            with self.lock:
                self.got.append((msg.topic, json.loads(msg.payload)))

    def to(self, client_or_topic: str) -> list[dict]:
        """The NACKs to a client, or what came on a topic."""
        topic = client_or_topic if "/" in client_or_topic else topics.nack_topic(FED, client_or_topic)
        with self.lock:
            return [body for t, body in self.got if t == topic]

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def test_a_device_that_lost_its_checkpoint_reads_its_nack_renumbers_and_the_run_finishes(
    tmp_path: Path, repo_root: Path, mosquitto
) -> None:
    """P-SEQ-6, P-NACK-1/2/4: the update numbered start(run) + 1 is dropped as ``replay`` (or
    ``duplicate``, at the mark) with the mark in its NACK; the device sends it again as mark + 1
    within the round; nothing is lost."""
    run = Run(repo_root, tmp_path / "run", mosquitto.url, OVERRIDES)
    watcher = Watcher(mosquitto.port)
    try:
        run.start_aggregator()
        run.start_clients()
        run.wait_for_round(0)
        device = run.clients["client-0"]
        device.service.stop.set()
        assert device.wait() is ExitCode.INTERRUPTED
        shutil.rmtree(device.service.store.path.parent)  # the SD card was replaced
        run.clients["client-0"] = Running(ClientDaemon(run.client_cfgs["client-0"]))
        assert set(run.finish().values()) == {ExitCode.OK}
        run.assert_every_round_once()  # the renumbered update was taken in its own round
    finally:
        run.stop_all()
        time.sleep(0.5)  # the last NACKs in flight reach the watcher
        watcher.close()
    start = started_us(run.agg.service.run_id)
    nacks = watcher.to("client-0")
    first = next(n for n in nacks if n["sequence"] == start + 1)  # the fresh device's first number
    # below its mark (replay), or at it (duplicate: only its round-0 update was accepted before)
    assert first["kind"] == "UPDATE" and first["mark"] >= start + 1 and first["reason"] in ("replay", "duplicate")
    every = [n for c in ("client-0", "client-1", "client-2") for n in watcher.to(c)]
    assert {n["reason"] for n in every} <= {"replay", "duplicate"}, every  # duplicates: re-sends asked for
    status = watcher.to(topics.status_topic(FED, "client-0"))[-1]  # its last status, "stopped" at the end
    assert status["nack"] == {k: nacks[-1][k] for k in ("round", "kind", "sequence", "reason", "detail")}
    assert status["protocol"] == 4 and status["decodes"]["frames"] == [1, 2]  # P-VER-5
    assert status["decodes"]["chunks"] is True  # protocol 3 reads chunked frames (P-CHK-6)
    assert run.clients["client-0"].service.status_snapshot()["last_nack"]["mark"] == nacks[-1]["mark"]  # fcl ctl
    agg_status = watcher.to(topics.status_topic(FED, topics.AGGREGATOR_ID))[-1]
    assert (agg_status["protocol"], agg_status["accepts"]) == (4, [1, 2, 3, 4])  # P-VER-6
    rejected = json.loads((run.out / "summary.json").read_text())["rejected"]
    assert set(rejected) <= {"replay", "duplicate"} and sum(rejected.values()) == len(every)


def test_garbage_flooded_under_a_devices_name_gets_a_burst_of_nacks_only(
    tmp_path: Path, repo_root: Path, mosquitto
) -> None:
    """P-NACK-3: 60 garbage frames in a second on client-1's topic; it is told PER_DEVICE_BURST
    times, every frame is counted as dropped, and the run finishes as if nothing happened."""
    run = Run(repo_root, tmp_path / "run", mosquitto.url, OVERRIDES)
    watcher = Watcher(mosquitto.port)
    forger = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="forger")
    forger.connect("127.0.0.1", mosquitto.port)
    forger.loop_start()
    try:
        run.start_aggregator()
        run.start_clients()
        run.wait_for_round(0)
        for i in range(60):
            forger.publish(topics.update_topic(FED, "client-1"), b"garbage %d" % i, qos=1).wait_for_publish(5)
        assert set(run.finish().values()) == {ExitCode.OK}
        run.assert_every_round_once()
    finally:
        forger.loop_stop()
        forger.disconnect()
        run.stop_all()
        time.sleep(0.5)  # the last NACKs in flight reach the watcher
        watcher.close()
    nacks = watcher.to("client-1")
    assert len(nacks) == PER_DEVICE_BURST and {n["reason"] for n in nacks} == {"codec"}, nacks
    assert json.loads((run.out / "summary.json").read_text())["rejected"]["codec"] == 60
