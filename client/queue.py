"""RolloutQueue: the trainer's side of the Redis Streams rollout queue (ARCHITECTURE.md flows 2, 3, 5).

submit() puts prompt jobs on the prompt stream (replicas pull them); batches() reads finished records
from the rollout stream through one consumer group, groups them by job (a GRPO group is whole or
absent), drops duplicates by rollout_id and stale records by policy version, and ack() confirms them
after the optimiser step: at-least-once delivery, and a trainer that dies before acking leaves its
records pending for the next one (XAUTOCLAIM after `claim_idle_s`). Admission control keeps at most
(max_staleness + 1) × batch_size rollouts in flight. The async class is the implementation; the sync
`RolloutQueue` runs it on a private event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from . import wire
from ._sync import LoopThread
from .records import PromptJob, RolloutRecord, SamplingOptions
from .streams import F_JOB, F_JOB_ERROR, F_REASON, F_RECORD, REPLICA_GROUP, TRAINER_GROUP, StreamKeys

log = logging.getLogger("maskroll.queue")

StalePolicy = Literal["drop", "keep"]
RETRYABLE = (RedisConnectionError, RedisTimeoutError, ConnectionError, OSError)


class QueueFull(Exception):
    """submit() waited `timeout` seconds and the in-flight limit still had no room."""


class QueueTimeout(TimeoutError):
    """No complete batch arrived within the timeout."""


class QueueUnavailable(ConnectionError):
    """Redis stayed unreachable through the whole retry budget."""


@dataclass
class QueueStats:
    submitted_jobs: int = 0
    submitted_rollouts: int = 0
    received: int = 0
    acked: int = 0
    duplicates: int = 0
    dropped_stale: int = 0
    dead_lettered: int = 0
    failed_jobs: int = 0
    reclaimed: int = 0


@dataclass(frozen=True)
class ReplicaInfo:
    replica_id: str
    address: str
    engine: str = ""
    model: str = ""
    policy_version: int = 0
    extra: dict = field(default_factory=dict)


def connect(url: str, *, retries: int = 10, socket_timeout: float = 10.0) -> aioredis.Redis:
    """A Redis client with an explicit retry rule: connection errors and timeouts, exponential backoff
    capped at 2 s, `retries` attempts (≈ 15 s in all by default). TLS and passwords come from the URL
    (rediss://, redis://:password@host)."""
    return aioredis.Redis.from_url(
        url,
        retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), retries),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
        socket_connect_timeout=2.0,
        socket_timeout=socket_timeout,
        health_check_interval=30,
    )


async def ensure_group(r: aioredis.Redis, stream: str, group: str) -> None:
    """Create the consumer group from the start of the stream; an existing group is fine (BUSYGROUP)."""
    try:
        await r.xgroup_create(stream, group, id="0", mkstream=True)
    except ResponseError as e:
        if "BUSYGROUP" not in str(e):
            raise


def ack_and_delete(pipe, stream: str, group: str, *entry_ids: bytes) -> None:
    """Queue XACK + XDEL on a pipeline: a consumed entry leaves the stream, so XLEN is the backlog."""
    pipe.xack(stream, group, *entry_ids)
    pipe.xdel(stream, *entry_ids)


async def dead_letter(
    r: aioredis.Redis, keys: StreamKeys, stream: str, group: str, entry_id: bytes, fields: dict, reason: str
) -> None:
    """Move an entry no consumer can decode to the dead-letter stream, atomically with its ack."""
    log.warning("dead-lettering %s entry %s: %s", stream, entry_id, reason)
    payload = b"".join(fields.values()) if fields else b""
    pipe = r.pipeline(transaction=True)
    pipe.xadd(
        keys.dead_letters, {b"stream": stream, b"id": entry_id, b"reason": reason[:500], b"payload": payload}
    )
    ack_and_delete(pipe, stream, group, entry_id)
    await pipe.execute()


def _default_consumer() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass
class _Group:
    size: int
    entries: list[tuple[bytes, RolloutRecord]] = field(default_factory=list)


class AsyncRolloutQueue:
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
        self.token = token  # bearer token and TLS settings for the replicas' gRPC (broadcast_weights)
        self._tls = {"tls": tls, "root_certs": root_certs}
        self.policy_version = 0
        self.stats = QueueStats()
        self._r = connect(url, retries=retries)
        self._ready_groups = False
        self._own_pending_read = False
        self._next_claim = 0.0
        self._jobs: dict[str, int] = {}  # job_id -> rollouts still expected (jobs this queue submitted)
        self._in_flight = 0
        self._room = asyncio.Condition()
        self._groups: dict[str, _Group] = {}
        self._complete: list[str] = []  # job ids whose group is whole, oldest first
        self._pending: dict[str, bytes] = {}  # rollout_id -> entry id, read but not acked
        self._acked: OrderedDict[str, None] = OrderedDict()  # recent acked rollout ids (LRU)

    # ---- lifecycle ------------------------------------------------------------------------------

    async def _groups_exist(self) -> None:
        if not self._ready_groups:
            await self._call(ensure_group(self._r, self.keys.rollouts, TRAINER_GROUP))
            await self._call(ensure_group(self._r, self.keys.prompts, REPLICA_GROUP))
            self._ready_groups = True

    async def close(self) -> None:
        await self._r.aclose()

    async def __aenter__(self) -> AsyncRolloutQueue:
        await self._groups_exist()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, coro):
        """Redis calls retry inside the client (see `connect`); past the budget, say so plainly."""
        try:
            return await coro
        except RETRYABLE as e:
            raise QueueUnavailable(f"Redis at {self.url} unreachable after the retry budget: {e}") from e

    # ---- admission control and submission ------------------------------------------------------

    @property
    def max_in_flight(self) -> int | None:
        if self.batch_size is None or self.max_staleness is None:
            return None
        return (self.max_staleness + 1) * self.batch_size

    @property
    def in_flight(self) -> int:
        """Rollouts submitted by this queue and not yet acked, dropped or failed."""
        return self._in_flight

    def room(self) -> int | None:
        """Rollouts that can be submitted now without blocking (None: no limit configured)."""
        limit = self.max_in_flight
        return None if limit is None else max(0, limit - self._in_flight)

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
        """Queue one prompt for `n` samples; returns the job id. Blocks while the in-flight limit is
        reached; raises QueueFull after `timeout` seconds (None: wait forever)."""
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
        await self._wait_for_room(options.n, timeout)
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
        self._jobs[job.job_id] = options.n
        self._in_flight += options.n
        self.stats.submitted_jobs += 1
        self.stats.submitted_rollouts += options.n
        return job.job_id

    async def _wait_for_room(self, n: int, timeout: float | None) -> None:
        limit = self.max_in_flight
        if limit is None:
            return
        async with self._room:
            try:
                await asyncio.wait_for(self._room.wait_for(lambda: self._in_flight + n <= limit), timeout)
            except (asyncio.TimeoutError, TimeoutError):
                raise QueueFull(
                    f"{self._in_flight} rollouts in flight; limit {limit} = (max_staleness + 1) × batch_size "
                    f"left no room for {n} more within {timeout} s (ack batches to make room)"
                ) from None

    async def _consumed(self, job_id: str, count: int) -> None:
        left = self._jobs.get(job_id)
        if left is None:
            return  # another submitter's job
        count = min(count, left)
        self._in_flight -= count
        if left - count <= 0:
            del self._jobs[job_id]
        else:
            self._jobs[job_id] = left - count
        async with self._room:
            self._room.notify_all()

    # ---- consumption -----------------------------------------------------------------------------

    def set_policy_version(self, version: int) -> None:
        """The version the trainer is at now; staleness = this − a record's first-token version."""
        self.policy_version = int(version)

    def _stale(self, rec: RolloutRecord, max_staleness: int | None) -> bool:
        return max_staleness is not None and self.policy_version - rec.policy_version_first > max_staleness

    async def next_batch(
        self, batch_size: int | None = None, max_staleness: int | None = None, timeout: float | None = None
    ) -> list[RolloutRecord]:
        """The next batch of whole groups (≥ batch_size records). Raises QueueTimeout after `timeout` s."""
        batch_size = batch_size or self.batch_size
        if not batch_size or batch_size < 1:
            raise ValueError("batch_size must be given (here or to the constructor) and >= 1")
        self.batch_size = batch_size
        if max_staleness is not None:
            self.max_staleness = max_staleness
        await self._groups_exist()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            batch = await self._take(batch_size)
            if batch:
                return batch
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                have = sum(len(g.entries) for g in self._groups.values())
                raise QueueTimeout(
                    f"no batch of {batch_size} rollouts within {timeout} s "
                    f"({have} buffered in incomplete groups)"
                )
            await self._read(
                batch_size, 1000 if remaining is None else max(1, min(1000, int(remaining * 1000)))
            )

    async def batches(
        self, batch_size: int | None = None, max_staleness: int | None = None, timeout: float | None = None
    ) -> AsyncIterator[list[RolloutRecord]]:
        while True:
            yield await self.next_batch(batch_size, max_staleness, timeout)

    async def _take(self, batch_size: int) -> list[RolloutRecord]:
        """Whole groups, oldest first, once they add up to batch_size records (stale ones dropped)."""
        ready = []
        for job_id in self._complete:
            group = self._groups[job_id]
            if self.stale_policy == "drop" and any(
                self._stale(rec, self.max_staleness) for _, rec in group.entries
            ):
                await self._discard(group.entries, job_id, stale=True)
            else:
                ready.append(job_id)
        self._complete = ready
        if sum(len(self._groups[j].entries) for j in ready) < batch_size:
            return []
        out: list[RolloutRecord] = []
        while self._complete and len(out) < batch_size:
            out.extend(rec for _, rec in self._groups.pop(self._complete.pop(0)).entries)
        return out

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
        fresh: list[tuple[bytes, RolloutRecord]] = []
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
        for (entry_id, rec), already in zip(fresh, flags, strict=True):
            rid = rec.rollout_id
            done = already is not None  # ZMSCORE: the ack time, or None
            if done or rid in self._acked or (rid in self._pending and self._pending[rid] != entry_id):
                self.stats.duplicates += 1
                await self._finish([entry_id])
                continue
            if rid in self._pending:  # the same entry delivered again (own PEL / reclaim)
                continue
            self.stats.received += 1
            self._pending[rid] = entry_id
            if self.stale_policy == "drop" and self._stale(rec, self.max_staleness):
                await self._discard([(entry_id, rec)], rec.job_id, stale=True)
                continue
            group = self._groups.setdefault(rec.job_id, _Group(size=max(1, rec.group_size)))
            group.entries.append((entry_id, rec))
            if len(group.entries) == group.size:
                self._complete.append(rec.job_id)

    async def _discard(self, entries: list[tuple[bytes, RolloutRecord]], job_id: str, *, stale: bool) -> None:
        ids = [entry_id for entry_id, _ in entries]
        for _, rec in entries:
            self._pending.pop(rec.rollout_id, None)
        # the rest of a dropped group is dropped when it arrives: its job is marked finished
        group = self._groups.pop(job_id, None)
        if group is not None:
            ids += [e for e, _ in group.entries]
            for _, rec in group.entries:
                self._pending.pop(rec.rollout_id, None)
        await self._finish(ids)
        if stale:
            self.stats.dropped_stale += len(ids)
        await self._consumed(job_id, len(ids))

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
        await self._consumed(job.job_id, self._jobs.get(job.job_id, 0))

    async def ack(self, batch: Sequence[RolloutRecord]) -> None:
        """Confirm a trained batch: XACK + XDEL and the `done` markers, in one transaction."""
        ids, per_job = [], {}
        for rec in batch:
            entry_id = self._pending.get(rec.rollout_id)
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
        for rec in batch:
            if self._pending.pop(rec.rollout_id, None) is not None:
                self._acked[rec.rollout_id] = None
        while len(self._acked) > 200_000:
            self._acked.popitem(last=False)
        self.stats.acked += len(ids)
        for job_id, count in per_job.items():
            await self._consumed(job_id, count)

    # ---- replicas and weights -----------------------------------------------------------------------

    async def replicas(self) -> list[ReplicaInfo]:
        """Live replicas: those whose heartbeat key has not expired."""
        out = []
        async for key in self._r.scan_iter(match=self.keys.replica_pattern, count=100):
            raw = await self._call(self._r.get(key))
            if raw is None:
                continue
            info = json.loads(raw)
            out.append(
                ReplicaInfo(
                    replica_id=info.get("replica_id", ""),
                    address=info.get("address", ""),
                    engine=info.get("engine", ""),
                    model=info.get("model", ""),
                    policy_version=int(info.get("policy_version", 0)),
                    extra=info,
                )
            )
        return sorted(out, key=lambda r: r.replica_id)

    async def broadcast_weights(
        self, version: int, checkpoint_dir: str, timeout: float = 120.0
    ) -> dict[str, str]:
        """UpdateWeights on every live replica concurrently, each bounded by `timeout`. Returns
        {replica_id: "ok" | error}; the trainer's declared version becomes `version` either way."""
        from .rollout_client import RolloutClient  # grpc only when weights are pushed

        async def one(rep: ReplicaInfo) -> str:
            try:
                async with RolloutClient(rep.address, token=self.token, **self._tls) as c:
                    await asyncio.wait_for(c.update_weights(version, checkpoint_dir), timeout)
                return "ok"
            except Exception as e:
                return f"{type(e).__name__}: {e}"

        reps = await self.replicas()
        results = await asyncio.gather(*(one(rep) for rep in reps))
        self.set_policy_version(version)
        return {rep.replica_id: res for rep, res in zip(reps, results, strict=True)}


class RolloutQueue:
    """Synchronous facade over AsyncRolloutQueue (same arguments, same behaviour)."""

    def __init__(self, url: str, namespace: str = "default", **kwargs) -> None:
        self._loop = LoopThread("maskroll-queue")
        self._q: AsyncRolloutQueue = self._loop.run(self._make(url, namespace, kwargs))

    @staticmethod
    async def _make(url: str, namespace: str, kwargs: dict) -> AsyncRolloutQueue:
        return AsyncRolloutQueue(url, namespace, **kwargs)

    @property
    def stats(self) -> QueueStats:
        return self._q.stats

    @property
    def policy_version(self) -> int:
        return self._q.policy_version

    @property
    def in_flight(self) -> int:
        return self._q.in_flight

    @property
    def consumer(self) -> str:
        return self._q.consumer

    def room(self) -> int | None:
        return self._q.room()

    def set_policy_version(self, version: int) -> None:
        self._q.set_policy_version(version)

    def submit(self, prompt_ids, options: SamplingOptions | None = None, **kwargs) -> str:
        return self._loop.run(self._q.submit(prompt_ids, options, **kwargs))

    def next_batch(self, batch_size=None, max_staleness=None, timeout=None) -> list[RolloutRecord]:
        return self._loop.run(self._q.next_batch(batch_size, max_staleness, timeout))

    def batches(self, batch_size=None, max_staleness=None, timeout=None) -> Iterator[list[RolloutRecord]]:
        while True:
            yield self.next_batch(batch_size, max_staleness, timeout)

    def ack(self, batch: Sequence[RolloutRecord]) -> None:
        self._loop.run(self._q.ack(batch))

    def replicas(self) -> list[ReplicaInfo]:
        return self._loop.run(self._q.replicas())

    def broadcast_weights(self, version: int, checkpoint_dir: str, timeout: float = 120.0) -> dict[str, str]:
        return self._loop.run(self._q.broadcast_weights(version, checkpoint_dir, timeout))

    def close(self) -> None:
        try:
            self._loop.run(self._q.close(), timeout=10)
        finally:
            self._loop.close()

    def __enter__(self) -> RolloutQueue:
        self._loop.run(self._q._groups_exist())
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
