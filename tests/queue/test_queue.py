"""RolloutQueue + RolloutPublisher + PromptPuller against a real Redis, with a scripted job runner.

Each test states the guarantee it checks: nothing lost, nothing trained twice, malformed entries
dead-lettered, staleness and admission control enforced, clear errors when Redis is gone.
"""

from __future__ import annotations

import asyncio

import pytest
import redis
from scripted import scripted_records, scripted_replica

from maskroll.client import (
    AsyncRolloutQueue,
    QueueFull,
    QueueTimeout,
    QueueUnavailable,
    RolloutQueue,
    SamplingOptions,
)
from maskroll.local.redis_server import LocalRedis
from maskroll.proto import wire
from maskroll.proto.redis_conn import connect
from maskroll.proto.streams import F_JOB, F_RECORD, StreamKeys
from maskroll.server.pull.publisher import PublishTimeout, RolloutPublisher
from maskroll.server.pull.puller import JobRejected

OPTS = SamplingOptions(max_tokens=6, logprobs_k=3)


replica = scripted_replica  # (url, ns, name, *, run_job=None, claim_idle_s=60.0)


def test_all_rollouts_arrive_once_in_whole_groups(redis_server, namespace):
    async def main():
        async with AsyncRolloutQueue(redis_server.url, namespace, batch_size=8, max_staleness=1) as q:
            async with replica(redis_server.url, namespace):
                jobs = [await q.submit([1, 2, 3], OPTS, n=4) for _ in range(4)]
                seen = []
                for _ in range(2):
                    batch = await q.next_batch(timeout=20)
                    assert len(batch) == 8
                    # whole GRPO groups: every job in a batch has all 4 samples
                    assert all(sum(r.job_id == j for r in batch) in (0, 4) for j in jobs)
                    seen += [r.rollout_id for r in batch]
                    await q.ack(batch)
            assert len(seen) == len(set(seen)) == 16
            assert q.in_flight == 0 and q.stats.acked == 16
        raw = redis.Redis.from_url(redis_server.url)
        keys = StreamKeys(namespace)
        assert raw.xlen(keys.rollouts) == 0 and raw.xlen(keys.prompts) == 0  # acked entries are deleted

    asyncio.run(main())


def test_at_least_takes_fewer_records_once_and_keeps_the_batch_size(redis_server, namespace):
    """next_batch(at_least=N): whole groups adding up to ≥ N this once, the batch size and in-flight limit
    unchanged; an N outside 1..batch_size is refused by value, and the queue serves the next call."""

    async def main():
        async with (
            AsyncRolloutQueue(redis_server.url, namespace, batch_size=8, max_staleness=1) as q,
            replica(redis_server.url, namespace),
        ):
            job = await q.submit([1, 2, 3], OPTS, n=4)  # one group: half a batch
            for bad in (0, 9):
                with pytest.raises(
                    ValueError, match=rf"at_least={bad}; expected 1 <= at_least <= batch_size \(8\)"
                ):
                    await q.next_batch(at_least=bad, timeout=5)
            batch = await q.next_batch(at_least=4, timeout=20)
            assert sorted(r.sample_index for r in batch) == [
                0,
                1,
                2,
                3,
            ]  # the one whole group, not a wait for 8
            assert {r.job_id for r in batch} == {job}
            assert q.batch_size == 8 and q.max_in_flight == 16
            await q.ack(batch)
            assert q.in_flight == 0

    asyncio.run(main())


def test_trainer_dying_before_ack_leaves_records_for_the_next(redis_server, namespace):
    async def main():
        async with replica(redis_server.url, namespace):
            first = AsyncRolloutQueue(redis_server.url, namespace, batch_size=4, claim_idle_s=0.3)
            await first.submit([5, 6], OPTS, n=4)
            batch = await first.next_batch(timeout=20)
            await first.close()  # dies: read, never acked
            second = AsyncRolloutQueue(
                redis_server.url, namespace, run="resume", batch_size=4, claim_idle_s=0.3
            )
            again = await second.next_batch(timeout=20)
            assert sorted(r.rollout_id for r in again) == sorted(r.rollout_id for r in batch)
            assert second.stats.reclaimed == 4
            await second.ack(again)
            await second.close()

    asyncio.run(main())


def test_duplicates_are_dropped_even_after_ack_and_restart(redis_server, namespace):
    async def main():
        r = connect(redis_server.url)
        keys = StreamKeys(namespace)
        pub = RolloutPublisher(r, keys.rollouts)
        async with AsyncRolloutQueue(redis_server.url, namespace, batch_size=2) as q:
            job_id = await q.submit([1], OPTS, n=2)
            job = wire.decode_job((await r.xrange(keys.prompts))[0][1][F_JOB])
            assert job.job_id == job_id
            recs = scripted_records(job)
            await pub.publish(recs)
            await pub.publish(recs)  # a replica re-ran the job before the first ack landed
            batch = await q.next_batch(timeout=5)
            assert sorted(x.rollout_id for x in batch) == sorted(x.rollout_id for x in recs)
            await q.ack(batch)
            with pytest.raises(QueueTimeout):
                await q.next_batch(timeout=0.5)
            assert q.stats.duplicates == 2
        await pub.publish(recs)  # a late duplicate, seen by a brand-new trainer
        async with AsyncRolloutQueue(redis_server.url, namespace, run="resume", batch_size=2) as q2:
            with pytest.raises(QueueTimeout):
                await q2.next_batch(timeout=0.5)
            assert q2.stats.duplicates == 2
        await r.aclose()

    asyncio.run(main())


def test_malformed_entries_go_to_dead_letters_and_consumption_continues(redis_server, namespace):
    async def main():
        r = connect(redis_server.url)
        keys = StreamKeys(namespace)
        async with AsyncRolloutQueue(redis_server.url, namespace, batch_size=2) as q:
            good = scripted_records(
                wire.decode_job(wire.job_to_pb(_job("j1", 2, q.run_id)).SerializeToString())
            )
            data = wire.encode_record(good[0])
            await r.xadd(keys.rollouts, {F_RECORD: data[:-7]})  # truncated bytes
            await r.xadd(keys.rollouts, {b"foreign": b"schema"})  # someone else's entry
            await r.xadd(keys.rollouts, {F_RECORD: b"\x00\x01garbage"})
            await RolloutPublisher(r, keys.rollouts).publish(good)
            batch = await q.next_batch(timeout=5)
            assert [x.rollout_id for x in batch] == [x.rollout_id for x in good]
            assert q.stats.dead_lettered == 3
            assert await r.xlen(keys.dead_letters) == 3
            reasons = [e[1][b"reason"] for e in await r.xrange(keys.dead_letters)]
            assert any(b"bytes" in x or b"corrupt" in x.lower() for x in reasons)
        # a malformed prompt job is dead-lettered by the replica, which keeps serving
        await r.xadd(keys.prompts, {F_JOB: b"\xffnot a job"})
        async with (
            AsyncRolloutQueue(redis_server.url, namespace, run="resume", batch_size=2) as q,
            replica(redis_server.url, namespace),
        ):
            await q.submit([7], OPTS, n=2)
            batch = await q.next_batch(timeout=10)
            assert len(batch) == 2
            await q.ack(batch)
        assert await r.xlen(keys.dead_letters) == 4
        await r.aclose()

    asyncio.run(main())


def _job(job_id: str, n: int, run_id: str):
    import numpy as np

    from maskroll.proto.records import PromptJob

    return PromptJob(
        job_id=job_id,
        prompt_ids=np.array([1, 2], np.int32),
        options=SamplingOptions(max_tokens=4, logprobs_k=2, n=n),
        run_id=run_id,
    )


@pytest.mark.parametrize("policy", ["drop", "keep"])
def test_stale_records(redis_server, namespace, policy):
    async def main():
        r = connect(redis_server.url)
        keys = StreamKeys(namespace)
        async with AsyncRolloutQueue(
            redis_server.url, namespace, batch_size=2, max_staleness=1, stale_policy=policy
        ) as q:
            q.set_policy_version(5)
            old, fresh = _job("old", 2, q.run_id), _job("fresh", 2, q.run_id)
            pub = RolloutPublisher(r, keys.rollouts)
            await pub.publish(scripted_records(old, version=3))  # staleness 2 > 1
            await pub.publish(scripted_records(fresh, version=4))  # staleness 1
            batch = await q.next_batch(timeout=5)
            if policy == "drop":
                assert {x.job_id for x in batch} == {"fresh"} and q.stats.dropped_stale == 2
            else:
                assert {x.job_id for x in batch} == {"old"} and q.stats.dropped_stale == 0
        await r.aclose()

    asyncio.run(main())


def test_admission_control_blocks_then_admits(redis_server, namespace):
    async def main():
        async with AsyncRolloutQueue(redis_server.url, namespace, batch_size=2, max_staleness=1) as q:
            assert q.max_in_flight == 4
            await q.submit([1], OPTS, n=2)
            await q.submit([1], OPTS, n=2)
            assert q.room() == 0
            with pytest.raises(QueueFull, match="in flight"):
                await q.submit([1], OPTS, n=2, timeout=0.2)
            async with replica(redis_server.url, namespace):
                waiter = asyncio.create_task(q.submit([1], OPTS, n=2, timeout=20))
                await asyncio.sleep(0.3)
                assert not waiter.done()  # blocked, not dropped
                batch = await q.next_batch(timeout=10)
                await q.ack(batch)
                await asyncio.wait_for(waiter, 10)  # the ack made room
                assert q.in_flight == 4
            with pytest.raises(ValueError, match="in-flight limit"):
                await q.submit([1], OPTS, n=5)

    asyncio.run(main())


def test_rejected_jobs_release_their_slot(redis_server, namespace):
    async def run_job(job):
        raise JobRejected("prompt token 999999 is outside the vocabulary")

    async def main():
        async with AsyncRolloutQueue(redis_server.url, namespace, batch_size=2, max_staleness=0) as q:
            async with replica(redis_server.url, namespace, run_job=run_job):
                await q.submit([999999], OPTS, n=2)
                with pytest.raises(QueueTimeout):
                    await q.next_batch(timeout=1.5)
            assert q.stats.failed_jobs == 1 and q.in_flight == 0

    asyncio.run(main())


def test_full_stream_blocks_the_publisher_instead_of_dropping(redis_server, namespace):
    async def main():
        r = connect(redis_server.url)
        keys = StreamKeys(namespace)
        pub = RolloutPublisher(r, keys.rollouts, max_len=2, wait_timeout_s=0.6, poll_s=0.05)
        async with AsyncRolloutQueue(redis_server.url, namespace, batch_size=2) as q:
            await pub.publish(scripted_records(_job("a", 2, q.run_id)))
            with pytest.raises(PublishTimeout, match="stayed full"):
                await pub.publish(scripted_records(_job("b", 1, q.run_id)))
            assert await r.xlen(keys.rollouts) == 2  # nothing trimmed
            waiting = asyncio.create_task(
                RolloutPublisher(r, keys.rollouts, max_len=2, wait_timeout_s=10, poll_s=0.05).publish(
                    scripted_records(_job("c", 1, q.run_id))
                )
            )
            await asyncio.sleep(0.2)
            assert not waiting.done()
            await q.ack(await q.next_batch(timeout=5))  # consuming makes room
            await asyncio.wait_for(waiting, 5)
        await r.aclose()

    asyncio.run(main())


def test_the_publisher_checks_the_backlog_only_past_half_its_bound(redis_server, namespace):
    # XLEN before a publish is skipped while the length the last transaction returned is under
    # max_len / 2; each replica can add one job unchecked after the backlog passed half, never more.
    async def main():
        r = connect(redis_server.url)
        stream = StreamKeys(namespace).rollouts
        pub = RolloutPublisher(r, stream, max_len=8, wait_timeout_s=0.3, poll_s=0.05)
        admin = redis.Redis.from_url(redis_server.url)

        def xlen_calls() -> int:
            return admin.info("commandstats").get("cmdstat_xlen", {}).get("calls", 0)

        calls = xlen_calls()
        for i in range(4):  # lengths 1, 2, 3, 4: only the first publish (nothing seen yet) checks first
            await pub.publish(scripted_records(_job(f"a{i}", 1, "run")))
        assert xlen_calls() - calls == 1 + 4  # one check, and one XLEN inside each transaction
        calls = xlen_calls()
        await pub.publish(scripted_records(_job("b", 1, "run")))  # 4 seen + 1 > 8 / 2: checks, 5 fits
        assert xlen_calls() - calls == 2
        other = RolloutPublisher(r, stream, max_len=8)
        await other.publish(scripted_records(_job("c", 3, "run")))  # another replica: length 8
        with pytest.raises(PublishTimeout):  # 5 seen: checks, and 8 + 1 > 8
            await pub.publish(scripted_records(_job("d", 1, "run")))
        assert await r.xlen(stream) == 8
        admin.close()
        await r.aclose()

    asyncio.run(main())


def test_redis_unreachable_gives_a_clear_error_then_recovers(tmp_path):
    srv = LocalRedis(data_dir=tmp_path, appendonly=True).start()
    try:
        q = RolloutQueue(srv.url, "down", batch_size=2, retries=3)
        q.submit([1], OPTS, n=1)
        srv.stop()
        with pytest.raises(QueueUnavailable, match="unreachable"):
            q.submit([1], OPTS, n=1)
        srv.start()
        q.submit([1], OPTS, n=1)  # the same client works again
        raw = redis.Redis.from_url(srv.url)
        assert raw.xlen(StreamKeys("down").prompts) == 2  # the AOF kept the first job
        q.close()
    finally:
        srv.close()


def test_aof_restart_keeps_acked_state_and_pending_entries(tmp_path):
    srv = LocalRedis(data_dir=tmp_path, appendonly=True).start()

    async def phase1():
        raw = connect(srv.url)
        async with (
            AsyncRolloutQueue(srv.url, "aof", batch_size=2, consumer="trainer-1") as q,
            replica(srv.url, "aof"),
        ):
            for _ in range(3):
                await q.submit([3], OPTS, n=2)
            acked = await q.next_batch(timeout=10)
            await q.ack(acked)
            unacked = await q.next_batch(timeout=10)
            while await raw.xlen(StreamKeys("aof").rollouts) < 4:  # the third job is published too
                await asyncio.sleep(0.05)
        await raw.aclose()
        return acked, unacked

    async def phase2():
        async with AsyncRolloutQueue(srv.url, "aof", run="resume", batch_size=2, consumer="trainer-1") as q:
            got = []
            for _ in range(2):
                b = await q.next_batch(timeout=10)
                got += b
                await q.ack(b)
            with pytest.raises(QueueTimeout):
                await q.next_batch(timeout=0.5)
            return got

    try:
        acked, unacked = asyncio.run(phase1())
        srv.restart()
        got = asyncio.run(phase2())
        ids = {x.rollout_id for x in got}
        assert {x.rollout_id for x in unacked} <= ids  # nothing un-acked disappeared
        assert not ids & {x.rollout_id for x in acked}  # nothing acked came back
        assert len(ids) == 4
    finally:
        srv.close()
