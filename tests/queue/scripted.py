"""A scripted job runner for fast queue tests: deterministic records without a model, and an in-process
pull-mode replica that runs it.

Only the queue paths are under test here; the real engines feed the same publisher and puller in
tests/queue/test_replicas.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import numpy as np

from maskroll.proto.records import PromptJob, RolloutRecord, Semantics, rollout_id_for
from maskroll.proto.redis_conn import open_redis
from maskroll.proto.streams import StreamKeys
from maskroll.server.pull.publisher import RolloutPublisher
from maskroll.server.pull.puller import PromptPuller


def scripted_records(job: PromptJob, *, version: int = 0, replica: str = "scripted") -> list[RolloutRecord]:
    n, t, k = job.options.n, job.options.max_tokens, job.options.logprobs_k
    out = []
    for i in range(n):
        rng = np.random.default_rng(abs(hash((job.job_id, i))) % 2**32)
        out.append(
            RolloutRecord(
                rollout_id=rollout_id_for(job.job_id, i),
                request_id=f"{job.job_id}-{i}",
                prompt_ids=job.prompt_ids,
                completion_ids=rng.integers(0, 250, t).astype(np.int32),
                sampled_logprobs=-rng.random(t).astype(np.float32),
                sampled_ranks=np.ones(t, np.int32),
                topk_ids=rng.integers(0, 250, (t, k)).astype(np.int32),
                topk_logprobs=-np.sort(rng.random((t, k)).astype(np.float32), axis=1),
                finish_reason="length",
                semantics=Semantics(temperature=job.options.temperature, logprobs_k=k, engine="scripted"),
                policy_version_first=version,
                policy_version_last=version,
                job_id=job.job_id,
                group_id=job.group_id or job.job_id,
                sample_index=i,
                metadata=job.metadata,
                replica_id=replica,
                created_at=time.time(),
                group_size=n,
                run_id=job.run_id,  # as a replica does: the job's run
            )
        )
    return out


@contextlib.asynccontextmanager
async def scripted_replica(
    url: str,
    ns: str,
    name: str = "rep-a",
    *,
    partitions: int = 1,
    run_job=None,
    delay: float = 0.01,
    claim_idle_s: float = 60.0,
    supervise: bool = False,
):
    """An in-process pull-mode replica (puller + publisher) running `run_job` (default: scripted records
    after `delay` s), connected as `maskroll serve` connects (cluster mode detected). supervise: run the
    puller as `serve` does, restarted after an error (its `failure()` says why); otherwise an error
    ends it and surfaces when the replica is left."""
    r, cluster = await open_redis(url)
    keys = StreamKeys(ns, partitions, cluster)

    async def default(job):
        await asyncio.sleep(delay)
        return scripted_records(job, replica=name)

    puller = PromptPuller(
        r,
        keys,
        name,
        run_job or default,
        RolloutPublisher(r, keys.rollouts, keys=keys),
        concurrency=4,
        claim_idle_s=claim_idle_s,
        heartbeat_ttl_s=2.0,
        replica_info=lambda: {"address": "127.0.0.1:1"},
    )
    task = asyncio.create_task(puller.supervise() if supervise else puller.run())
    try:
        yield puller
    finally:
        puller.stop()
        await puller.drain(5)
        await asyncio.wait_for(task, 10)
        await puller.unregister()
        await r.aclose()
