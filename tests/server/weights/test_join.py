"""Joining the run at its current version over the directory transport, with in-process replicas: a
replica started after the trainer published version 1 serves it before its puller starts; one whose
weights root does not hold the checkpoint starts on its own weights and says why, and so does one
started after an NCCL broadcast (whose group it cannot join)."""

from __future__ import annotations

import logging

import pytest
from grpc_fixtures import server_config

from maskroll.client import ReplicaWeights, RolloutQueue
from maskroll.local.redis_server import LocalRedis
from maskroll.server.app import start
from maskroll.weight_sync import CheckpointPublisher
from maskroll.weight_sync.broadcast import replica_weights

NS = "join"


@pytest.fixture(scope="module")
def redis_url():
    with LocalRedis() as srv:
        yield srv.url


def _start(loop, model_dir, url, name, **kw):
    cfg = server_config(model_dir, redis_url=url, namespace=NS, pull=True, replica_id=name, **kw)
    return loop.run(start(cfg))


def test_a_replica_started_mid_run_loads_the_recorded_checkpoint_before_taking_jobs(
    loop, model_dir, redis_url, tmp_path, caplog
):
    from transformers import AutoModelForCausalLM

    first = _start(loop, model_dir, redis_url, "rep-a", weights_root=tmp_path, heartbeat_ttl_s=3)
    late = stranger = None
    try:
        with RolloutQueue(redis_url, NS, run="new", batch_size=2) as q:
            import time

            deadline = time.monotonic() + 20
            while not q.replicas():
                assert time.monotonic() < deadline
                time.sleep(0.05)
            model = AutoModelForCausalLM.from_pretrained(model_dir)
            pub = CheckpointPublisher(q, tmp_path)
            pub.start(model)
            assert pub.publish(model) == {"rep-a": "ok"}
            with caplog.at_level(logging.INFO, logger="maskroll.weights"):
                late = _start(loop, model_dir, redis_url, "rep-b", weights_root=tmp_path)
                # an app.start() that returned has started its puller: the join came first
                assert late.core.updates.weights_served == (q.run.run_id, 1)
                assert late.puller is not None
                elsewhere = tmp_path / "elsewhere"
                elsewhere.mkdir()
                stranger = _start(loop, model_dir, redis_url, "rep-c", weights_root=elsewhere)
            assert stranger.core.updates.weights_served == ("", 0)
            assert f"joined at version 1 of run {q.run.run_id}" in caplog.text
            assert "could not join at version 1" in caplog.text and "PERMISSION_DENIED" in caplog.text
            assert replica_weights(q)["rep-b"] == ReplicaWeights(q.run.run_id, 1)
    finally:
        for r in (first, late, stranger):
            if r is not None:
                loop.run(r.drain(timeout_s=0))


def test_a_replica_started_after_an_nccl_broadcast_starts_on_its_own_weights_and_says_why(
    loop, model_dir, redis_url, caplog
):
    """NcclPublisher records NCCL_CHECKPOINT (RolloutQueue.record_version): the NCCL group cannot
    take in a replica that starts later, so it does not wait for weights that will not come."""
    import time

    from maskroll.proto.run_record import NCCL_CHECKPOINT

    rep = None
    try:
        with RolloutQueue(redis_url, NS, run="new", batch_size=2) as q:
            q.record_version(3, NCCL_CHECKPOINT)
            assert (q.run.version, q.run.checkpoint, q.policy_version) == (3, NCCL_CHECKPOINT, 3)
            t0 = time.monotonic()
            with caplog.at_level(logging.INFO, logger="maskroll.weights"):
                rep = _start(loop, model_dir, redis_url, "rep-nccl")
            assert time.monotonic() - t0 < 60  # no join wait (MASKROLL_JOIN_TIMEOUT_S is 300)
            assert rep.core.updates.weights_served == ("", 0)
            assert f"run {q.run.run_id} is at version 3, broadcast over NCCL" in caplog.text
    finally:
        if rep is not None:
            loop.run(rep.drain(timeout_s=0))
