"""A private Redis per test module (LocalRedis on a free loopback port, stopped by PID), one tiny model for
the session (its tokenizer decodes the records), and this directory on the path of the `maskroll reward`
processes the tests start, so `stage_rewards:<fn>` imports there too."""

from __future__ import annotations

import pathlib
import sys

import pytest

from maskroll.local.redis_server import LocalRedis

HERE = pathlib.Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))


@pytest.fixture(scope="module")
def redis_server():
    with LocalRedis(appendonly=True) as r:
        yield r


@pytest.fixture
def namespace(request) -> str:
    import hashlib

    name = request.node.name.replace("[", "-").replace("]", "")
    return f"{name[:48]}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    from maskroll.app.model_init import init_model

    return init_model(tmp_path_factory.mktemp("model") / "tiny", seed=0)
