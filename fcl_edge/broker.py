"""The embedded broker for the zero-config demo (amqtt).  Production and tests use Mosquitto."""

from __future__ import annotations

import asyncio
import logging
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from fclcore.exitcodes import ExitCode

log = logging.getLogger(__name__)


def run_embedded_broker(host: str = "127.0.0.1", port: int = 1883) -> int:
    """Serve MQTT on host:port until SIGTERM/SIGINT."""
    try:
        from amqtt.broker import Broker
    except ImportError:
        log.error("the embedded broker needs amqtt: pip install 'fcl-edge[broker]', or pass --broker")
        return int(ExitCode.BAD_INPUT)
    logging.getLogger("amqtt").setLevel(logging.WARNING)
    logging.getLogger("transitions").setLevel(logging.WARNING)
    config = {
        "listeners": {"default": {"type": "tcp", "bind": f"{host}:{port}"}},
        "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}},
    }

    async def serve() -> None:
        broker = Broker(config)
        await broker.start()
        log.info("embedded broker listening on %s:%d", host, port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await broker.shutdown()

    asyncio.run(serve())
    return int(ExitCode.OK)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def wait_for_port(host: str, port: int, timeout: float) -> bool:
    """True once something accepts TCP connections on host:port."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.1)
    return False


class MosquittoProcess:
    """A Mosquitto broker on a free loopback port, for tests and benchmarks."""

    def __init__(self, workdir: Path, extra_config: str = "") -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.extra_config = extra_config
        self.proc: subprocess.Popen | None = None
        self.log_path = self.workdir / "mosquitto.log"

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    def start(self, timeout: float = 10.0) -> "MosquittoProcess":
        binary = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
        conf = self.workdir / "mosquitto.conf"
        conf.write_text(f"listener {self.port} 127.0.0.1\nallow_anonymous true\npersistence false\n"
                        f"max_queued_messages 0\nlog_dest stdout\n{self.extra_config}\n")
        with open(self.log_path, "a") as log_file:
            self.proc = subprocess.Popen([binary, "-c", str(conf)], stdout=log_file, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mosquitto exited: {self.log_path.read_text()}")
            if wait_for_port("127.0.0.1", self.port, 0.2):
                return self
        raise RuntimeError("mosquitto did not start listening")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
