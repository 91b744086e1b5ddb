"""Hostile prompt jobs on the shared replica's prompt stream (written raw to Redis, bypassing the SDK's
checks): each ends as a `job_error` on the namespace's rollout stream (the trainer is told, its
admission slot released) or a dead letter with the reason, never in a loop, and the next job is served.

Regressions of issue 11: a job whose publish failed with WRONGTYPE was regenerated 7 times in 20 s
and never dead-lettered; a job's rollout_stream could name any Redis key.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import urllib.request
import uuid

import numpy as np
import pytest
import redis
from hardening_fixtures import NAMESPACE, PROMPT, wait_for

from maskroll.client import RolloutClient
from maskroll.client.queue import RolloutQueue
from maskroll.proto import wire
from maskroll.proto.records import PromptJob, SamplingOptions
from maskroll.proto.streams import F_JOB, F_JOB_ERROR, F_REASON, F_RECORD, REPLICA_GROUP, StreamKeys

pytestmark = pytest.mark.slow
KEYS = StreamKeys(NAMESPACE)
OPTS = SamplingOptions(max_tokens=3, logprobs_k=2, ignore_eos=True, n=2)


@pytest.fixture(scope="module")
def raw(redis_server):
    r = redis.Redis.from_url(redis_server.url)
    yield r
    r.close()


def submit(raw, job_id: str | None = None, **fields) -> str:
    fields = {"prompt_ids": PROMPT, "options": OPTS, **fields}
    job = PromptJob(job_id=job_id or uuid.uuid4().hex, **fields)
    raw.xadd(KEYS.prompts, {F_JOB: wire.job_to_pb(job).SerializeToString()})
    return job.job_id


def outcome(raw, job_id: str, timeout: float = 60) -> tuple[str, object]:
    """("records", [records]) once all n records of the job are on the rollout stream, or
    ("job_error", reason) once its job error is."""

    def look():
        records = []
        for _, fields in raw.xrange(KEYS.rollouts):
            if F_JOB_ERROR in fields and wire.decode_job(fields[F_JOB_ERROR]).job_id == job_id:
                return "job_error", fields[F_REASON].decode()
            if F_RECORD in fields and (r := wire.decode_record(fields[F_RECORD])).job_id == job_id:
                records.append(r)
        return ("records", records) if len(records) == OPTS.n else None

    return wait_for(look, timeout, f"job {job_id} to finish")


def dead_letters(raw, job_id: str) -> list[str]:
    return [
        f[b"reason"].decode()
        for _, f in raw.xrange(KEYS.dead_letters)
        if job_id.encode() in f.get(b"payload", b"")
    ]


def next_job_is_served(raw) -> None:
    kind, records = outcome(raw, submit(raw))
    assert kind == "records" and all(r.num_tokens == OPTS.max_tokens for r in records)


def pending(raw) -> int:
    return raw.xpending(KEYS.prompts, REPLICA_GROUP)["pending"]


@pytest.mark.parametrize(
    ("stream", "case"),
    [
        ("maskroll:other:rollouts", "another run's stream"),
        (KEYS.prompts, "the prompt stream"),
        ("victim", "a key outside maskroll"),
        (KEYS.rollouts + ":" + "x" * 1_000_000, "a 1 MB name"),
    ],
)
def test_a_job_naming_a_foreign_rollout_stream_is_rejected(replica, raw, stream, case):
    existed = raw.exists(stream)
    prompts_before = raw.xlen(KEYS.prompts)
    kind, reason = outcome(raw, submit(raw, rollout_stream=stream))
    assert kind == "job_error", f"{case}: the job ran"
    assert "is not one of this replica's rollout streams" in reason and len(reason) < 600, reason
    assert raw.exists(stream) == existed, f"{case}: the replica created {stream[:60]!r}"
    assert raw.xlen(KEYS.prompts) <= prompts_before + 1  # no record landed on the prompt stream
    next_job_is_served(raw)


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"metadata": {f"k{i}": "v" for i in range(1000)}}, "metadata has 1000 entries; at most 64"),
        ({"options": SamplingOptions(max_tokens=3, temperature=1e-40)}, "temperature must be >= 2.94e-35"),
        ({"prompt_ids": np.array([300], np.int32)}, "prompt_token_ids[0] = 300 is outside the vocabulary"),
    ],
)
def test_an_invalid_job_is_a_job_error(replica, raw, fields, needle):
    kind, reason = outcome(raw, submit(raw, **fields))
    assert kind == "job_error" and needle in reason, reason
    next_job_is_served(raw)


def test_an_undecodable_job_is_dead_lettered(replica, raw):
    entry = raw.xadd(KEYS.prompts, {F_JOB: b"\xff\x00 not a PromptJob " + b"marker-42"})
    wait_for(lambda: dead_letters(raw, "marker-42"), 30, "the dead letter")
    assert raw.xrange(KEYS.prompts, entry, entry) == []  # acked and deleted, not redelivered
    next_job_is_served(raw)


def _metric(replica, name: str) -> float:
    body = urllib.request.urlopen(f"http://{replica.metrics}/metrics", timeout=10).read().decode()
    line = next((x for x in body.splitlines() if x.startswith(name + " ")), None)
    return float(line.split()[-1]) if line else 0.0


def test_a_poison_job_is_dead_lettered_after_max_deliveries(replica, raw):
    """Its records cannot be published (the stream it names is a string key: WRONGTYPE), which no retry
    fixes. The replica runs it --max-job-deliveries (3) times, then dead-letters it with the reason and
    tells the trainer, instead of regenerating it forever."""
    poison = KEYS.rollouts + ":poison"
    raw.set(poison, "not a stream")
    errors_before = _metric(replica, 'maskroll_pull_jobs_total{outcome="error"}')
    t0 = time.monotonic()
    job_id = submit(raw, rollout_stream=poison)
    kind, reason = outcome(raw, job_id, timeout=60)
    elapsed = time.monotonic() - t0
    assert kind == "job_error", reason
    assert f"job {job_id} dead-lettered: failed on delivery 3: ResponseError: WRONGTYPE" in reason, reason
    [dead] = wait_for(lambda: dead_letters(raw, job_id), 10, "the dead letter")
    assert dead == reason
    assert _metric(replica, 'maskroll_pull_jobs_total{outcome="error"}') - errors_before == 3
    assert _metric(replica, 'maskroll_pull_jobs_total{outcome="dead_lettered"}') >= 1
    assert raw.get(poison) == b"not a stream"
    wait_for(lambda: pending(raw) == 0, 10, "the prompt stream's pending list to empty")
    print(f"poison job dead-lettered after 3 deliveries in {elapsed:.1f} s")
    next_job_is_served(raw)


def _served_version(replica) -> int:
    async def main():
        async with RolloutClient(replica.address) as c:
            return (await c.info()).policy_version

    return asyncio.run(main())


def test_the_trainer_gets_its_admission_slot_back(replica, redis_server):
    """Through the SDK: a rejected job fills the whole admission window; its job_error frees it."""
    with RolloutQueue(redis_server.url, NAMESPACE, batch_size=2, max_staleness=0, consumer="t1") as q:
        # The trainer is at the version the replica serves (other cases here may have updated it):
        # records from a version ahead of the trainer's would be refused, which is not this test.
        q.set_policy_version(_served_version(replica))
        assert q.room() == 2
        q.submit(PROMPT, SamplingOptions(max_tokens=3), n=2, metadata={"k" * 200: "v"})
        assert q.room() == 0
        deadline = time.monotonic() + 60
        while q.stats.failed_jobs == 0:
            assert time.monotonic() < deadline, "the job error never reached the trainer"
            with contextlib.suppress(TimeoutError):
                q.next_batch(timeout=1)
        assert q.room() == 2
        q.submit(PROMPT, SamplingOptions(max_tokens=3, ignore_eos=True), n=2)
        batch = q.next_batch(timeout=60)
        assert len(batch) == 2 and all(r.num_tokens == 3 for r in batch)
        q.ack(batch)
