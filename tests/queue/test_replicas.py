"""Independently scaled replicas, for real: `maskroll serve --pull` processes (torch engine), a real
Redis, the trainer SDK. A replica killed with SIGKILL while it holds jobs loses nothing and duplicates
nothing; a trainer that dies before acking leaves its records to the next; Redis restarted mid-run
(AOF) keeps what was acked acked and what was not pending.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter

import pytest
import redis
from procs import Replicas

from maskroll.app.model_init import encode_text, init_model
from maskroll.client.queue import BroadcastError, RolloutQueue
from maskroll.local.redis_server import LocalRedis
from maskroll.proto.records import SamplingOptions
from maskroll.proto.streams import REPLICA_GROUP, StreamKeys
from maskroll.weight_sync.broadcast import broadcast_weights

pytestmark = pytest.mark.slow

OPTS = SamplingOptions(max_tokens=12, logprobs_k=4, temperature=1.0)


def _pending_of(raw: redis.Redis, keys: StreamKeys, consumer: str) -> list[bytes]:
    try:
        return [
            e["message_id"]
            for e in raw.xpending_range(keys.prompts, REPLICA_GROUP, "-", "+", 1000, consumername=consumer)
        ]
    except redis.ResponseError:
        return []


def _collect(q: RolloutQueue, total: int, timeout: float = 240.0):
    got = []
    deadline = time.monotonic() + timeout
    while len(got) < total:
        assert time.monotonic() < deadline, f"only {len(got)} of {total} rollouts arrived"
        batch = q.next_batch(timeout=deadline - time.monotonic())
        got += batch
        q.ack(batch)
    return got


def test_sigkill_of_a_replica_holding_jobs_loses_and_duplicates_nothing(model_dir):
    with LocalRedis(appendonly=True) as srv:
        ns, keys = "failover", StreamKeys("failover")
        raw = redis.Redis.from_url(srv.url)
        reps = Replicas(model_dir, srv.url, ns)
        for name in ("rep-a", "rep-b", "rep-c"):
            reps.start(name)
        try:
            reps.wait_ready()
            prompt = encode_text(model_dir, "count:")
            with RolloutQueue(srv.url, ns, batch_size=16) as q:
                jobs = [q.submit(prompt, OPTS, n=4) for _ in range(60)]
                # SIGKILL rep-b as soon as it holds jobs (pending on its consumer, not yet acked)
                deadline = time.monotonic() + 60
                while not (held := _pending_of(raw, keys, "rep-b")):
                    assert time.monotonic() < deadline, "rep-b never took a job"
                    time.sleep(0.02)
                reps.kill9("rep-b")
                orphaned = set(_pending_of(raw, keys, "rep-b")) or set(held)
                got = _collect(q, 240)
                stats = q.stats
            ids = Counter(r.rollout_id for r in got)
            assert len(got) == 240 and len(ids) == 240, "a rollout was lost or delivered twice"
            per_job = Counter(r.job_id for r in got)
            assert set(per_job) == set(jobs) and set(per_job.values()) == {4}
            by_replica = Counter(r.replica_id for r in got)
            assert by_replica["rep-a"] > 0 and by_replica["rep-c"] > 0
            assert orphaned, "the killed replica held no job"
            # the jobs rep-b held were finished by the survivors after the claim timeout
            assert raw.xlen(keys.prompts) == 0 and raw.xlen(keys.rollouts) == 0
            print(
                f"failover: {dict(by_replica)}; duplicates dropped {stats.duplicates}; "
                f"orphaned jobs {len(orphaned)}"
            )
            # the dead replica drops out of the registry when its heartbeat key expires
            deadline = time.monotonic() + 10
            while raw.get(keys.replica("rep-b")) is not None:
                assert time.monotonic() < deadline, "the killed replica is still registered"
                time.sleep(0.1)
            assert raw.get(keys.replica("rep-a")) is not None
        finally:
            codes = reps.stop_all()
        assert codes["rep-a"] == 0 and codes["rep-c"] == 0, codes


def test_trainer_death_and_redis_restart_mid_run(model_dir, tmp_path):
    srv = LocalRedis(appendonly=True, data_dir=tmp_path).start()
    ns, keys = "restart", StreamKeys("restart")
    reps = Replicas(model_dir, srv.url, ns)
    for name in ("rep-x", "rep-y"):
        reps.start(name)
    try:
        reps.wait_ready()
        prompt = encode_text(model_dir, "abc")
        q = RolloutQueue(srv.url, ns, batch_size=8, consumer="trainer-1", claim_idle_s=1.0)
        jobs = [q.submit(prompt, OPTS, n=4) for _ in range(12)]
        first = q.next_batch(timeout=120)
        q.ack(first)
        # a trainer process reads a batch and dies (os._exit) before acking
        script = (
            "import json, os, sys\n"
            "from maskroll.client.queue import RolloutQueue\n"
            f"q = RolloutQueue({srv.url!r}, {ns!r}, run='resume', batch_size=8, consumer='doomed')\n"
            "b = q.next_batch(timeout=120)\n"
            "print(json.dumps([r.rollout_id for r in b]), flush=True)\n"
            "os._exit(0)\n"
        )
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180)
        lost = set(json.loads(out.stdout.strip().splitlines()[-1]))
        assert len(lost) == 8
        # Redis goes down and comes back (same port, AOF) while the replicas are running
        srv.restart()
        rest = _collect(q, 48 - 8, timeout=240)
        ids = Counter(r.rollout_id for r in first + rest)
        assert len(ids) == 48 and max(ids.values()) == 1
        assert lost <= set(ids), "the dead trainer's unacked records were not redelivered"
        assert {r.job_id for r in first + rest} == set(jobs)
        raw = redis.Redis.from_url(srv.url)
        assert raw.xlen(keys.rollouts) == 0 and raw.xlen(keys.prompts) == 0
        q.close()
    finally:
        reps.stop_all()
        srv.close()


def test_broadcast_weights_reaches_every_live_replica(model_dir, tmp_path):
    import shutil

    root = tmp_path / "weights"
    (root / "v1").mkdir(parents=True)
    other = init_model(tmp_path / "other", seed=1)  # same architecture, different weights
    shutil.copy(other / "model.safetensors", root / "v1" / "model.safetensors")
    with LocalRedis(password="s3cret") as srv:  # a password in the URL reaches every component
        reps = Replicas(model_dir, srv.url, "weights", log_dir=tmp_path)  # kept: a stuck drain shows why
        for name in ("rep-1", "rep-2"):
            reps.start(name, "--weights-root", str(root))
        try:
            reps.wait_ready()
            prompt = encode_text(model_dir, "w")
            with RolloutQueue(srv.url, "weights", batch_size=8) as q:
                deadline = time.monotonic() + 30
                while len(q.replicas()) < 2:
                    assert time.monotonic() < deadline, "replicas did not register"
                    time.sleep(0.1)
                results = broadcast_weights(q, 1, str(root / "v1"), timeout=60)
                assert results == {"rep-1": "ok", "rep-2": "ok"}
                assert q.policy_version == 1
                with pytest.raises(BroadcastError, match="loaded by none of the 2 live replicas") as bad:
                    broadcast_weights(q, 2, str(tmp_path / "outside-the-root"), timeout=60)
                assert all("PERMISSION_DENIED" in r for r in bad.value.results.values()), bad.value
                q.set_policy_version(1)
                for _ in range(2):
                    q.submit(prompt, OPTS, n=4)
                batch = q.next_batch(timeout=120)
                assert {r.policy_version_first for r in batch} == {1}
                q.ack(batch)
                deadline = time.monotonic() + 10
                while {r.policy_version for r in q.replicas()} != {1}:
                    assert time.monotonic() < deadline, "heartbeats do not report the new version"
                    time.sleep(0.1)
        finally:
            codes = reps.stop_all()
        stuck = {name: reps.log(name).read_text()[-3000:] for name, code in codes.items() if code != 0}
        assert set(codes.values()) == {0}, (codes, stuck)
