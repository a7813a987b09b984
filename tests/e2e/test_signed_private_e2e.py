"""Signed updates end to end, with forged, replayed and unsigned frames injected by a stock
MQTT client; and the privacy guard: every payload a device published in the run is
recorded and none contains a training sample, nor any vector equal to one."""

from __future__ import annotations

import math
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import paho.mqtt.client as mqtt
from support.timescale import scaled

from fcl_edge.simulate import plan
from fclcore.codec import Frame, Header, Kind, SparseTensor, decode, encode
from fclcore.data import client_task_split, load_dataset
from fclcore.signing import is_signed, sign, verify

FED = "quickstart"


class Recorder:
    """Every PUBLISH on the federation's uplink topics, as the broker delivers it."""

    def __init__(self, port: int) -> None:
        self.messages: list[tuple[str, bytes]] = []
        self.lock = threading.Lock()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="recorder")
        self.client.on_connect = lambda c, *_: c.subscribe(f"fcl/{FED}/update/+", qos=1)
        self.client.on_message = self._on_message
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()

    def _on_message(self, client, userdata, message) -> None:
        with self.lock:
            self.messages.append((message.topic, bytes(message.payload)))

    def updates_of(self, client: str) -> list[bytes]:
        with self.lock:
            return [p for t, p in self.messages if t.endswith("/" + client)]


def leaked_vectors(frame: Frame, samples: set[bytes], dim: int) -> int:
    """Vectors of length ``dim`` in the frame (rows, columns, aligned runs of a flattened
    tensor, numeric lists in the metadata) that equal a training sample."""
    found = 0
    arrays = [t.to_dense() if isinstance(t, SparseTensor) else np.asarray(t) for t in frame.tensors.values()]
    candidates: list[np.ndarray] = []
    for a in arrays:
        a = a.astype(np.float32)
        if a.shape and a.shape[-1] == dim:
            candidates += list(a.reshape(-1, dim))
        if a.ndim >= 2 and a.shape[0] == dim:
            candidates += list(a.reshape(dim, -1).T)
        flat = a.reshape(-1)
        candidates += [flat[i : i + dim] for i in range(0, flat.size - dim + 1, dim)]

    def walk(value):
        if isinstance(value, list) and len(value) == dim and all(isinstance(v, (int, float)) for v in value):
            candidates.append(np.asarray(value, np.float32))
        elif isinstance(value, list):
            for v in value:
                walk(v)
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)

    walk(frame.meta)
    for vector in candidates:
        found += np.ascontiguousarray(vector, np.float32).tobytes() in samples
    return found


def test_signed_run_rejects_forgeries_and_leaks_no_sample(mosquitto, tmp_path: Path, repo_root: Path) -> None:
    scenario = repo_root / "configs/scenarios/quickstart.yaml"
    overrides = ["compare=[]", "federation.rounds_per_task=4", "sign_updates=true"]
    recorder = Recorder(mosquitto.port)
    out = tmp_path / "run"
    sim = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fcl_edge.cli",
            "simulate",
            str(scenario),
            "--out",
            str(out),
            "--broker",
            mosquitto.url,
            *sum((["--set", o] for o in overrides), []),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 120
    while len(recorder.updates_of("client-0")) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    first, latest = recorder.updates_of("client-0")[0], recorder.updates_of("client-0")[-1]
    assert is_signed(first)
    inner = decode(first[36:])
    attacker = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="attacker")
    attacker.connect("127.0.0.1", mosquitto.port)
    attacker.loop_start()
    topic = f"fcl/{FED}/update/client-0"
    forged_tensors = {
        k: (np.asarray(v.to_dense() if isinstance(v, SparseTensor) else v) * 0 + 1e3) for k, v in inner.tensors.items()
    }
    forged = encode(
        Frame(Header(Kind.UPDATE, FED, inner.header.round + 2, 0, "client-0", 2**62), inner.meta, forged_tensors)
    )
    injected = [
        sign(forged, bytes(32)),  # signed with a key that is not client-0's
        forged,  # unsigned
        latest,
        first,
    ]  # replays of client-0's own signed updates
    for payload in injected:
        attacker.publish(topic, payload, qos=1).wait_for_publish(5)
    output, _ = sim.communicate(timeout=scaled(240))
    attacker.loop_stop()
    recorder.client.loop_stop()
    assert sim.returncode == 0, output

    import json

    summary = json.loads((out / "summary.json").read_text())
    rejected = summary["rejected"]
    assert rejected.get("signature", 0) >= 2, rejected
    assert rejected.get("duplicate", 0) + rejected.get("replay", 0) + rejected.get("late", 0) >= 2, rejected
    # the rejected frames changed nothing: the numbers of an undisturbed in-process run of the same scenario
    from fcl_edge.simulate import simulate

    assert simulate(str(scenario), str(tmp_path / "undisturbed"), overrides=overrides, in_process=True) == 0
    undisturbed = json.loads((tmp_path / "undisturbed" / "summary.json").read_text())["final"]
    assert summary["final"]["avg_nll"] == undisturbed["avg_nll"] < 64 * math.log(2)  # below a coin flip per pixel
    assert summary["final"]["per_client"] == undisturbed["per_client"]

    # privacy guard: the clients' own training rows, as float32 bytes
    p = plan(str(scenario), overrides)
    train, test = load_dataset(p.scenario.data.dataset, p.scenario.data.path, p.scenario.federation.seed)
    keys = {c: (out / "keys" / f"{c}.key").read_text().strip() for c in p.client_ids}
    total_frames = 0
    for index, client in enumerate(p.client_ids):
        shard = client_task_split(train, test, p.client_tasks, index, p.scenario.federation.seed)
        samples = {row.astype(np.float32).tobytes() for d in shard.train for row in d.x}
        dim = shard.train[0].x.shape[1]
        for payload in recorder.updates_of(client):
            if payload in injected:
                continue
            frame = decode(verify(payload, bytes.fromhex(keys[client])))
            total_frames += 1
            assert leaked_vectors(frame, samples, dim) == 0, f"{client} sent a training sample"
        # the check can fail: the same frame carrying one training row is caught
        frame = decode(verify(recorder.updates_of(client)[0], bytes.fromhex(keys[client])))
        leaky = Frame(frame.header, {**frame.meta, "debug": shard.train[0].x[3].tolist()}, frame.tensors)
        assert leaked_vectors(leaky, samples, dim) == 1
    assert total_frames >= 3 * 8  # every round's update of every client was inspected
