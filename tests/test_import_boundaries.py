"""The import boundaries of ARCHITECTURE.md ("Folders"), checked in fresh interpreters.

Each component may import only what its row of the table allows; a heavy or foreign dependency
leaking in (torch into the client, grpc into the trainer adapter) fails here.
"""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# package -> modules that importing it must never load
FORBIDDEN = {
    "maskroll.client": ["torch", "vllm", "transformers"],
    "maskroll.trainer_adapter": ["grpc", "redis", "vllm", "transformers", "google.protobuf"],
    "maskroll.server": [
        "vllm",
        "torch",
        "grpc",
        "redis",
    ],  # the package itself is light; modules import lazily
}


def _loaded_after_import(module: str) -> set[str]:
    code = f"import sys, json; import {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    return set(json.loads(out.stdout))


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_importing_package_loads_no_forbidden_module(package: str) -> None:
    loaded = _loaded_after_import(package)
    leaked = [m for m in FORBIDDEN[package] if m in loaded or any(x.startswith(m + ".") for x in loaded)]
    assert not leaked, f"importing {package} loaded {leaked}"


def _imported_names(folder: pathlib.Path) -> dict[str, set[str]]:
    """Top-level module names each source file imports (statically, lazy imports included)."""
    found: dict[str, set[str]] = {}
    for path in folder.rglob("*.py"):
        if "_proto" in path.parts:
            continue
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
        found[str(path.relative_to(ROOT))] = names
    return found


def test_trainer_adapter_sources_import_only_torch_and_numpy() -> None:
    stdlib = set(sys.stdlib_module_names)
    for path, names in _imported_names(ROOT / "trainer_adapter").items():
        foreign = names - stdlib - {"torch", "numpy", "maskroll"}
        if path.endswith("analyze.py"):  # the CLI report may draw a figure
            foreign -= {"matplotlib"}
        assert not foreign, f"{path} imports {sorted(foreign)}"


def test_client_sources_never_import_torch_or_vllm() -> None:
    for path, names in _imported_names(ROOT / "client").items():
        assert not names & {"torch", "vllm"}, f"{path} imports {sorted(names & {'torch', 'vllm'})}"


def test_only_one_server_module_imports_vllm() -> None:
    importers = [p for p, names in _imported_names(ROOT / "server").items() if "vllm" in names]
    assert len(importers) <= 1, f"vllm imported by {importers}"
