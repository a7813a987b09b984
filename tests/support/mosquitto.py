"""Start and stop a real Mosquitto broker on a free loopback port (tests only)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def mosquitto_binary() -> str:
    return shutil.which("mosquitto") or "/usr/sbin/mosquitto"


class Mosquitto:
    def __init__(self, workdir: Path, extra_config: str = "") -> None:
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.extra_config = extra_config
        self.proc: subprocess.Popen | None = None
        self.log_path = workdir / "mosquitto.log"

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    def start(self, timeout: float = 10.0) -> None:
        conf = self.workdir / "mosquitto.conf"
        conf.write_text(
            f"listener {self.port} 127.0.0.1\n"
            "allow_anonymous true\n"
            "persistence false\n"
            "max_queued_messages 0\n"
            "log_dest stdout\n"
            f"{self.extra_config}\n"
        )
        log = open(self.log_path, "a")
        self.proc = subprocess.Popen([mosquitto_binary(), "-c", str(conf)], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mosquitto exited: {self.log_path.read_text()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("mosquitto did not start listening")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
