"""Shared fixtures of the server tests: one tiny model directory per session (writing it takes ~1 s)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`maskroll init-model` output with the defaults: hidden 128, 4 heads, 2 layers, max_len 1024, seed 0."""
    from maskroll.app.model_init import init_model

    return init_model(tmp_path_factory.mktemp("tiny_model") / "model", seed=0)
