"""RolloutQueue: the trainer's side of the Redis Streams rollout queue (ARCHITECTURE.md flows 2, 3, 5).

submit() puts prompt jobs on the prompt stream (replicas pull them); next_batch() / batches() read
finished records from the rollout stream through one consumer group, and ack() confirms them after the
optimiser step: at-least-once delivery, and a trainer that dies before acking leaves its records
pending for the next one (XAUTOCLAIM after `claim_idle_s`). This module owns that Redis conversation;
what to admit (admission.py), how records become batches (batching.py), the stream layout
(streams.py), the connection policy (redis_conn.py) and the replicas (replicas.py) live next to it.
The async class is the implementation; the sync `RolloutQueue` runs it on a private event loop.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Literal, TypeVar

import numpy as np

from . import wire
from ._sync import LoopThread
from .admission import InFlight, QueueFull, in_flight_limit
from .batching import Entry, GroupBatcher
from .records import PromptJob, RolloutRecord, SamplingOptions
from .redis_conn import QueueUnavailable, call, connect
from .replicas import ReplicaInfo, live_replicas
from .replicas import broadcast_weights as _broadcast_weights
from .streams import (
    F_JOB,
    F_JOB_ERROR,
    F_REASON,
    F_RECORD,
    REPLICA_GROUP,
    TRAINER_GROUP,
    StreamKeys,
    ack_and_delete,
    dead_letter,
    ensure_group,
)

__all__ = [
    "AsyncRolloutQueue",
    "QueueFull",
    "QueueStats",
    "QueueTimeout",
    "QueueUnavailable",
    "ReplicaInfo",
    "RolloutQueue",
    "StalePolicy",
]

log = logging.getLogger("maskroll.queue")

StalePolicy = Literal["drop", "keep"]
T = TypeVar("T")


class QueueTimeout(TimeoutError):
    """No complete batch arrived within the timeout."""


@dataclass
class QueueStats:
    """Counters of one queue object since it was created (rollouts unless the name says jobs)."""

    submitted_jobs: int = 0
    submitted_rollouts: int = 0
    received: int = 0
    acked: int = 0
    duplicates: int = 0
    dropped_stale: int = 0
    dead_lettered: int = 0
    failed_jobs: int = 0
    reclaimed: int = 0


def _default_consumer() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class AsyncRolloutQueue:
    """The trainer's queue client for one namespace (one training run); `async with` or close().

    url: redis:// or rediss:// URL (password and TLS from the URL). consumer: this trainer's name in
    the consumer group; a restarted trainer with the same name first re-reads its own unacked records.
    batch_size, max_staleness: defaults of next_batch(), and together the in-flight limit of submit().
    stale_policy: "drop" acks and discards records older than max_staleness versions, "keep" trains on
    them. claim_idle_s: records another trainer read and left unacked this long are taken over.
    done_ttl_s: how long acked rollout ids are remembered in Redis to catch late duplicates.
    token, tls, root_certs: how broadcast_weights() reaches the replicas' gRPC. retries: Redis retry
    attempts before QueueUnavailable (see redis_conn.connect).
    """

    def __init__(
        self,
        url: str,
        namespace: str = "default",
        *,
        consumer: str | None = None,
        batch_size: int | None = None,
        max_staleness: int | None = None,
        stale_policy: StalePolicy = "drop",
        claim_idle_s: float = 60.0,
        done_ttl_s: float = 7 * 86400,
        token: str | None = None,
        tls: bool = False,
        root_certs: bytes | None = None,
        retries: int = 10,
    ) -> None:
        if stale_policy not in ("drop", "keep"):
            raise ValueError(f"stale_policy={stale_policy!r}; expected 'drop' or 'keep'")
        self.url = url
        self.keys = StreamKeys(namespace)
        self.consumer = consumer or _default_consumer()
        self.batch_size = batch_size
        self.max_staleness = max_staleness
        self.stale_policy = stale_policy
        self.claim_idle_ms = int(claim_idle_s * 1000)
        self.done_ttl_ms = int(done_ttl_s * 1000)
        self.token = token
        self._tls = {"tls": tls, "root_certs": root_certs}
        self.policy_version = 0
        self.stats = QueueStats()
        self._r = connect(url, retries=retries)
        self._ready_groups = False
        self._own_pending_read = False
        self._next_claim = 0.0
        self._flight = InFlight()
        self._batcher = GroupBatcher()

    # ---- lifecycle ------------------------------------------------------------------------------

    async def _groups_exist(self) -> None:
        if not self._ready_groups:
            await self._call(ensure_group(self._r, self.keys.rollouts, TRAINER_GROUP))
            await self._call(ensure_group(self._r, self.keys.prompts, REPLICA_GROUP))
            self._ready_groups = True

    async def close(self) -> None:
        """Close the Redis connection; unacked records stay pending for this consumer name."""
        await self._r.aclose()

    async def __aenter__(self) -> AsyncRolloutQueue:
        await self._groups_exist()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, aw: Awaitable[T]) -> T:
        return await call(aw, self.url)

    # ---- admission control and submission ------------------------------------------------------

    @property
    def max_in_flight(self) -> int | None:
        """(max_staleness + 1) × batch_size, or None while either is unset (no limit)."""
        return in_flight_limit(self.batch_size, self.max_staleness)

    @property
    def in_flight(self) -> int:
        """Rollouts submitted by this queue and not yet acked, dropped or failed."""
        return self._flight.count

    def room(self) -> int | None:
        """Rollouts that can be submitted now without blocking (None: no limit configured)."""
        return self._flight.room(self.max_in_flight)

    async def submit(
        self,
        prompt_ids: Sequence[int] | np.ndarray,
        options: SamplingOptions | None = None,
        *,
        n: int | None = None,
        group_id: str | None = None,
        metadata: dict[str, str] | None = None,
        job_id: str | None = None,
        timeout: float | None = None,
        rollout_stream: str = "",
    ) -> str:
        """Queue one prompt for `n` samples (default options.n); returns the job id. Blocks while the
        in-flight limit is reached; raises QueueFull after `timeout` seconds (None: wait forever).
        group_id, metadata: carried into every record. rollout_stream: publish the records there
        instead of this namespace's rollout stream."""
        options = options or SamplingOptions()
        if n is not None:
            options = replace(options, n=n)
        problems = options.problems()
        prompt = np.asarray(prompt_ids, dtype=np.int32)
        if prompt.ndim != 1 or prompt.size == 0:
            problems.append("prompt_ids must be a non-empty 1-D sequence of token ids")
        if problems:
            raise ValueError("; ".join(problems))
        limit = self.max_in_flight
        if limit is not None and options.n > limit:
            raise ValueError(
                f"n={options.n} exceeds the in-flight limit {limit} = (max_staleness + 1) × batch_size"
            )
        await self._flight.wait_for_room(options.n, limit, timeout)
        await self._groups_exist()
        job = PromptJob(
            job_id=job_id or uuid.uuid4().hex,
            prompt_ids=prompt,
            options=options,
            group_id=group_id or "",
            metadata=metadata or {},
            submitted_at=time.time(),
            rollout_stream=rollout_stream,
        )
        # No MAXLEN on the prompt stream: unconsumed jobs must never be trimmed; admission bounds it.
        await self._call(self._r.xadd(self.keys.prompts, {F_JOB: wire.job_to_pb(job).SerializeToString()}))
        self._flight.submitted(job.job_id, options.n)
        self.stats.submitted_jobs += 1
        self.stats.submitted_rollouts += options.n
        return job.job_id

    # ---- consumption -----------------------------------------------------------------------------

    def set_policy_version(self, version: int) -> None:
        """The version the trainer is at now; staleness = this − a record's first-token version."""
        self.policy_version = int(version)

    def _drops(self, rec: RolloutRecord) -> bool:
        """The staleness rule: with stale_policy "drop", a record more than max_staleness versions old."""
        return (
            self.stale_policy == "drop"
            and self.max_staleness is not None
            and self.policy_version - rec.policy_version_first > self.max_staleness
        )

    async def next_batch(
        self, batch_size: int | None = None, max_staleness: int | None = None, timeout: float | None = None
    ) -> list[RolloutRecord]:
        """The next batch of whole groups (≥ batch_size records, oldest groups first). batch_size and
        max_staleness, when given, also become the defaults (and the in-flight limit). Raises
        QueueTimeout after `timeout` s (None: wait forever)."""
        batch_size = batch_size or self.batch_size
        if not batch_size or batch_size < 1:
            raise ValueError("batch_size must be given (here or to the constructor) and >= 1")
        self.batch_size = batch_size
        if max_staleness is not None:
            self.max_staleness = max_staleness
        await self._groups_exist()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            batch, dropped = self._batcher.take(batch_size, self._drops)
            for job_id, ids in dropped.items():
                await self._drop(job_id, ids)
            if batch:
                return batch
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise QueueTimeout(
                    f"no batch of {batch_size} rollouts within {timeout} s "
                    f"({self._batcher.buffered} buffered in incomplete groups)"
                )
            await self._read(
                batch_size, 1000 if remaining is None else max(1, min(1000, int(remaining * 1000)))
            )

    async def batches(
        self, batch_size: int | None = None, max_staleness: int | None = None, timeout: float | None = None
    ) -> AsyncIterator[list[RolloutRecord]]:
        """next_batch() forever: `async for batch in q.batches(...)`; ack each one after training on it."""
        while True:
            yield await self.next_batch(batch_size, max_staleness, timeout)

    async def _read(self, batch_size: int, block_ms: int) -> None:
        r, keys = self._r, self.keys
        if not self._own_pending_read:
            # our own unacked entries from a previous life of this consumer name
            resp = await self._call(r.xreadgroup(TRAINER_GROUP, self.consumer, {keys.rollouts: "0"}))
            self._own_pending_read = True
            await self._ingest(resp[0][1] if resp else [])
            return
        if time.monotonic() >= self._next_claim:
            self._next_claim = time.monotonic() + max(0.5, self.claim_idle_ms / 4000)
            _, claimed, *_ = await self._call(
                r.xautoclaim(
                    keys.rollouts, TRAINER_GROUP, self.consumer, self.claim_idle_ms, "0-0", count=256
                )
            )
            claimed = [e for e in claimed if e is not None]
            if claimed:
                self.stats.reclaimed += len(claimed)
                await self._ingest(claimed)
                return
        resp = await self._call(
            r.xreadgroup(
                TRAINER_GROUP, self.consumer, {keys.rollouts: ">"}, count=2 * batch_size, block=block_ms
            )
        )
        await self._ingest(resp[0][1] if resp else [])

    async def _ingest(self, entries: list) -> None:
        fresh: list[Entry] = []
        for entry_id, fields in entries:
            if not fields:  # deleted while pending
                await self._call(self._r.xack(self.keys.rollouts, TRAINER_GROUP, entry_id))
                continue
            if F_RECORD in fields:
                try:
                    fresh.append((entry_id, wire.decode_record(fields[F_RECORD])))
                except wire.WireError as e:
                    await self._dead_letter(entry_id, fields, str(e))
            elif F_JOB_ERROR in fields:
                await self._job_failed(entry_id, fields)
            else:
                await self._dead_letter(entry_id, fields, f"unknown fields {sorted(fields)}")
        if not fresh:
            return
        flags = await self._call(self._r.zmscore(self.keys.done, [rec.rollout_id for _, rec in fresh]))
        for (entry_id, rec), ack_time in zip(fresh, flags, strict=True):
            verdict = self._batcher.offer(entry_id, rec, acked=ack_time is not None, drop=self._drops(rec))
            if verdict == "duplicate":
                self.stats.duplicates += 1
                await self._finish([entry_id])
            elif verdict in ("kept", "drop"):
                self.stats.received += 1
                if verdict == "drop":
                    await self._drop(rec.job_id, self._batcher.drop(rec.job_id, [(entry_id, rec)]))

    async def _drop(self, job_id: str, entry_ids: list[bytes]) -> None:
        """Stale records: ack and delete them untrained, and free their room."""
        await self._finish(entry_ids)
        self.stats.dropped_stale += len(entry_ids)
        await self._flight.consumed(job_id, len(entry_ids))

    async def _finish(self, entry_ids: list[bytes]) -> None:
        if entry_ids:
            pipe = self._r.pipeline(transaction=True)
            ack_and_delete(pipe, self.keys.rollouts, TRAINER_GROUP, *entry_ids)
            await self._call(pipe.execute())

    async def _dead_letter(self, entry_id: bytes, fields: dict, reason: str) -> None:
        await self._call(
            dead_letter(self._r, self.keys, self.keys.rollouts, TRAINER_GROUP, entry_id, fields, reason)
        )
        self.stats.dead_lettered += 1

    async def _job_failed(self, entry_id: bytes, fields: dict) -> None:
        try:
            job = wire.decode_job(fields[F_JOB_ERROR])
        except wire.WireError:  # a broken failure notice is itself dead-lettered
            await self._dead_letter(entry_id, fields, "undecodable job_error")
            return
        reason = fields.get(F_REASON, b"").decode(errors="replace")
        log.warning("job %s failed on a replica: %s", job.job_id, reason)
        self.stats.failed_jobs += 1
        await self._finish([entry_id])
        await self._flight.consumed(job.job_id, self._flight.expected(job.job_id))

    async def ack(self, batch: Sequence[RolloutRecord]) -> None:
        """Confirm a trained batch: XACK + XDEL and the `done` markers, in one transaction. Records
        already acked are skipped; the acked rollouts free their in-flight room."""
        ids, per_job = [], {}
        for rec in batch:
            entry_id = self._batcher.entry_of(rec.rollout_id)
            if entry_id is None:
                continue  # already acked
            ids.append(entry_id)
            per_job[rec.job_id] = per_job.get(rec.job_id, 0) + 1
        if not ids:
            return
        pipe = self._r.pipeline(transaction=True)
        ack_and_delete(pipe, self.keys.rollouts, TRAINER_GROUP, *ids)
        now = time.time()
        pipe.zadd(self.keys.done, {rec.rollout_id: now for rec in batch})
        pipe.zremrangebyscore(self.keys.done, "-inf", now - self.done_ttl_ms / 1000)  # forget old acks
        await self._call(pipe.execute())
        self._batcher.acked(batch)
        self.stats.acked += len(ids)
        for job_id, count in per_job.items():
            await self._flight.consumed(job_id, count)

    # ---- replicas and weights (replicas.py) ------------------------------------------------------

    async def replicas(self) -> list[ReplicaInfo]:
        """Live replicas of this namespace: those whose heartbeat key has not expired."""
        return await self._call(live_replicas(self._r, self.keys))

    async def broadcast_weights(
        self, version: int, checkpoint_dir: str, timeout: float = 120.0
    ) -> dict[str, str]:
        """UpdateWeights on every live replica concurrently, each bounded by `timeout`. Returns
        {replica_id: "ok" | error}; the trainer's declared version becomes `version` either way."""
        reps = await self.replicas()
        results = await _broadcast_weights(
            reps, version, checkpoint_dir, timeout=timeout, token=self.token, **self._tls
        )
        self.set_policy_version(version)
        return results


class RolloutQueue:
    """Synchronous facade over AsyncRolloutQueue: the same arguments and behaviour, each call run on a
    private event loop thread. Use as a context manager or call close()."""

    def __init__(
        self,
        url: str,
        namespace: str = "default",
        *,
        consumer: str | None = None,
        batch_size: int | None = None,
        max_staleness: int | None = None,
        stale_policy: StalePolicy = "drop",
        claim_idle_s: float = 60.0,
        done_ttl_s: float = 7 * 86400,
        token: str | None = None,
        tls: bool = False,
        root_certs: bytes | None = None,
        retries: int = 10,
    ) -> None:
        """See AsyncRolloutQueue for what each argument means."""
        kwargs = dict(
            consumer=consumer,
            batch_size=batch_size,
            max_staleness=max_staleness,
            stale_policy=stale_policy,
            claim_idle_s=claim_idle_s,
            done_ttl_s=done_ttl_s,
            token=token,
            tls=tls,
            root_certs=root_certs,
            retries=retries,
        )
        self._loop = LoopThread("maskroll-queue")
        try:
            # built inside the loop thread that runs every later call on it
            self._q: AsyncRolloutQueue = self._loop.run(self._make(url, namespace, kwargs))
        except BaseException:
            self._loop.close()
            raise

    @staticmethod
    async def _make(url: str, namespace: str, kwargs: dict) -> AsyncRolloutQueue:
        return AsyncRolloutQueue(url, namespace, **kwargs)

    @property
    def stats(self) -> QueueStats:
        """Counters since this queue was created."""
        return self._q.stats

    @property
    def policy_version(self) -> int:
        """The trainer's declared policy version (set_policy_version, broadcast_weights)."""
        return self._q.policy_version

    @property
    def max_in_flight(self) -> int | None:
        """(max_staleness + 1) × batch_size, or None while either is unset (no limit)."""
        return self._q.max_in_flight

    @property
    def in_flight(self) -> int:
        """Rollouts submitted by this queue and not yet acked, dropped or failed."""
        return self._q.in_flight

    @property
    def consumer(self) -> str:
        """This trainer's consumer name in the rollout stream's group."""
        return self._q.consumer

    def room(self) -> int | None:
        """Rollouts that can be submitted now without blocking (None: no limit configured)."""
        return self._q.room()

    def set_policy_version(self, version: int) -> None:
        """The version the trainer is at now; staleness = this − a record's first-token version."""
        self._q.set_policy_version(version)

    def submit(
        self,
        prompt_ids: Sequence[int] | np.ndarray,
        options: SamplingOptions | None = None,
        *,
        n: int | None = None,
        group_id: str | None = None,
        metadata: dict[str, str] | None = None,
        job_id: str | None = None,
        timeout: float | None = None,
        rollout_stream: str = "",
    ) -> str:
        """Queue one prompt for `n` samples; returns the job id. Blocks while the in-flight limit is
        reached; raises QueueFull after `timeout` seconds (None: wait forever). See
        AsyncRolloutQueue.submit."""
        return self._loop.run(
            self._q.submit(
                prompt_ids,
                options,
                n=n,
                group_id=group_id,
                metadata=metadata,
                job_id=job_id,
                timeout=timeout,
                rollout_stream=rollout_stream,
            )
        )

    def next_batch(
        self, batch_size: int | None = None, max_staleness: int | None = None, timeout: float | None = None
    ) -> list[RolloutRecord]:
        """The next batch of whole groups (≥ batch_size records). Raises QueueTimeout after `timeout` s.
        See AsyncRolloutQueue.next_batch."""
        return self._loop.run(self._q.next_batch(batch_size, max_staleness, timeout))

    def batches(
        self, batch_size: int | None = None, max_staleness: int | None = None, timeout: float | None = None
    ) -> Iterator[list[RolloutRecord]]:
        """next_batch() forever: `for batch in q.batches(...)`; ack each one after training on it."""
        while True:
            yield self.next_batch(batch_size, max_staleness, timeout)

    def ack(self, batch: Sequence[RolloutRecord]) -> None:
        """Confirm a trained batch (XACK + XDEL and the `done` markers, in one transaction)."""
        self._loop.run(self._q.ack(batch))

    def replicas(self) -> list[ReplicaInfo]:
        """Live replicas of this namespace: those whose heartbeat key has not expired."""
        return self._loop.run(self._q.replicas())

    def broadcast_weights(self, version: int, checkpoint_dir: str, timeout: float = 120.0) -> dict[str, str]:
        """UpdateWeights on every live replica concurrently; {replica_id: "ok" | error}. The declared
        policy version becomes `version` either way."""
        return self._loop.run(self._q.broadcast_weights(version, checkpoint_dir, timeout))

    def close(self) -> None:
        """Close the Redis connection and the event loop thread."""
        try:
            self._loop.run(self._q.close(), timeout=10)
        finally:
            self._loop.close()

    def __enter__(self) -> RolloutQueue:
        self._loop.run(self._q._groups_exist())
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
