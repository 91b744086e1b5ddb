"""Pull mode: a replica consumes prompt jobs from the Redis prompt stream (ARCHITECTURE.md flow 2).

All replicas read through one consumer group. A job is acked only after its records are published.
Jobs left pending by a dead replica are reclaimed by survivors once idle for `claim_idle_s`
(XAUTOCLAIM); a live replica keeps its running jobs' idle time low by re-claiming them (XCLAIM JUSTID),
so slow generations are not stolen. Replicas register with a heartbeat key (TTL) so trainers can find
them for weight updates. Knows nothing of engines: `run_job` turns a job into records.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis

from maskroll.client import wire
from maskroll.client.records import PromptJob, RolloutRecord
from maskroll.client.redis_conn import REDIS_DOWN
from maskroll.client.streams import (
    F_JOB,
    REPLICA_GROUP,
    StreamKeys,
    ack_and_delete,
    dead_letter,
    ensure_group,
)

from .metrics import Metrics
from .publisher import RolloutPublisher

log = logging.getLogger("maskroll.puller")


class JobRejected(ValueError):
    """The job itself is invalid (bad prompt or options): retrying elsewhere cannot help."""


RunJob = Callable[[PromptJob], Awaitable[list[RolloutRecord]]]


class PromptPuller:
    def __init__(
        self,
        redis: aioredis.Redis,
        keys: StreamKeys,
        consumer: str,
        run_job: RunJob,
        publisher: RolloutPublisher,
        *,
        concurrency: int = 8,
        claim_idle_s: float = 60.0,
        heartbeat_ttl_s: float = 15.0,
        replica_info: Callable[[], dict] | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.metrics = metrics or publisher.metrics
        self.redis, self.keys, self.consumer = redis, keys, consumer
        self.run_job, self.publisher = run_job, publisher
        self.concurrency = concurrency
        self.claim_idle_ms = int(claim_idle_s * 1000)
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.replica_info = replica_info or (lambda: {})
        self._active: dict[bytes, asyncio.Task] = {}
        self._stopping = asyncio.Event()

    async def run(self) -> None:
        """Until stop(): read or reclaim jobs while below `concurrency`, keep heartbeats fresh."""
        await ensure_group(self.redis, self.keys.prompts, REPLICA_GROUP)
        beat = asyncio.create_task(self._heartbeat())
        next_claim = 0.0
        try:
            while not self._stopping.is_set():
                free = self.concurrency - len(self._active)
                if free <= 0:
                    await asyncio.sleep(0.05)
                    continue
                try:
                    next_claim = await self._take_jobs(free, next_claim)
                except REDIS_DOWN:
                    # The client already retried with backoff; keep trying: the replica recovers
                    # when Redis returns, and running jobs go on meanwhile.
                    log.warning("prompt stream unreachable; retrying", exc_info=True)
                    await asyncio.sleep(1.0)
        finally:
            beat.cancel()
            await asyncio.gather(beat, return_exceptions=True)

    async def _take_jobs(self, free: int, next_claim: float) -> float:
        """Reclaim idle jobs (at most every claim_idle/4) or read new ones; start a task per job."""
        entries = []
        if time.monotonic() >= next_claim:
            next_claim = time.monotonic() + max(0.5, self.claim_idle_ms / 4000)
            _, claimed, *_ = await self.redis.xautoclaim(
                self.keys.prompts, REPLICA_GROUP, self.consumer, self.claim_idle_ms, "0-0", count=free
            )
            entries = [e for e in claimed if e is not None]
            self.metrics.jobs_reclaimed.inc(len(entries))
        if not entries:
            resp = await self.redis.xreadgroup(
                REPLICA_GROUP, self.consumer, {self.keys.prompts: ">"}, count=free, block=500
            )
            entries = resp[0][1] if resp else []
        for entry_id, fields in entries:
            if entry_id not in self._active:
                self._active[entry_id] = asyncio.create_task(self._handle(entry_id, fields))
                self.metrics.jobs_active.set(len(self._active))
        return next_claim

    def stop(self) -> None:
        """Stop taking jobs; running ones finish (see drain)."""
        self._stopping.set()

    async def drain(self, timeout: float) -> int:
        """Wait up to `timeout` for running jobs; cancel the rest (they stay pending and are reclaimed).
        Returns the number cancelled."""
        tasks = list(self._active.values())
        if not tasks:
            return 0
        _, pending = await asyncio.wait(tasks, timeout=timeout)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        return len(pending)

    async def _handle(self, entry_id: bytes, fields: dict) -> None:
        try:
            try:
                job = wire.decode_job(fields.get(F_JOB, b""))
            except wire.WireError as e:
                await self._dead_letter(entry_id, fields, str(e))
                self.metrics.jobs.labels("malformed").inc()
                return
            try:
                records = await self.run_job(job)
            except JobRejected as e:
                await self.publisher.publish_job_error(job, str(e))
                await self._ack(entry_id)
                self.metrics.jobs.labels("rejected").inc()
                return
            await self.publisher.publish(records, job.rollout_stream or None)
            await self._ack(entry_id)  # only after the records are safely in Redis
            self.metrics.jobs.labels("ok").inc()
        except asyncio.CancelledError:
            raise  # drain: the job stays pending and another replica (or we) reclaim it
        except Exception:
            # engine or Redis trouble: leave the job pending, it is reclaimed after the idle timeout
            log.exception("job %s failed; left pending for redelivery", entry_id)
            self.metrics.jobs.labels("error").inc()
        finally:
            self._active.pop(entry_id, None)
            self.metrics.jobs_active.set(len(self._active))

    async def _ack(self, entry_id: bytes) -> None:
        pipe = self.redis.pipeline(transaction=True)
        ack_and_delete(pipe, self.keys.prompts, REPLICA_GROUP, entry_id)
        await pipe.execute()

    async def _dead_letter(self, entry_id: bytes, fields: dict, reason: str) -> None:
        await dead_letter(self.redis, self.keys, self.keys.prompts, REPLICA_GROUP, entry_id, fields, reason)

    async def _heartbeat(self) -> None:
        """Refresh the registry key and keep running jobs' idle time below the reclaim threshold."""
        period = max(0.2, min(self.heartbeat_ttl_s / 3, self.claim_idle_ms / 3000))
        while True:
            try:
                info = {**self.replica_info(), "replica_id": self.consumer, "active_jobs": len(self._active)}
                await self.redis.set(
                    self.keys.replica(self.consumer), json.dumps(info), px=int(self.heartbeat_ttl_s * 1000)
                )
                if self._active:
                    await self.redis.xclaim(
                        self.keys.prompts, REPLICA_GROUP, self.consumer, 0, list(self._active), justid=True
                    )
            except asyncio.CancelledError:
                raise
            except Exception:  # Redis hiccup: the next beat retries; the TTL tolerates a few misses
                log.warning("heartbeat failed", exc_info=True)
            await asyncio.sleep(period)

    async def unregister(self) -> None:
        await self.redis.delete(self.keys.replica(self.consumer))
