"""SIGTERM to ``fcl simulate`` stops what it started, as Ctrl-C does (exit 130, no orphans)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from support.timescale import scaled


def _children(pid: int) -> set[int]:
    """Pids whose parent is ``pid`` (from /proc)."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.add(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_sigterm_stops_the_broker_aggregator_and_devices(mosquitto, tmp_path: Path, repo_root: Path) -> None:
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "fcl_edge.cli", "simulate", str(repo_root / "configs/scenarios/quickstart.yaml")]
    argv += [
        "--out",
        str(out),
        "--broker",
        mosquitto.url,
        "--set",
        "compare=[]",
        "--set",
        "federation.rounds_per_task=50",
    ]
    sim = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + scaled(120)
        children: set[int] = set()
        while time.monotonic() < deadline and len(children) < 4:  # the aggregator and three devices
            children = _children(sim.pid)
            time.sleep(0.2)
        assert len(children) >= 4, f"simulate started {len(children)} processes"
        sim.send_signal(signal.SIGTERM)
        output, _ = sim.communicate(timeout=scaled(90))
    finally:
        if sim.poll() is None:
            sim.kill()
    assert sim.returncode == 130, output[-2000:]
    left = sorted(pid for pid in children if _alive(pid))
    assert not left, f"still running after simulate exited: {left}"
