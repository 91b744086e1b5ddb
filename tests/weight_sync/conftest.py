"""Fixtures of the trainer's end of the weight transports against real replicas: the tiny model, its
checkpoints and an in-process torch replica are tests/server/weights' `weights_fixtures` (shared with
the replica's end); tests/server holds grpc_fixtures (in-process servers), tests/queue holds procs
(`maskroll serve` replica processes). All three folders are importable from here by module name."""

from __future__ import annotations

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
for folder in (TESTS / "queue", TESTS / "server", TESTS / "server" / "weights"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from weights_fixtures import loop, model, model_dir, spool, torch_replica, weights_root  # noqa: E402, F401
