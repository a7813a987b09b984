"""Capability-limited downlinks over a real Mosquitto (docs/protocol.md section 17), with the
aggregator service and the device daemons as threads of this process (``test_wedge_e2e.Run``).

A ConFedMADE federation sends int8 values at derived positions, in chunks here (a small
``wire.chunk_bytes``).  One device declares it reads none of the three: it gets its
announcements on its own topic, coded within that, holds itself to its declaration (its
decoder refuses int8, derived deltas do not apply, chunks are dropped), and the run ends with
the model and the metrics of a run where every device decodes everything.  A device whose
declaration cannot be served at all is told so by a NACK and the federation does not hang."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import threading
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import paho.mqtt.client as mqtt
from support.timescale import scaled
from test_wedge_e2e import FED, Run, Running

from edge_client.daemon import ClientDaemon
from fclcore import checkpoint, topics
from fclcore.capabilities import device_capabilities
from fclcore.exitcodes import ExitCode

OVERRIDES = ["federation.method=confedmade", "federation.rounds.quorum=1.0", "federation.wire.chunk_bytes=4096"]
LEAN = "client-2"
DECLARES = {"frames": [1], "dtypes": ["float32", "float16"], "derived_positions": False, "chunks": False}


def _finish(repo_root: Path, out: Path, url: str, lean: dict | None) -> dict:
    """Run the federation, ``LEAN`` declaring ``lean`` (None: everything); what it ended with."""
    run = Run(repo_root, out, url, OVERRIDES)
    try:
        run.start_aggregator()
        for name, cfg in run.client_cfgs.items():
            cfg = dataclasses.replace(cfg, decodes=lean) if name == LEAN else cfg
            run.clients[name] = Running(ClientDaemon(cfg))
        codes = [r.wait(scaled(300)) for r in [run.agg, *run.clients.values()]]  # generous: a loaded machine
        assert set(codes) == {ExitCode.OK}
        run.assert_every_round_once()
        daemons = {n: r.service for n, r in run.clients.items()}
        down: dict[str, int] = defaultdict(int)
        for e in run.events("round_client"):
            down[e["client"]] += e["bytes_down"]
    finally:
        run.stop_all()
    meta, arrays = checkpoint.load(out / "state" / "committed.npz")
    digest = hashlib.sha256()
    for name in sorted(k for k in arrays if k.startswith("global/")):
        digest.update(name.encode() + np.ascontiguousarray(arrays[name]).tobytes())
    summary = json.loads((out / "summary.json").read_text())
    return {
        "hash": digest.hexdigest(),
        "fleet": summary["fleet"],
        "down": dict(down),
        "received": {n: d.link.meter.snapshot()["down"]["bytes"] for n, d in daemons.items()},
        "syncs": {n: d.sync.totals() for n, d in daemons.items()},
        "rejected": {n: dict(d.stats.rejected) for n, d in daemons.items()},
        "chunks": {n: d.chunks.fetched for n, d in daemons.items()},
    }


# docs/protocol.md P-CAP-1, P-CAP-2, P-CAP-3, P-CAP-4, P-CHK-6
def test_a_device_without_int8_derived_positions_or_chunks_ends_with_the_same_model(
    tmp_path: Path, repo_root: Path, mosquitto
) -> None:
    everyone = _finish(repo_root, tmp_path / "all", mosquitto.url, None)
    mixed = _finish(repo_root, tmp_path / "mixed", mosquitto.url, DECLARES)
    assert mixed["hash"] == everyone["hash"]
    assert mixed["fleet"] == everyone["fleet"]
    assert all(not r for r in mixed["rejected"].values()), mixed["rejected"]  # nothing it cannot read came
    assert not mixed["syncs"][LEAN]  # every variant applied: no bad delta, no resync
    assert mixed["chunks"][LEAN] == 0 and everyone["chunks"][LEAN] > 0  # the others fetched chunks
    others = [c for c in mixed["down"] if c != LEAN]
    assert all(mixed["down"][c] == everyone["down"][c] for c in others)  # their frames did not change
    assert mixed["down"][LEAN] > everyone["down"][LEAN]  # float32 at listed positions: more than int8 derived
    print("downlink bytes per device (run log):", {"all": everyone["down"], "mixed": mixed["down"]})
    print("bytes received per device (meter):", {"all": everyone["received"], "mixed": mixed["received"]})


class Impostor:
    """A device that says in its status it decodes only frames of version 2, and what it is told."""

    def __init__(self, port: int, client: str) -> None:
        self.nacks: list[dict] = []
        self.got = threading.Event()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"fcl-{FED}-{client}")
        self.client.on_message = self._on_message
        self.client.connect("127.0.0.1", port)
        self.client.subscribe(topics.nack_topic(FED, client), qos=1)
        self.client.loop_start()
        status = {"state": "online", "time": time.time(), **device_capabilities()}
        status["decodes"]["frames"] = [2]
        self.client.publish(topics.status_topic(FED, client), json.dumps(status), qos=1, retain=True)

    def _on_message(self, client, userdata, msg) -> None:
        self.nacks.append(json.loads(msg.payload))
        self.got.set()

    def close(self) -> None:
        self.client.publish(topics.status_topic(FED, LEAN), b"", qos=1, retain=True).wait_for_publish(5)
        self.client.loop_stop()
        self.client.disconnect()


# docs/protocol.md P-CAP-5
def test_a_device_that_declares_what_cannot_be_served_gets_a_nack_and_nothing_hangs(
    tmp_path: Path, repo_root: Path, mosquitto, caplog
) -> None:
    run = Run(repo_root, tmp_path / "run", mosquitto.url, ["federation.rounds.start_timeout_s=4"])
    impostor = Impostor(mosquitto.port, LEAN)
    try:
        with caplog.at_level(logging.WARNING, logger="aggregator.intake"):
            run.start_aggregator()
            run.start_clients(["client-0", "client-1"])
            assert impostor.got.wait(30), "no NACK"
            codes = run.finish()
    finally:
        impostor.close()
        run.stop_all()
    assert codes["aggregator"] is ExitCode.NOT_ENOUGH_CLIENTS  # it waited for the device as for an absent one
    assert [(n["reason"], n["round"], n["kind"]) for n in impostor.nacks] == [("decodes", None, None)]
    assert "frames [2]" in impostor.nacks[0]["detail"]
    lines = [r.getMessage() for r in caplog.records if "cannot be served" in r.getMessage()]
    assert len(lines) == 1 and LEAN in lines[0] and "frames [2]" in lines[0]  # one clear line
