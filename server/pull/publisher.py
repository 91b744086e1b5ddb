"""RolloutPublisher: finished records → the Redis rollout stream, with backpressure instead of drops.

The stream is bounded by `max_len` *unconsumed* entries: trainers XDEL what they ack, so XLEN is the
backlog. When the backlog is full, or Redis answers OOM, the publisher waits (bounded) rather than
trimming with MAXLEN, which would silently delete rollouts nobody has read. When Redis is down, the
client's retry rule applies (maskroll.proto.redis_conn.connect); past the budget the error propagates
and the caller keeps the job unacked, so it is redelivered — a record is never silently dropped.

The XLEN check costs a round trip per publish, so it is skipped while the backlog is well under the
bound: the transaction also returns the stream's length after its XADDs, and a publish whose last one
left the backlog under half of max_len (with room for this job) goes without. Each replica can then add
at most one job unchecked once the backlog has passed half, so the bound holds while max_len / 2 is more
than one job per replica — the slack that two replicas checking at the same moment need anyway.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from maskroll.proto import wire
from maskroll.proto.records import PromptJob, RolloutRecord
from maskroll.proto.redis_conn import Pieces, sends_pieces, transaction
from maskroll.proto.streams import F_JOB_ERROR, F_REASON, F_RECORD, StreamKeys

from ..metrics import Metrics


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
        keys: StreamKeys | None = None,
    ) -> None:
        """keys: the namespace's key layout (partitions, cluster), for front ends that validate a
        request's rollout stream against it; `stream` is where records go by default."""
        self.keys = keys
        self.metrics = metrics or Metrics()
        self.redis = redis
        self.stream = stream
        self.max_len = max_len
        self.wait_timeout_s = wait_timeout_s
        self.poll_s = poll_s
        self._seen: dict[str, int] = {}  # stream -> its length right after our last publish to it
        # A record goes out as its pieces (header, arrays), never copied into a payload of its own, where
        # the client can send them (redis_conn.connect's can; a plain redis-py client gets bytes).
        self._pieces = sends_pieces(redis)

    async def publish(
        self, records: Sequence[RolloutRecord], stream: str | None = None, *, wait_s: float | None = None
    ) -> list[bytes]:
        """XADD all records of one job in one transaction (all or none); returns their entry ids.
        wait_s: how long to wait for room in a full stream (default: wait_timeout_s), then PublishTimeout."""
        stream = stream or self.stream
        if self._pieces:
            payloads: list = [Pieces(wire.record_pieces(r)) for r in records]
        else:
            payloads = [wire.encode_record(r) for r in records]
        started = time.monotonic()
        wait_s = self.wait_timeout_s if wait_s is None else wait_s
        deadline = started + wait_s
        while True:
            seen = self._seen.pop(stream, None)  # used once: a wait or an error starts from a fresh XLEN
            if (seen is not None and seen + len(payloads) <= self.max_len // 2) or (
                await self.redis.xlen(stream) + len(payloads) <= self.max_len
            ):
                pipe = transaction(self.redis)
                for data in payloads:
                    pipe.xadd(stream, {F_RECORD: data})
                pipe.xlen(stream)
                try:
                    *ids, self._seen[stream] = await pipe.execute()
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
                    f"for {wait_s} s; the job stays pending for redelivery"
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
