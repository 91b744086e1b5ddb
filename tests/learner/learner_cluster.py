"""The learner tests' cluster (conftest.py's fixture) and what they read back from it: Redis, a tiny
model, two torch-engine replicas; the rollout ids acked on the namespace; the trace the ranks write
(ranks_script.py)."""

from __future__ import annotations

import json
from pathlib import Path

import redis

from maskroll.app.model_init import init_model
from maskroll.local.redis_server import LocalRedis
from maskroll.local.replica import LocalReplica, stop_all, wait_all
from maskroll.proto import wire
from maskroll.proto.streams import F_RECORD, StreamKeys

NAMESPACE = "learner"
LOGPROBS_K = 4
SCRIPT = Path(__file__).with_name("ranks_script.py")


class LearnerCluster:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.redis: LocalRedis | None = None
        self.replicas: list[LocalReplica] = []

    def __enter__(self) -> LearnerCluster:
        self.model_dir = init_model(self.root / "model", seed=0)
        self.redis = LocalRedis(appendonly=False, data_dir=self.root / "redis").start()
        self.url = self.redis.url
        for name in ("rep-a", "rep-b"):
            args = ["--model", str(self.model_dir), "--engine", "torch", "--port", "0", "--threads", "1"]
            args += ["--namespace", NAMESPACE, "--pull", "--replica-id", name, "--claim-idle-s", "2"]
            args += ["--max-logprobs", str(LOGPROBS_K), "--heartbeat-ttl-s", "3", "--drain-timeout-s", "5"]
            env = {"OMP_NUM_THREADS": "1", "MASKROLL_REDIS_URL": self.url}
            rep = LocalReplica(args, env=env, log=self.root / f"{name}.log", name=f"replica {name}")
            self.replicas.append(rep.start())
        wait_all(self.replicas, 180)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            stop_all(self.replicas, timeout=20)
        finally:
            if self.redis is not None:
                self.redis.close()

    def acked_ids(self) -> set[str]:
        """Every rollout id the namespace's trainers have acked (the `done` markers)."""
        r = redis.Redis.from_url(self.url)
        try:
            return {m.decode() for m in r.zrange(StreamKeys(NAMESPACE).done, 0, -1)}
        finally:
            r.close()

    def stream_ids(self) -> set[str]:
        """The rollout ids of the records still in the namespace's rollout stream (unacked or unread)."""
        r = redis.Redis.from_url(self.url)
        try:
            entries = r.xrange(StreamKeys(NAMESPACE).rollouts)
        finally:
            r.close()
        return {wire.decode_record(f[F_RECORD]).rollout_id for _, f in entries if F_RECORD in f}


def read_trace(trace_dir: Path) -> list[dict]:
    """Every StepEvent the ranks wrote (ranks_script.py), each with its `life` (torchrun restart count)."""
    events = []
    for path in sorted(trace_dir.glob("rank*.jsonl")):
        events += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return events
