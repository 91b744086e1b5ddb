"""Fixtures of the weight-transport tests, both ends: one tiny model and checkpoints of it under a weights
root, one torch engine behind a real in-process gRPC replica (it changes weights, so it is these tests'
own), and a private spool directory for pushed weights. A module, not a conftest, so that the replica's
end (tests/server/weights) and the trainer's (tests/weight_sync) import the same fixtures into their
conftests: each conftest puts tests/server (grpc_fixtures) and this folder (push_helpers) on sys.path
first."""

from __future__ import annotations

from pathlib import Path

import pytest
from grpc_fixtures import ServerLoop, replica, server_config, start_torch_engine
from push_helpers import spool_at


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


@pytest.fixture(scope="module")
def model(model_dir):
    """The tiny model as a trainer holds it (float32, no gradients): each module's own copy, which its
    stand-in optimiser steps move."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir).requires_grad_(False)


@pytest.fixture(scope="session")
def tiny_model_dir(model_dir) -> Path:
    """The name tests/server/vllm_fixtures.py asks for: the same tiny model (init_model is deterministic)."""
    return model_dir
