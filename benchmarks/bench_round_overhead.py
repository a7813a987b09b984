"""Protocol overhead of a round: the real aggregator service and N MQTT clients, tiny model.

Each client is a real MQTT connection (``MqttLink``) that answers every round announcement
with the received tensors as its update, so training costs nothing and what is measured
is the protocol: round latency and bytes on the wire beyond the raw tensor bytes.
A Mosquitto broker is started on a free loopback port unless ``--broker`` is given.

    python benchmarks/bench_round_overhead.py --clients 20 --rounds 10
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from aggregator.service import AggregatorService  # noqa: E402
from fcl_edge.broker import MosquittoProcess  # noqa: E402
from fclcore import topics  # noqa: E402
from fclcore.codec import Frame, Header, Kind, decode, encode  # noqa: E402
from fclcore.schema import AggregatorConfig, BrokerSpec, FederationSpec, ModelSpec, RoundSpec, TrainSpec  # noqa: E402
from fclcore.transport import MqttLink  # noqa: E402

FED = "bench"


class EchoClient:
    """Answers each ROUND with the announced tensors (and a fake evaluation)."""

    def __init__(self, cid: str, broker: BrokerSpec) -> None:
        self.cid = cid
        self.sequence = 0
        self.done = threading.Event()
        self.link = MqttLink(
            broker,
            f"bench-{cid}",
            status_topic=topics.status_topic(FED, cid),
            subscriptions=[topics.round_topic(FED)],
            on_message=self._on_message,
        )

    def _on_message(self, topic: str, payload: bytes, size: int) -> None:
        if not payload:
            return
        frame = decode(payload)
        h = frame.header
        self.sequence += 1
        report = {"round": h.round - 1, "task": max(0, h.round - 1) // 10 if h.round else 0, "nll": [1.0]}
        kind = Kind.EVAL if h.kind is Kind.FINISH else Kind.UPDATE
        meta = {"n_samples": 10, "train_nll": 1.0, "eval": report}
        tensors = frame.tensors if kind is Kind.UPDATE else {}
        out = encode(Frame(Header(kind, FED, h.round, h.task, self.cid, self.sequence), meta, tensors))
        self.link.publish(topics.update_topic(FED, self.cid), out)
        if kind is Kind.EVAL:
            self.done.set()


def run(args: argparse.Namespace, out_dir: Path, url: str) -> dict:
    broker = BrokerSpec(url=url)
    ids = [f"c{i:03d}" for i in range(args.clients)]
    fed = FederationSpec(
        name=FED,
        num_tasks=1,
        rounds_per_task=args.rounds,
        model=ModelSpec(hidden_sizes=[args.hidden]),
        train=TrainSpec(),
        rounds=RoundSpec(deadline_s=60, start_timeout_s=60),
    )
    cfg = AggregatorConfig(
        federation=fed, expected_clients=ids, out_dir=str(out_dir), broker=broker, input_dim=args.input_dim
    )
    clients = [EchoClient(cid, broker) for cid in ids]
    for c in clients:
        c.link.start(30)
    service = AggregatorService(cfg)
    started = time.perf_counter()
    code = service.run()
    wall = time.perf_counter() - started
    for c in clients:
        c.done.wait(10)
        c.link.close()
    if code != 0:
        raise SystemExit(f"aggregator exited with {code}")
    events = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    rounds = [e for e in events if e["event"] == "round"]
    per_client = [e for e in events if e["event"] == "round_client"]
    tensor_bytes = service.strategy.dense_fp32_bytes
    up = np.mean([e["bytes_up"] for e in per_client])
    down = np.mean([e["bytes_down"] for e in per_client])
    return {
        "clients": args.clients,
        "rounds": args.rounds,
        "trainable_params": tensor_bytes // 4,
        "raw_tensor_bytes": tensor_bytes,
        "bytes_up_per_client_round": round(float(up), 1),
        "bytes_down_per_client_round": round(float(down), 1),
        "overhead_up_bytes": round(float(up) - tensor_bytes, 1),
        "overhead_up_pct": round(100 * (float(up) - tensor_bytes) / float(up), 2),
        "overhead_down_bytes": round(float(down) - tensor_bytes, 1),
        "round_latency_ms_median": round(1000 * float(np.median([e["duration_s"] for e in rounds])), 1),
        "round_latency_ms_p90": round(1000 * float(np.percentile([e["duration_s"] for e in rounds], 90)), 1),
        "wall_s": round(wall, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--input-dim", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=8)
    parser.add_argument("--broker", help="mqtt://host:port (default: start Mosquitto)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/round_overhead.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        broker = None if args.broker else MosquittoProcess(Path(tmp) / "broker").start()
        try:
            result = run(args, Path(tmp) / "run", args.broker or broker.url)
        finally:
            if broker is not None:
                broker.stop()
    result["machine"] = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }
    result["command"] = " ".join([Path(sys.executable).name, *sys.argv])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for key, value in result.items():
        if key != "machine":
            print(f"{key:>30}: {value}")


if __name__ == "__main__":
    main()
