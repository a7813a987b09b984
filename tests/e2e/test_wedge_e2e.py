"""The three ways an earlier fault run wedged a fleet (issue 22), as regression tests over a
real Mosquitto: the aggregator service and the device daemons run as threads of this process
with real MQTT links, the broker is a separate process (with persistence where it matters).

1. A stale retained FINISH of an earlier, finished run, back after a broker restart from its
   persistence file: devices ignore it and finish their own run.
2. A stale retained ROUND of an aborted run, on the broker when a fresh run starts: devices
   that trained it join the new run, and every round of the new run gets every update.
3. A forged update with a sequence 31 years ahead, unsigned: rejected ("sequence"), and the
   device's genuine updates are all accepted.
4. The aggregator gives up: devices end (exit 7) instead of waiting.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import paho.mqtt.client as mqtt
from support.mosquitto import Mosquitto

from aggregator.service import AggregatorService
from edge_client.daemon import ClientDaemon
from fcl_edge.simulate import plan, write_configs
from fclcore import topics
from fclcore.codec import Frame, Header, Kind, encode
from fclcore.config import load_config
from fclcore.exitcodes import ExitCode
from fclcore.schema import AggregatorConfig, ClientConfig

OVERRIDES = ["federation.rounds_per_task=2", "federation.rounds.resend_after_s=1", "federation.rounds.deadline_s=60"]
FED = "quickstart"


class Running:
    """A service (aggregator or daemon) running in a thread; ``code`` once it returned."""

    def __init__(self, service) -> None:
        self.service, self.code = service, None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.code = self.service.run()

    def wait(self, timeout: float = 90) -> ExitCode:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"{type(self.service).__name__} still running after {timeout} s"
        return self.code


class Run:
    """One run of the quickstart federation: configs in ``out``, services started on demand."""

    def __init__(self, repo: Path, out: Path, url: str, overrides=()) -> None:
        out.mkdir(parents=True)
        configs = write_configs(
            plan(str(repo / "configs/scenarios/quickstart.yaml"), [*OVERRIDES, *overrides]), out, url
        )
        self.out = out
        self.agg_cfg = load_config(AggregatorConfig, configs["aggregator"][1])
        self.client_cfgs = {n: load_config(ClientConfig, p) for n, (k, p) in configs.items() if k == "client"}
        self.clients: dict[str, Running] = {}
        self.agg: Running | None = None

    def start_aggregator(self, **changes) -> Running:
        self.agg = Running(AggregatorService(dataclasses.replace(self.agg_cfg, **changes)))
        return self.agg

    def start_clients(self, names=None) -> None:
        for name in names or self.client_cfgs:
            self.clients[name] = Running(ClientDaemon(self.client_cfgs[name]))

    def events(self, kind: str) -> list[dict]:
        path = self.out / "metrics.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return [e for e in map(json.loads, lines) if e.get("event") == kind]

    def wait_for_round(self, rnd: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not any(e["round"] >= rnd for e in self.events("round")):
            assert time.monotonic() < deadline, f"round {rnd} did not close"
            time.sleep(0.05)

    def finish(self) -> dict[str, int]:
        codes = {"aggregator": self.agg.wait()}
        codes.update({n: r.wait() for n, r in self.clients.items()})
        return codes

    def stop_all(self) -> None:
        for r in [*self.clients.values(), *([self.agg] if self.agg else [])]:
            r.service.stop.set()
        for r in [*self.clients.values(), *([self.agg] if self.agg else [])]:
            r.thread.join(30)

    def assert_every_round_once(self) -> None:
        rounds = self.agg.service.fed.total_rounds
        assert collections.Counter(e["round"] for e in self.events("round")) == {r: 1 for r in range(rounds)}
        pairs = collections.Counter((e["round"], e["client"]) for e in self.events("round_client"))
        assert len(pairs) == rounds * len(self.client_cfgs) and set(pairs.values()) == {1}
        assert all(e["status"] == "accepted" for e in self.events("round_client"))


def test_a_stale_finish_from_the_brokers_persistence_file_is_ignored(tmp_path, repo_root) -> None:
    broker = Mosquitto(tmp_path / "broker", persistence_dir=tmp_path / "broker" / "db").start()
    try:
        earlier = Run(repo_root, tmp_path / "earlier", broker.url)
        earlier.start_aggregator()
        earlier.start_clients()
        assert set(earlier.finish().values()) == {ExitCode.OK}
        broker.stop()  # a clean stop writes the persistence file: it holds the earlier run's FINISH
        snapshot = tmp_path / "finished-run.db"
        shutil.copy(broker.persistence_dir / "mosquitto.db", snapshot)
        broker.start()
        run = Run(repo_root, tmp_path / "current", broker.url)  # fresh state: a new run
        run.start_aggregator()
        run.start_clients()
        run.wait_for_round(0)
        run.agg.service.stop.set()  # the aggregator goes down between rounds ...
        assert run.agg.wait() is ExitCode.INTERRUPTED
        broker.kill()  # ... then the broker dies and comes back from the old persistence file
        shutil.copy(snapshot, broker.persistence_dir / "mosquitto.db")
        broker.start()
        deadline = time.monotonic() + 30
        while not all(c.service.stats.rejected.get("run") for c in run.clients.values()):
            assert time.monotonic() < deadline, {n: c.service.stats.rejected for n, c in run.clients.items()}
            time.sleep(0.05)  # every device got the stale FINISH, and none took it as its end
        assert all(c.code is None for c in run.clients.values())
        run.start_aggregator()  # resumes the same run
        assert set(run.finish().values()) == {ExitCode.OK}
        run.assert_every_round_once()
    finally:
        broker.stop()


# docs/protocol.md P-9.3
def test_a_stale_round_of_an_aborted_run_does_not_wedge_a_fresh_run(tmp_path, repo_root, mosquitto) -> None:
    aborted = Run(repo_root, tmp_path / "aborted", mosquitto.url)
    aborted.start_aggregator()
    aborted.start_clients()
    aborted.wait_for_round(1)
    aborted.stop_all()  # its retained ROUND (1 or later) stays on the broker
    run = Run(repo_root, tmp_path / "fresh", mosquitto.url)
    run.start_clients()  # fresh devices meet the stale ROUND first and train it
    deadline = time.monotonic() + 30
    while not all(c.service.device.done_round >= 1 for c in run.clients.values()):
        assert time.monotonic() < deadline, {n: c.service.device.done_round for n, c in run.clients.items()}
        time.sleep(0.05)
    run.start_aggregator()  # a new run: clears the stale messages; devices join it
    assert set(run.finish().values()) == {ExitCode.OK}
    run.assert_every_round_once()


def test_a_forged_far_future_sequence_locks_no_device_out(tmp_path, repo_root, mosquitto) -> None:
    run = Run(repo_root, tmp_path / "run", mosquitto.url)
    run.start_aggregator()
    run.start_clients()
    run.wait_for_round(0)
    far = time.time_ns() // 1000 + 31 * 365 * 86400 * 10**6
    forger = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="forger")
    forger.connect("127.0.0.1", mosquitto.port)
    forger.loop_start()
    try:
        for rnd in (1, 2):  # the open round, whichever of the two it is
            header = Header(Kind.UPDATE, FED, rnd, 0, "client-0", far)
            payload = encode(Frame(header, {"n_samples": 5}, {"w": np.zeros(3, np.float32)}))
            forger.publish(topics.update_topic(FED, "client-0"), payload, qos=1).wait_for_publish(5)
    finally:
        forger.loop_stop()
        forger.disconnect()
    assert set(run.finish().values()) == {ExitCode.OK}
    run.assert_every_round_once()  # client-0's genuine updates were all accepted
    rejected = json.loads((run.out / "summary.json").read_text())["rejected"]
    assert rejected.get("sequence") == 2 and "replay" not in rejected


def test_devices_end_when_the_aggregator_gives_up(tmp_path, repo_root, mosquitto) -> None:
    run = Run(repo_root, tmp_path / "run", mosquitto.url, ["federation.rounds.start_timeout_s=3"])
    run.start_clients(["client-0", "client-1"])  # client-2 never comes: the quorum (all 3) is not met
    time.sleep(1)
    run.start_aggregator()
    codes = run.finish()
    assert codes == {
        "aggregator": ExitCode.NOT_ENOUGH_CLIENTS,
        "client-0": ExitCode.FEDERATION_FAILED,
        "client-1": ExitCode.FEDERATION_FAILED,
    }
    failed = [e for e in run.events("failed")]
    assert len(failed) == 1 and "quorum" in failed[0]["reason"]
