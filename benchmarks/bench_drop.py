"""What a dropped link costs a device that is fetching a multi-megabyte retained frame, with the
frame sent whole and in chunks (``wire.chunk_bytes``; docs/protocol.md section 16).

The aggregator's outbox publishes one retained MODEL frame (``--frame-mb`` of float32 values)
on a real Mosquitto; a device process in its own network namespace behind a shaped link
(``fcl_edge.links``: tbf at the profile's rates, the relay's delay) subscribes to it, with the
device's chunk fetch (``edge_client.chunkfetch``).  Once ``--cut-at`` of the frame has crossed
the device's link, the relay cuts the connection; the device reconnects and
finishes.  Per mode, a run without a cut and one with it: the bytes that crossed the device's
link towards it (IP packets after the qdisc: the host end of its veth pair) and the seconds
until the frame was whole.  The drop's cost is the difference.

    sudo python benchmarks/bench_drop.py                       # lte-m, a 5.6 MB frame (Sequential MNIST's model)
    sudo python benchmarks/bench_drop.py --profile farm-wifi --frame-mb 2

Writes ``benchmarks/results/drop.json``.  Needs root (namespaces and qdiscs) and mosquitto.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from aggregator.outbox import Outbox  # noqa: E402
from fcl_edge.broker import MosquittoProcess  # noqa: E402
from fcl_edge.links import PROFILES, LinkProfile, LinkRelay, Namespace  # noqa: E402
from fclcore.codec import Frame, Header, Kind, encode  # noqa: E402
from fclcore.schema import BrokerSpec  # noqa: E402
from fclcore.transport import MqttLink  # noqa: E402

TOPIC = "fcl/drop/model/full"
SEQMNIST_MB = 5.6  # the 784-500-784 MADE with its direct connections, float32

# the device: fetch the retained frame on TOPIC (whole or in chunks) until its SHA-256 is argv[2]'s
DEVICE = """
import hashlib, json, queue, sys, time
from edge_client.chunkfetch import ChunkFetch
from fclcore.chunks import CHUNK_MAGIC
from fclcore.schema import BrokerSpec
from fclcore.transport import MqttLink
topic, want = sys.argv[1], sys.argv[2]
got = queue.Queue()
link = MqttLink(BrokerSpec(url=sys.argv[3], reconnect_min_s=0.2, reconnect_max_s=1.0), "fcl-drop-device",
                status_topic="fcl/drop/status/device", subscriptions=[topic],
                on_message=lambda t, p, n: got.put((t, p, n)))
fetch = ChunkFetch(link, 64 * 2**20)
start = time.monotonic()
link.start()
print("connected", flush=True)
while True:
    t, p, n = got.get(timeout=600)
    whole = fetch.take(t, p, n) if p[:4] == CHUNK_MAGIC else (t, p, n)
    if whole is not None and hashlib.sha256(whole[1]).hexdigest() == want:
        break
seconds = time.monotonic() - start
down = link.meter.snapshot()["down"]["bytes"]
print(json.dumps({"seconds": round(seconds, 1), "connects": link.connects, "metered_down": down}), flush=True)
link.close()
"""


def model_frame(megabytes: float, seed: int = 0) -> bytes:
    """A MODEL frame of about ``megabytes`` MB of float32 values (seeded, nothing compresses)."""
    values = np.random.default_rng(seed).standard_normal(int(megabytes * 1e6 / 4)).astype(np.float32)
    return encode(Frame(Header(Kind.MODEL, "drop", 1, 0, "aggregator", 1), {"run": "bench"}, {"w": values}))


def drop_run(
    broker_port: int, payload: bytes, chunk_bytes: int | None, profile: LinkProfile, cut_at: float | None
) -> dict:
    """Publish ``payload`` retained, let a shaped device fetch it, cut its link once the relay has
    passed ``cut_at`` of the frame (None: no cut); the relay's byte counts and the device's report."""
    agg = MqttLink(
        BrokerSpec(url=f"mqtt://127.0.0.1:{broker_port}"),
        "fcl-drop-aggregator",
        status_topic="fcl/drop/status/aggregator",
        subscriptions=[],
        on_message=lambda *_: None,
    )
    agg.start()
    try:
        sent = []
        outbox = Outbox(_Recorded(agg, sent), "drop", "bench", chunk_bytes=chunk_bytes)
        outbox.publish(TOPIC, payload, tag="sync:full")
        for info in sent:
            info.wait_for_publish(60)  # the broker holds every retained message before the device comes
        with Namespace(0, profile) as space:
            relay = LinkRelay(space.host_ip, ("127.0.0.1", broker_port), profile)
            try:
                return _fetch(space, relay, payload, cut_at)
            finally:
                relay.close()
    finally:
        agg.close()


@dataclasses.dataclass
class _Recorded:
    """The aggregator's link, keeping paho's handle of each message published."""

    link: MqttLink
    sent: list
    connects: int = 1

    def publish(self, topic: str, payload: bytes, *, retain: bool = False, tag: str | None = None):
        self.sent.append(self.link.publish(topic, payload, retain=retain, tag=tag))
        return self.sent[-1]


def _fetch(space: Namespace, relay: LinkRelay, payload: bytes, cut_at: float | None) -> dict:
    want = hashlib.sha256(payload).hexdigest()
    argv = space.wrap([sys.executable, "-c", DEVICE, TOPIC, want, f"mqtt://{space.host_ip}:{relay.port}"])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    device = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    cut_after = None
    if cut_at is not None:
        while device.poll() is None and space.link_bytes()["down"] < cut_at * len(payload):
            time.sleep(0.02)
        cut_after = space.link_bytes()["down"]
        relay.cut()
    out, err = device.communicate(timeout=900)
    if device.returncode != 0:
        raise RuntimeError(f"device failed: {err[-2000:]}")
    report = json.loads(out.strip().splitlines()[-1])
    crossed = space.link_bytes()
    return {**report, "cut_after_bytes": cut_after, "link_down": crossed["down"], "link_up": crossed["up"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="lte-m", choices=sorted(PROFILES))
    parser.add_argument("--frame-mb", type=float, default=SEQMNIST_MB)
    parser.add_argument("--chunk-bytes", type=int, default=256 * 1024)
    parser.add_argument(
        "--cut-at", type=float, nargs="+", default=[0.3, 0.5, 0.7], help="shares of the frame crossed before a cut"
    )
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/drop.json"))
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("bench_drop: shaping needs root", file=sys.stderr)
        return 2
    profile = dataclasses.replace(PROFILES[args.profile], stall_rate=0.0)  # stalls would only add noise
    payload = model_frame(args.frame_mb)
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-drop-") as work:
        broker = MosquittoProcess(Path(work) / "mosquitto")
        broker.start()
        try:
            for mode, chunk_bytes in (("whole", None), ("chunks", args.chunk_bytes)):
                clean = drop_run(broker.port, payload, chunk_bytes, profile, None)
                for share in args.cut_at:
                    cut = drop_run(broker.port, payload, chunk_bytes, profile, share)
                    run = {
                        "mode": mode,
                        "chunk_bytes": chunk_bytes,
                        "cut_at": share,
                        "clean": clean,
                        "cut": cut,
                        "drop_cost_bytes": cut["link_down"] - clean["link_down"],
                        "drop_cost_s": round(cut["seconds"] - clean["seconds"], 1),
                        "load_avg_1m": round(os.getloadavg()[0], 2),
                    }
                    print(json.dumps(run), flush=True)
                    runs.append(run)
        finally:
            broker.stop()
    result = {
        "frame_bytes": len(payload),
        "profile": f"{profile.name}: {profile.describe} (stalls off)",
        "runs": runs,
        "machine": f"{platform.node()} {platform.platform()}, {os.cpu_count()} CPUs",
        "command": "python benchmarks/bench_drop.py " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
