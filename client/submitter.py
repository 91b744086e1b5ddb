"""Submitting prompt jobs: check, admit under the in-flight limit (admission.py), put on a partition's
prompt stream (docs/architecture.md flow 2).

Every job carries the queue's run id; with several partitions, each job goes to the next partition in
turn. No MAXLEN on the prompt stream: unconsumed jobs must never be trimmed; admission bounds it.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace

import numpy as np

from maskroll.proto import wire
from maskroll.proto.prompts import prompt_problem
from maskroll.proto.records import PromptJob, SamplingOptions
from maskroll.proto.streams import F_JOB

from .queue_state import QueueState


class Submitter:
    """Puts one queue's jobs on the prompt streams; `opened` opens the queue (once) before the first."""

    def __init__(self, state: QueueState, opened: Callable[[], Awaitable[object]]) -> None:
        self.state, self._opened = state, opened
        self._turn = random.randrange(state.keys.partitions)  # the partition of the next job

    def room(self) -> int | None:
        """Rollouts that can be submitted now without blocking (None: no limit configured)."""
        return self.state.flight.room(self.state.max_in_flight)

    async def submit(
        self,
        prompt_ids: Sequence[int] | np.ndarray,
        options: SamplingOptions | None,
        *,
        n: int | None,
        group_id: str | None,
        metadata: dict[str, str] | None,
        job_id: str | None,
        timeout: float | None,
        rollout_stream: str,
    ) -> str:
        """AsyncRolloutQueue.submit (its docstring says what each argument means)."""
        s = self.state
        options = options or SamplingOptions()
        if n is not None:
            options = replace(options, n=n)
        problems = options.problems()
        prompt = np.asarray(prompt_ids, dtype=np.int32)
        if problem := prompt_problem(prompt, name="prompt_ids"):
            problems.append(problem)
        if problems:
            raise ValueError("; ".join(problems))
        limit = s.max_in_flight
        if limit is not None and options.n > limit:
            raise ValueError(
                f"n={options.n} exceeds the in-flight limit {limit} = (max_staleness + 1) × batch_size"
            )
        await s.flight.wait_for_room(options.n, limit, timeout)
        await self._opened()
        part = self._turn
        if s.reward_stage and not rollout_stream:  # the stage publishes them, scored, where we read
            rollout_stream = s.keys.part(part).finished
        job = PromptJob(
            job_id=job_id or uuid.uuid4().hex,
            prompt_ids=prompt,
            options=options,
            group_id=group_id or "",
            metadata=metadata or {},
            submitted_at=time.time(),
            rollout_stream=rollout_stream,
            run_id=s.require_run().run_id,
        )
        self._turn = (part + 1) % s.keys.partitions
        entry = await s.call(
            s.r.xadd(s.keys.part(part).prompts, {F_JOB: wire.job_to_pb(job).SerializeToString()})
        )
        s.flight.submitted(job.job_id, options.n)
        s.job_entries[job.job_id] = (part, entry)
        s.stats.submitted_jobs += 1
        s.stats.submitted_rollouts += options.n
        return job.job_id
