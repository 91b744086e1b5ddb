"""Fixtures of the client tests: the clients talk to real in-process replicas, so tests/server's
`grpc_fixtures` (servers on a background loop, the session's torch engine) is importable from here by
module name, and the tiny model its engine loads is its `tiny_model_dir`."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE.parent / "server") not in sys.path:
    sys.path.insert(0, str(HERE.parent / "server"))

from grpc_fixtures import tiny_model_dir  # noqa: E402, F401  (a fixture)
