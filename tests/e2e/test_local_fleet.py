"""docs/local-fleet.md, followed as written: every ``sh`` block's command runs in page order,
from a directory holding ``configs/services/local/``, with one change: the broker port 1883 is
replaced by a free port (in the commands and the copied configs), so the test never meets a
system Mosquitto.  The services run as background processes, as in their own terminals."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.timescale import scaled

from fcl_edge.broker import free_port

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs/local-fleet.md"
SERVICES = ("mosquitto ", "fcl aggregator ", "fcl client ")  # run in their own terminal: started, not awaited


def page_commands() -> list[str]:
    """The commands of the page's ``sh`` blocks, in order."""
    blocks = re.findall(r"```sh\n(.*?)```", PAGE.read_text(), flags=re.S)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip()]


def test_the_page_starts_a_broker_an_aggregator_and_three_devices() -> None:
    commands = page_commands()
    assert [c.split(" --config ")[-1] for c in commands if c.startswith(SERVICES[1:])] == [
        "configs/services/local/aggregator.yaml",
        *(f"configs/services/local/client-{i}.yaml" for i in range(3)),
    ]
    assert commands[0].startswith("mosquitto ") and any(c.startswith("fcl status ") for c in commands)


# the default suite's 10 min: CI runs it with the slow tests (pytest -m slow)
@pytest.mark.slow
def test_following_the_page_word_for_word(tmp_path: Path) -> None:
    port = str(free_port())
    local = tmp_path / "configs/services/local"
    local.mkdir(parents=True)
    for src in (ROOT / "configs/services/local").iterdir():
        (local / src.name).write_text(src.read_text().replace("1883", port))
    mosquitto = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
    services: dict[str, subprocess.Popen] = {}
    outputs: list[tuple[str, str]] = []
    try:
        for command in page_commands():
            argv = command.replace("1883", port).split()
            argv = (
                [mosquitto, *argv[1:]] if argv[0] == "mosquitto" else [sys.executable, "-m", "fcl_edge.cli", *argv[1:]]
            )
            if command.startswith(SERVICES):
                name = command.split()[-1].rsplit("/", 1)[-1]
                log = open(tmp_path / f"{name}.log", "w")
                services[name] = subprocess.Popen(argv, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
                time.sleep(1.0 if argv[0] == mosquitto else 0.2)
            else:
                outputs.append((command, _run_when_ready(argv, tmp_path, services)))
        agg = services["aggregator.yaml"]
        assert agg.wait(timeout=scaled(240)) == 0, _logs(tmp_path)
        for name in ("client-0.yaml", "client-1.yaml", "client-2.yaml"):
            assert services[name].wait(timeout=scaled(60)) == 0, _logs(tmp_path)
    finally:
        for proc in services.values():
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=scaled(20))
    aggregator_log = (tmp_path / "aggregator.yaml.log").read_text()
    assert re.search(r"start: waiting for (client-\d, )*client-2 \(", aggregator_log), aggregator_log
    rounds = re.findall(r"round (\d+)/10 task (\d): 3/3 updates, [\d,.]+ kB up, [\d,.]+ kB down", aggregator_log)
    assert [int(r) for r, _ in rounds] == list(range(1, 11)), aggregator_log
    first_status = next(out for cmd, out in outputs if cmd.startswith("fcl status"))
    assert "2/3 clients online" in first_status and re.search(r"client-2\s+absent", first_status), first_status
    summary = json.loads((tmp_path / "fleet/aggregator/summary.json").read_text())
    assert summary["method"] == "confedmade" and summary["rounds"] == 10
    samples = next(out for cmd, out in outputs if cmd.startswith("fcl infer"))
    assert len(json.loads(samples)["samples"]) == 3
    fp32, int8 = (tmp_path / f"fleet/client-1{suffix}.onnx" for suffix in ("", ".int8"))
    assert fp32.stat().st_size > int8.stat().st_size > 0
    assert (tmp_path / "fleet/aggregator/report/bytes_per_round.png").exists()


def _run_when_ready(argv: list[str], cwd: Path, services: dict[str, subprocess.Popen]) -> str:
    """A one-off command of the page, run when what it reads is there: ``fcl status`` before
    the third device once the two devices are online; the rest once the aggregator is done."""
    if "status" in argv and "client-2.yaml" not in services:
        # as a person would: two devices online, and the aggregator saying whom it waits for (it
        # says so after a few seconds of waiting) before the third device is started
        aggregator_log = cwd / "aggregator.yaml.log"
        deadline = time.monotonic() + 60
        while True:
            out = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=scaled(30))
            waiting = aggregator_log.exists() and "waiting for" in aggregator_log.read_text()
            if ("2/3 clients online" in out.stdout and waiting) or time.monotonic() > deadline:
                return out.stdout + out.stderr
            time.sleep(0.5)
    services["aggregator.yaml"].wait(timeout=scaled(240))
    for name in ("client-0.yaml", "client-1.yaml", "client-2.yaml"):
        services[name].wait(timeout=scaled(60))
    out = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=scaled(120))
    assert out.returncode == 0, f"{' '.join(argv)}: {out.stderr}"
    return out.stdout


def _logs(where: Path) -> str:
    return "\n".join(f"== {p.name}\n{p.read_text()[-3000:]}" for p in sorted(where.glob("*.log")))
