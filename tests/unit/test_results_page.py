"""docs/results.md is what benchmarks/results_page.py writes from benchmarks/results/."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import results_page  # noqa: E402


def test_the_page_is_what_the_result_files_say() -> None:
    assert results_page.PAGE.read_text() == results_page.render(), "run python benchmarks/results_page.py"


def test_every_result_file_is_on_the_page_or_said_to_be_superseded() -> None:
    listed = {name for _, name, _ in results_page.SECTIONS} | set(results_page.SUPERSEDED)
    present = {path.name for path in results_page.RESULTS.glob("*.md")}
    assert present == listed, f"not placed: {sorted(present - listed)}; gone: {sorted(listed - present)}"


def test_a_changed_number_makes_the_page_stale(tmp_path, monkeypatch) -> None:
    results = tmp_path / "results"
    results.mkdir()
    for name in {n for _, n, _ in results_page.SECTIONS}:
        (results / name).write_text((results_page.RESULTS / name).read_text())
    monkeypatch.setattr(results_page, "RESULTS", results)
    page = results_page.render()
    first = results_page.SECTIONS[0][1]
    (results / first).write_text((results / first).read_text().replace("|", "| 9.99 |", 1))
    assert results_page.render() != page
