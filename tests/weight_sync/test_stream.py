"""The streamed transport for real: `maskroll serve --pull` replica processes (torch engine, no shared
volume), one Redis, the trainer SDK and StreamPublisher. A publish reaches every replica and is
recorded in the run record as "stream"; a replica started mid-run is pushed the current version before
it takes a job (its ready line already says so); a replica that hangs and is then killed during a push
does not hold back the others."""

from __future__ import annotations

import re
import signal
import threading
import time

import pytest
import torch
from procs import Replicas
from push_helpers import wait_replicas

from maskroll.client import ReplicaWeights, RolloutQueue, SyncRolloutClient
from maskroll.local.redis_server import LocalRedis
from maskroll.proto.run_record import STREAM_CHECKPOINT
from maskroll.proto.streams import StreamKeys
from maskroll.weight_sync.broadcast import replica_weights
from maskroll.weight_sync.stream import StreamPublisher

pytestmark = pytest.mark.slow

NS = "stream"


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp("stream")
    with LocalRedis() as srv:
        reps = Replicas(model_dir, srv.url, NS, log_dir=base)
        for name in ("rep-0", "rep-1"):
            reps.start(name)
        try:
            reps.wait_ready()
            yield srv.url, reps
        finally:
            reps.stop_all()


def _step(model, seed: int) -> None:  # a stand-in for an optimiser step
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.add_(torch.randn(p.shape, generator=g) * 1e-3)


def test_publish_reaches_every_replica_and_a_replica_started_mid_run_joins_at_the_current_version(
    cluster, model
):
    url, reps = cluster
    with RolloutQueue(url, NS, run="new", batch_size=2) as q:
        wait_replicas(q, 2)
        with StreamPublisher(q, follow_s=0.3, timeout=60) as pub:
            assert pub.start(model) == 0
            _step(model, 1)
            assert pub.publish(model) == {"rep-0": "ok", "rep-1": "ok"}
            _step(model, 2)
            assert pub.publish(model) == {"rep-0": "ok", "rep-1": "ok"}
            run = q.run
            assert replica_weights(q) == {r: ReplicaWeights(run.run_id, 2) for r in ("rep-0", "rep-1")}
            import redis

            record = redis.Redis.from_url(url).hgetall(StreamKeys(NS).run)
            assert (
                record[b"version"] == b"2"
                and record[b"checkpoint"] == STREAM_CHECKPOINT.encode() == b"stream"
            )

            t0 = time.monotonic()
            reps.start("rep-2")
            reps.wait_ready()
            log = reps.log("rep-2").read_text()
            # ready (the puller started) only after the join: its first job is sampled from version 2
            assert re.search(r"ready on .*policy version 2\b", log), log[-2000:]
            assert f"joined run {run.run_id} at version 2" in log
            assert log.index("joined run") < log.index("ready on")
            assert replica_weights(q)["rep-2"] == ReplicaWeights(run.run_id, 2)
            assert time.monotonic() - t0 < 60
            # the pushed weights are the trainer's version 2 exactly: same logits as the trainer computes
            info = {r.replica_id: r for r in q.replicas()}["rep-2"]
            with SyncRolloutClient(info.address) as c:
                rec = c.generate_record([256, 84, 104], _opts())
            assert rec.policy_version_first == 2 and rec.run_id == run.run_id
            logits = model(torch.tensor([[256, 84, 104]])).logits[0, -1]
            expected = torch.log_softmax(logits.float(), -1)[int(rec.completion_ids[0])]
            assert abs(float(rec.sampled_logprobs[0]) - float(expected)) < 1e-4


def _opts():
    from maskroll.client import SamplingOptions

    return SamplingOptions(max_tokens=1, logprobs_k=1, seed=3)


def test_a_replica_killed_during_a_push_does_not_hold_back_the_others(cluster, model):
    url, reps = cluster
    with RolloutQueue(url, NS, run="resume", batch_size=2) as q:
        addresses = {r.replica_id: r.address for r in q.replicas()}
        version = q.run.version + 1
        reps.procs["rep-1"].send_signal(signal.SIGSTOP)  # hung: accepts bytes, answers nothing
        loaded_at: dict[str, float] = {}

        def watch(name):
            with SyncRolloutClient(addresses[name]) as c:
                while c.info().policy_version < version:
                    time.sleep(0.05)
            loaded_at[name] = time.monotonic()

        watchers = [threading.Thread(target=watch, args=(n,), daemon=True) for n in ("rep-0", "rep-2")]
        for w in watchers:
            w.start()
        pub = StreamPublisher(q, follow_s=None, timeout=40, require_all=False, chunk_bytes=64 << 10)
        t0 = time.monotonic()
        done: dict = {}
        pusher = threading.Thread(target=lambda: done.update(pub.publish(model, version)), daemon=True)
        _step(model, 3)
        pusher.start()
        for w in watchers:
            w.join(30)
        assert set(loaded_at) == {"rep-0", "rep-2"}  # the others loaded while rep-1 hung
        assert max(loaded_at.values()) - t0 < 20
        reps.kill9("rep-1")  # killed with the push to it half-sent
        pusher.join(60)
        elapsed = time.monotonic() - t0
        assert done["rep-0"] == "ok" and done["rep-2"] == "ok"
        assert done["rep-1"].startswith("RolloutError"), done["rep-1"]
        assert elapsed < 40, f"the push waited for the killed replica's timeout ({elapsed:.1f} s)"
