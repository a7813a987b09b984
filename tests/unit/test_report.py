"""fcl report turns run directories into PNG plots and a table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_fcl

pytestmark = pytest.mark.e2e  # each test runs `fcl report` in a fresh interpreter (matplotlib included)


def _fake_run(path: Path, method: str, nll_offset: float) -> None:
    path.mkdir(parents=True)
    matrix = [[10 + nll_offset, None], [12 + nll_offset, 11 + nll_offset]]
    summary = {
        "method": method,
        "clients": 1,
        "tasks": 2,
        "rounds": 4,
        "bytes": {"up_total": 100, "down_total": 200, "dense_fp32_up_total": 400},
        "final": {"avg_nll": 11.5 + nll_offset, "forgetting": 2.0, "per_client": {"c0": {"nll_matrix": matrix}}},
    }
    (path / "summary.json").write_text(json.dumps(summary))
    events = [
        {"event": "round_client", "round": r, "client": "c0", "task": r // 2, "bytes_up": 25, "bytes_down": 50}
        for r in range(4)
    ]
    events.append({"event": "attention", "round": 3, "task": 1, "client": "c0", "entries": ["c1/t0"], "alpha": [0.3]})
    (path / "metrics.jsonl").write_text("\n".join(json.dumps(e) for e in events) + "\n")


def test_report_writes_plots_and_table(tmp_path: Path) -> None:
    _fake_run(tmp_path / "runs" / "a", "confedmade", 0.0)
    _fake_run(tmp_path / "runs" / "b", "fedcl-finetune", 3.0)
    result = run_fcl("report", str(tmp_path / "runs"), "--out", str(tmp_path / "rep"))
    assert result.returncode == 0, result.stderr
    for name in ("nll_per_task.png", "bytes_per_round.png", "cumulative_bytes.png", "attention_a.png"):
        data = (tmp_path / "rep" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name
    table = (tmp_path / "rep" / "report.md").read_text()
    assert "| a | confedmade | avg NLL | 11.5 |" in table and "| b | fedcl-finetune | avg NLL | 14.5 |" in table


def test_report_plots_accuracy_runs_apart(tmp_path: Path) -> None:
    """A FedET run (accuracy matrix) next to an NLL run: each metric gets its own figure."""
    _fake_run(tmp_path / "runs" / "made", "confedmade", 0.0)
    fedet = tmp_path / "runs" / "fedet"
    fedet.mkdir(parents=True)
    final = {
        "avg_accuracy": 0.8,
        "avg_incremental_accuracy": 0.85,
        "forgetting": 0.1,
        "per_client": {"c0": {"accuracy_matrix": [[0.9, None], [0.8, 0.8]]}},
    }
    (fedet / "summary.json").write_text(
        json.dumps(
            {"method": "fedet", "bytes": {"up_total": 1, "down_total": 2, "dense_fp32_up_total": 3}, "final": final}
        )
    )
    (fedet / "metrics.jsonl").write_text("")
    result = run_fcl("report", str(tmp_path / "runs"), "--out", str(tmp_path / "rep"))
    assert result.returncode == 0, result.stderr
    for name in ("nll_per_task.png", "accuracy_per_task.png"):
        assert (tmp_path / "rep" / name).read_bytes()[:4] == b"\x89PNG", name
    assert "| fedet | fedet | avg incremental accuracy | 0.85 |" in (tmp_path / "rep" / "report.md").read_text()


def _fleet_run(path: Path, matrix: list[list[float | None]], avg_accuracy: float) -> None:
    """A run of a fleet with late enrollment: no device reported at every task end, so only the
    fleet's matrix (every device that reported) has numbers."""
    path.mkdir(parents=True)
    summary = {
        "method": "filver",
        "bytes": {"up_total": 10, "down_total": 20, "dense_fp32_up_total": 40},
        "final": {"per_client": {}},
        "fleet": {"avg_accuracy": avg_accuracy, "accuracy_matrix": matrix, "clients_per_task": [2, 3, 3]},
    }
    (path / "summary.json").write_text(json.dumps(summary))
    (path / "metrics.jsonl").write_text("")


def test_report_draws_fleet_task_accuracy(tmp_path: Path) -> None:
    _fleet_run(tmp_path / "runs" / "f1", [[0.9, None, None], [0.7, 0.85, None], [0.6, 0.8, 0.9]], 0.7667)
    # nobody reported on task 2 after task 2 (a gap), then task 2 again after task 3
    _fleet_run(tmp_path / "runs" / "f2", [[0.95, None, None], [None, 0.9, None], [0.5, 0.7, 0.88]], 0.6933)
    result = run_fcl("report", str(tmp_path / "runs"), "--out", str(tmp_path / "rep"))
    assert result.returncode == 0, result.stderr
    data = (tmp_path / "rep" / "task_accuracy.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert (tmp_path / "rep" / "accuracy_per_task.png").exists()  # scored as accuracy runs, from the fleet
    assert not (tmp_path / "rep" / "nll_per_task.png").exists()
    table = (tmp_path / "rep" / "report.md").read_text().splitlines()
    assert table[0].endswith("| fleet acc |") and table[1].endswith("|---:|---:|")
    assert any(line.startswith("| f1 | filver |") and line.endswith("| 0.7667 |") for line in table)
    assert any(line.startswith("| f2 | filver |") and line.endswith("| 0.6933 |") for line in table)


def test_report_without_fleet_has_no_task_accuracy(tmp_path: Path) -> None:
    _fake_run(tmp_path / "runs" / "a", "confedmade", 0.0)
    result = run_fcl("report", str(tmp_path / "runs"), "--out", str(tmp_path / "rep"))
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / "rep" / "task_accuracy.png").exists()
    assert "fleet acc" not in (tmp_path / "rep" / "report.md").read_text()


def test_report_on_a_directory_without_runs_fails_cleanly(tmp_path: Path) -> None:
    result = run_fcl("report", str(tmp_path))
    assert result.returncode == 2 and "no summary.json" in result.stderr


def test_report_shows_the_run_level_share_of_the_devices_bytes(tmp_path: Path) -> None:
    _fake_run(tmp_path / "runs" / "a", "confedmade", 0.0)
    _fake_run(tmp_path / "runs" / "b", "fedavg", 1.0)
    summary = json.loads((tmp_path / "runs" / "a" / "summary.json").read_text())
    summary["bytes"]["run_level"] = {"share": 0.1234, "up_total": 1_500, "down_total": 20_000}
    (tmp_path / "runs" / "a" / "summary.json").write_text(json.dumps(summary))
    result = run_fcl("report", str(tmp_path / "runs"), "--out", str(tmp_path / "rep"))
    assert result.returncode == 0, result.stderr
    table = (tmp_path / "rep" / "report.md").read_text().splitlines()
    assert table[0].endswith(" run-level |")
    assert table[2].endswith("| 12.3% (1,500 up / 20,000 down) |") and table[3].endswith("| 400 |  |"), table
