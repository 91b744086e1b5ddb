"""Fixtures of the app tests: the session's tiny model (`maskroll init-model` with the defaults) is
tests/server's `grpc_fixtures.tiny_model_dir`, importable from here by module name."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE.parent / "server") not in sys.path:
    sys.path.insert(0, str(HERE.parent / "server"))

from grpc_fixtures import tiny_model_dir  # noqa: E402, F401  (a fixture)
