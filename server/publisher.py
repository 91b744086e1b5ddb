"""RolloutPublisher: finished records → the Redis rollout stream, with backpressure instead of drops.

The stream is bounded by `max_len` *unconsumed* entries: trainers XDEL what they ack, so XLEN is the
backlog. When the backlog is full, or Redis answers OOM, the publisher waits (bounded) rather than
trimming with MAXLEN, which would silently delete rollouts nobody has read. When Redis is down, the
client's retry rule applies (maskroll.client.redis_conn.connect); past the budget the error propagates
and the caller keeps the job unacked, so it is redelivered — a record is never silently dropped.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from maskroll.client import wire
from maskroll.client.records import PromptJob, RolloutRecord
from maskroll.client.streams import F_JOB_ERROR, F_REASON, F_RECORD

from .metrics import Metrics


class PublishTimeout(TimeoutError):
    """The rollout stream stayed full (or Redis out of memory) for the whole wait budget."""


class RolloutPublisher:
    def __init__(
        self,
        redis: aioredis.Redis,
        stream: str,
        *,
        max_len: int = 100_000,
        wait_timeout_s: float = 600.0,
        poll_s: float = 0.25,
        metrics: Metrics | None = None,
    ) -> None:
        self.metrics = metrics or Metrics()
        self.redis = redis
        self.stream = stream
        self.max_len = max_len
        self.wait_timeout_s = wait_timeout_s
        self.poll_s = poll_s

    async def publish(self, records: Sequence[RolloutRecord], stream: str | None = None) -> list[bytes]:
        """XADD all records of one job in one transaction (all or none); returns their entry ids."""
        stream = stream or self.stream
        payloads = [wire.encode_record(r) for r in records]
        started = time.monotonic()
        deadline = started + self.wait_timeout_s
        while True:
            if await self.redis.xlen(stream) + len(payloads) <= self.max_len:
                pipe = self.redis.pipeline(transaction=True)
                for data in payloads:
                    pipe.xadd(stream, {F_RECORD: data})
                try:
                    ids = await pipe.execute()
                except ResponseError as e:
                    if "OOM" not in str(e):
                        raise
                    ids = None  # Redis is full: same as a full stream, wait for consumers
                if ids is not None:
                    self.metrics.published.inc(len(payloads))
                    self.metrics.published_bytes.inc(sum(map(len, payloads)))
                    self.metrics.publish_seconds.observe(time.monotonic() - started)
                    return ids
            if time.monotonic() >= deadline:
                self.metrics.publish_failures.inc()
                raise PublishTimeout(
                    f"rollout stream {stream} stayed full ({self.max_len} unconsumed entries or Redis OOM) "
                    f"for {self.wait_timeout_s} s; the job stays pending for redelivery"
                )
            self.metrics.backpressure.inc()
            await asyncio.sleep(self.poll_s)

    async def publish_job_error(self, job: PromptJob, reason: str, stream: str | None = None) -> None:
        """Tell the trainer a job cannot run (bad input, or dead-lettered), so its admission slot is
        released. `stream`: a checked stream (validation.rollout_stream), default this publisher's; never
        the job's own rollout_stream unchecked."""
        await self.redis.xadd(
            stream or self.stream,
            {F_JOB_ERROR: wire.job_to_pb(job).SerializeToString(), F_REASON: reason[:1000]},
        )
