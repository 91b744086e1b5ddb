"""Pull-mode jobs: a PromptJob from the Redis prompt stream → n engine samples → finished records.

The same steps as a Generate call (validation, fan-out, record building), without gRPC: what the
servicer streams to a client, a job hands to the publisher. An invalid job raises JobRejected (the
trainer is told and its admission slot released); anything else propagates and the job stays pending.
"""

from __future__ import annotations

import time
import uuid

from maskroll.client.records import PromptJob, RolloutRecord

from . import validation
from .config import ServerConfig
from .engine import Engine
from .errors import InvalidArgument
from .fanout import FanOut
from .puller import JobRejected
from .records_builder import RecordHeader, SampleBuilder, semantics_for


class JobRunner:
    def __init__(self, engine: Engine, config: ServerConfig) -> None:
        self.engine = engine
        self.replica_id = config.replica_id
        self.caps = validation.Caps.of(
            engine.limits, max_logprobs=config.max_logprobs, max_tokens=config.max_tokens, max_n=config.max_n
        )

    async def __call__(self, job: PromptJob) -> list[RolloutRecord]:
        e = self.engine
        try:
            validation.check_ids("", job.job_id, job.group_id)
            validation.check_prompt(job.prompt_ids, self.caps)
            params = validation.sampling_params(job.prompt_ids, job.options, self.caps)
        except InvalidArgument as exc:
            raise JobRejected(str(exc)) from exc
        n = job.options.n
        header = RecordHeader(
            request_id=job.job_id,
            job_id=job.job_id,
            group_id=job.group_id or job.job_id,
            metadata=dict(job.metadata),
            prompt_ids=job.prompt_ids,
            semantics=semantics_for(params, engine=e.name, engine_version=e.version, model=e.model_id),
            replica_id=self.replica_id,
            group_size=n,
        )
        samples = [SampleBuilder(header, i) for i in range(n)]
        records: list[RolloutRecord | None] = [None] * n
        # Engine request ids must be unique even if this job is re-run here (reclaimed while a first
        # attempt still winds down); rollout ids come from the job id, so a re-run yields duplicates.
        engine_id = f"{job.job_id}.{uuid.uuid4().hex[:8]}"
        try:
            async with FanOut(e, validation.engine_requests(engine_id, job.prompt_ids, params, n)) as fan:
                async for i, out in fan.outputs():
                    if out is not None:
                        chunk = samples[i].add(out, now=time.time())
                    elif not samples[i].finished:
                        chunk = samples[i].abort(current_version=e.policy_version, now=time.time())
                    else:
                        continue
                    if chunk.record is not None:
                        records[i] = chunk.record
        except InvalidArgument as exc:  # the engine refused the parameters before the first token
            raise JobRejected(str(exc)) from exc
        missing = [i for i, r in enumerate(records) if r is None]
        if missing:
            raise RuntimeError(f"job {job.job_id}: samples {missing} ended without a record")
        return records  # type: ignore[return-value]
