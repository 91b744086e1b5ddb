"""The session's one vLLM engine (start-up takes 35-80 s on CPU), for every test that needs real vLLM.

Import the fixtures into a test module:

    from vllm_fixtures import server_loop, vllm_engine, vllm_env  # noqa: F401  (fixtures)

`server_loop` here is the loop the engine lives on (a grpc_fixtures.ServerLoop), so the engine can
also sit behind a real gRPC replica. A fixture imported into several modules is a separate fixture in
each (pytest keys fixtures by the module that holds them), which would start one engine per module on
different loops; so the loop, the engine and vLLM's environment are one process-wide `_Shared` object,
reference-counted across those copies and torn down when the last one is. The environment vLLM reads
(cache and IPC directories, log level) is set for that lifetime and restored afterwards.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from grpc_fixtures import ServerLoop

from maskroll.server.engines.contract import Engine

HAS_VLLM = importlib.util.find_spec("vllm") is not None
MAX_LOGPROBS = 20
LORA_RANK = 8  # vLLM's max_lora_rank (one of its allowed sizes): adapters of rank <= 8
MAX_LORAS = 4  # adapters resident at once (vLLM's max_loras = max_cpu_loras)


@dataclass
class _SharedState:
    users: int = 0
    loop: ServerLoop | None = None
    engine: Engine | None = None
    env: dict[str, str] = field(default_factory=dict)
    saved_env: dict[str, str | None] = field(default_factory=dict)
    tmp: tempfile.TemporaryDirectory | None = None


_Shared = _SharedState()  # process-wide: see the module docstring


@contextlib.contextmanager
def _use() -> Iterator[_SharedState]:
    if _Shared.users == 0:
        _Shared.loop = ServerLoop()
    _Shared.users += 1
    try:
        yield _Shared
    finally:
        _Shared.users -= 1
        if _Shared.users == 0:
            _teardown()


def _teardown() -> None:
    if _Shared.engine is not None:
        _Shared.loop.run(_Shared.engine.close(), timeout=120)
        _Shared.engine = None
    _Shared.loop.close()
    _Shared.loop = None
    for key, value in _Shared.saved_env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    _Shared.env, _Shared.saved_env = {}, {}
    if _Shared.tmp is not None:
        _Shared.tmp.cleanup()
        _Shared.tmp = None


def _set_env() -> dict[str, str]:
    """vLLM's caches and IPC sockets in a temp dir of this run; quieter logs; no usage reports."""
    if not _Shared.env:
        _Shared.tmp = tempfile.TemporaryDirectory(prefix="maskroll-vllm-tests-")
        root = Path(_Shared.tmp.name)
        env = {
            "VLLM_CACHE_ROOT": str(root / "vllm"),
            "TORCHINDUCTOR_CACHE_DIR": str(root / "torchinductor"),
            "VLLM_RPC_BASE_PATH": str(root / "rpc"),
            "VLLM_LOGGING_LEVEL": "WARNING",
            # Anonymous usage stats would try the network from a test machine.
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }
        _Shared.saved_env = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        for key in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "VLLM_RPC_BASE_PATH"):
            Path(env[key]).mkdir(parents=True, exist_ok=True)
        _Shared.env = env
    return _Shared.env


@pytest.fixture(scope="session")
def server_loop() -> Iterator[ServerLoop]:
    """The loop the shared vLLM engine lives on: one per process, whichever module asks first."""
    with _use() as shared:
        yield shared.loop


@pytest.fixture(scope="session")
def vllm_env() -> Iterator[dict[str, str]]:
    with _use():
        yield _set_env()


@pytest.fixture(scope="session")
def vllm_engine(tiny_model_dir: Path) -> Iterator[Engine]:
    """One started VllmEngine on the tiny model, eager mode (no torch.compile: start-up time, and the
    numbers are compared with an eager reference), LoRA on (rank <= LORA_RANK, MAX_LORAS resident). It
    lives on this module's `server_loop`: drive it with that one, not grpc_fixtures'. Tests that change its
    weights restore them; tests that add adapters remove them."""
    if not HAS_VLLM:
        pytest.skip("vllm is not installed")
    with _use() as shared:
        if shared.engine is None:
            from maskroll.server.config import EngineConfig
            from maskroll.server.engines.vllm_engine import VllmEngine

            _set_env()
            # The defaults otherwise: float32, a 1 GiB KV cache on CPU, the model's context of 1024.
            # LoRA on (tests/lora): requests without an adapter are the base model's exactly, so every
            # other vLLM test runs on it unchanged, and CI starts one engine instead of two.
            config = EngineConfig(enforce_eager=True, seed=0)
            engine = VllmEngine(
                tiny_model_dir,
                max_logprobs=MAX_LOGPROBS,
                config=config,
                max_lora_rank=LORA_RANK,
                max_loras=MAX_LORAS,
            )
            shared.loop.run(engine.start(), timeout=600)
            shared.engine = engine
        yield shared.engine
