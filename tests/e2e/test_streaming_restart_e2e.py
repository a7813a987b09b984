"""Streaming aggregation keeps the journal's exactly-once guarantee, over a real Mosquitto.

The aggregator service runs in a thread with a real MQTT link; the devices are a test client
that publishes hand-made updates (dense and sparse), so the expected model is known exactly.
Round 1 is interrupted after two of three updates were accepted and journaled; a new service
on the same state directory folds the journaled ones into a rebuilt running sum, rejects both
a re-sent copy and a second update of a device it already has, and closes the round with the
third: the committed model is the weighted average of each update once.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import paho.mqtt.client as mqtt

from aggregator.service import AggregatorService
from aggregator.state import StateStore
from fcl_edge.simulate import plan, write_configs
from fclcore import topics
from fclcore.aggregation import weighted_average
from fclcore.codec import Frame, Header, Kind, SparseTensor, decode, encode
from fclcore.config import load_config
from fclcore.exitcodes import ExitCode
from fclcore.schema import AggregatorConfig

FED = "quickstart"
OVERRIDES = [
    "federation.rounds_per_task=1",  # two tasks: rounds 0 and 1
    "federation.rounds.deadline_s=60",
    "federation.rounds.resend_after_s=60",
]


class Threaded:
    def __init__(self, service: AggregatorService) -> None:
        self.service, self.code = service, None
        self.thread = threading.Thread(target=lambda: setattr(self, "code", service.run()), daemon=True)
        self.thread.start()

    def stop(self) -> ExitCode:
        self.service.stop.set()
        self.thread.join(30)
        assert not self.thread.is_alive(), "the aggregator did not stop"
        return self.code


class Devices:
    """Every device of the federation, played by one MQTT client of the test."""

    def __init__(self, port: int, clients: list[str]) -> None:
        self.clients, self.announced = clients, []
        self.mqtt = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="test-devices")
        self.mqtt.on_message = lambda c, u, m: self.announced.append(decode(m.payload)) if m.payload else None
        self.mqtt.connect("127.0.0.1", port)
        self.mqtt.subscribe(topics.round_topic(FED), qos=1)
        self.mqtt.loop_start()
        for client in clients:
            status = json.dumps({"state": "online"}).encode()
            self.mqtt.publish(topics.status_topic(FED, client), status, qos=1, retain=True).wait_for_publish(5)

    def wait_for_round(self, rnd: int, times: int = 1) -> None:
        """Until round ``rnd`` was announced ``times`` times (a restarted service announces it again)."""
        deadline = time.monotonic() + 60
        while sum(f.header.kind is Kind.ROUND and f.header.round == rnd for f in list(self.announced)) < times:
            assert time.monotonic() < deadline, f"round {rnd} not announced {times} time(s)"
            time.sleep(0.02)

    def send(self, client: str, rnd: int, tensors: dict, n_samples: int) -> bytes:
        header = Header(Kind.UPDATE, FED, rnd, rnd, client, time.time_ns() // 1000)
        payload = encode(Frame(header, {"n_samples": n_samples}, tensors), "float32")
        self.publish(client, payload)
        return payload

    def publish(self, client: str, payload: bytes) -> None:
        self.mqtt.publish(topics.update_topic(FED, client), payload, qos=1).wait_for_publish(5)

    def close(self) -> None:
        self.mqtt.loop_stop()
        self.mqtt.disconnect()


def _update(shapes: dict, rng: np.random.Generator, sparse: bool) -> dict:
    """Full-shape tensors; with ``sparse`` every weight matrix is a SparseTensor at ~30% density."""
    out = {}
    for name, shape in shapes.items():
        values = rng.normal(size=shape).astype(np.float32)
        keep = sparse and len(shape) == 2
        out[name] = SparseTensor.from_dense(values, rng.random(shape) < 0.3) if keep else values
    return out


def _wait(predicate, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_restart_mid_round_folds_each_journaled_update_once(mosquitto, tmp_path: Path, repo_root: Path, caplog):
    caplog.set_level("INFO", logger="aggregator")
    configs = write_configs(
        plan(str(repo_root / "configs/scenarios/quickstart.yaml"), OVERRIDES), tmp_path, mosquitto.url
    )
    cfg = load_config(AggregatorConfig, configs["aggregator"][1])
    store = StateStore(cfg.state_dir or Path(cfg.out_dir) / "state")
    c0, c1, c2 = clients = list(cfg.expected_clients)
    rng = np.random.default_rng(18)
    devices = Devices(mosquitto.port, clients)
    first = Threaded(AggregatorService(cfg))
    try:
        shapes = {k: v.shape for k, v in first.service.global_params.items()}
        initial = dict(first.service.global_params)
        devices.wait_for_round(0)
        round0 = {c: (_update(shapes, rng, sparse=c != c0), int(rng.integers(5, 200))) for c in clients}
        for client, (tensors, n) in round0.items():
            devices.send(client, 0, tensors, n)
        devices.wait_for_round(1)
        round1 = {c: (_update(shapes, rng, sparse=c != c1), int(rng.integers(5, 200))) for c in clients}
        sent_c0 = devices.send(c0, 1, *round1[c0])
        devices.send(c1, 1, *round1[c1])
        _wait(lambda: len(store.journaled_clients(1)) == 2, "two updates of round 1 journaled")
        assert first.stop() is ExitCode.INTERRUPTED  # round 1 stays open; its journal carries over

        second = Threaded(AggregatorService(cfg))
        devices.wait_for_round(1, times=2)
        devices.publish(c0, sent_c0)  # the same frame again: a duplicate
        devices.send(c0, 1, _update(shapes, rng, sparse=False), 7)  # a second update for the round: refused
        time.sleep(0.5)  # both reach the service before the round can close
        devices.send(c2, 1, *round1[c2])
        _wait(lambda: (state := store.load()) is not None and state.round >= 1, "round 1 committed")
        second.stop()
    finally:
        devices.close()
        for run in (first, locals().get("second")):
            if run is not None and run.thread.is_alive():
                run.stop()

    after0 = weighted_average(list(round0.values()), initial)
    expected = weighted_average([round1[c] for c in clients], after0)
    got = store.load().global_params
    for name in expected:
        np.testing.assert_array_max_ulp(got[name], expected[name], maxulp=1)
    twice = weighted_average([round1[c0], *(round1[c] for c in clients)], after0)  # what a double fold would give
    assert any(not np.allclose(got[k], twice[k]) for k in twice)
    assert "round 1: 2 update(s) recovered from the journal" in caplog.text
    events = [json.loads(line) for line in (Path(cfg.out_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [e["accepted"] for e in events if e["event"] == "round"] == [3, 3]
    refused = [e for e in events if e["event"] == "rejected" and e.get("client") == c0]
    assert sorted(e["reason"] for e in refused) == ["duplicate", "duplicate"], refused
    by_kind = [e["tensor_bytes_by_kind"]["model"] for e in events if e["event"] == "round_client" and e["round"] == 1]
    assert len(by_kind) == 3 and all(b > 0 for b in by_kind)  # counted before the fold dropped the tensors
