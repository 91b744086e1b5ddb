"""docs/architecture.md is the map of the house: this keeps it from drifting.

- Every library module (a .py file of the 11 packages, not `__init__.py`, not generated code) is a row
  of its package's module table ("### `<package>/` ..." sections, module paths relative to the
  package), and every module a table names exists.
- Every file path the page names anywhere (`server/app.py`, `bench/weights.py`, ...) exists.
- Every size it states is right: a module's "`<path>` (<n> lines)" within 5 % (or 15 lines), and the
  library's "<n> lines in <m> library modules" (lines within 3 %, modules exactly).
"""

from __future__ import annotations

import pathlib
import re

import pytest
from test_import_boundaries import PACKAGES  # the 11 packages, named once

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
TOP = (*PACKAGES, "bench", "tests", "deploy", "examples", "docs")

SECTION = re.compile(r"^### `(\w+)/`")
TICKED = re.compile(r"`([^`\s]+)`")
PATH = re.compile(r"^[a-z_]+/[\w/.-]*\w\.(py|md|proto|yaml|json)$")
SIZE = re.compile(r"`([\w/.]+\.py)` \((\d[\d,]*) lines")
TOTAL = re.compile(r"(\d[\d,]*) lines in (\d+) library modules")


def library_modules() -> set[str]:
    return {
        str(p.relative_to(ROOT))
        for pkg in PACKAGES
        for p in (ROOT / pkg).rglob("*.py")
        if p.name != "__init__.py" and "_generated" not in p.parts
    }


def table_modules(text: str) -> dict[str, set[str]]:
    """package -> the modules (paths from the repository root) its section's tables list in their first
    column; a section heading names its package."""
    found: dict[str, set[str]] = {}
    package = None
    for line in text.splitlines():
        if line.startswith("## "):
            package = None
        elif m := SECTION.match(line):
            package = m.group(1)
            found.setdefault(package, set())
        elif package and line.startswith("|"):
            first = line.split("|")[1]
            for token in TICKED.findall(first):
                if token.endswith(".py"):
                    found[package].add(f"{package}/{token}")
    return found


def lines_of(path: str) -> int:
    return len((ROOT / path).read_text().splitlines())


@pytest.fixture(scope="module")
def text() -> str:
    return DOC.read_text()


def test_every_package_has_its_section(text: str) -> None:
    assert set(table_modules(text)) == set(PACKAGES)


def test_every_library_module_is_on_the_map(text: str) -> None:
    listed = set().union(*table_modules(text).values())
    missing = sorted(library_modules() - listed)
    assert not missing, f"modules missing from docs/architecture.md's module tables: {missing}"


def test_the_map_names_no_module_that_does_not_exist(text: str) -> None:
    listed = set().union(*table_modules(text).values())
    ghosts = sorted(listed - library_modules())
    assert not ghosts, f"docs/architecture.md's tables name modules that do not exist: {ghosts}"


def test_every_path_the_page_names_exists(text: str) -> None:
    named = {t for t in TICKED.findall(text) if PATH.match(t) and t.split("/")[0] in TOP}
    assert len(named) > 20  # the page names paths: the check has something to check
    ghosts = sorted(t for t in named if not (ROOT / t).exists())
    assert not ghosts, f"docs/architecture.md names paths that do not exist: {ghosts}"


def test_every_stated_size_is_right(text: str) -> None:
    sizes = SIZE.findall(text)
    assert sizes, "the page states the largest modules' sizes"
    wrong = []
    for path, stated in sizes:
        n, actual = int(stated.replace(",", "")), lines_of(path)
        if abs(actual - n) > max(15, 0.05 * actual):
            wrong.append(f"{path}: the page says {n} lines, it has {actual}")
    assert not wrong, "\n".join(wrong)


def test_the_stated_size_of_the_library_is_right(text: str) -> None:
    totals = TOTAL.findall(text)
    assert len(totals) == 1, "one sentence states the library's size: '<n> lines in <m> library modules'"
    lines, modules = (int(x.replace(",", "")) for x in totals[0])
    all_modules = {
        str(p.relative_to(ROOT))
        for pkg in PACKAGES
        for p in (ROOT / pkg).rglob("*.py")
        if "_generated" not in p.parts
    }
    actual = sum(lines_of(p) for p in all_modules)
    assert modules == len(library_modules()), (
        f"the page says {modules} library modules, there are {len(library_modules())}"
    )
    assert abs(actual - lines) <= 0.03 * actual, f"the page says {lines} lines, the library has {actual}"


def test_the_checks_catch_drift() -> None:
    doc = (
        "### `server/` — x\n\n| module | owns |\n|---|---|\n| `app.py`, `gone.py` | x |\n## Flows\n| `x.py` |"
    )
    assert table_modules(doc) == {"server": {"server/app.py", "server/gone.py"}}
    assert SIZE.findall("`server/app.py` (1,234 lines, why)") == [("server/app.py", "1,234")]
    assert PATH.match("server/app.py") and not PATH.match("maskroll.server")
