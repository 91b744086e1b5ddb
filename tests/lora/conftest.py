"""Fixtures of the LoRA tests (issue 22). Shared helpers are in `lora_helpers` (a module, not this
conftest); tests/server's `fake_engine` and `grpc_fixtures` and tests/server/weights' `push_helpers` are
importable from here by module name."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
for folder in (HERE.parent / "server", HERE.parent / "server" / "weights"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from weights_fixtures import loop  # noqa: E402, F401  (fixture: a module-scoped server loop of one's own)


@pytest.fixture(scope="session")
def lora_model_dir(tmp_path_factory) -> Path:
    """The tiny model (`maskroll init-model`, seed 0): the base every adapter here is made for."""
    from maskroll.app.model_init import init_model

    return init_model(tmp_path_factory.mktemp("lora_base") / "tiny", seed=0)
