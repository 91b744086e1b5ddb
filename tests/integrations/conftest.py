"""One private Redis and two pull-mode replicas (torch engine, `maskroll serve --pull` subprocesses) on a
tiny model, shared by the integration tests of a module; every process started here is stopped here."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from maskroll.app.model_init import init_model
from maskroll.local.redis_server import LocalRedis
from maskroll.local.replica import LocalReplica, stop_all, wait_all

NAMESPACE = "trl-it"
LOGPROBS_K = 8


@dataclass
class Cluster:
    model_dir: Path
    weights_root: Path
    redis_url: str
    namespace: str
    procs: dict[str, subprocess.Popen]
    addresses: dict[str, str]  # replica id -> host:port
    logprobs_k: int = LOGPROBS_K


def _replica(name: str, model_dir: Path, weights: Path, url: str, log: Path) -> LocalReplica:
    args = [
        *("--model", str(model_dir), "--engine", "torch", "--port", "0", "--threads", "1"),
        *("--namespace", NAMESPACE, "--pull", "--replica-id", name, "--weights-root", str(weights)),
        *("--max-logprobs", str(LOGPROBS_K), "--heartbeat-ttl-s", "3", "--drain-timeout-s", "5"),
    ]
    env = {"OMP_NUM_THREADS": "1", "MASKROLL_REDIS_URL": url}
    return LocalReplica(args, env=env, log=log, name=f"replica {name}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("trl-cluster")
    model_dir = init_model(root / "model", seed=0)
    weights, logs = root / "weights", root / "logs"
    weights.mkdir()
    logs.mkdir()
    with LocalRedis(appendonly=False, data_dir=root / "redis") as srv:
        replicas = {
            name: _replica(name, model_dir, weights, srv.url, logs / f"{name}.log").start()
            for name in ("rep-0", "rep-1")
        }
        try:
            wait_all(replicas.values(), timeout=180.0)
            procs = {name: r.proc for name, r in replicas.items()}
            addresses = {name: r.address for name, r in replicas.items()}
            yield Cluster(model_dir, weights, srv.url, NAMESPACE, procs, addresses)
        finally:
            stop_all(replicas.values(), timeout=30.0)
