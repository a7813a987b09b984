"""The README's main command: `fcl simulate` with no --broker starts the embedded broker."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import run_fcl


def test_simulate_with_the_embedded_broker(tmp_path: Path, repo_root: Path) -> None:
    out = tmp_path / "run"
    result = run_fcl(
        "simulate",
        str(repo_root / "configs/scenarios/quickstart.yaml"),
        "--out",
        str(out),
        "--set",
        "federation.rounds_per_task=2",
        "--set",
        "compare=[]",
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == 4 and summary["final"]["avg_nll"] > 0
    assert "embedded broker listening" in (out / "logs" / "broker.log").read_text()


def test_bad_scenario_fails_with_one_line(tmp_path: Path, repo_root: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text((repo_root / "configs/scenarios/quickstart.yaml").read_text().replace("clients: 3", "clients: many"))
    result = run_fcl("simulate", str(bad), "--out", str(tmp_path / "run"))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "clients" in lines[0] and str(bad) in lines[0] and "int" in lines[0]
