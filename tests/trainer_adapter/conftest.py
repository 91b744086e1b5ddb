"""Shared set-up for the trainer_adapter math tests.

The reference implementation lives next to the tests (reference_impl.py); this directory is put on
sys.path so that it imports the same way under any pytest import mode. When the project is not
installed (`make venv` does `pip install -e .`, a bare checkout may not have), the source folder is
mapped into the `maskroll` namespace the way pyproject.toml maps it.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import types

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

try:
    import maskroll.trainer_adapter  # noqa: F401
except ModuleNotFoundError as exc:  # only when the package itself is missing, not one of its imports
    if exc.name not in ("maskroll", "maskroll.trainer_adapter"):
        raise
    if "maskroll" not in sys.modules:
        pkg = types.ModuleType("maskroll")
        pkg.__path__ = []
        sys.modules["maskroll"] = pkg
    src = ROOT / "trainer_adapter"
    spec = importlib.util.spec_from_file_location(
        "maskroll.trainer_adapter", src / "__init__.py", submodule_search_locations=[str(src)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["maskroll.trainer_adapter"] = module
    spec.loader.exec_module(module)
    sys.modules["maskroll"].trainer_adapter = module
