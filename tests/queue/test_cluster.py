"""The queue on a real Redis Cluster (3 masters + 3 replicas, LocalRedisCluster) and partitioned namespaces.

Partitions spread one run over the cluster's masters; a trainer and replicas pointed at any node detect
cluster mode; a replica process killed mid-job loses and duplicates nothing; a master killed mid-run is
replaced by its replica while the trainer keeps going, and what at-least-once means then is measured
(docs/scaling.md, "Redis Cluster").
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter

import grpc
import numpy as np
import pytest
import redis
from procs import Replicas
from redis.exceptions import RedisClusterException
from scripted import scripted_replica
from test_replicas import OPTS as MODEL_OPTS
from test_replicas import _collect

from maskroll.app.model_init import encode_text
from maskroll.client import AsyncRolloutQueue, RolloutQueue, SamplingOptions
from maskroll.proto._generated import rollout_pb2 as pb
from maskroll.proto._generated import rollout_pb2_grpc as pb_grpc
from maskroll.proto.redis_conn import open_redis, transaction
from maskroll.proto.streams import REPLICA_GROUP, StreamKeys

OPTS = SamplingOptions(max_tokens=6, logprobs_k=3)


def replica(url: str, ns: str, partitions: int, name: str, *, delay: float = 0.01):
    """A scripted in-process replica on `partitions`, supervised as `maskroll serve` runs its puller."""
    return scripted_replica(
        url, ns, name, partitions=partitions, delay=delay, claim_idle_s=2.0, supervise=True
    )


def test_partitioned_round_trip_on_the_cluster(redis_cluster, namespace):
    async def main():
        async with AsyncRolloutQueue(redis_cluster.url, namespace, batch_size=8, partitions=3) as q:
            assert q.keys.cluster and q.keys.prompts == f"maskroll:{{{namespace}:0}}:prompts"
            async with (
                replica(redis_cluster.url, namespace, 3, "rep-a"),
                replica(redis_cluster.url, namespace, 3, "rep-b"),
            ):
                jobs = [await q.submit([1, 2, 3], OPTS, n=4) for _ in range(12)]
                seen = []
                while len(seen) < 48:
                    batch = await q.next_batch(timeout=30)
                    assert all(sum(r.job_id == j for r in batch) in (0, 4) for j in jobs)  # whole groups
                    seen += [r.rollout_id for r in batch]
                    await q.ack(batch)
                assert len(seen) == len(set(seen)) == 48
                assert len(await q.replicas()) == 2  # the registry (one slot) is found through the cluster
            return q.keys, q.stats

    keys, stats = asyncio.run(main())
    assert stats.acked == 48 and stats.duplicates == 0
    raw = redis.RedisCluster.from_url(redis_cluster.url)
    try:
        # every partition carried its share (jobs go to the partitions in turn: 4 jobs × 4 samples each)
        assert [raw.zcard(p.done) for p in keys.parts] == [16, 16, 16]
        assert [raw.xlen(p.prompts) + raw.xlen(p.rollouts) for p in keys.parts] == [0, 0, 0]
        masters = {redis_cluster.master_of(p.prompts) for p in keys.parts}
        assert len(masters) >= 2, f"the 3 partitions all landed on master {masters}"
        for p in keys.parts:  # a partition's keys share one slot (hash tag)
            assert len({raw.keyslot(k) for k in (p.prompts, p.rollouts, p.done, p.dead_letters)}) == 1
    finally:
        raw.close()


def test_one_partition_on_the_cluster_tags_its_keys_and_cancels_unstarted_jobs(redis_cluster, namespace):
    """The default (1 partition) on a cluster: every key of the partition in one slot, so the ack
    transaction and the Lua scripts (run record, cancel) work there."""

    async def main():
        async with AsyncRolloutQueue(redis_cluster.url, namespace, batch_size=4) as q:
            assert q.keys.prompts == f"maskroll:{{{namespace}:0}}:prompts"
            assert q.keys.run == f"maskroll:{{{namespace}}}:run"
            await q.submit([1], OPTS, n=4)
            await q.submit([2], OPTS, n=4)
            assert await q.cancel_pending_jobs() == 2 and q.in_flight == 0
            await q.submit([3], OPTS, n=4)
            async with replica(redis_cluster.url, namespace, 1, "rep-a"):
                batch = await q.next_batch(timeout=20)
                await q.ack(batch)
            assert [r.prompt_ids.tolist() for r in batch] == [[3]] * 4 and q.stats.acked == 4
        async with AsyncRolloutQueue(redis_cluster.url, namespace, run="new") as q2:
            assert q2.run_id != q.run_id  # the run scripts ran on the cluster

    asyncio.run(main())


def test_a_transaction_on_the_cluster_is_one_script_in_its_slot(redis_cluster, namespace):
    """`transaction()` on a cluster: the queued commands run in order in one EVAL on their slot's master,
    with Redis's replies; keys of two slots are refused before anything is sent."""

    async def main():
        r, cluster = await open_redis(redis_cluster.url)
        assert cluster
        part = StreamKeys(namespace, 2, cluster).part(1)
        try:
            pipe = transaction(r)
            pipe.xadd(part.rollouts, {b"r": b"\x00payload\xff"})
            pipe.xadd(part.rollouts, {b"r": b"second"})
            pipe.xlen(part.rollouts)
            pipe.zadd(part.done, {"rid": 1.5})
            first, second, length, added = await pipe.execute()
            assert length == 2 and added == 1 and first < second
            assert [f[b"r"] for _, f in await r.xrange(part.rollouts)] == [b"\x00payload\xff", b"second"]
            assert await r.zscore(part.done, "rid") == 1.5
            other = StreamKeys(namespace, 2, cluster).part(0)
            pipe = transaction(r)
            pipe.xlen(part.rollouts)
            pipe.xlen(other.rollouts)
            with pytest.raises(RedisClusterException, match=r"same key slot|CROSSSLOT"):
                await pipe.execute()
        finally:
            await r.aclose()

    asyncio.run(main())


def test_partitions_on_a_single_redis_and_a_mismatch_is_refused(redis_server, namespace):
    async def main():
        async with AsyncRolloutQueue(redis_server.url, namespace, batch_size=8, partitions=2) as q:
            assert not q.keys.cluster and q.keys.part(1).rollouts == f"maskroll:{{{namespace}:1}}:rollouts"
            async with replica(redis_server.url, namespace, 2, "rep-a"):
                for _ in range(4):
                    await q.submit([1, 2], OPTS, n=2)
                batch = await q.next_batch(timeout=20)
                await q.ack(batch)
                assert len(batch) == 8 and q.stats.duplicates == 0
            # a replica (or trainer) given another partition count is refused, naming both counts
            async with replica(redis_server.url, namespace, 1, "rep-wrong") as wrong:
                deadline = time.monotonic() + 10
                while wrong.failure() is None:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.05)
                assert "has 2 partitions in Redis" in wrong.failure() and "given 1" in wrong.failure()
        with pytest.raises(ValueError, match=r"has 2 partitions in Redis .* given 3"):
            RolloutQueue(redis_server.url, namespace, run="resume", partitions=3)

    asyncio.run(main())


def _generate_to(address: str, stream: str, prompt) -> grpc.StatusCode:
    """A raw Generate (n=2) asking the replica to publish its records to `stream`; its status code."""

    async def main():
        async with grpc.aio.insecure_channel(address) as channel:
            req = pb.GenerateRequest(
                prompt_token_ids=np.asarray(prompt, "<i4").tobytes(),
                options=pb.SamplingOptions(max_tokens=3, logprobs_k=2, n=2),
                rollout_stream=stream,
            )
            try:
                async for _ in pb_grpc.RolloutServiceStub(channel).Generate(req, timeout=60):
                    pass
            except grpc.aio.AioRpcError as e:
                return e.code()
            return grpc.StatusCode.OK

    return asyncio.run(main())


def _pending(raw: redis.RedisCluster, keys: StreamKeys, consumer: str) -> list[bytes]:
    out = []
    for p in keys.parts:
        with contextlib.suppress(redis.ResponseError):
            out += [
                e["message_id"]
                for e in raw.xpending_range(p.prompts, REPLICA_GROUP, "-", "+", 1000, consumername=consumer)
            ]
    return out


@pytest.mark.slow
def test_sigkill_of_a_replica_on_the_cluster_loses_and_duplicates_nothing(redis_cluster, model_dir):
    """test_replicas.py's failover test, on the cluster with 3 partitions: three `maskroll serve`
    replicas, one SIGKILLed while it holds jobs, every rollout exactly once."""
    ns = "cluster-failover"
    raw = redis.RedisCluster.from_url(redis_cluster.url)
    reps = Replicas(model_dir, redis_cluster.url, ns)
    for name in ("rep-a", "rep-b", "rep-c"):
        reps.start(name, "--partitions", "3")
    try:
        reps.wait_ready()
        prompt = encode_text(model_dir, "count:")
        with RolloutQueue(redis_cluster.url, ns, batch_size=8, partitions=3) as q:
            keys = StreamKeys(ns, 3, cluster=True)
            jobs = [q.submit(prompt, MODEL_OPTS, n=4) for _ in range(24)]
            deadline = time.monotonic() + 60
            while not (held := _pending(raw, keys, "rep-b")):
                assert time.monotonic() < deadline, "rep-b never took a job"
                time.sleep(0.02)
            reps.kill9("rep-b")
            got = _collect(q, 96)
            stats = q.stats
            address = next(r.address for r in q.replicas() if r.replica_id == "rep-a")
        ids = Counter(r.rollout_id for r in got)
        assert len(got) == 96 and len(ids) == 96, "a rollout was lost or delivered twice"
        assert set(Counter(r.job_id for r in got).values()) == {4} and {r.job_id for r in got} == set(jobs)
        by_replica = Counter(r.replica_id for r in got)
        assert by_replica["rep-a"] > 0 and by_replica["rep-c"] > 0 and held
        assert all(raw.xlen(p.prompts) == 0 and raw.xlen(p.rollouts) == 0 for p in keys.parts)
        print(f"cluster failover: {dict(by_replica)}; duplicates dropped {stats.duplicates}")
        # a Generate publishes to the namespace's rollout stream as the cluster names it (hash tag)
        assert _generate_to(address, keys.rollouts, prompt) == grpc.StatusCode.OK
        assert raw.xlen(keys.rollouts) == 2
        assert _generate_to(address, f"maskroll:{ns}:rollouts", prompt) == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        codes = reps.stop_all()
        raw.close()
    assert codes["rep-a"] == 0 and codes["rep-c"] == 0, codes


@pytest.mark.slow
def test_a_master_killed_mid_run_is_replaced_and_the_run_goes_on():
    """A master of one partition SIGKILLed while jobs are submitted, generated and acked: its replica is
    promoted (node timeout 1 s), the SDK's retries carry the trainer and the replicas through it, and no
    rollout is trained twice. Redis replicates asynchronously, so a write the dead master acknowledged
    but had not yet sent to its replica is gone: the figures printed are what that cost here."""
    from maskroll.local.redis_cluster import LocalRedisCluster

    ns, jobs_total, n = "master-kill", 90, 4
    # its own cluster: killing a master would leave the session's cluster without a spare
    with LocalRedisCluster(node_timeout_ms=1000) as cluster:

        async def main():
            async with (
                AsyncRolloutQueue(cluster.url, ns, batch_size=8, partitions=3, claim_idle_s=2.0) as q,
                replica(cluster.url, ns, 3, "rep-a"),
                replica(cluster.url, ns, 3, "rep-b"),
            ):
                victim = cluster.master_of(q.keys.part(0).prompts)
                submitted, trained, gaps = [], Counter(), []
                t_kill = failover_s = None

                async def produce():
                    for _ in range(jobs_total):
                        submitted.append(await q.submit([1, 2, 3], OPTS, n=n))
                        await asyncio.sleep(0.02)

                producer = asyncio.create_task(produce())
                last = time.monotonic()
                while sum(trained.values()) < jobs_total * n:
                    if t_kill is None and sum(trained.values()) >= jobs_total * n // 3:
                        cluster.kill(victim)
                        t_kill = time.monotonic()
                        await asyncio.to_thread(cluster.wait_ok, 30)
                        failover_s = time.monotonic() - t_kill
                    try:
                        batch = await q.next_batch(timeout=8)
                    except TimeoutError:  # QueueTimeout: what is missing now will not come
                        assert t_kill is not None and producer.done(), "the run stalled before the kill"
                        break
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now
                    trained.update(r.rollout_id for r in batch)
                    await q.ack(batch)
                await producer
                return (
                    submitted,
                    trained,
                    max(gaps),
                    failover_s,
                    q.stats,
                    cluster.master_of(q.keys.part(0).prompts),
                    victim,
                )

        submitted, trained, stall_s, failover_s, stats, new_master, victim = asyncio.run(main())
    lost = jobs_total * n - sum(trained.values())
    print(
        f"master kill: failover {failover_s:.2f} s, longest wait for a batch {stall_s:.2f} s, "
        f"{len(submitted)} jobs submitted, rollouts trained {sum(trained.values())} of {jobs_total * n} "
        f"(lost {lost}), trained twice {sum(c > 1 for c in trained.values())}, duplicates dropped "
        f"{stats.duplicates}, reclaimed {stats.reclaimed}"
    )
    assert new_master != victim and len(submitted) == jobs_total  # no error reached the trainer
    assert max(trained.values()) == 1, "a rollout was trained twice"
    # Loss is bounded by the replication window: jobs submitted within it on the dead master's partition.
    assert lost <= 8 * n, f"{lost} rollouts lost"


def test_clients_read_large_replies_with_the_raised_stream_limit(redis_server, redis_cluster):
    """Both clients' connections open their streams with READ_LIMIT (not asyncio's 64 KiB, which made
    a 1k-token record's read pause and resume the socket every 64 KiB), and large values round-trip."""
    from maskroll.proto.redis_conn import READ_LIMIT

    value = bytes(range(256)) * 1200  # 300 kB: past twice the old limit

    async def main(url: str):
        r, cluster = await open_redis(url)
        try:
            await r.set("read-limit-key", value)
            got = await r.get("read-limit-key")
            if cluster:
                node = r.get_node_from_key("read-limit-key")
                conn = node.acquire_connection()
                try:
                    await conn.connect()
                    return cluster, got, conn._reader._limit
                finally:
                    node.release(conn)
            conn = await r.connection_pool.get_connection()
            try:
                return cluster, got, conn._reader._limit
            finally:
                await r.connection_pool.release(conn)
        finally:
            await r.aclose()

    assert asyncio.run(main(redis_server.url)) == (False, value, READ_LIMIT)
    assert asyncio.run(main(redis_cluster.url)) == (True, value, READ_LIMIT)


def _records_for_pieces() -> list:
    """Records of every array layout: single-turn, multi-turn (logprobs travel only where sampled), with
    a teacher's arrays, and zero tokens (no array field at all)."""
    from maskroll.proto.records import RolloutRecord, Semantics

    rng = np.random.default_rng(0)

    def rec(t: int, k: int = 5, **extra) -> RolloutRecord:
        return RolloutRecord(
            rollout_id=f"r{t}",
            request_id="req",
            prompt_ids=rng.integers(0, 250, 7).astype(np.int32),
            completion_ids=rng.integers(0, 250, t).astype(np.int32),
            sampled_logprobs=-rng.random(t).astype(np.float32),
            sampled_ranks=rng.integers(1, 9, t).astype(np.int32),
            topk_ids=rng.integers(0, 250, (t, k)).astype(np.int32),
            topk_logprobs=-np.sort(rng.random((t, k)).astype(np.float32), axis=1),
            finish_reason="length",
            semantics=Semantics(temperature=0.7, logprobs_k=k, engine="torch", model="m"),
            **extra,
        )

    multi = rec(
        5, loss_mask=np.array([1, 1, 0, 0, 1], bool), segment_starts=[2], num_turns=2, schema_version=2
    )
    for name in ("sampled_logprobs", "sampled_ranks", "topk_ids", "topk_logprobs"):
        getattr(multi, name)[2:4] = 0
    teacher = rec(
        9,
        teacher_topk_ids=rng.integers(0, 250, (9, 4)).astype(np.int32),
        teacher_topk_logprobs=-np.sort(rng.random((9, 4)).astype(np.float32), axis=1),
        teacher_sampled_logprobs=-rng.random(9).astype(np.float32),
        teacher_semantics=Semantics(temperature=1.0, logprobs_k=4, engine="torch", model="t"),
        teacher_policy_version=7,
    )
    return [rec(40), multi, teacher, rec(0)]


def test_the_publisher_stores_records_sent_as_pieces_byte_for_byte(redis_server, redis_cluster):
    """On one Redis and on a cluster (where a transaction is a script), the publisher's client sends each
    record as its pieces, and the stream holds exactly encode_record's bytes; a plain redis-py client,
    which cannot send pieces, gets the joined bytes and stores the same."""
    import redis.asyncio as aioredis

    from maskroll.proto import wire
    from maskroll.proto.streams import F_RECORD
    from maskroll.server.pull.publisher import RolloutPublisher

    recs = _records_for_pieces()

    async def publish(url: str, plain: bool) -> tuple[bool, list[bytes]]:
        r = aioredis.Redis.from_url(url) if plain else (await open_redis(url))[0]
        stream = "{pieces}:rollouts"
        try:
            pub = RolloutPublisher(r, stream)
            ids = await pub.publish(recs)
            entries = await r.xrange(stream)
            await r.delete(stream)
            assert [e[0] for e in entries] == ids
            return pub._pieces, [fields[F_RECORD] for _, fields in entries]
        finally:
            await r.aclose()

    want = [wire.encode_record(r) for r in recs]
    assert asyncio.run(publish(redis_server.url, False)) == (True, want)
    assert asyncio.run(publish(redis_cluster.url, False)) == (True, want)
    assert asyncio.run(publish(redis_server.url, True)) == (False, want)
