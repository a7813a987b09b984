"""The README's main command, `fcl simulate` with no --broker, on a bad scenario.  A good one,
which starts the embedded broker, runs in test_clean_run.py (its logs must be clean too)."""

from __future__ import annotations

from pathlib import Path

from conftest import run_fcl


def test_bad_scenario_fails_with_one_line(tmp_path: Path, repo_root: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text((repo_root / "configs/scenarios/quickstart.yaml").read_text().replace("clients: 3", "clients: many"))
    result = run_fcl("simulate", str(bad), "--out", str(tmp_path / "run"))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "clients" in lines[0] and str(bad) in lines[0] and "int" in lines[0]
