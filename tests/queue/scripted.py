"""A scripted job runner for fast queue tests: deterministic records without a model.

Only the queue paths are under test here; the real engines feed the same publisher and puller in
tests/queue/test_replicas.py.
"""

from __future__ import annotations

import time

import numpy as np

from maskroll.client.records import PromptJob, RolloutRecord, Semantics, rollout_id_for


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
