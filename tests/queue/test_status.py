"""`maskroll status` / `maskroll dead-letters` against a real Redis with a scripted replica: the numbers
they report (backlog and pending per partition, dead letters by reason, the replica listed) are the
namespace's, on one partition and on several, and the CLI prints them as JSON."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys

from scripted import scripted_replica

from maskroll.client import AsyncRolloutQueue, QueueTimeout, SamplingOptions
from maskroll.client.status import (
    drop_dead_letters,
    list_dead_letters,
    namespace_keys,
    namespace_status,
)
from maskroll.proto.redis_conn import connect
from maskroll.proto.streams import F_RECORD, StreamKeys

OPTS = SamplingOptions(max_tokens=4, logprobs_k=2)


def _cli(*args: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "maskroll.app.cli", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_status_reports_the_run_replica_backlog_and_dead_letters(redis_server, namespace):
    url = redis_server.url

    async def main():
        r = connect(url)
        keys = StreamKeys(namespace)
        # the replica takes every job (concurrency 4) and holds each for a long while
        async with (
            AsyncRolloutQueue(url, namespace, batch_size=2, run="new") as q,
            scripted_replica(url, namespace, "rep-a", delay=30.0),
        ):
            for _ in range(3):
                await q.submit([1, 2], OPTS, n=2)
            for _ in range(100):
                st = await namespace_status(r, await namespace_keys(r, namespace))
                reps = st["replicas"]
                if reps and reps[0]["active_jobs"] == 3 and st["prompts"]["pending"] == 3:
                    break
                await asyncio.sleep(0.05)
            # three entries no trainer can decode: dead-lettered with two reasons
            for data in (b"\x00\x01garbage", b"\x00\x02garbage"):
                await r.xadd(keys.rollouts, {F_RECORD: data})
            await r.xadd(keys.rollouts, {b"foreign": b"schema"})
            # not read by the trainer yet
            with_bad = await namespace_status(r, keys)
            assert with_bad["rollouts"] == {"length": 3, "pending": 0, "waiting": 3}
            with contextlib.suppress(QueueTimeout):  # reads (and dead-letters) the three
                await q.next_batch(timeout=0.3)
            st = await namespace_status(r, await namespace_keys(r, namespace))
            assert st["run"]["run_id"] == q.run_id and st["run"]["version"] == 0
            assert [rep["replica_id"] for rep in st["replicas"]] == ["rep-a"]
            assert st["replicas"][0]["address"] == "127.0.0.1:1"
            assert st["replicas"][0]["active_jobs"] == 3  # concurrency 4: all three jobs taken
            assert st["prompts"] == {"length": 3, "pending": 3, "waiting": 0}
            assert st["rollouts"] == {"length": 0, "pending": 0, "waiting": 0}
            dead = st["dead_letters"]
            assert dead["total"] == dead["read"] == 3
            assert sum(dead["by_reason"].values()) == 3
            assert dead["by_reason"]["unknown fields [b'foreign']"] == 1
            assert len(dead["by_reason"]) == 2  # the two corrupt records: one reason
            assert "namespaces_with_replicas" not in st

            cli = _cli("status", "--redis-url", url, "--namespace", namespace)
            assert cli["replicas"][0]["replica_id"] == "rep-a"
            assert cli["prompts"] == st["prompts"] and cli["dead_letters"] == st["dead_letters"]
            assert cli["run"]["run_id"] == q.run_id

            listed = _cli("dead-letters", "--redis-url", url, "--namespace", namespace, "--limit", "2")
            assert len(listed["dead_letters"]) == 2 and listed["dropped"] == 0
            newest = listed["dead_letters"][0]
            assert newest["reason"] == "unknown fields [b'foreign']"
            assert newest["stream"] == keys.rollouts and newest["age_s"] < 60
            dropped = _cli(
                "dead-letters", "--redis-url", url, "--namespace", namespace, "--limit", "2", "--drop"
            )
            assert dropped["dropped"] == 2
            assert (await namespace_status(r, keys))["dead_letters"]["total"] == 1
            await q.cancel_pending_jobs()
        await r.aclose()

    asyncio.run(main())


def test_status_with_partitions_counts_each_partition(redis_server, namespace):
    url = redis_server.url

    async def main():
        r = connect(url)
        async with AsyncRolloutQueue(url, namespace, batch_size=2, run="new", partitions=3) as q:
            for _ in range(5):  # partitions in turn: 2, 2, 1 prompts, none delivered (no replica yet)
                await q.submit([1, 2], OPTS, n=2)
            keys = await namespace_keys(r, namespace)
            assert keys.partitions == 3  # read from the namespace's recorded layout
            await r.xadd(keys.part(2).dead_letters, {b"stream": b"s", b"id": b"1-0", b"reason": b"why"})
            st = await namespace_status(r, keys)
            assert st["partitions"] == 3
            assert sorted(p["prompts"]["length"] for p in st["by_partition"]) == [1, 2, 2]
            assert st["prompts"] == {"length": 5, "pending": 0, "waiting": 5}
            assert [p["dead_letters"] for p in st["by_partition"]] == [0, 0, 1]
            assert st["dead_letters"]["by_reason"] == {"why": 1}
            assert st["replicas"] == [] and isinstance(st["namespaces_with_replicas"], dict)
            letters = await list_dead_letters(r, keys)
            assert [(d["id"].split("/")[0], d["reason"]) for d in letters] == [("2", "why")]
            assert await drop_dead_letters(r, keys, letters) == 1
            await q.cancel_pending_jobs()
        await r.aclose()

    asyncio.run(main())


def test_requeue_puts_a_dead_lettered_job_back_and_its_rollouts_arrive(redis_server, namespace):
    """A prompt job that died for a passing reason (a replica's engine, say) is requeued by
    `maskroll dead-letters --requeue`: a replica takes it again and the trainer gets its records."""
    from maskroll.proto.streams import REPLICA_GROUP, dead_letter, ensure_group

    url = redis_server.url

    async def main():
        r = connect(url)
        keys = StreamKeys(namespace)
        async with AsyncRolloutQueue(url, namespace, batch_size=2, run="new") as q:
            await q.submit([1, 2], OPTS, n=2)
            await ensure_group(r, keys.prompts, REPLICA_GROUP)
            ((_, entries),) = await r.xreadgroup(REPLICA_GROUP, "dying-replica", {keys.prompts: ">"})
            entry_id, fields = entries[0]
            await dead_letter(r, keys, keys.prompts, REPLICA_GROUP, entry_id, fields, "engine died")
            assert (await namespace_status(r, keys))["prompts"]["length"] == 0

            listed = _cli("dead-letters", "--redis-url", url, "--namespace", namespace, "--reason", "engine")
            assert [d["reason"] for d in listed["dead_letters"]] == ["engine died"]
            kept = _cli("dead-letters", "--redis-url", url, "--namespace", namespace, "--reason", "other")
            assert kept["dead_letters"] == [] and kept["requeued"] == {}
            done = _cli("dead-letters", "--redis-url", url, "--namespace", namespace, "--requeue")
            assert list(done["requeued"].values()) == ["requeued"]
            st = await namespace_status(r, keys)
            assert st["dead_letters"]["total"] == 0 and st["prompts"]["length"] == 1
            async with scripted_replica(url, namespace, "rep-b"):
                batch = await q.next_batch(timeout=20)
            assert sorted(rec.sample_index for rec in batch) == [0, 1]
            assert {rec.run_id for rec in batch} == {q.run_id}
            await q.ack(batch)
        await r.aclose()

    asyncio.run(main())
