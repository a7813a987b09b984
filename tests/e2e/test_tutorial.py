"""docs/tutorial.md, followed as written: its ``python`` and ``sh`` blocks run in page order
from a directory holding the configs the page names, with one change: the broker port 1883 is
replaced by a free port (in the commands and the copied configs).  The broker, the aggregator
and the devices run as background processes, as in their own terminals; every later command
runs once the aggregator and the devices have exited."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.timescale import scaled

from fcl_edge.broker import free_port

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs/tutorial.md"
SERVICES = ("mosquitto ", "fcl aggregator ", "fcl client ")  # run in their own terminal: started, not awaited
COPIED = ("configs/services/tutorial", "configs/services/local/mosquitto.conf", "configs/scenarios/quickstart.yaml")


def page_steps() -> list[tuple[str, str]]:
    """(language, code) of the page's ``sh`` lines and ``python`` blocks, in order."""
    steps = []
    for lang, body in re.findall(r"```(sh|python)\n(.*?)```", PAGE.read_text(), flags=re.S):
        if lang == "python":
            steps.append((lang, body))
        else:
            steps += [(lang, line.strip()) for line in body.splitlines() if line.strip()]
    return steps


def _copy_configs(into: Path, port: str) -> None:
    for name in COPIED:
        src = ROOT / name
        for path in [src] if src.is_file() else sorted(src.iterdir()):
            dest = into / path.relative_to(ROOT)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(path.read_text().replace("1883", port))


# the default suite's 10 min: CI runs it with the slow tests (pytest -m slow)
@pytest.mark.slow
def test_following_the_tutorial_word_for_word(tmp_path: Path) -> None:
    port = str(free_port())
    _copy_configs(tmp_path, port)
    mosquitto = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
    services: dict[str, subprocess.Popen] = {}
    outputs: dict[str, str] = {}
    try:
        for lang, code in page_steps():
            if lang == "python":
                done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
                assert done.returncode == 0, done.stderr
                continue
            argv = code.replace("1883", port).split()
            argv = (
                [mosquitto, *argv[1:]] if argv[0] == "mosquitto" else [sys.executable, "-m", "fcl_edge.cli", *argv[1:]]
            )
            if code.startswith(SERVICES):
                log = open(tmp_path / f"{code.split()[-1].rsplit('/', 1)[-1]}.log", "w")
                services[code] = subprocess.Popen(argv, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
                continue
            _wait_for_the_fleet(services, tmp_path)
            done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=scaled(300))
            assert done.returncode == 0, f"{code}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
            outputs[code.split()[1]] = done.stdout
    finally:
        for proc in services.values():
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=scaled(20))
    assert "confedmade" in outputs["simulate"] and "vs dense" in outputs["simulate"], outputs["simulate"]
    assert "run finished after 6 rounds" in outputs["status"], outputs["status"]
    scores = json.loads(outputs["infer"])["log_likelihood"]
    rows = len((tmp_path / "mydata/csv/client-0-task-1.csv").read_text().splitlines())
    assert len(scores) == rows and all(s < 0 for s in scores), outputs["infer"][:500]
    summary = json.loads((tmp_path / "tutorial-fleet/aggregator/summary.json").read_text())
    assert summary["rounds"] == 6 and summary["final"]["avg_nll"] > 0
    assert (tmp_path / "tutorial-fleet/aggregator/report/bytes_per_round.png").exists()


def _wait_for_the_fleet(services: dict[str, subprocess.Popen], cwd: Path) -> None:
    """The aggregator and the devices exit 0 once the run is over (the broker keeps running)."""
    for code, proc in services.items():
        if not code.startswith("mosquitto"):
            assert proc.wait(timeout=scaled(300)) == 0, _logs(cwd)


def _logs(where: Path) -> str:
    return "\n".join(f"== {p.name}\n{p.read_text()[-3000:]}" for p in sorted(where.glob("*.log")))
