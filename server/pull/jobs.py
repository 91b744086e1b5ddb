"""Pull-mode jobs: a PromptJob from the Redis prompt stream → n engine samples → finished records.

The generation is `pipeline`'s, as for a Generate call; what a job adds is its transport: the job id is
the request id, the group defaults to the job, an invalid job raises JobRejected (the trainer is told
and its admission slot released), and the records go back to the puller to publish. Anything else
propagates and the job stays pending.
"""

from __future__ import annotations

import uuid

from maskroll.proto.records import PromptJob, RolloutRecord

from ..config import ServerConfig
from ..engines.contract import Engine
from ..generation.pipeline import Pipeline
from ..grpc_api.errors import InvalidArgument
from .puller import JobRejected


class JobRunner:
    def __init__(self, engine: Engine, config: ServerConfig) -> None:
        self.pipeline = Pipeline(engine, config)

    async def __call__(self, job: PromptJob) -> list[RolloutRecord]:
        try:
            gen = self.pipeline.prepare(
                job.prompt_ids,
                job.options,
                request_id=job.job_id,
                job_id=job.job_id,
                group_id=job.group_id or job.job_id,
                metadata=job.metadata,
                run_id=job.run_id,  # every record of the job belongs to the run that submitted it
                # Engine request ids must be unique even if this job is re-run here (reclaimed while a
                # first attempt still winds down); rollout ids come from the job id, so a re-run yields
                # duplicates.
                engine_id=f"{job.job_id}.{uuid.uuid4().hex[:8]}",
            )
            return await gen.records()
        except InvalidArgument as exc:  # a bad field, or the engine refused the parameters up front
            raise JobRejected(str(exc)) from exc
