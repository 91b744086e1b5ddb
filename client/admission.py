"""Admission control for the trainer queue: at most (max_staleness + 1) × batch_size rollouts in flight.

A rollout is in flight from submit() until it is acked, dropped as stale or its job fails. Bounding
that count bounds the prompt and rollout streams and the staleness of what is generated (docs/architecture.md
flow 2): a full queue makes submit() wait (backpressure), never drop. Counts only jobs this process
submitted. No I/O: `AsyncRolloutQueue` tells it what was submitted and what was consumed.
"""

from __future__ import annotations

import asyncio


class QueueFull(Exception):
    """submit() waited `timeout` seconds and the in-flight limit still had no room."""


def in_flight_limit(batch_size: int | None, max_staleness: int | None) -> int | None:
    """(max_staleness + 1) × batch_size; None (no limit) unless both are set."""
    if batch_size is None or max_staleness is None:
        return None
    return (max_staleness + 1) * batch_size


class InFlight:
    """Rollouts submitted and not yet consumed, per job, with a wait for room under a limit."""

    def __init__(self) -> None:
        self.count = 0
        self._jobs: dict[str, int] = {}  # job_id -> rollouts still expected
        self._room = asyncio.Condition()

    def room(self, limit: int | None) -> int | None:
        """Rollouts that fit under `limit` now (None: no limit)."""
        return None if limit is None else max(0, limit - self.count)

    def expected(self, job_id: str) -> int:
        """Rollouts of `job_id` still in flight (0 for a job another process submitted)."""
        return self._jobs.get(job_id, 0)

    async def wait_for_room(self, n: int, limit: int | None, timeout: float | None) -> None:
        """Return once `n` more rollouts fit under `limit`; QueueFull after `timeout` s (None: forever)."""
        if limit is None:
            return
        async with self._room:
            try:
                await asyncio.wait_for(self._room.wait_for(lambda: self.count + n <= limit), timeout)
            except (asyncio.TimeoutError, TimeoutError):
                raise QueueFull(
                    f"{self.count} rollouts in flight; limit {limit} = (max_staleness + 1) × batch_size "
                    f"left no room for {n} more within {timeout} s (ack batches to make room)"
                ) from None

    def submitted(self, job_id: str, n: int) -> None:
        """`n` rollouts of `job_id` are now on the prompt stream."""
        self._jobs[job_id] = n
        self.count += n

    async def consumed(self, job_id: str, count: int) -> None:
        """`count` rollouts of `job_id` were acked, dropped or failed: their room is free again."""
        left = self._jobs.get(job_id)
        if left is None:
            return  # another submitter's job
        count = min(count, left)
        self.count -= count
        if left - count <= 0:
            del self._jobs[job_id]
        else:
            self._jobs[job_id] = left - count
        async with self._room:
            self._room.notify_all()
