"""A real Prometheus (Debian's ``prometheus``, installed by .ci/run) for tests: the shipped
deploy/prometheus/ configuration with its target port and intervals templated, on a free
loopback port, queried over its HTTP API."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

from support.mosquitto import free_port

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
SHIPPED_TARGET = "127.0.0.1:9108"  # the target in the shipped prometheus.yml (configs/services/aggregator.yaml)


def binary(name: str) -> str:
    path = shutil.which(name) or (f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").exists() else None)
    if path is None:
        raise RuntimeError(f"{name} is not installed (apt-get install prometheus); .ci/run installs it")
    return path


def shipped_config(target_port: int, interval: str) -> str:
    """The shipped prometheus.yml aimed at ``127.0.0.1:target_port``, scraping and evaluating
    every ``interval``; an error if the shipped file no longer has what is templated."""
    text = (DEPLOY / "prometheus.yml").read_text()
    for old in (SHIPPED_TARGET, "scrape_interval: 15s", "evaluation_interval: 15s", "scrape_timeout: 10s"):
        if text.count(old) != 1:
            raise AssertionError(f"deploy/prometheus/prometheus.yml: expected one {old!r} to template")
    text = text.replace(SHIPPED_TARGET, f"127.0.0.1:{target_port}")
    return text.replace("scrape_timeout: 10s", f"scrape_timeout: {interval}").replace(
        "interval: 15s", f"interval: {interval}"
    )


class PrometheusProcess:
    def __init__(self, work: Path, target_port: int, interval: str = "2s") -> None:
        self.work = work
        work.mkdir(parents=True, exist_ok=True)
        (work / "prometheus.yml").write_text(shipped_config(target_port, interval))
        shutil.copy(DEPLOY / "fcl-alerts.yml", work / "fcl-alerts.yml")
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60) -> "PrometheusProcess":
        log = open(self.work / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [
                binary("prometheus"),
                f"--config.file={self.work / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.work / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited: {(self.work / 'prometheus.log').read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"prometheus not ready in {timeout} s")

    def api(self, path: str, **params: object) -> object:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=30) as response:
            body = json.loads(response.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str, at: float) -> list[dict]:
        """An instant query at unix time ``at``: [{"metric": {labels}, "value": float}]."""
        data = self.api("query", query=expr, time=f"{at:.3f}")
        assert data["resultType"] == "vector", (expr, data)
        return [{"metric": r["metric"], "value": float(r["value"][1])} for r in data["result"]]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
