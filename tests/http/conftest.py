"""Shared fixtures of the HTTP front-end tests: one torch engine and one replica (gRPC + HTTP, a bearer
token, a private Redis) for the whole session, on a background event loop; clients run in the test's
thread (the official `openai` client and plain `httpx`).

tests/server holds the server test helpers (grpc_fixtures) and the session's one vLLM engine
(vllm_fixtures), which the vLLM test here shares rather than starting a second engine.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))

from grpc_fixtures import ServerLoop, adopt_run, replica, server_config, start_torch_engine
from http_fixtures import NAMESPACE, TOKEN, Served

from maskroll.local.redis_server import LocalRedis


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`maskroll init-model` output with the defaults (as tests/server/conftest.py's)."""
    from maskroll.app.model_init import init_model

    return init_model(tmp_path_factory.mktemp("tiny_model") / "model", seed=0)


@pytest.fixture(scope="session")
def http_loop() -> Iterator[ServerLoop]:
    loop = ServerLoop()
    yield loop
    loop.close()


@pytest.fixture(scope="session")
def http_engine(http_loop: ServerLoop, tiny_model_dir: Path):
    engine = start_torch_engine(http_loop, tiny_model_dir, max_logprobs=20, max_batch=32)
    yield engine
    http_loop.run(engine.close())


@pytest.fixture(scope="session")
def redis_server() -> Iterator[LocalRedis]:
    with LocalRedis() as r:
        yield r


@pytest.fixture(scope="session")
def served(http_loop, http_engine, tiny_model_dir, redis_server) -> Iterator[Served]:
    """The replica most tests use: token auth, HTTP on a free port, Redis for session records."""
    config = server_config(
        tiny_model_dir,
        http_port=0,
        auth_token=TOKEN,
        redis_url=redis_server.url,
        namespace=NAMESPACE,
    )
    with replica(http_loop, config, http_engine) as r:
        adopt_run(http_loop, r, token=TOKEN)  # session records belong to a run (else finish refuses them)
        yield Served(r, f"http://127.0.0.1:{r.http.port}", r.address, redis_server.url)
