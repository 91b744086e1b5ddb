"""One private Redis and two pull-mode replicas (torch engine, `maskroll serve --pull` subprocesses) on a
tiny model, shared by the integration tests of a module; every process started here is stopped here."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from maskroll.app.model_init import init_model
from maskroll.local.redis_server import LocalRedis

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


def _start_replica(name: str, model_dir: Path, weights: Path, url: str, log: Path) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "maskroll.app.cli",
        "serve",
        *("--model", str(model_dir), "--engine", "torch", "--port", "0", "--threads", "1"),
        *("--namespace", NAMESPACE, "--pull", "--replica-id", name, "--weights-root", str(weights)),
        *("--max-logprobs", str(LOGPROBS_K), "--heartbeat-ttl-s", "3", "--drain-timeout-s", "5"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASKROLL_REDIS_URL": url}
    with open(log, "w") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)


def _wait_ready(procs: dict[str, subprocess.Popen], logs: Path, timeout: float = 180.0) -> dict[str, str]:
    """Each replica's gRPC address, from its "ready on <address>" line."""
    deadline = time.monotonic() + timeout
    addresses = {}
    for name, p in procs.items():
        path = logs / f"{name}.log"
        while not (found := re.search(r"ready on (\S+)", path.read_text(errors="replace"))):
            if p.poll() is not None:
                raise RuntimeError(f"replica {name} exited with {p.returncode}:\n{path.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"replica {name} not ready after {timeout} s")
            time.sleep(0.2)
        addresses[name] = found.group(1)
    return addresses


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("trl-cluster")
    model_dir = init_model(root / "model", seed=0)
    weights, logs = root / "weights", root / "logs"
    weights.mkdir()
    logs.mkdir()
    with LocalRedis(appendonly=False, data_dir=root / "redis") as srv:
        procs = {
            name: _start_replica(name, model_dir, weights, srv.url, logs / f"{name}.log")
            for name in ("rep-0", "rep-1")
        }
        try:
            addresses = _wait_ready(procs, logs)
            yield Cluster(model_dir, weights, srv.url, NAMESPACE, procs, addresses)
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in procs.values():
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
