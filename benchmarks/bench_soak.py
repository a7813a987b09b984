"""Soak: N devices, each with its own MQTT connection, x R rounds through one Mosquitto.

The aggregator is the real service (``fcl aggregator``) in its own process with device keys
(every update is signed and verified).  Devices are light threads in this process that
answer each round with the announced model plus noise, signed with their own key, and
re-send when the aggregator asks: the load is the protocol, not training.  Checked: every
accepted update is counted exactly once (one ``round_client`` row per round and device,
every one accepted).  Reported: round latency, and CPU seconds and peak RSS of the broker
and the aggregator (from /proc, sampled every 50 ms).

    python benchmarks/bench_soak.py --clients 100 --rounds 20
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fcl_edge.broker import MosquittoProcess  # noqa: E402
from fclcore import topics  # noqa: E402
from fclcore.codec import Frame, Header, Kind, decode, encode  # noqa: E402
from fclcore.config import to_dict  # noqa: E402
from fclcore.schema import AggregatorConfig, BrokerSpec, FederationSpec, ModelSpec, RoundSpec, TrainSpec  # noqa: E402
from fclcore.signing import sign, write_key  # noqa: E402
from fclcore.transport import MqttLink  # noqa: E402

FED = "soak"


class Device:
    """Answers each ROUND with global + noise (signed), FINISH with an evaluation."""

    def __init__(self, cid: str, index: int, broker: BrokerSpec, key: bytes) -> None:
        self.cid, self.key = cid, key
        self.rng = np.random.default_rng(index)
        self.sequence = time.time_ns() // 1000
        self.last: tuple[int, bytes] | None = None
        self.done = threading.Event()
        self.link = MqttLink(
            broker,
            f"soak-{cid}",
            status_topic=topics.status_topic(FED, cid),
            subscriptions=[topics.round_topic(FED)],
            on_message=self._on_message,
        )

    def _on_message(self, topic: str, payload: bytes, size: int) -> None:
        if not payload:
            return
        frame = decode(payload)
        h = frame.header
        if h.kind is Kind.REQUEST:
            if self.last and self.last[0] == h.round and self.cid in frame.meta.get("missing", []):
                self.link.publish(topics.update_topic(FED, self.cid), self.last[1])
            return
        if self.last and h.kind is Kind.ROUND and h.round <= self.last[0]:
            return
        self.sequence += 1
        report = {"round": h.round - 1, "task": 0, "nll": [1.0]}
        if h.kind is Kind.FINISH:
            kind, meta, tensors = Kind.EVAL, {"eval": report}, {}
        else:
            kind, meta = Kind.UPDATE, {"n_samples": 10, "train_nll": 1.0, "eval": report}
            tensors = {k: (v + self.rng.normal(0, 1e-3, v.shape)).astype(np.float32) for k, v in frame.tensors.items()}
        out = sign(encode(Frame(Header(kind, FED, h.round, h.task, self.cid, self.sequence), meta, tensors)), self.key)
        self.last = (h.round, out)
        self.link.publish(topics.update_topic(FED, self.cid), out)
        if kind is Kind.EVAL:
            self.done.set()


class Sampler(threading.Thread):
    """Peak RSS and CPU seconds of a process, sampled until stopped."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.proc = psutil.Process(pid)
        self.peak_rss = 0
        self.cpu_s = 0.0
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            try:
                self.peak_rss = max(self.peak_rss, self.proc.memory_info().rss)
                t = self.proc.cpu_times()
                self.cpu_s = t.user + t.system
            except psutil.Error:
                return
            time.sleep(0.05)


def run(args: argparse.Namespace, work: Path) -> dict:
    broker_proc = MosquittoProcess(work / "broker").start()
    broker = BrokerSpec(url=broker_proc.url)
    ids = [f"d{i:03d}" for i in range(args.clients)]
    keys = {cid: write_key(work / "keys" / f"{cid}.key") for cid in ids}
    fed = FederationSpec(
        name=FED,
        num_tasks=1,
        rounds_per_task=args.rounds,
        model=ModelSpec(hidden_sizes=[args.hidden]),
        train=TrainSpec(),
        rounds=RoundSpec(deadline_s=120, start_timeout_s=120, resend_after_s=30),
    )
    cfg = AggregatorConfig(
        federation=fed,
        expected_clients=ids,
        out_dir=str(work / "run"),
        broker=broker,
        input_dim=args.input_dim,
        keys_dir=str(work / "keys"),
    )
    (work / "aggregator.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    devices = [Device(cid, i, broker, keys[cid]) for i, cid in enumerate(ids)]
    for d in devices:
        d.link.start(60)
    broker_sampler = Sampler(broker_proc.proc.pid)
    broker_sampler.start()
    started = time.perf_counter()
    with open(work / "aggregator.log", "w") as log:
        agg = subprocess.Popen(
            [sys.executable, "-m", "fcl_edge.cli", "aggregator", "--config", str(work / "aggregator.yaml")],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        agg_sampler = Sampler(agg.pid)
        agg_sampler.start()
        code = agg.wait(args.timeout)
    wall = time.perf_counter() - started
    agg_sampler.halt.set()
    for d in devices:
        d.done.wait(10)
        d.link.close()
    broker_sampler.halt.set()
    broker_proc.stop()
    if code != 0:
        raise SystemExit(f"aggregator exited with {code}; see {work / 'aggregator.log'}")
    events = [json.loads(line) for line in (work / "run/metrics.jsonl").read_text().splitlines()]
    rows = [e for e in events if e["event"] == "round_client"]
    pairs = collections.Counter((e["round"], e["client"]) for e in rows)
    accepted = sum(e["status"] == "accepted" for e in rows)
    durations = [e["duration_s"] for e in events if e["event"] == "round"]
    summary = json.loads((work / "run/summary.json").read_text())
    return {
        "clients": args.clients,
        "rounds": args.rounds,
        "signed": True,
        "accepted_updates": accepted,
        "expected_updates": args.clients * args.rounds,
        "each_counted_once": set(pairs.values()) == {1} and len(pairs) == args.clients * args.rounds,
        "rejected": summary["rejected"],
        "round_latency_s_median": round(float(np.median(durations)), 3),
        "round_latency_s_p90": round(float(np.percentile(durations, 90)), 3),
        "update_bytes": int(np.mean([e["bytes_up"] for e in rows])),
        "aggregator": {"cpu_s": round(agg_sampler.cpu_s, 2), "peak_rss_mb": round(agg_sampler.peak_rss / 2**20, 1)},
        "broker": {"cpu_s": round(broker_sampler.cpu_s, 2), "peak_rss_mb": round(broker_sampler.peak_rss / 2**20, 1)},
        "wall_s": round(wall, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--input-dim", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/soak.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = run(args, Path(tmp))
    result["machine"] = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }
    result["command"] = " ".join(["python", *sys.argv])
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    if not result["each_counted_once"] or result["accepted_updates"] != result["expected_updates"]:
        raise SystemExit("soak: some update was lost or counted twice")


if __name__ == "__main__":
    main()
