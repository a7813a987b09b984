"""A NATS cluster as the MQTT broker tier: node configs, and a runner for tests and demos.

Each node runs JetStream with its own store and the MQTT gateway; the MQTT streams
(sessions, QoS 1 messages, retained messages) are replicated ``replicas`` times, so a
retained round announcement and a device's status outlive the node they were published
on.  ``python -m fcl_edge.nats_cluster write DIR`` writes the node configs that
``deploy/nats/`` ships; ``run`` starts them in the foreground.  See docs/scaling-out.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from fcl_edge.broker import free_port, wait_for_port

CLUSTER_NAME = "fcl"
MAX_PAYLOAD = "64MB"  # NATS's ceiling; frames above wire.max_frame_mb = 64 are refused anyway


@dataclass(frozen=True)
class NodePorts:
    client: int  # NATS protocol (unused by fcl-edge; monitoring tools use it)
    route: int  # cluster routes between the nodes
    mqtt: int  # what devices and the aggregator connect to


def node_config(index: int, ports: Sequence[NodePorts], store: Path, host: str = "127.0.0.1", replicas: int = 3) -> str:
    """The nats-server config of node ``index`` of a cluster whose nodes listen on ``ports``
    (one node: no cluster block, as JetStream refuses a cluster without routes)."""
    own = ports[index]
    routes = ", ".join(f"nats-route://{host}:{p.route}" for i, p in enumerate(ports) if i != index)
    cluster = f"""
cluster {{
  name: {CLUSTER_NAME}
  listen: {host}:{own.route}
  routes: [{routes}]
}}
"""
    return f"""# fcl-edge broker tier: node {index} of a {len(ports)}-node NATS cluster (MQTT over JetStream).
server_name: n{index}
listen: {host}:{own.client}
max_payload: {MAX_PAYLOAD}

jetstream {{
  store_dir: "{store / f"n{index}"}"
}}
{cluster if len(ports) > 1 else ""}
mqtt {{
  listen: {host}:{own.mqtt}
  # sessions, QoS 1 messages and retained messages on {replicas} node(s): a minority may go away
  stream_replicas: {replicas}
}}
"""


class NatsCluster:
    """``nodes`` nats-server processes on free loopback ports, clustered, MQTT on each."""

    def __init__(
        self,
        workdir: Path,
        nodes: int = 3,
        ports: Sequence[NodePorts] | None = None,
        *,
        store: Path | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        if nodes < 1 or nodes % 2 == 0:
            raise ValueError(f"nodes: expected an odd count (JetStream needs a majority), got {nodes}")
        self.workdir = Path(workdir)
        self.ports = list(ports) if ports else [NodePorts(free_port(), free_port(), free_port()) for _ in range(nodes)]
        if len(self.ports) != nodes:
            raise ValueError(f"ports: expected {nodes} entries, got {len(self.ports)}")
        self.procs: list[subprocess.Popen | None] = [None] * nodes
        self.store = Path(store) if store is not None else self.workdir / "store"
        self.host = host

    @property
    def urls(self) -> list[str]:
        """The MQTT url of every node, in node order."""
        return [f"mqtt://{self.host}:{p.mqtt}" for p in self.ports]

    def config_path(self, index: int) -> Path:
        return self.workdir / f"node-{index}.conf"

    def log_path(self, index: int) -> Path:
        return self.workdir / f"node-{index}.log"

    def write(self) -> list[Path]:
        self.workdir.mkdir(parents=True, exist_ok=True)
        replicas = min(3, len(self.ports))
        for index in range(len(self.ports)):
            text = node_config(index, self.ports, self.store, host=self.host, replicas=replicas)
            self.config_path(index).write_text(text)
        return [self.config_path(i) for i in range(len(self.ports))]

    def start(self, timeout: float = 30.0) -> "NatsCluster":
        """Start every node; return once each accepts MQTT connections (JetStream ready)."""
        self.write()
        for index in range(len(self.ports)):
            self.start_node(index)
        deadline = time.monotonic() + timeout
        for index in range(len(self.ports)):
            self._wait_ready(index, deadline)
        return self

    def start_node(self, index: int) -> None:
        binary = nats_server_binary()
        if binary is None:
            raise RuntimeError("nats-server is not installed (apt-get install nats-server)")
        with open(self.log_path(index), "a") as log_file:
            self.procs[index] = subprocess.Popen(
                [binary, "-c", str(self.config_path(index))], stdout=log_file, stderr=subprocess.STDOUT
            )

    def _wait_ready(self, index: int, deadline: float) -> None:
        from fcl_edge.broker import probe_broker  # an MQTT CONNECT: JetStream must be up to answer it
        from fclcore.errors import BrokerUnreachable

        proc = self.procs[index]
        while True:
            if proc is None or proc.poll() is not None:
                raise RuntimeError(f"nats-server node {index} exited: {self.log_path(index).read_text()[-2000:]}")
            if wait_for_port(self.host, self.ports[index].mqtt, 0.2):
                try:
                    probe_broker(self.urls[index], timeout=2.0)
                    return
                except BrokerUnreachable:
                    pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"nats-server node {index} did not accept MQTT in time; log: {self.log_path(index)}")
            time.sleep(0.2)

    def kill_node(self, index: int) -> None:
        """SIGKILL one node, as a machine that loses power."""
        proc = self.procs[index]
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)

    def stop(self) -> None:
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            if proc is not None:
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def nats_server_binary() -> str | None:
    return shutil.which("nats-server") or ("/usr/sbin/nats-server" if os.path.exists("/usr/sbin/nats-server") else None)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fcl_edge.nats_cluster",
        description="Write (and with 'run', start) the node configs of a NATS cluster that serves MQTT. "
        "Node i listens on NATS port + i, route port + i and MQTT port + i.",
    )
    parser.add_argument("command", choices=["write", "run"], help="write the node configs, or write and run them")
    parser.add_argument("dir", type=Path, help="where node-<i>.conf (and with 'run', node-<i>.log) go")
    parser.add_argument("--nodes", type=int, default=3, help="an odd number of nodes (default 3)")
    parser.add_argument("--store", type=Path, help="JetStream store root, one n<i> folder per node (default DIR/store)")
    parser.add_argument("--host", default="127.0.0.1", help="the address every node listens on (default 127.0.0.1)")
    parser.add_argument("--nats-port", type=int, default=4222, help="first node's NATS client port (default 4222)")
    parser.add_argument("--route-port", type=int, default=6222, help="first node's cluster route port (default 6222)")
    parser.add_argument("--mqtt-port", type=int, default=1883, help="first node's MQTT port (default 1883)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    bases = (args.nats_port, args.route_port, args.mqtt_port)
    if args.nodes < 1 or args.nodes % 2 == 0:
        return _usage_error(f"--nodes: expected an odd count >= 1, got {args.nodes}")
    if not all(1 <= b and b + args.nodes - 1 <= 65535 for b in bases):
        return _usage_error(f"ports: expected 1..65535 for every node, got bases {bases} for {args.nodes} nodes")
    spans = [set(range(b, b + args.nodes)) for b in bases]
    if spans[0] & spans[1] or spans[0] & spans[2] or spans[1] & spans[2]:
        return _usage_error(f"ports: the NATS, route and MQTT port ranges overlap (bases {bases})")
    ports = [NodePorts(*(b + i for b in bases)) for i in range(args.nodes)]
    cluster = NatsCluster(args.dir, args.nodes, ports, store=args.store, host=args.host)
    for path in cluster.write():
        print(path)
    if args.command == "write":
        return 0
    stop_signals = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)  # held for sigwait, not acted on
    try:
        cluster.start()
        print("MQTT urls:", " ".join(cluster.urls), flush=True)
        signal.sigwait(stop_signals)
    finally:
        cluster.stop()
    return 0


def _usage_error(message: str) -> int:
    print(f"nats_cluster: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
