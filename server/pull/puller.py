"""Pull mode: a replica consumes prompt jobs from the Redis prompt stream (docs/architecture.md flow 2).

All replicas read through one consumer group. A job is acked only after its records are published.
Jobs left pending by a dead replica are reclaimed by survivors once idle for `claim_idle_s`
(XAUTOCLAIM); a live replica keeps its running jobs' idle time low by re-claiming them (XCLAIM JUSTID),
so slow generations are not stolen (both: `proto.consumer.GroupConsumer`, as the stage workers do). Replicas
register with a heartbeat key (TTL) so trainers can find them for weight updates. Knows nothing of
engines: `run_job` turns a job into records.

With several partitions (`--partitions`), every partition's prompt stream is read, one stream per call
(in a Redis Cluster a multi-stream XREADGROUP must stay in one slot), starting with each in turn, and a
job's records go to the rollout stream of its own partition.

Hostile or broken input never stops the puller: a job naming a rollout stream outside the namespace's
is rejected (`validation.rollout_stream`); a job that keeps failing for a reason that is not transient
(a WRONGTYPE key, say), or whose replica keeps dying, is dead-lettered once Redis has delivered it
`max_deliveries` times (the pending entry list counts them), and the trainer is told with a `job_error`
so its admission slot is released. A consumer group that vanished (Redis flushed, or replaced by one
without the AOF) is recreated. `supervise()` restarts `run()` with backoff after any other error, and
`failure()` says why the replica cannot pull right now (its health turns NOT_SERVING meanwhile).

A replica serving several namespaces (several LoRA runs, `--lora-namespaces`) runs one puller per
namespace, each with its own keys, reads and heartbeat; they share the replica's `pull_concurrency`
through one `slots.JobSlots` (taken in turn: no run starves another). Without `slots` a puller keeps
`concurrency` jobs of its own, as a single-namespace replica always has.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from maskroll.proto import wire
from maskroll.proto.consumer import GroupConsumer
from maskroll.proto.heartbeat import encode_heartbeat
from maskroll.proto.records import PromptJob, RolloutRecord
from maskroll.proto.redaction import redact
from maskroll.proto.redis_conn import REDIS_DOWN, transaction
from maskroll.proto.streams import (
    F_JOB,
    REPLICA_GROUP,
    PartitionKeys,
    StreamKeys,
    ack_and_delete,
    check_layout,
    dead_letter,
    ensure_group,
)

from ..engines.contract import EngineDead
from ..errors import InvalidArgument
from ..generation import validation
from ..metrics import Metrics
from .publisher import PublishTimeout, RolloutPublisher
from .slots import IDLE_WANT, JobSlots

log = logging.getLogger("maskroll.puller")

# Failures another attempt may not repeat: leave the job pending, never count them against it.
TRANSIENT = (*REDIS_DOWN, PublishTimeout, EngineDead)
# A Redis call of the loop (a 0.5 s blocking read) that has not returned after this long means the
# prompt stream is unreachable: the client is still inside its retry budget, but health should know now.
UNREACHABLE_AFTER_S = 5.0
RESTART_BACKOFF_S = (1.0, 30.0)  # first and largest wait before run() is restarted after an error


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
        max_deliveries: int = 10,
        slots: JobSlots | None = None,
    ) -> None:
        self.metrics = metrics or publisher.metrics
        self.redis, self.keys, self.consumer = redis, keys, consumer
        self.run_job, self.publisher = run_job, publisher
        self.concurrency = concurrency
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.replica_info = replica_info or (lambda: {})
        self.max_deliveries = max_deliveries
        self.slots = slots  # shared with the other namespaces' pullers; None: `concurrency` of its own
        self._active = 0  # len(self._jobs.active) as last heard (_on_active)
        self._started = 0  # jobs started so far: how many of a reservation the last read filled
        self._idle = False  # the last read found nothing: ask the shared slots for one only
        self._jobs = GroupConsumer(
            redis,
            keys,
            lambda part: part.prompts,
            REPLICA_GROUP,
            consumer,
            self._handle,
            claim_idle_s=claim_idle_s,
            min_reclaim_every_s=0.5,
            call=self._redis,  # timed: failure()
            on_active=self._on_active,
        )
        # for messages: the prompt stream, or "<first> … <last>" of several partitions
        parts = keys.parts
        self._streams = parts[0].prompts if len(parts) == 1 else f"{parts[0].prompts} … {parts[-1].prompts}"
        self._stopping = asyncio.Event()
        self._problem: str | None = None  # why the last attempt to take jobs failed; None once one works
        self._call_since: float | None = None  # when the Redis call now in progress started

    def failure(self) -> str | None:
        """Why this replica cannot take jobs right now (Redis unreachable, the loop restarting after an
        error), or None. Cheap: the health monitor polls it."""
        since = self._call_since
        if since is not None and (waited := time.monotonic() - since) > UNREACHABLE_AFTER_S:
            return f"the prompt stream {self._streams} has not answered for {waited:.0f} s"
        return self._problem

    async def supervise(self) -> None:
        """run() until stop(), restarted with exponential backoff after any error; every exit is logged."""
        first, cap = RESTART_BACKOFF_S
        wait = first
        while not self._stopping.is_set():
            started = time.monotonic()
            try:
                await self.run()
            except asyncio.CancelledError:
                log.info("prompt puller cancelled")
                raise
            except Exception as exc:
                self._problem = redact(f"the prompt puller failed: {type(exc).__name__}: {exc}")
                if time.monotonic() - started > 10 * cap:  # it had been running fine: start over fast
                    wait = first
                log.error("prompt puller exited with an error; restarting in %.0f s", wait, exc_info=True)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), wait)
                wait = min(wait * 2, cap)
                continue
            log.info("prompt puller stopped")
            return

    async def run(self) -> None:
        """Until stop(): read or reclaim jobs while below `concurrency`, keep heartbeats fresh."""
        await self._redis(check_layout(self.redis, self.keys))
        await self._ensure_groups()
        beat = asyncio.create_task(self.heartbeat())
        self._jobs.next_reclaim = 0.0  # a (re)start reclaims at once
        try:
            while not self._stopping.is_set():
                if self.slots is not None:
                    await self._take_shared()
                    continue
                free = self.concurrency - len(self._jobs.active)
                if free <= 0:
                    await asyncio.sleep(0.05)
                    continue
                await self._take(free)
        finally:
            beat.cancel()
            await asyncio.gather(beat, return_exceptions=True)

    async def _take_shared(self) -> None:
        """One turn on the shared slots: reserve (waiting for a free slot and this puller's turn, or
        stop()), read at most that many jobs, give back what the read did not fill."""
        reserving = asyncio.ensure_future(self.slots.reserve(IDLE_WANT if self._idle else self.slots.total))
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait((reserving, stopping), return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
            if not reserving.done():
                reserving.cancel()  # reserve() gives back a grant made meanwhile
            await asyncio.gather(reserving, stopping, return_exceptions=True)
        if reserving.cancelled() or reserving.exception() is not None:
            return  # stopping
        granted, before = reserving.result(), self._started
        try:
            await self._take(granted)
        finally:
            started = self._started - before
            self.slots.give_back(granted - started)
            self._idle = started == 0

    async def _take(self, free: int) -> None:
        """Start at most `free` jobs (reclaimed or new). Redis away and a lost consumer group are dealt
        with here (said, retried); anything else propagates and supervise() restarts run()."""
        try:
            self.metrics.jobs_reclaimed.inc(await self._jobs.take(free))
            if self._problem:
                log.info("prompt stream %s readable again", self._streams)
            self._problem = None
        except REDIS_DOWN as e:
            # The client already retried with backoff; keep trying: the replica recovers when Redis
            # returns, and running jobs go on meanwhile.
            self._problem = redact(f"the prompt stream {self._streams} is unreachable: {e}")
            log.warning("%s; retrying", self._problem)
            await asyncio.sleep(1.0)
        except ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            # Redis lost the group (FLUSHALL, or a new Redis without the AOF): the jobs it held are gone
            # with it; recreate it and read what comes next.
            log.warning(
                "consumer group %r on %s is gone (Redis flushed or replaced?); recreating it",
                REPLICA_GROUP,
                self._streams,
            )
            await self._ensure_groups()

    def _on_active(self, n: int) -> None:
        """The GroupConsumer's count of running jobs changed (one started, or one ended)."""
        delta, self._active = n - self._active, n
        if self.slots is None:
            self.metrics.jobs_active.set(n)
            return
        for _ in range(max(delta, 0)):
            self._started += 1
            self.slots.job_started()
        for _ in range(max(-delta, 0)):
            self.slots.job_ended()
        self.metrics.jobs_active.set(self.slots.running)  # every namespace's jobs

    async def _ensure_groups(self) -> None:
        for part in self.keys.parts:
            await self._redis(ensure_group(self.redis, part.prompts, REPLICA_GROUP))

    async def _redis(self, aw):
        """Await one Redis call of the loop, timed for failure()."""
        self._call_since = time.monotonic()
        try:
            return await aw
        finally:
            self._call_since = None

    def stop(self) -> None:
        """Stop taking jobs; running ones finish (see drain)."""
        self._stopping.set()

    async def drain(self, timeout: float) -> int:
        """Wait up to `timeout` for running jobs; cancel the rest (they stay pending and are reclaimed).
        Returns the number cancelled."""
        return await self._jobs.drain(timeout)

    async def _handle(self, part: PartitionKeys, entry_id: bytes, fields: dict, deliveries: int = 1) -> None:
        job = None
        try:
            try:
                job = wire.decode_job(fields.get(F_JOB, b""))
            except wire.WireError as e:
                await self._dead_letter(part, entry_id, fields, str(e))
                self.metrics.jobs.labels("malformed").inc()
                return
            if deliveries > self.max_deliveries:  # it never finished: each run failed or killed its replica
                await self._give_up(
                    part, entry_id, fields, job, f"delivered {deliveries} times and never finished"
                )
                return
            stream = None
            try:
                # A job's records go to its own partition's rollout stream unless it names one.
                stream = (
                    validation.rollout_stream(job.rollout_stream, self.keys)
                    if job.rollout_stream
                    else part.rollouts
                )
                records = await self.run_job(job)
            except (JobRejected, InvalidArgument) as e:
                # A job error goes where the records would have gone, unless that is what is wrong.
                await self.publisher.publish_job_error(job, str(e), stream or part.rollouts)
                await self._ack(part, entry_id)
                self.metrics.jobs.labels("rejected").inc()
                return
            await self.publisher.publish(records, stream)
            await self._ack(part, entry_id)  # only after the records are safely in Redis
            self.metrics.jobs.labels("ok").inc()
            self.metrics.tokens.inc(sum(int(r.completion_ids.size) for r in records))
        except asyncio.CancelledError:
            raise  # drain: the job stays pending and another replica (or we) reclaim it
        except TRANSIENT as e:
            # Redis down, a full stream, a dead engine: leave the job pending for redelivery
            log.warning("job %s failed: %s; left pending for redelivery", entry_id, redact(repr(e)))
            self.metrics.jobs.labels("error").inc()
        except Exception as e:
            self.metrics.jobs.labels("error").inc()
            if job is None or deliveries < self.max_deliveries:
                log.exception(
                    "job %s failed (delivery %d of at most %d); left pending for redelivery",
                    entry_id,
                    deliveries,
                    self.max_deliveries,
                )
            else:
                await self._give_up_quietly(
                    part, entry_id, fields, job, f"{type(e).__name__}: {e}", deliveries
                )

    async def _give_up_quietly(
        self, part: PartitionKeys, entry_id: bytes, fields: dict, job: PromptJob, error: str, deliveries: int
    ) -> None:
        try:
            await self._give_up(part, entry_id, fields, job, f"failed on delivery {deliveries}: {error}")
        except Exception:  # Redis trouble: the job stays pending, the next delivery gives up again
            log.exception("job %s: dead-lettering failed; left pending", entry_id)

    async def _give_up(
        self, part: PartitionKeys, entry_id: bytes, fields: dict, job: PromptJob, why: str
    ) -> None:
        """Dead-letter a job that cannot succeed, telling the trainer (its admission slot is released).
        The job error goes to its partition's rollout stream, which the SDK reads."""
        reason = redact(f"job {job.job_id} dead-lettered: {why}")
        try:
            await self.publisher.publish_job_error(job, reason, part.rollouts)
        except REDIS_DOWN:
            raise  # try again on the next delivery
        except Exception:  # the stream itself is broken (WRONGTYPE): the dead letter still records it
            log.exception("job %s: the job error could not be published", job.job_id)
        await self._dead_letter(part, entry_id, fields, reason)
        self.metrics.jobs.labels("dead_lettered").inc()

    async def _ack(self, part: PartitionKeys, entry_id: bytes) -> None:
        pipe = transaction(self.redis)
        ack_and_delete(pipe, part.prompts, REPLICA_GROUP, entry_id)
        await pipe.execute()

    async def _dead_letter(self, part: PartitionKeys, entry_id: bytes, fields: dict, reason: str) -> None:
        await dead_letter(self.redis, part, part.prompts, REPLICA_GROUP, entry_id, fields, reason)

    async def heartbeat(self) -> None:
        """Refresh the registry key and keep running jobs' idle time below the reclaim threshold, until
        cancelled (the puller runs it; a joining replica alone, weights/join.py, to be found and pushed)."""
        period = max(0.2, min(self.heartbeat_ttl_s / 3, self._jobs.claim_idle_ms / 3000))
        while True:
            try:
                beat = encode_heartbeat(
                    self.consumer, **self.replica_info(), active_jobs=len(self._jobs.active)
                )
                await self.redis.set(
                    self.keys.replica(self.consumer), beat, px=int(self.heartbeat_ttl_s * 1000)
                )
                await self._jobs.keep_claimed()
            except asyncio.CancelledError:
                raise
            except Exception:  # Redis hiccup: the next beat retries; the TTL tolerates a few misses
                log.warning("heartbeat failed", exc_info=True)
            await asyncio.sleep(period)

    async def unregister(self) -> None:
        await self.redis.delete(self.keys.replica(self.consumer))
