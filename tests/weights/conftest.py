"""Fixtures of the weight-transport tests: one tiny model and checkpoints of it under a weights root,
one torch engine behind a real in-process gRPC replica (it changes weights, so it is this folder's own),
and a private spool directory for pushed weights. tests/server holds grpc_fixtures (in-process
servers) and vllm_fixtures (the session's vLLM engine); tests/queue holds procs (`maskroll serve`
replica processes)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "server"))
sys.path.insert(0, str(HERE.parent / "queue"))

from grpc_fixtures import ServerLoop, replica, server_config, start_torch_engine  # noqa: E402
from push_helpers import spool_at  # noqa: E402


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    from maskroll.app.model_init import init_model

    return init_model(tmp_path_factory.mktemp("model") / "tiny", seed=0)


@pytest.fixture(scope="session")
def weights_root(tmp_path_factory, model_dir) -> Path:
    """v1 and v2: the tiny model's architecture with other seeds."""
    from maskroll.app.model_init import init_model

    root = tmp_path_factory.mktemp("weights")
    init_model(root / "v1", seed=1)
    init_model(root / "v2", seed=2)
    return root


@pytest.fixture(scope="module")
def loop():
    lp = ServerLoop()
    yield lp
    lp.close()


@pytest.fixture(scope="module")
def spool(tmp_path_factory):
    """Where pushed weights are received (the replica runs in this process, so the env applies)."""
    with spool_at(tmp_path_factory.mktemp("spool")) as path:
        yield path


@pytest.fixture(scope="module")
def torch_replica(loop, model_dir, weights_root, spool):
    engine = start_torch_engine(loop, model_dir, max_logprobs=20, max_batch=8, threads=1)
    with replica(loop, server_config(model_dir, weights_root=weights_root), engine) as r:
        yield r
    loop.run(engine.close())


@pytest.fixture(scope="session")
def tiny_model_dir(model_dir) -> Path:
    """The name tests/server/vllm_fixtures.py asks for: the same tiny model (init_model is deterministic)."""
    return model_dir
