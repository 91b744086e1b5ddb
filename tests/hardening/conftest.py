"""Shared real processes of the adversarial suite: one tiny model, one private Redis with a password, and
one `maskroll serve --pull` replica (torch engine) that every non-destructive case attacks in turn — each
case then checks that the same process still serves. Cases that flush, restart or stop Redis bring
their own Redis and replica (test_redis_events.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hardening_fixtures import NAMESPACE, Serve

from maskroll.local.redis_server import LocalRedis

REDIS_PASSWORD = "hardening-s3cret-pw"


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    from maskroll.app.model_init import init_model

    return init_model(tmp_path_factory.mktemp("model") / "tiny", seed=0)


@pytest.fixture(scope="session")
def weights_root(tmp_path_factory, model_dir) -> Path:
    """Checkpoints: v1 / v2 (good, other seeds), nan and inf (one poisoned tensor each), a FIFO named
    model.safetensors, and a checkpoint outside the root."""
    from safetensors.torch import load_file, save_file

    from maskroll.app.model_init import init_model

    base = tmp_path_factory.mktemp("weights")
    root = base / "root"
    init_model(root / "v1", seed=1)
    init_model(root / "v2", seed=2)
    good = load_file(str(root / "v1" / "model.safetensors"))
    for name, value in (("nan", float("nan")), ("inf", float("inf"))):
        bad = {k: v.clone() for k, v in good.items()}
        bad["model.norm.weight"][7] = value
        (root / name).mkdir()
        save_file(bad, str(root / name / "model.safetensors"))
    (root / "fifo").mkdir()
    os.mkfifo(root / "fifo" / "model.safetensors")
    init_model(base / "outside", seed=3)
    return root


@pytest.fixture(scope="session")
def redis_server():
    with LocalRedis(password=REDIS_PASSWORD) as r:
        yield r


@pytest.fixture(scope="session")
def replica(model_dir, weights_root, redis_server, tmp_path_factory):
    """The shared replica: pull mode on namespace "hard", UpdateWeights from weights_root, reclaim after
    1 s and at most 3 deliveries per job (so poison jobs die in seconds)."""
    log = tmp_path_factory.mktemp("replica") / "serve.log"
    s = Serve(
        model_dir, log, "--namespace", NAMESPACE, "--pull", "--replica-id", "hard-1",
        "--claim-idle-s", "1", "--heartbeat-ttl-s", "3", "--pull-concurrency", "4",
        "--max-job-deliveries", "3", "--weights-root", str(weights_root),
        env={"MASKROLL_REDIS_URL": redis_server.url},
    )  # fmt: skip
    yield s
    code = s.stop()
    assert code == 0, f"the shared replica exited with {code}; log:\n{s.log_text()[-3000:]}"
    assert REDIS_PASSWORD not in s.log_text(), "the Redis password reached the replica's log"
