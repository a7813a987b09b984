"""Garbage published to a federation's topics during a run: the run finishes, every message
is dropped with a logged reason and counted, and the model is not corrupted."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import paho.mqtt.client as mqtt
from support.timescale import scaled

from fclcore.codec import Frame, Header, Kind, encode

FED = "quickstart"


def _frame(client: str, rnd: int = 0, tensors: dict | None = None) -> bytes:
    header = Header(Kind.UPDATE, FED, rnd, 0, client, 1)
    return encode(Frame(header, {"n_samples": 10}, tensors or {"w": np.ones(4, np.float32)}))


def _with_nan(payload: bytes) -> bytes:
    """Replace a float32 1.0 in a valid frame with NaN and fix the CRC, so only finiteness fails."""
    body = payload[:-4]
    at = body.rindex(np.float32(1.0).tobytes())
    body = body[:at] + np.float32(np.nan).tobytes() + body[at + 4 :]
    return body + zlib.crc32(body).to_bytes(4, "little")


def _wait_for_round(metrics: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metrics.exists() and '"event": "round"' in metrics.read_text():
            return
        time.sleep(0.1)
    raise AssertionError("no round completed")


def test_run_survives_hostile_messages(mosquitto, tmp_path: Path, repo_root: Path) -> None:
    out = tmp_path / "run"
    sim = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fcl_edge.cli",
            "simulate",
            str(repo_root / "configs/scenarios/quickstart.yaml"),
            "--out",
            str(out),
            "--broker",
            mosquitto.url,
            "--set",
            "compare=[]",
            "--set",
            "federation.rounds_per_task=4",
            "--set",
            "federation.wire.max_frame_mb=1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    _wait_for_round(out / "metrics.jsonl")

    attacker = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="attacker")
    attacker.connect("127.0.0.1", mosquitto.port)
    attacker.loop_start()
    hostile = {
        f"fcl/{FED}/update/client-0": [b"garbage", b"", _with_nan(_frame("client-0")), b"\x00" * (2 * 2**20)],
        f"fcl/{FED}/update/intruder": [_frame("intruder")],
        f"fcl/{FED}/update/client-1": [_frame("client-2")],
        f"fcl/{FED}/status/client-2": [b"not json"],
        f"fcl/{FED}/round": [b"\xff" * 64],
    }
    for topic, payloads in hostile.items():
        for payload in payloads:
            attacker.publish(topic, payload, qos=1).wait_for_publish(5)
    attacker.loop_stop()
    attacker.disconnect()

    output, _ = sim.communicate(timeout=scaled(300))
    assert sim.returncode == 0, output
    summary = json.loads((out / "summary.json").read_text())
    rejected = summary["rejected"]
    assert rejected.get("codec", 0) >= 4, rejected  # garbage, empty, NaN, oversized
    assert rejected.get("unknown-client") == 1 and rejected.get("sender") == 1 and rejected.get("status") == 1
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    drops = [e for e in events if e["event"] == "rejected"]
    assert len(drops) == sum(rejected.values()) and all(e["reason"] and e["detail"] for e in drops)
    assert any("finite" in e["detail"].lower() or "nan" in e["detail"].lower() for e in drops)
    agg_log = (out / "logs" / "aggregator.log").read_text()
    assert agg_log.count("dropped message") >= sum(rejected.values())

    # every client dropped the garbage round message and still finished every round
    for cid in summary["client_ids"]:
        wire = json.loads((out / "clients" / cid / "wire.json").read_text())
        assert wire["rejected"].get("codec") == 1
    assert all(e["accepted"] == 3 for e in events if e["event"] == "round")
    assert all(np.isfinite(v) for c in summary["final"]["per_client"].values() for v in c["new_nll"])
