"""The reward stage against a real Redis: records scored and published exactly once (duplicates and job
errors included), every way a reward function fails dead-lettered with its reason while the next record
is scored, the trainer's queue reading scored records and closing a group the stage refused, and a
`maskroll reward` process SIGKILLed mid-batch — after a restart, every record published exactly once."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from maskroll.proto import wire
from maskroll.proto.records import RolloutRecord, Semantics, rollout_id_for
from maskroll.proto.redis_conn import open_redis
from maskroll.proto.streams import (
    F_JOB_ERROR,
    F_REASON,
    F_RECORD,
    F_REWARD_FAILED,
    REWARD_GROUP,
    StreamKeys,
)
from maskroll.stages import RewardStageConfig, make_worker

HERE = pathlib.Path(__file__).resolve().parent  # stage_rewards.py: the reward functions' module


def record(
    model_dir, job: str, i: int, n: int, text: bytes = b"abca", run_id: str = "run", **meta
) -> RolloutRecord:
    t = len(text)
    return RolloutRecord(
        rollout_id=rollout_id_for(job, i),
        request_id=job,
        prompt_ids=np.frombuffer(b"say:", np.uint8).astype(np.int32),
        completion_ids=np.frombuffer(text, np.uint8).astype(np.int32),
        sampled_logprobs=np.full(t, -0.5, np.float32),
        sampled_ranks=np.ones(t, np.int32),
        topk_ids=np.zeros((t, 1), np.int32),
        topk_logprobs=np.full((t, 1), -0.5, np.float32),
        finish_reason="length",
        semantics=Semantics(temperature=1.0, logprobs_k=1, engine="torch", model=str(model_dir)),
        job_id=job,
        group_id=job,
        sample_index=i,
        group_size=n,
        metadata={k: str(v) for k, v in meta.items()},
        run_id=run_id,
        created_at=time.time(),
    )


async def feed(r, keys: StreamKeys, records, part: int = 0) -> None:
    for rec in records:
        await r.xadd(keys.part(part).finished, {F_RECORD: wire.encode_record(rec)})


async def wait_for(cond, timeout: float = 20.0, every: float = 0.05):
    deadline = time.monotonic() + timeout
    while (value := await cond()) is None:
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(every)
    return value


async def freeze_mid_batch(r, proc, finished: str, group: str, done: str, total: int, timeout: float = 60.0):
    """SIGSTOP `proc` (a stage worker) at a moment it holds records unacknowledged (pending in `group` of
    `finished`) after it has published some but not all `total` records to `done`, so that a SIGKILL after
    this lands mid-batch. A worker frozen between batches (nothing pending) is let go and caught later:
    asserting on one lucky poll made these tests flaky under load."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (await r.xpending(finished, group))["pending"] > 0 and 0 < await r.xlen(done) < total:
            proc.send_signal(signal.SIGSTOP)
            await asyncio.sleep(0.3)  # what it had already sent to Redis lands
            if (await r.xpending(finished, group))["pending"] > 0 and await r.xlen(done) < total:
                return
            proc.send_signal(signal.SIGCONT)
        await asyncio.sleep(0.005)
    raise AssertionError(f"the worker never held records mid-batch within {timeout} s")


@contextlib.asynccontextmanager
async def worker(url: str, namespace: str, reward: str, **kw):
    cfg = RewardStageConfig(redis_url=url, namespace=namespace, reward=f"stage_rewards:{reward}", **kw)
    r, cluster = await open_redis(url)
    w = make_worker(r, StreamKeys(namespace, cfg.partitions, cluster), cfg, "test-worker")
    await w.start()
    task = asyncio.create_task(w.supervise())
    try:
        yield w
    finally:
        w.stop()
        await w.drain(5)
        await asyncio.wait_for(task, 10)
        await w.unregister()
        w.scorer.close()
        await r.aclose()


async def published(r, stream: str) -> list[tuple[bytes, dict]]:
    return await r.xrange(stream)


def test_records_are_scored_and_published_exactly_once(redis_server, namespace, model_dir):
    async def main():
        r, _ = await open_redis(redis_server.url)
        keys = StreamKeys(namespace)
        recs = [
            record(model_dir, f"job{j}", i, 3, text=b"a" * (i + 1) + b"bc", k=j)
            for j in range(2)
            for i in range(3)
        ]
        await feed(r, keys, recs)
        await feed(r, keys, [recs[1]])  # the same record published twice (a regenerated job)
        job_error = {F_JOB_ERROR: b"not-decoded-here", F_REASON: b"bad prompt"}
        await r.xadd(keys.part(0).finished, job_error)
        async with worker(redis_server.url, namespace, "count_a", heartbeat_ttl_s=0.6):
            out = await wait_for(lambda: _when(published(r, keys.rollouts), lambda x: len(x) >= 7))
            await wait_for(lambda: _when(r.xlen(keys.part(0).finished), lambda n: n == 0))
            beat = await wait_for(
                lambda: _when(_beat(r, keys, "test-worker"), lambda b: b and b["scored"] == 6)
            )
        records = [wire.decode_record(f[F_RECORD]) for _, f in out if F_RECORD in f]
        assert sorted(x.rollout_id for x in records) == sorted(x.rollout_id for x in recs)  # once each
        for rec in records:
            text = "a" * (rec.sample_index + 1) + "bc"
            assert rec.reward == pytest.approx(text.count("a") / len(text))
            assert rec.reward_verifier == "count_a"
            assert (
                rec.reward_reason == f"{len(text)} chars {{'k': '{rec.job_id[-1]}'}}"
            )  # metadata reached it
        assert [f for _, f in out if F_JOB_ERROR in f] == [job_error]  # passed through unchanged
        pending = await r.xpending(keys.part(0).finished, REWARD_GROUP)
        assert pending["pending"] == 0
        assert beat["scored"] == 6 and beat["duplicates"] == 1 and beat["failed"] == 0
        assert await r.zcard(keys.part(0).scored) == 7  # the 6 rollout ids and the job error's entry
        assert await r.get(keys.rewarder("test-worker")) is None  # unregistered on stop
        await r.aclose()

    asyncio.run(main())


async def _beat(r, keys: StreamKeys, worker_id: str) -> dict | None:
    raw = await r.get(keys.rewarder(worker_id))
    return None if raw is None else json.loads(raw)


async def _when(aw_factory, pred):
    value = await aw_factory
    return value if pred(value) else None


FAILURES = {
    "raise": "reward function by_metadata raised RuntimeError: the verifier broke",
    "hang": "reward function by_metadata did not return within 0.5 s",
    "nan": "reward function by_metadata returned nan, not a finite number",
    "garbage": "reward function by_metadata returned str 'yes'; expected a finite number or a RewardResult",
    "none": "reward function by_metadata returned NoneType None",
    "bool": "reward function by_metadata returned bool True",
}


@pytest.mark.parametrize("reward", ["by_metadata", "async_hang"])
def test_a_failing_reward_function_dead_letters_its_record_and_the_next_is_scored(
    redis_server, namespace, model_dir, reward
):
    modes = list(FAILURES) if reward == "by_metadata" else ["hang"]

    async def main():
        r, _ = await open_redis(redis_server.url)
        keys = StreamKeys(namespace)
        bad = [record(model_dir, f"bad-{m}", 0, 1, mode=m) for m in modes]
        good = [record(model_dir, f"good{j}", 0, 1, text=b"x" * (j + 1)) for j in range(3)]
        # every failure comes before the good records, at a concurrency lower than the failures: a
        # failed call must free its slot
        await feed(r, keys, bad + good)
        os.environ["STAGE_HANG_S"] = "2"
        async with worker(redis_server.url, namespace, reward, concurrency=2, timeout_s=0.5):
            out = await wait_for(lambda: _when(published(r, keys.rollouts), lambda x: len(x) >= len(bad) + 3))
        dead = await r.xrange(keys.dead_letters)
        reasons = {wire.decode_record(f[b"payload"]).job_id: f[b"reason"].decode() for _, f in dead}
        for m in modes:
            want = FAILURES[m].replace("by_metadata", reward)
            assert want in reasons[f"bad-{m}"], (m, reasons[f"bad-{m}"])
            assert reasons[f"bad-{m}"].startswith(f"no reward for {rollout_id_for(f'bad-{m}', 0)}")
        scored = [wire.decode_record(f[F_RECORD]) for _, f in out if F_RECORD in f]
        expected = {f"good{j}": float(j + 1) if reward == "by_metadata" else 2.0 for j in range(3)}
        assert {x.job_id: x.reward for x in scored} == expected
        notices = [f for _, f in out if F_REWARD_FAILED in f]  # the trainer is told at once
        assert sorted(wire.decode_record(f[F_REWARD_FAILED]).job_id for f in notices) == sorted(
            f"bad-{m}" for m in modes
        )
        assert all(
            f[F_REASON].decode() == reasons[wire.decode_record(f[F_REWARD_FAILED]).job_id] for f in notices
        )
        assert await r.xlen(keys.part(0).finished) == 0
        await r.aclose()

    asyncio.run(main())


def test_the_trainer_reads_scored_records_and_closes_a_group_the_stage_refused(
    redis_server, namespace, model_dir
):
    from maskroll.client import AsyncRolloutQueue, QueueTimeout
    from maskroll.trainer_adapter import collate

    async def main():
        r, _ = await open_redis(redis_server.url)
        keys = StreamKeys(namespace)
        async with AsyncRolloutQueue(redis_server.url, namespace, run="new", reward_stage=True) as q:
            run = q.run_id
            ok = [record(model_dir, "ok", i, 2, text=b"x" * (i + 1), run_id=run) for i in range(2)]
            broken = [
                record(model_dir, "broken", 0, 2, run_id=run),
                record(model_dir, "broken", 1, 2, run_id=run, mode="raise"),
            ]
            await feed(r, keys, broken[:1] + ok + broken[1:])
            unscored = record(model_dir, "direct", 0, 1, run_id=run)  # published around the stage
            await r.xadd(keys.rollouts, {F_RECORD: wire.encode_record(unscored)})
            async with worker(redis_server.url, namespace, "by_metadata"):
                batch = await q.next_batch(batch_size=2, timeout=20)
                assert sorted(x.rollout_id for x in batch) == sorted(x.rollout_id for x in ok)
                b = collate(batch)  # the rewards the stage put in the records
                assert sorted(b.rewards.tolist()) == [1.0, 2.0]
                assert sorted(b.advantages.tolist()) == pytest.approx(
                    [-1 / np.sqrt(0.5) / 2 * 1, 1 / np.sqrt(0.5) / 2], abs=0.3
                )
                await q.ack(batch)
                # the refused group: its scored sample was set aside at once, not after group_timeout_s
                await wait_for(lambda: _when(r.xlen(keys.rollouts), lambda n: n == 0), timeout=10)
                with pytest.raises(QueueTimeout):  # nothing left to batch
                    await q.next_batch(batch_size=2, timeout=1)
            dead = {
                wire.decode_record(f[b"payload"]).rollout_id: f[b"reason"].decode()
                for _, f in await r.xrange(keys.dead_letters)
            }
            assert "carries no reward" in dead[unscored.rollout_id]
            # its scored sample is set aside as soon as the notice is read (before it, or as a late sample)
            why = dead[broken[0].rollout_id]
            assert "the reward stage refused it" in why or "which was closed incomplete" in why, why
            assert "raised RuntimeError" in dead[broken[1].rollout_id]  # by the stage itself
        await r.aclose()

    asyncio.run(main())


def _reward_proc(url: str, namespace: str, reward: str, *extra: str, log=None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "maskroll.app.cli", "reward", "--redis-url", url, "--namespace", namespace]
    cmd += ["--reward", f"stage_rewards:{reward}", *extra]
    env = {**os.environ, "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env["STAGE_SLOW_S"] = "0.15"
    return subprocess.Popen(cmd, env=env, stdout=log or subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_ready(proc: subprocess.Popen, log_path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while "maskroll reward: ready" not in log_path.read_text():
        assert proc.poll() is None, log_path.read_text()
        assert time.monotonic() < deadline, log_path.read_text()
        time.sleep(0.05)


def test_a_reward_worker_killed_mid_batch_loses_and_repeats_nothing(
    redis_server, namespace, model_dir, tmp_path
):
    """SIGKILL a real `maskroll reward` process while it scores; its restart takes over what it held."""
    total = 40

    async def count(r, keys):
        return await r.xlen(keys.rollouts)

    async def main():
        r, _ = await open_redis(redis_server.url)
        keys = StreamKeys(namespace)
        recs = [
            record(model_dir, f"job{j}", i, 4, text=b"ab" * (i + 1))
            for j in range(total // 4)
            for i in range(4)
        ]
        await feed(r, keys, recs)
        await feed(r, keys, recs[:4])  # and a job whose records were published twice
        flags = ["--concurrency", "4", "--timeout-s", "1", "--claim-idle-s", "1.5", "--log-every-s", "0"]
        log1 = tmp_path / "w1.log"
        with open(log1, "w") as f:
            p1 = _reward_proc(redis_server.url, namespace, "slow", *flags, "--worker-id", "w1", log=f)
        try:
            _wait_ready(p1, log1)
            await freeze_mid_batch(r, p1, keys.part(0).finished, REWARD_GROUP, keys.rollouts, total)
            p1.send_signal(signal.SIGKILL)
            p1.wait(10)
        finally:
            if p1.poll() is None:
                p1.kill()
        pending = await r.xpending(keys.part(0).finished, REWARD_GROUP)
        before = await count(r, keys)
        assert pending["pending"] > 0, "the kill landed between records: nothing was mid-scoring"
        assert before < total
        log2 = tmp_path / "w2.log"
        with open(log2, "w") as f:
            p2 = _reward_proc(redis_server.url, namespace, "slow", *flags, "--worker-id", "w2", log=f)
        try:
            _wait_ready(p2, log2)
            await wait_for(lambda: _when(r.xlen(keys.part(0).finished), lambda n: n == 0), timeout=60)
            await asyncio.sleep(0.5)
            beat = json.loads(await r.get(keys.rewarder("w2")))
        finally:
            p2.send_signal(signal.SIGTERM)
            assert p2.wait(20) == 0, log2.read_text()
        out = await r.xrange(keys.rollouts)
        ids = [wire.decode_record(f[F_RECORD]).rollout_id for _, f in out]
        assert len(ids) == len(set(ids)) == total  # every record exactly once
        assert set(ids) == {x.rollout_id for x in recs}
        assert all(wire.decode_record(f[F_RECORD]).reward is not None for _, f in out)
        assert (await r.xpending(keys.part(0).finished, REWARD_GROUP))["pending"] == 0
        assert beat["scored"] + before >= total and beat["worker_id"] == "w2"
        assert "ready" in log2.read_text()
        await r.aclose()

    asyncio.run(main())


@pytest.fixture(scope="module")
def redis_cluster():
    from maskroll.local.redis_cluster import LocalRedisCluster

    with LocalRedisCluster() as c:
        yield c


@pytest.mark.slow
def test_partitions_on_a_redis_cluster(redis_cluster, namespace, model_dir):
    """Three partitions on a Redis Cluster (their keys on different masters): each partition's records are
    scored and published once, to that partition's own rollout stream (one slot per script)."""

    async def main():
        r, cluster = await open_redis(redis_cluster.url)
        assert cluster
        keys = StreamKeys(namespace, 3, cluster=True)
        sent = {}
        for p in range(3):
            sent[p] = [record(model_dir, f"p{p}-job{j}", 0, 1, text=b"a" * (p + 1)) for j in range(4)]
            await feed(r, keys, sent[p] + sent[p][:1], part=p)  # one duplicate per partition
        async with worker(redis_cluster.url, namespace, "length", partitions=3) as w:
            for p in range(3):
                rollouts = keys.part(p).rollouts
                await wait_for(lambda s=rollouts: _when(r.xlen(s), lambda n: n >= 4), timeout=30)
            await wait_for(lambda: _when(r.xlen(keys.part(2).finished), lambda n: n == 0))
            assert w.counters.duplicates == 3
        for p in range(3):
            out = await r.xrange(keys.part(p).rollouts)
            got = [wire.decode_record(f[F_RECORD]) for _, f in out]
            assert sorted(x.rollout_id for x in got) == sorted(x.rollout_id for x in sent[p])
            assert {x.reward for x in got} == {float(p + 1)}
        await r.aclose()

    asyncio.run(main())
