"""The reward stage in its two placements, with real replicas: inside a replica (`maskroll serve
--reward`) and as its own process (`maskroll reward`) beside a plain replica. A trainer's queue opened
with reward_stage=True submits jobs, the replica generates them into the finished stream, the stage
scores them, and next_batch hands out whole groups whose rewards are the function's (collate uses them).
`maskroll status` shows the reward workers."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from maskroll.client import RolloutQueue, SamplingOptions
from maskroll.local.replica import LocalReplica
from maskroll.trainer_adapter import collate

HERE = pathlib.Path(__file__).resolve().parent  # stage_rewards.py: the reward functions' module

pytestmark = pytest.mark.slow

ENV = {"OMP_NUM_THREADS": "1", "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def _replica(model_dir, url: str, namespace: str, *extra: str) -> LocalReplica:
    args = ["--model", str(model_dir), "--engine", "torch", "--port", "0", "--threads", "1"]
    args += ["--namespace", namespace, "--pull", "--replica-id", "r0", "--drain-timeout-s", "5", *extra]
    return LocalReplica(args, env={**ENV, "MASKROLL_REDIS_URL": url}, name="replica r0")


def _train_one_batch(url: str, namespace: str) -> list:
    opts = SamplingOptions(max_tokens=6, logprobs_k=2)
    with RolloutQueue(url, namespace, run="new", batch_size=6, reward_stage=True) as q:
        for p in ([104, 105], [97, 98, 99], [120]):
            q.submit(p, opts, n=2, metadata={"task": "t"})
        batch = q.next_batch(timeout=120)
        q.ack(batch)
        return batch


def _check(batch) -> None:
    assert len(batch) == 6
    for rec in batch:
        assert rec.reward == float(len(rec.completion_ids)) and rec.reward_verifier == "length"
    b = collate(batch)  # rewards from the records; advantages from whole groups
    assert np.allclose(b.rewards.numpy(), [len(r.completion_ids) for r in batch])


def test_inside_a_replica(redis_server, namespace, model_dir):
    with _replica(model_dir, redis_server.url, namespace, "--reward", "stage_rewards:length") as rep:
        _check(_train_one_batch(redis_server.url, namespace))
        status = subprocess.run(
            [
                sys.executable,
                "-m",
                "maskroll.app.cli",
                "status",
                "--redis-url",
                redis_server.url,
                "--namespace",
                namespace,
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert status.returncode == 0, status.stderr
        workers = json.loads(status.stdout)["reward_workers"]
        assert [w["worker_id"] for w in workers] == ["r0-reward"] and workers[0]["scored"] >= 0
        assert "Traceback" not in rep.log_text()


def test_as_its_own_process(redis_server, namespace, model_dir, tmp_path):
    log_path = tmp_path / "reward.log"
    cmd = [sys.executable, "-m", "maskroll.app.cli", "reward", "--redis-url", redis_server.url]
    cmd += ["--namespace", namespace, "--reward", "stage_rewards:length", "--workers", "2"]
    with open(log_path, "w") as log:
        stage = subprocess.Popen(cmd, env={**os.environ, **ENV}, stdout=log, stderr=subprocess.STDOUT)
    try:
        with _replica(model_dir, redis_server.url, namespace):
            _check(_train_one_batch(redis_server.url, namespace))
    finally:
        stage.terminate()
        code = stage.wait(30)
    text = log_path.read_text()
    assert code == 0, text
    assert text.count("maskroll reward: ready") == 2  # one line per worker process
