"""Pull-mode jobs: a PromptJob from the Redis prompt stream → n engine samples → finished records.

The generation is `pipeline`'s, as for a Generate call; what a job adds is its transport: the job id is
the request id, the group defaults to the job, an invalid job raises JobRejected (the trainer is told
and its admission slot released), and the records go back to the puller to publish. Anything else
propagates and the job stays pending.

A job samples with its namespace's current adapter (`AdapterTable.use(namespace)`, held for the whole
generation so that no eviction removes it under the job; None: the base or the full weights served, as
without LoRA): the records then name that adapter (pipeline.py). Never another run's: a job of run R on
a namespace whose current adapter belongs to another run waits up to `ADAPTER_WAIT_S` for R's (a new
run's trainer pushes its version 0 as it starts; a job may arrive first), then is rejected — sampled with
the other run's adapter and labelled R, its records could pass R's trainer's checks as R's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

from maskroll.proto.records import PromptJob, RolloutRecord

from ..config import ServerConfig
from ..engines.contract import Engine
from ..errors import InvalidArgument
from ..generation.pipeline import Pipeline
from .puller import JobRejected

ADAPTER_WAIT_S = 30.0  # how long a job waits for its own run's adapter
_POLL_S = 0.05


class JobRunner:
    def __init__(
        self, engine: Engine, config: ServerConfig, adapters=None, namespace: str = "", *, pipeline=None
    ) -> None:
        """adapters: the replica's AdapterTable (None: no LoRA); namespace: the one whose jobs this runs;
        pipeline: the replica's one (`ReplicaCore.serving.pipeline`; default: one of its own)."""
        self.pipeline = pipeline or Pipeline(engine, config)
        self.adapters, self.namespace = adapters, namespace or config.namespace

    def _adapter(self):
        if self.adapters is None:
            return contextlib.nullcontext(None)
        return self.adapters.use(self.namespace)

    async def __call__(self, job: PromptJob) -> list[RolloutRecord]:
        await self._wait_for_run(job)
        with self._adapter() as adapter:
            if adapter is not None and job.run_id and adapter.run_id != job.run_id:
                raise JobRejected(
                    f"job of run {job.run_id}: namespace {self.namespace!r} samples with run "
                    f"{adapter.run_id}'s adapter ({adapter.name}) on this replica, and run {job.run_id}'s "
                    f"did not arrive within {ADAPTER_WAIT_S:.0f} s"
                )
            return await self._run(job, adapter)

    async def _wait_for_run(self, job: PromptJob) -> None:
        if self.adapters is None or not job.run_id:
            return
        deadline = time.monotonic() + ADAPTER_WAIT_S
        while (ref := self.adapters.current(self.namespace)) is not None and ref.run_id != job.run_id:
            if time.monotonic() >= deadline:
                return
            await asyncio.sleep(_POLL_S)

    async def _run(self, job: PromptJob, adapter) -> list[RolloutRecord]:
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
                adapter=adapter,
            )
            return await gen.records()
        except InvalidArgument as exc:  # a bad field, or the engine refused the parameters up front
            raise JobRejected(str(exc)) from exc
