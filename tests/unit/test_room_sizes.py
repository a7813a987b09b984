"""The services and the export package stay in rooms that read in one sitting (issue 38): no file
over 500 lines, no class over 300, in ``aggregator/``, ``edge_client/`` and ``export/``.  A room
that outgrows this is split by responsibility, as ``ClientDaemon`` was (``edge_client.lifecycle``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("aggregator", "edge_client", "export")
MAX_FILE_LINES, MAX_CLASS_LINES = 500, 300


def sizes(path: Path) -> tuple[int, dict[str, int]]:
    """(lines in the file, lines of each class from its ``class`` line to its last)."""
    source = path.read_text(encoding="utf-8")
    classes = {
        node.name: node.end_lineno - node.lineno + 1
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ClassDef)
    }
    return len(source.splitlines()), classes


def test_the_sizes_are_measured_as_lines_of_the_file_and_of_each_class(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(4))
    (tmp_path / "m.py").write_text(f'"""doc"""\n\n\nclass A:\n{body}\n\n\nclass B:\n    pass\n')
    assert sizes(tmp_path / "m.py") == (12, {"A": 5, "B": 2})


@pytest.mark.parametrize("package", PACKAGES)
def test_no_file_or_class_is_over_its_limit(package: str) -> None:
    files = sorted((ROOT / package).glob("**/*.py"))
    assert files, f"{package}/ has no Python files"
    over = []
    for path in files:
        lines, classes = sizes(path)
        name = path.relative_to(ROOT)
        if lines > MAX_FILE_LINES:
            over.append(f"{name}: {lines} lines (at most {MAX_FILE_LINES})")
        over += [
            f"{name}: class {cls} has {n} lines (at most {MAX_CLASS_LINES})"
            for cls, n in classes.items()
            if n > MAX_CLASS_LINES
        ]
    assert not over, "split these by responsibility:\n" + "\n".join(over)
