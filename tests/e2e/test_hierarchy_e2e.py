"""A hierarchy of aggregators over real Mosquitto processes: a root broker, one broker per site
bridged to it with the shipped deploy/mosquitto/site-bridge.conf, the root aggregator service and
site aggregators.  Devices are played by a test client per site broker with hand-made updates
(dense and sparse), so the expected model is known exactly.

* flat vs two-level: the same updates through one aggregator and through two sites give the same
  global model to float32 rounding, and no device's raw update reaches the root broker;
* a site killed with SIGKILL mid-round and restarted re-collects its devices' updates (from its
  journal, and by asking the one whose update was lost while it was down), refuses a re-sent copy,
  and the root counts every device once.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import paho.mqtt.client as mqtt
import yaml
from support.mosquitto import Mosquitto
from support.timescale import scaled
from test_streaming_restart_e2e import Threaded, _wait

import methods
from aggregator.service import AggregatorService
from aggregator.site import SiteAggregator
from aggregator.state import StateStore
from fcl_edge.broker import site_bridge_config
from fcl_edge.simulate import plan, write_configs
from fclcore import topics
from fclcore.aggregation import weighted_average
from fclcore.codec import Frame, Header, Kind, SparseTensor, decode, encode
from fclcore.config import load_config, to_dict
from fclcore.schema import AggregatorConfig, BrokerSpec, SiteConfig

FED = "quickstart"
OVERRIDES = [
    "federation.rounds_per_task=1",  # two tasks: rounds 0 and 1
    "federation.rounds.deadline_s=60",
    "federation.rounds.resend_after_s=1",
]
SITES = {"site-a": ["d0", "d1"], "site-b": ["d2", "d3"]}
DEVICES = [d for share in SITES.values() for d in share]


def bridge_config(repo_root: Path, site: str, root_port: int) -> str:
    return site_bridge_config(FED, site, "127.0.0.1", root_port, repo_root / "deploy/mosquitto/site-bridge.conf")


class SiteDevices:
    """The devices of one broker, played by one MQTT client; a REQUEST naming one re-sends its last frame."""

    def __init__(self, port: int, clients: list[str]) -> None:
        self.clients, self.rounds, self.sent = clients, set(), {}
        self.mqtt = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"test-devices-{port}")
        self.mqtt.on_message = self._on_message
        self.mqtt.connect("127.0.0.1", port)
        self.mqtt.subscribe(topics.round_topic(FED), qos=1)
        self.mqtt.loop_start()
        for client in clients:
            status = json.dumps({"state": "online"}).encode()
            self.mqtt.publish(topics.status_topic(FED, client), status, qos=1, retain=True).wait_for_publish(5)

    def _on_message(self, client, userdata, message) -> None:
        if not message.payload:
            return
        frame = decode(message.payload)
        if frame.header.kind is Kind.ROUND:
            self.rounds.add(frame.header.round)
        if frame.header.kind is Kind.REQUEST:
            for device in set(frame.meta["missing"]) & set(self.sent):
                self.mqtt.publish(topics.update_topic(FED, device), self.sent[device], qos=1)

    def wait_for_round(self, rnd: int) -> None:
        _wait(lambda: rnd in self.rounds, f"round {rnd} announced on this broker", timeout=scaled(60))

    def send(self, client: str, rnd: int, tensors: dict, n_samples: int, publish: bool = True) -> bytes:
        header = Header(Kind.UPDATE, FED, rnd, rnd, client, time.time_ns() // 1000)
        payload = encode(Frame(header, {"n_samples": n_samples}, tensors), "float32")
        self.sent[client] = payload
        if publish:
            self.publish(client, payload)
        return payload

    def publish(self, client: str, payload: bytes) -> None:
        self.mqtt.publish(topics.update_topic(FED, client), payload, qos=1).wait_for_publish(5)

    def close(self) -> None:
        self.mqtt.loop_stop()
        self.mqtt.disconnect()


class Spy:
    """Every update topic the root broker carries."""

    def __init__(self, port: int) -> None:
        self.topics: set[str] = set()
        self.mqtt = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="test-spy")
        self.mqtt.on_message = lambda c, u, m: self.topics.add(m.topic)
        self.mqtt.connect("127.0.0.1", port)
        self.mqtt.subscribe(topics.update_filter(FED), qos=1)
        self.mqtt.loop_start()

    def close(self) -> None:
        self.mqtt.loop_stop()
        self.mqtt.disconnect()


def _updates(shapes: dict, seed: int) -> dict[int, dict[str, tuple[dict, int]]]:
    """Per round, per device: full-shape tensors (sparse weight matrices for odd devices, d3 all
    sparse, so some elements have no sender) and a sample count."""
    rng = np.random.default_rng(seed)
    out = {}
    for rnd in (0, 1):
        out[rnd] = {}
        for i, device in enumerate(DEVICES):
            tensors = {}
            for name, shape in shapes.items():
                values = rng.normal(size=shape).astype(np.float32)
                if i % 2 and len(shape) == 2:
                    tensors[name] = SparseTensor.from_dense(values, rng.random(shape) < 0.2)
                elif device == "d3":  # a nearly empty sparse bias
                    tensors[name] = SparseTensor.from_dense(values, rng.random(shape) < 0.05)
                else:
                    tensors[name] = values
            out[rnd][device] = (tensors, int(rng.integers(5, 300)))
    return out


def _root_config(repo_root: Path, work: Path, url: str, clients: list[str], sites: list[str]) -> AggregatorConfig:
    work.mkdir()
    configs = write_configs(plan(str(repo_root / "configs/scenarios/quickstart.yaml"), OVERRIDES), work, url)
    cfg = load_config(AggregatorConfig, configs["aggregator"][1])
    return dataclasses.replace(cfg, expected_clients=clients, sites=sites)


def _site_config(root: AggregatorConfig, site: str, url: str, work: Path) -> SiteConfig:
    return SiteConfig(
        federation=root.federation,
        site_id=site,
        expected_clients=SITES[site],
        broker=BrokerSpec(url=url),
        out_dir=str(work / site),
        input_dim=root.input_dim,
    )


def _run_rounds(cfg: AggregatorConfig, devices: dict[str, SiteDevices], updates: dict) -> dict[str, np.ndarray]:
    """Run rounds 0 and 1 with ``updates``; the committed global model after round 1."""
    store = StateStore(cfg.state_dir or Path(cfg.out_dir) / "state")
    root = Threaded(AggregatorService(cfg))
    try:
        for rnd in (0, 1):
            for device, (tensors, n) in updates[rnd].items():
                devices[device].wait_for_round(rnd)
                devices[device].send(device, rnd, tensors, n)
        _wait(lambda: (state := store.load()) is not None and state.round >= 1, "round 1 committed", timeout=scaled(90))
    finally:
        root.stop()
    return store.load().global_params


def test_two_levels_give_the_flat_model_and_keep_raw_updates_at_the_sites(tmp_path: Path, repo_root: Path) -> None:
    brokers = []
    try:
        flat_broker = Mosquitto(tmp_path / "flat-broker").start()
        brokers.append(flat_broker)
        flat_cfg = _root_config(repo_root, tmp_path / "flat", flat_broker.url, DEVICES, [])
        initial = methods.strategy_for(flat_cfg.federation, flat_cfg.input_dim).initial_model()
        updates = _updates({k: v.shape for k, v in initial.items()}, seed=18)
        flat_devices = SiteDevices(flat_broker.port, DEVICES)
        flat = _run_rounds(flat_cfg, dict.fromkeys(DEVICES, flat_devices), updates)
        flat_devices.close()

        root_broker = Mosquitto(tmp_path / "root-broker").start()
        brokers.append(root_broker)
        site_brokers = {
            s: Mosquitto(tmp_path / f"{s}-broker", bridge_config(repo_root, s, root_broker.port)).start() for s in SITES
        }
        brokers += site_brokers.values()
        spy = Spy(root_broker.port)
        cfg = _root_config(repo_root, tmp_path / "root", root_broker.url, list(SITES), list(SITES))
        sites = [
            Threaded(SiteAggregator(_site_config(cfg, s, b.url, tmp_path), threading.Event()))
            for s, b in site_brokers.items()
        ]
        per_site = {s: SiteDevices(site_brokers[s].port, SITES[s]) for s in SITES}
        two_level = _run_rounds(cfg, {d: per_site[s] for s in SITES for d in SITES[s]}, updates)
        for run in sites:
            run.stop()
        spy.close()
    finally:
        for broker in brokers:
            broker.stop()

    after0 = weighted_average(list(updates[0].values()), initial)
    expected = weighted_average(list(updates[1].values()), after0)
    for name in expected:
        np.testing.assert_array_max_ulp(flat[name], expected[name], maxulp=1)
        np.testing.assert_array_max_ulp(two_level[name], flat[name], maxulp=1)
    assert spy.topics == {topics.update_topic(FED, s) for s in SITES}  # partial sums only, never a device's update
    events = [json.loads(line) for line in (tmp_path / "site-a" / "metrics.jsonl").read_text().splitlines()]
    assert [(e["round"], e["devices"]) for e in events if e["event"] == "partial"] == [
        (0, ["d0", "d1"]),
        (1, ["d0", "d1"]),
    ]


def _start_site(cfg: SiteConfig, work: Path, repo_root: Path) -> subprocess.Popen:
    path = work / f"{cfg.site_id}.yaml"
    path.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    env = {**os.environ, "PYTHONPATH": str(repo_root)}
    with open(work / f"{cfg.site_id}.log", "a") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "fcl_edge.cli", "site", "--config", str(path)], env=env, stdout=log, stderr=log
        )


def test_a_site_killed_mid_round_re_collects_and_the_root_counts_each_device_once(tmp_path: Path, repo_root: Path):
    root_broker = Mosquitto(tmp_path / "root-broker").start()
    site_brokers = {
        s: Mosquitto(tmp_path / f"{s}-broker", bridge_config(repo_root, s, root_broker.port)) for s in SITES
    }
    for broker in site_brokers.values():
        broker.start()
    cfg = _root_config(repo_root, tmp_path / "root", root_broker.url, list(SITES), list(SITES))
    site_cfgs = {s: _site_config(cfg, s, b.url, tmp_path) for s, b in site_brokers.items()}
    journal = StateStore(Path(site_cfgs["site-a"].out_dir) / "state")
    root_store = StateStore(Path(cfg.out_dir) / "state")
    procs = {s: _start_site(c, tmp_path, repo_root) for s, c in site_cfgs.items()}
    per_site = {s: SiteDevices(site_brokers[s].port, SITES[s]) for s in SITES}
    root = Threaded(AggregatorService(cfg))
    try:
        initial = dict(root.service.global_params)
        updates = _updates({k: v.shape for k, v in initial.items()}, seed=7)[0]
        a, b = per_site["site-a"], per_site["site-b"]
        a.wait_for_round(0)
        sent_d0 = a.send("d0", 0, *updates["d0"])
        _wait(lambda: len(journal.journaled_clients(0)) == 1, "d0 journaled at site-a")
        procs["site-a"].send_signal(signal.SIGKILL)
        procs["site-a"].wait(10)
        a.send("d1", 0, *updates["d1"])  # nobody at site-a takes it: lost with the site
        for device in SITES["site-b"]:
            b.wait_for_round(0)
            b.send(device, 0, *updates[device])
        time.sleep(1.0)
        procs["site-a"] = _start_site(site_cfgs["site-a"], tmp_path, repo_root)
        _wait(lambda: "recovered from the journal" in (tmp_path / "site-a.log").read_text(), "site-a replayed")
        a.publish("d0", sent_d0)  # the same frame again: a duplicate at the site
        _wait(
            lambda: (state := root_store.load()) is not None and state.round >= 0,
            "round 0 committed",
            timeout=scaled(90),
        )
    finally:
        root.stop()
        a.close(), b.close()
        for proc in procs.values():
            proc.terminate()
            proc.wait(10)
        for broker in (root_broker, *site_brokers.values()):
            broker.stop()

    expected = weighted_average(list(updates.values()), initial)
    got = root_store.load().global_params
    for name in expected:
        np.testing.assert_array_max_ulp(got[name], expected[name], maxulp=1)
    twice = weighted_average([updates["d0"], *updates.values()], initial)  # d0 counted twice
    assert any(not np.allclose(got[k], twice[k]) for k in twice)
    site_log = (tmp_path / "site-a.log").read_text()
    assert "round 0: 1 update(s) recovered from the journal" in site_log
    assert "asked d1 to re-send" in site_log
    events = [json.loads(line) for line in (tmp_path / "site-a" / "metrics.jsonl").read_text().splitlines()]
    assert [e["devices"] for e in events if e["event"] == "partial" and e["round"] == 0] == [["d0", "d1"]]
    assert any(e["event"] == "rejected" and e["client"] == "d0" and e["reason"] == "duplicate" for e in events)
    root_events = [json.loads(line) for line in (Path(cfg.out_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [e["accepted"] for e in root_events if e["event"] == "round" and e["round"] == 0] == [2]
