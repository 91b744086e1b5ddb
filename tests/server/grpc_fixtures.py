"""Real grpc.aio servers on port 0 for the server tests, living on one background event loop.

Servers and engines run on `ServerLoop`'s thread; each test drives its clients with `asyncio.run` in
the main thread (one convention for every test here: no pytest-asyncio). Two loops in one process is
also what a trainer embedding a replica would do, and grpc.aio supports it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from maskroll.server.app import Replica, start
from maskroll.server.config import ServerConfig
from maskroll.server.engines.contract import Engine


class ServerLoop:
    """An asyncio loop on a daemon thread; `run(coro)` runs a coroutine there and returns its result."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-server-loop", daemon=True)
        self._thread.start()

    def run(self, coro, timeout: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


def server_config(model_dir: Path, **overrides) -> ServerConfig:
    base = {
        "model": model_dir,
        "engine": "torch",
        "port": 0,
        "replica_id": "test-replica",
        "drain_timeout_s": 5,
    }
    return ServerConfig(**{**base, **overrides})


@contextlib.contextmanager
def replica(loop: ServerLoop, config: ServerConfig, engine: Engine) -> Iterator[Replica]:
    """A started server around an already-started engine (the caller owns the engine)."""
    r = loop.run(start(config, engine))
    try:
        yield r
    finally:
        loop.run(r.drain(timeout_s=0))


def adopt_run(loop: ServerLoop, r: Replica, run_id: str = "test-run", token: str | None = None) -> None:
    """Make `r` serve version 0 of run `run_id` on its starting weights (AdoptSource, as a trainer's
    publisher.start does): records it publishes then belong to a run, as every trainer requires."""
    from maskroll.client import RolloutClient

    async def go() -> None:
        async with RolloutClient(r.address, token=token) as c:
            info = await c.info()
            if not info.run_id:
                await c.adopt_weights(info.weights_fingerprint, run_id=run_id)

    loop.run(go())


def start_torch_engine(loop: ServerLoop, model_dir: Path, **kwargs) -> Engine:
    from maskroll.server.engines.torch_engine import TorchEngine

    async def make() -> Engine:
        engine = TorchEngine(model_dir, **kwargs)
        await engine.start()
        return engine

    return loop.run(make())


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`maskroll init-model` output with the defaults: hidden 128, 4 heads, 2 layers, max_len 1024, seed 0.
    tests/server's conftest imports it (so do tests/client's and tests/app's): the model its engines load."""
    from maskroll.app.model_init import init_model

    return init_model(tmp_path_factory.mktemp("tiny_model") / "model", seed=0)


@pytest.fixture(scope="session")
def server_loop() -> Iterator[ServerLoop]:
    loop = ServerLoop()
    yield loop
    loop.close()


@pytest.fixture(scope="session")
def torch_engine(server_loop: ServerLoop, tiny_model_dir: Path) -> Iterator[Engine]:
    """The session's shared TorchEngine. Tests that change its weights use their own engine."""
    engine = start_torch_engine(server_loop, tiny_model_dir, max_logprobs=20, max_batch=32)
    yield engine
    server_loop.run(engine.close())


@pytest.fixture(scope="session")
def torch_server(server_loop: ServerLoop, torch_engine: Engine, tiny_model_dir: Path) -> Iterator[Replica]:
    with replica(server_loop, server_config(tiny_model_dir), torch_engine) as r:
        yield r
