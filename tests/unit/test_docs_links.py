"""Every relative link and every repository path in README.md and docs/*.md exists, and every
table renders as one table.

Checked in each page:

* markdown links ``[text](target)`` that are not URLs: the target, relative to the page, must
  exist; a ``#fragment`` must name a heading of the target page (GitHub's anchor rule);
* every path written in backticks, inline or in a fenced block, token by token: a token that
  contains a ``/`` and ends in an extension or a ``/`` must exist relative to the repository
  root (or to the page).  Not paths of this repository, so skipped: URLs, globs and MQTT
  wildcards, placeholders (``<id>``, ``@SITE_ID@``, ``DIR/...``), absolute and home paths
  (a machine's ``/etc``, ``/var``, ``/tmp``, ...), and what a command writes (``runs/``,
  ``fleet/``, the out dirs the pages' commands create);
* every table: no row cut off from its header by a blank line, and as many cells per row as
  the header has.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
_INLINE_CODE = re.compile(r"`([^`\n]+)`")
_EXTENSION = re.compile(r"\.[A-Za-z][A-Za-z0-9]*$")
_PLACEHOLDER = re.compile(r"<[^>]*>|@[A-Z_]+@|(^|/)[A-Z]{2,}[A-Z_]*([-/]|$)")  # DIR/, OUT/, NNN-name/
_GLOB = set("*?[]{}+$")
# What the pages' commands create (run directories and their parts, state), not repository paths.
OUTPUT_ROOTS = (
    "runs/",
    "fleet/",
    "state/",
    "state_dir/",
    "out_dir/",
    "logs/",
    "clients/",
    "mydata/",
    "tutorial-fleet/",
)
_STRIP = "\"'(),;:.!"


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to '-'."""
    text = _FENCE.sub("", page.read_text(encoding="utf-8"))
    out = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(slug)
    return out


def looks_like_path(token: str) -> bool:
    """A repository path as the pages write one: a ``/`` and an extension or a trailing ``/``."""
    if "/" not in token or "://" in token or _GLOB & set(token) or _PLACEHOLDER.search(token):
        return False
    if token.startswith(("/", "~")) or token.startswith(OUTPUT_ROOTS):
        return False
    return token.endswith("/") or bool(_EXTENSION.search(token))


def _path_tokens(code: str) -> list[str]:
    tokens = []
    for raw in code.split():
        token = raw.split("=", 1)[-1] if re.match(r"(--)?[\w-]+=", raw) else raw  # --out=runs/x, key="a/b"
        token = re.sub(r":\d+$", "", token.strip(_STRIP))  # file.py:123
        if token.startswith("./"):
            token = token[2:]
        if looks_like_path(token):
            tokens.append(token)
    return tokens


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """``page``'s links and backticked paths that do not resolve, one line each."""
    text = page.read_text(encoding="utf-8")
    prose = _FENCE.sub("", text)
    problems = []
    for target in _LINK.findall(prose):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path_part, _, fragment = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.exists():
            problems.append(f"{page.name}: link ({target}): no such file")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            problems.append(f"{page.name}: link ({target}): no heading #{fragment} in {dest.name}")
    code = _INLINE_CODE.findall(prose) + [m.group(0) for m in _FENCE.finditer(text)]
    for span in code:
        for token in _path_tokens(span):
            if not ((root / token).exists() or (page.parent / token).exists()):
                problems.append(f"{page.name}: path `{token}` does not exist")
    return problems


def _cells(row: str) -> int:
    return len(re.split(r"(?<!\\)\|", row.strip().strip("|")))


def broken_tables(page: Path) -> list[str]:
    """Tables that would not render as one table: a row after a blank line (the rows below it
    become a paragraph) or a row whose cell count differs from its header's."""
    lines = _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), page.read_text(encoding="utf-8")).split("\n")
    problems, header = [], None
    for i, line in enumerate(lines):
        row = line.strip()
        if not row.startswith("|"):
            header = None
            continue
        if header is None:
            below = lines[i + 1].strip() if i + 1 < len(lines) else ""
            if not re.fullmatch(r"\|?(\s*:?-+:?\s*\|)+\s*:?-*:?\s*", below):
                problems.append(f"{page.name}:{i + 1}: table row without a header above it")
                continue
            header = _cells(row)
        elif _cells(row) != header:
            problems.append(f"{page.name}:{i + 1}: {_cells(row)} cells, the header has {header}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_and_path_of_the_page_exists(page: Path) -> None:
    assert broken_links(page) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_table_of_the_page_renders(page: Path) -> None:
    assert broken_tables(page) == []


def test_the_pages_checked_include_the_readme_and_the_docs() -> None:
    names = {str(p.relative_to(ROOT)) for p in PAGES}
    assert {"README.md", "docs/architecture.md", "docs/deploy.md", "docs/metrics.md", "docs/wire.md"} <= names


# -- the checker itself ---------------------------------------------------------------------------


def _page(tmp_path: Path, text: str) -> Path:
    (tmp_path / "docs").mkdir(exist_ok=True)
    (tmp_path / "docs" / "there.md").write_text("# Title\n\n## A section, with words\n")
    (tmp_path / "pkg").mkdir(exist_ok=True)
    (tmp_path / "pkg" / "mod.py").write_text("")
    page = tmp_path / "docs" / "page.md"
    page.write_text(text)
    return page


@pytest.mark.parametrize(
    "text, expected",
    [
        ("see [there](there.md)", []),
        ("see [gone](missing.md)", ["page.md: link (missing.md): no such file"]),
        ("see [up](../pkg/mod.py)", []),
        ("see [up](../pkg/gone.py)", ["page.md: link (../pkg/gone.py): no such file"]),
        ("see [s](there.md#a-section-with-words)", []),
        ("see [s](there.md#nope)", ["page.md: link (there.md#nope): no heading #nope in there.md"]),
        ("see [web](https://example.org/x.md) and <https://example.org>", []),
        ("code `pkg/mod.py` and `pkg/`", []),
        ("code `pkg/gone.py`", ["page.md: path `pkg/gone.py` does not exist"]),
        ("a command `python pkg/gone.py --out runs/x`", ["page.md: path `pkg/gone.py` does not exist"]),
        (
            "```sh\nfcl simulate pkg/nothing.yaml --out runs/q\n```\n",
            ["page.md: path `pkg/nothing.yaml` does not exist"],
        ),
        ("```sh\n[no](link.md) inside a fence is code\n```\n", []),
        ("see `pkg/mod.py:12` and `pkg/mod.py: name`", []),
        ("skipped: `/etc/fcl-edge/x.yaml` `~/a/b.txt` `runs/q/summary.json` `fleet/client-0/model.onnx`", []),
        ("skipped: `DIR/clients/<id>/model.onnx` `fcl/+/update/+` `configs/*.yaml` `@ROOT_HOST@/x.conf`", []),
        ("not paths: `up/device` `a/b` `B*sigmoid(m)` `0.52/0.60`", []),
    ],
)
def test_broken_links_finds_exactly_the_broken_ones(tmp_path: Path, text: str, expected: list[str]) -> None:
    assert broken_links(_page(tmp_path, text), root=tmp_path) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("| a | b |\n|---|---|\n| 1 | 2 |\n| 3 | 4 |\n", []),
        ("| a | b |\n|---|---:|\n| `x \\| y` | 2 |\n", []),
        ("| a | b |\n|---|---|\n| 1 | 2 |\n\n| 3 | 4 |\n", ["page.md:5: table row without a header above it"]),
        ("| a | b |\n|---|---|\n| 1 | 2 | 3 |\n", ["page.md:3: 3 cells, the header has 2"]),
        ("```\n| not | a table |\n```\n", []),
    ],
)
def test_broken_tables_finds_a_split_or_ragged_table(tmp_path: Path, text: str, expected: list[str]) -> None:
    assert broken_tables(_page(tmp_path, text)) == expected
