"""Separate ``fcl aggregator`` and ``fcl client`` processes for one scenario, as on a fleet,
so tests can kill, restart and disturb each of them."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

import yaml

from fcl_edge.simulate import plan, write_configs
from support.timescale import scaled

# A short run used by the crash, outage and service tests (8 rounds, 3 devices); a re-send
# request every 2 s so a lost update is asked for quickly.
QUICK_SCENARIO = "configs/scenarios/quickstart.yaml"
QUICK_OVERRIDES = [
    "federation.rounds_per_task=4",
    "federation.rounds.resend_after_s=2",
    "federation.rounds.deadline_s=90",
]


def matrices(summary: dict) -> dict:
    """Per-client NLL matrices of a summary.json: what an undisturbed run is compared on."""
    return {c: v["nll_matrix"] for c, v in summary["final"]["per_client"].items()}


def assert_each_round_once(fleet: "Fleet", rounds: int, clients: int) -> None:
    """Every round closed once, with one accepted update per client: none lost, none twice."""
    per_round = collections.Counter(e["round"] for e in fleet.events("round"))
    assert per_round == {r: 1 for r in range(rounds)}, per_round
    pairs = collections.Counter((e["round"], e["client"]) for e in fleet.events("round_client"))
    assert set(pairs.values()) == {1} and len(pairs) == rounds * clients
    assert all(e["status"] == "accepted" for e in fleet.events("round_client"))


class Fleet:
    def __init__(
        self, scenario: Path, out: Path, broker_url: str, overrides: Sequence[str] = (), aggregator: dict | None = None
    ) -> None:
        """``aggregator``: extra keys for the aggregator's config (e.g. metrics_port)."""
        self.out = out
        (out / "logs").mkdir(parents=True, exist_ok=True)
        self.plan = plan(str(scenario), overrides)
        self.configs = write_configs(self.plan, out, broker_url)
        if aggregator:
            path = self.configs["aggregator"][1]
            path.write_text(yaml.safe_dump({**yaml.safe_load(path.read_text()), **aggregator}, sort_keys=False))
        self.procs: dict[str, subprocess.Popen] = {}
        self.starts: dict[str, int] = {}

    @property
    def metrics(self) -> Path:
        return self.out / "metrics.jsonl"

    def start(self, name: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        kind, path = self.configs[name]
        self.starts[name] = self.starts.get(name, 0) + 1
        log = open(self.out / "logs" / f"{name}.{self.starts[name]}.log", "w")
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "fcl_edge.cli", kind, "--config", str(path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
        )
        return self.procs[name]

    def start_all(self) -> None:
        for name in self.configs:
            self.start(name)

    def kill(self, name: str) -> None:
        """SIGKILL: no handler runs, nothing is flushed or closed."""
        proc = self.procs[name]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)

    @contextlib.contextmanager
    def paused(self, name: str):
        """SIGSTOP a process for the duration of the block (its TCP connection stays up)."""
        os.kill(self.procs[name].pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(self.procs[name].pid, signal.SIGCONT)

    def wait_for_log(self, name: str, text: str, timeout: float = 120) -> None:
        path = self.out / "logs" / f"{name}.{self.starts[name]}.log"
        deadline = time.monotonic() + scaled(timeout)
        while time.monotonic() < deadline:
            if path.exists() and text in path.read_text():
                return
            time.sleep(0.05)
        raise AssertionError(f"{name} did not log {text!r} in {timeout} s")

    def events(self, kind: str | None = None) -> list[dict]:
        if not self.metrics.exists():
            return []
        text = self.metrics.read_text()
        whole = text[: text.rfind("\n") + 1]  # the service may be mid-write: its last line can be partial
        lines = [json.loads(line) for line in whole.splitlines() if line.strip()]
        return [e for e in lines if kind is None or e.get("event") == kind]

    def wait_for_round(self, rnd: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + scaled(timeout)
        while time.monotonic() < deadline:
            if any(e["round"] >= rnd for e in self.events("round")):
                return
            time.sleep(0.05)
        raise AssertionError(f"round {rnd} did not complete in {timeout} s; logs in {self.out / 'logs'}")

    def wait(self, timeout: float = 240) -> dict[str, int]:
        """Wait for the aggregator to finish, then for the clients; exit codes by name."""
        codes = {"aggregator": self.procs["aggregator"].wait(scaled(timeout))}
        for name, proc in self.procs.items():
            if name != "aggregator":
                codes[name] = proc.wait(scaled(60))
        return codes

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)

    def summary(self) -> dict:
        return json.loads((self.out / "summary.json").read_text())

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((self.out / "logs").glob("*.log")))
