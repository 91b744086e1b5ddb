"""Every maskroll import the README's code shows still works: a layout change that moves a public name
fails here, not in a new user's first hour. Each `from maskroll... import ...` / `import maskroll...`
statement of the README's Python blocks runs in a fresh interpreter (the snippets themselves need
servers; their imports need nothing)."""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)


def readme_imports() -> list[str]:
    found = []
    for block in BLOCK.findall((ROOT / "README.md").read_text()):
        for line in block.splitlines():
            stripped = line.strip()
            if not stripped.startswith(("from maskroll", "import maskroll")):
                continue
            statement = stripped.split("#", 1)[0].rstrip()
            ast.parse(statement)  # one whole statement per line: the README keeps them so
            found.append(statement)
    return found


def test_the_readme_shows_imports() -> None:
    # the check below must have something to check: the quick-start's own imports are there
    assert "from maskroll.client import RolloutQueue, SamplingOptions" in readme_imports()


def test_every_import_in_the_readme_works() -> None:
    statements = sorted(set(readme_imports()))
    code = "\n".join(statements)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, f"a README import fails:\n{out.stderr[-3000:]}"
