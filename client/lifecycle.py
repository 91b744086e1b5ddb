"""The queue's run lifecycle: open (consumer groups, the run taken up), record a published version,
cancel the jobs no replica started, close.

A queue belongs to one training run (runs.py): opened as a new run — the older runs' unstarted prompt
jobs are cancelled — or resuming the namespace's current one, never silently both. `record_version`
is how the trainer's policy version moves forward (every publisher calls it before the replicas load
the version); it lives in `QueueState.run` (queue_state.py).
"""

from __future__ import annotations

import logging
import time

from maskroll.proto.streams import (
    REPLICA_GROUP,
    TRAINER_GROUP,
    check_layout,
    delete_undelivered,
    ensure_group,
)

from .queue_state import QueueState
from .runs import RunMode, advance, open_run

log = logging.getLogger("maskroll.queue")


class RunLifecycle:
    """Opens and closes one queue's connection and run; see the module docstring."""

    def __init__(self, state: QueueState, mode: RunMode | None) -> None:
        if mode not in (None, "new", "resume"):
            raise ValueError(
                f"run={mode!r}; expected 'new', 'resume' or None (new only on an empty namespace)"
            )
        self.state, self.mode = state, mode
        self._ready_groups = False

    async def open(self) -> None:
        """Create the consumer groups and take up the run (new or resumed)."""
        s = self.state
        await s.connect()
        if not self._ready_groups:
            await s.call(check_layout(s.r, s.keys))
            for part in s.keys.parts:
                await s.call(ensure_group(s.r, part.rollouts, TRAINER_GROUP))
                await s.call(ensure_group(s.r, part.prompts, REPLICA_GROUP))
            self._ready_groups = True
        if s.run is not None:
            return
        run, new = await s.call(open_run(s.r, s.keys, self.mode, s.consumer))
        s.run = run
        if not new:
            log.info("namespace %r: resuming %s", s.keys.namespace, run.describe())
            return
        # Jobs no replica has started belong to older runs: their records would only be refused.
        cancelled = []
        for part in s.keys.parts:
            cancelled += await s.call(delete_undelivered(s.r, part.prompts, REPLICA_GROUP))
        s.stats.cancelled_jobs += len(cancelled)
        log.info(
            "namespace %r: started run %s (%d unstarted jobs of earlier runs cancelled)",
            s.keys.namespace,
            run.run_id,
            len(cancelled),
        )

    async def record_version(self, version: int, record: str) -> None:
        """Record `version` (at `record`) as the run's latest in Redis, then make it the policy version."""
        await self.open()
        s = self.state
        await s.call(advance(s.r, s.keys, s.require_run().run_id, version, record))
        s.set_version(version, checkpoint=record, updated_at=time.time())

    async def cancel_pending_jobs(self) -> int:
        """Delete the submitted jobs no replica has started; free their room; returns how many."""
        s = self.state
        if not s.job_entries:
            return 0
        by_entry = {entry: job for job, entry in s.job_entries.items()}
        deleted = 0
        for p in sorted({p for p, _ in by_entry}):
            ids = [entry_id for q, entry_id in by_entry if q == p]
            prompts = s.keys.part(p).prompts
            for entry_id in await s.call(delete_undelivered(s.r, prompts, REPLICA_GROUP, ids)):
                job = by_entry[(p, entry_id)]
                await s.consumed(job, s.flight.expected(job))
                s.job_entries.pop(job, None)
                deleted += 1
        s.stats.cancelled_jobs += deleted
        return deleted

    async def close(self, cancel_jobs: bool) -> None:
        """Close the Redis connection (cancel_jobs: first cancel_pending_jobs, if the run was taken up)."""
        try:
            if cancel_jobs and self.state.run is not None:
                await self.cancel_pending_jobs()
        finally:
            if self.state.r is not None:
                await self.state.r.aclose()
