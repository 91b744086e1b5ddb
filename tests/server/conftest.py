"""Shared fixtures of the server tests: one tiny model directory per session (writing it takes ~1 s;
grpc_fixtures' `tiny_model_dir`), and replicas around the scripted FakeEngine (`fake`; a module using it
imports grpc_fixtures' `server_loop`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from grpc_fixtures import tiny_model_dir  # noqa: F401  (a fixture: the session's tiny model)


@pytest.fixture
def fake_model_dir(tmp_path: Path) -> Path:
    """A model directory the FakeEngine's replicas accept (a config.json, no weights)."""
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


@pytest.fixture
def fake(server_loop, fake_model_dir):
    """Factory: fake(**engine_kwargs, config=dict(...)) -> (replica, engine); stopped at teardown."""
    from fake_engine import FakeEngine
    from grpc_fixtures import replica, server_config

    stack = []

    def make(config=None, **engine_kwargs):
        engine = FakeEngine(**engine_kwargs)
        cm = replica(server_loop, server_config(fake_model_dir, **(config or {})), engine)
        r = cm.__enter__()
        stack.append(cm)
        return r, engine

    yield make
    for cm in reversed(stack):
        cm.__exit__(None, None, None)
