"""The quickstart's ``compare:``: each method runs into OUT/<method>, then one table that names
each method and sets its bytes per device against dense fp32 FedAvg."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_fcl

from fcl_edge.compare import format_table, row_of, verdict

QUICKSTART = "configs/scenarios/quickstart.yaml"
TINY = ["--set", "clients=2", "--set", "federation.rounds_per_task=1", "--set", "federation.model.hidden_sizes=[16]"]


def _summary(method: str, up: int, down: int, dense_up: int, dense_down: int | None = None, **final) -> dict:
    b = {"up_total": up, "down_total": down, "dense_fp32_up_total": dense_up}
    if dense_down is not None:
        b["dense_fp32_down_total"] = dense_down
    return {"method": method, "clients": 2, "bytes": b, "final": final}


def test_row_is_per_device_and_against_dense_both_ways() -> None:
    row = row_of(_summary("confedmade", 300, 900, 1000, 1400, avg_nll=20.5, forgetting=0.25))
    assert (row.up_per_device, row.down_per_device) == (150, 450)
    assert row.dense_share == pytest.approx(1200 / 2400)
    assert (row.method, row.score, row.forgetting) == ("confedmade", 20.5, 0.25)


def test_without_a_logged_dense_download_the_dense_upload_stands_for_it() -> None:
    assert row_of(_summary("fedavg", 1000, 1000, 800)).dense_share == pytest.approx(2000 / 1600)


def test_verdict_names_the_cheapest_and_the_least_forgetting_method() -> None:
    rows = [
        row_of(_summary("a", 100, 100, 1000, avg_nll=1.0, forgetting=2.0)),
        row_of(_summary("b", 900, 900, 1000, avg_nll=1.0, forgetting=0.5)),
    ]
    assert verdict(rows) == "fewest bytes: a (10% of dense fp32 FedAvg); least forgetting: b"
    table = format_table(rows, "avg NLL")
    assert [line.split()[0] for line in table[2:]] == ["a", "b"] and "avg NLL" in table[1]


def test_quickstart_compares_two_methods_in_one_table(tmp_path: Path, repo_root: Path) -> None:
    out = tmp_path / "qs"
    result = run_fcl("simulate", str(repo_root / QUICKSTART), "--out", str(out), "--in-process", *TINY)
    assert result.returncode == 0, result.stderr
    rows = {m: row_of(json.loads((out / m / "summary.json").read_text())) for m in ("confedmade", "fedavg")}
    assert {m: r.method for m, r in rows.items()} == {"confedmade": "confedmade", "fedavg": "fedavg"}
    lines = result.stdout.strip().splitlines()
    assert lines[-5:-1] == format_table(list(rows.values()), "avg NLL")
    assert lines[-1] == verdict(list(rows.values()))
    assert "confedmade on quickstart: 2 clients" in result.stdout and "fedavg: avg NLL" in result.stdout
    markdown = (out / "comparison.md").read_text().splitlines()
    assert [line.split("|")[1].strip() for line in markdown[2:]] == ["confedmade", "fedavg"]

    again = run_fcl("simulate", str(repo_root / QUICKSTART), "--out", str(out), "--in-process", *TINY)
    assert again.returncode == 2 and "--force" in again.stderr
    report = run_fcl("report", str(out))
    assert report.returncode == 0, report.stderr
    assert "| confedmade | confedmade |" in (out / "report" / "report.md").read_text()


@pytest.mark.parametrize(
    "compare, says",
    [
        ("[confedmade, fedavgg]", "unknown method 'fedavgg'"),
        ("[fedavg, fedet]", "report different metrics"),
        ("[fedavg, fedavg]", "distinct"),
    ],
)
def test_a_bad_compare_list_fails_before_any_run(compare: str, says: str, tmp_path: Path, repo_root: Path) -> None:
    out = tmp_path / "qs"
    result = run_fcl("simulate", str(repo_root / QUICKSTART), "--out", str(out), "--set", f"compare={compare}")
    assert result.returncode == 2 and says in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not out.exists()


@pytest.mark.parametrize("method", ["fedavg", "ngfl"])
def test_the_quickstart_runs_one_method_alone(method: str, tmp_path: Path, repo_root: Path) -> None:
    """The quickstart's advice for one method alone: ConFedMADE's options stay in its own
    ``method_options`` entry, so a method without them (NGFL) runs too."""
    out = tmp_path / "one"
    only = ["--set", "compare=[]", "--set", f"federation.method={method}"]
    result = run_fcl("simulate", str(repo_root / QUICKSTART), "--out", str(out), "--in-process", *only, *TINY)
    assert result.returncode == 0, result.stderr
    assert json.loads((out / "summary.json").read_text())["method"] == method
