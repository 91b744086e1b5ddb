"""Runs and refused records against a real Redis, with in-process scripted replicas (fast).

A namespace's run is chosen explicitly and never mixed; a superseded trainer is told; records that do
not decode, fail a semantic check, belong to another run or come from a policy version the trainer has
not reached are dead-lettered with the reason and counted, and next_batch never raises for them; an
incomplete group expires; unstarted jobs are cancelled. The same rules with real replica processes:
test_run_lifecycle.py.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import redis
from scripted import scripted_records
from test_queue import OPTS, replica

from maskroll.client import (
    AsyncRolloutQueue,
    BroadcastError,
    QueueTimeout,
    RolloutQueue,
    RunChoiceRequired,
    RunNotFound,
    RunSuperseded,
)
from maskroll.proto import wire
from maskroll.proto.records import PromptJob, SamplingOptions
from maskroll.proto.redis_conn import connect
from maskroll.proto.streams import F_JOB, F_RECORD, REPLICA_GROUP, StreamKeys
from maskroll.server.pull.publisher import RolloutPublisher
from maskroll.weight_sync.broadcast import broadcast_weights, broadcast_weights_async


def _job(job_id: str, n: int, run_id: str) -> PromptJob:
    opts = SamplingOptions(max_tokens=4, logprobs_k=2, n=n)
    return PromptJob(job_id=job_id, prompt_ids=np.array([1, 2], np.int32), options=opts, run_id=run_id)


def _reasons(url: str, keys: StreamKeys) -> list[str]:
    return [e[1][b"reason"].decode() for e in redis.Redis.from_url(url).xrange(keys.dead_letters)]


def test_a_namespace_with_a_run_needs_an_explicit_choice(redis_server, namespace):
    with pytest.raises(RunNotFound, match="no run to resume"):
        RolloutQueue(redis_server.url, namespace, run="resume")
    with RolloutQueue(redis_server.url, namespace) as first:  # an empty namespace: a new run
        run = first.run
        assert (len(run.run_id), run.version, run.started_by) == (32, 0, first.consumer)
    with pytest.raises(RunChoiceRequired) as err:
        RolloutQueue(redis_server.url, namespace, consumer="second")
    message = str(err.value)
    assert f"already has run {run.run_id} (policy version 0" in message
    assert "run='resume' continues it from version 0; run='new' starts a new run" in message
    with RolloutQueue(redis_server.url, namespace, run="resume") as again:
        assert again.run_id == run.run_id and again.policy_version == 0
    with RolloutQueue(redis_server.url, namespace, run="new") as fresh:
        assert fresh.run_id != run.run_id
    with pytest.raises(ValueError, match="run='continue'"):
        RolloutQueue(redis_server.url, namespace, run="continue")


def test_bad_foreign_and_future_records_are_dead_lettered_and_never_raise(redis_server, namespace):
    async def main():
        r = connect(redis_server.url)
        keys = StreamKeys(namespace)
        pub = RolloutPublisher(r, keys.rollouts)
        async with AsyncRolloutQueue(redis_server.url, namespace, batch_size=2) as q:
            mine = q.run_id
            q.set_policy_version(3)
            # issue 11: logprobs_k = -1 and num_tokens = 0 used to raise ValueError out of next_batch
            poison = wire.record_to_pb(scripted_records(_job("p", 1, mine), version=3)[0])
            poison.num_tokens, poison.semantics.logprobs_k = 0, -1
            for f in (
                "completion_token_ids",
                "sampled_logprobs",
                "sampled_ranks",
                "topk_ids",
                "topk_logprobs",
            ):
                setattr(poison, f, b"")
            await r.xadd(keys.rollouts, {F_RECORD: poison.SerializeToString()})
            nan, sibling = scripted_records(_job("nan", 2, mine), version=3)
            nan.sampled_logprobs[:] = np.nan  # a checkpoint with NaN weights
            await pub.publish([nan, sibling])  # the group can never be whole: both are set aside
            await pub.publish(scripted_records(_job("old", 1, "run-of-yesterday"), version=2))
            await pub.publish(scripted_records(_job("anon", 1, ""), version=2))
            await pub.publish(scripted_records(_job("ahead", 1, mine), version=9))
            back = scripted_records(_job("back", 1, mine), version=9)[0]
            back.version_changes, back.policy_version_last = [(2, 1)], 1  # a reload mid-generation
            await pub.publish([back])
            good = scripted_records(_job("good", 2, mine), version=3)
            await pub.publish(good)
            batch = await q.next_batch(timeout=10)
            assert sorted(x.rollout_id for x in batch) == sorted(x.rollout_id for x in good)
            await q.ack(batch)
            s = q.stats
            assert (s.invalid, s.foreign_run, s.future_version, s.dead_lettered) == (2, 2, 2, 7)
            assert q.in_flight == 0 and s.expired_groups == 0
        reasons = _reasons(redis_server.url, keys)
        assert len(reasons) == 7 and await r.xlen(keys.rollouts) == 0  # each one acked and set aside
        sibling_reasons = (
            "group nan, which was closed incomplete",
            "another sample of group nan was refused",
        )
        assert sum(any(why in x for why in sibling_reasons) for x in reasons) == 1
        expected = [
            "semantics.logprobs_k -1 is negative",
            "sampled_logprobs holds a NaN",
            "belongs to run run-of-yesterday, not to this trainer's run",
            "no run id",
            "policy version 9 is ahead of this trainer's version 3",
            "goes backwards within the record ([9, 1])",
        ]
        for needle in expected:
            assert sum(needle in x for x in reasons) == 1, (needle, reasons)
        # a restarted trainer does not see them again
        async with AsyncRolloutQueue(redis_server.url, namespace, run="resume", batch_size=2) as q2:
            with pytest.raises(QueueTimeout):
                await q2.next_batch(timeout=0.5)
            assert q2.stats.dead_lettered == 0
        await r.aclose()

    asyncio.run(main())


def test_an_incomplete_group_expires_and_its_late_samples_follow(redis_server, namespace):
    async def main():
        r = connect(redis_server.url)
        keys = StreamKeys(namespace)
        pub = RolloutPublisher(r, keys.rollouts)
        async with AsyncRolloutQueue(redis_server.url, namespace, batch_size=2, group_timeout_s=0.5) as q:
            job_id = await q.submit([1, 2], SamplingOptions(max_tokens=2, logprobs_k=1), n=1000)
            assert q.in_flight == 1000
            job = wire.decode_job((await r.xrange(keys.prompts))[0][1][F_JOB])
            recs = scripted_records(job)
            await pub.publish(recs[:1])  # one sample of 1000; the others never come
            with pytest.raises(QueueTimeout, match="0 buffered in incomplete groups"):
                await q.next_batch(timeout=2)
            assert (q.stats.expired_groups, q.stats.dead_lettered, q.in_flight) == (1, 1, 0)
            await pub.publish(recs[1:2])  # a late sample of the expired group
            with pytest.raises(QueueTimeout):
                await q.next_batch(timeout=0.5)
            assert q.stats.dead_lettered == 2 and await r.xlen(keys.rollouts) == 0
        reasons = _reasons(redis_server.url, keys)
        assert f"group {job_id} incomplete: 1 of 1000 samples after 0.5 s" in reasons[0]
        assert "a late sample of group" in reasons[1] and "closed incomplete" in reasons[1]
        await r.aclose()

    asyncio.run(main())


def test_unstarted_jobs_are_cancelled_on_request_and_when_a_new_run_starts(redis_server, namespace):
    async def main():
        raw = connect(redis_server.url)
        keys = StreamKeys(namespace)
        async with AsyncRolloutQueue(redis_server.url, namespace) as q:
            jobs = [await q.submit([1], OPTS, n=2) for _ in range(3)]
            # a replica takes the first job: started jobs run on
            taken = await raw.xreadgroup(REPLICA_GROUP, "rep-x", {keys.prompts: ">"}, count=1)
            assert wire.decode_job(taken[0][1][0][1][F_JOB]).job_id == jobs[0]
            assert await q.cancel_pending_jobs() == 2
            assert (q.in_flight, q.stats.cancelled_jobs, await raw.xlen(keys.prompts)) == (2, 2, 1)
            for _ in range(2):
                await q.submit([1], OPTS, n=2)  # left behind by this trainer
        async with AsyncRolloutQueue(redis_server.url, namespace, run="new") as q2:
            assert q2.stats.cancelled_jobs == 2  # the previous run's jobs no replica had started
            assert await raw.xlen(keys.prompts) == 1  # the started one is left to its replica
            await q2.submit([1], OPTS, n=2)
            await q2.close(cancel_jobs=True)
            assert await raw.xlen(keys.prompts) == 1
        await raw.aclose()

    asyncio.run(main())


def test_a_superseded_trainer_is_told_and_leaves_the_new_runs_records(redis_server, namespace):
    async def main():
        old = await AsyncRolloutQueue(redis_server.url, namespace, batch_size=2, claim_idle_s=0.5).open()
        new = await AsyncRolloutQueue(
            redis_server.url, namespace, run="new", batch_size=2, claim_idle_s=0.5
        ).open()
        with pytest.raises(RunSuperseded, match=f"now belongs to run {new.run_id}"):
            await broadcast_weights_async(old, 1, "/nowhere/v1")
        async with replica(redis_server.url, namespace):
            await new.submit([3], OPTS, n=2)
            with pytest.raises(RunSuperseded, match="another trainer started a new run"):
                await old.next_batch(timeout=10)  # it may read the new run's records first
            assert old.stats.dead_lettered == 0
            batch = await new.next_batch(timeout=10)  # reclaimed from the old trainer if it read them
            assert {x.run_id for x in batch} == {new.run_id} and len(batch) == 2
            await new.ack(batch)
        await old.close()
        await new.close()

    asyncio.run(main())


def test_timeouts_and_broadcasts_say_there_is_no_live_replica(redis_server, namespace):
    with RolloutQueue(redis_server.url, namespace, batch_size=4) as q:
        q.submit([1, 2], OPTS, n=4)
        with pytest.raises(QueueTimeout, match=f"0 live replicas in namespace '{namespace}'"):
            q.next_batch(timeout=0.5)
        with pytest.raises(
            BroadcastError, match=f"reached no replica: 0 live replicas in namespace '{namespace}'"
        ):
            broadcast_weights(q, 1, "/ckpt/v1")
        # the version is the run's all the same: the trainer's weights are at 1 and its checkpoint exists
        assert (q.policy_version, q.run.version, q.run.checkpoint) == (1, 1, "/ckpt/v1")
        with pytest.raises(ValueError, match=r"does not move run \w+ forward: it is at version 1"):
            broadcast_weights(q, 1, "/ckpt/v1")
    with RolloutQueue(redis_server.url, namespace, run="resume") as again:
        assert (again.policy_version, again.run.checkpoint) == (1, "/ckpt/v1")
