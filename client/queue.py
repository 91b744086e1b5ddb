"""RolloutQueue: the trainer's side of the Redis Streams rollout queue (docs/architecture.md flows 2, 3, 6).

submit() puts prompt jobs on the prompt stream (replicas pull them); next_batch() / batches() read
finished records from the rollout stream through one consumer group, and ack() confirms them after the
optimiser step: at-least-once delivery, and a trainer that dies before acking leaves its records
pending for the next one (XAUTOCLAIM after `claim_idle_s`). Every record read is checked before it is
batched: one that does not decode, fails a semantic check, belongs to another run or comes from a
policy version this trainer has not reached is dead-lettered with the reason and counted — never
trained on, and never raised out of next_batch. A queue belongs to one training run (runs.py): opened
as a new run or resuming the namespace's current one, never silently both.

This module owns that Redis conversation; what to admit (admission.py), how records become batches and
which are refused (batching.py), the run (runs.py), the stream layout (streams.py), the connection
policy (redis_conn.py) and the replicas (replicas.py) live next to it. The async class is the
implementation; the sync `RolloutQueue` runs it on a private event loop.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Literal, TypeVar

import numpy as np

from maskroll.proto import wire
from maskroll.proto.prompts import prompt_problem
from maskroll.proto.records import PromptJob, RolloutRecord, SamplingOptions
from maskroll.proto.redis_conn import QueueUnavailable, call, open_redis, transaction
from maskroll.proto.streams import (
    F_JOB,
    F_JOB_ERROR,
    F_REASON,
    F_RECORD,
    REPLICA_GROUP,
    TRAINER_GROUP,
    PartitionKeys,
    StreamKeys,
    ack_and_delete,
    check_layout,
    dead_letter,
    delete_undelivered,
    ensure_group,
)
from maskroll.proto.tensor_push import WeightsManifest

from ._sync import LoopThread
from .admission import InFlight, QueueFull, in_flight_limit
from .batching import Entry, GroupBatcher, RefusalKind, group_key, refusal
from .replicas import BroadcastError, ReplicaInfo, ReplicaWeights, live_replicas, replica_weights
from .replicas import broadcast_weights as _broadcast_weights
from .replicas import push_weights as _push_weights
from .runs import RunChoiceRequired, RunInfo, RunMode, RunNotFound, RunSuperseded, advance, open_run, read_run

__all__ = [
    "AsyncRolloutQueue",
    "BroadcastError",
    "QueueFull",
    "QueueStats",
    "QueueTimeout",
    "QueueUnavailable",
    "ReplicaInfo",
    "RolloutQueue",
    "RunChoiceRequired",
    "RunInfo",
    "RunNotFound",
    "RunSuperseded",
    "StalePolicy",
]

log = logging.getLogger("maskroll.queue")

StalePolicy = Literal["drop", "keep"]
T = TypeVar("T")

# With several partitions, a read that found nothing on any of them waits on one (each in turn) this
# long at most, so a record arriving on another waits no longer than this to be read.
SWEEP_BLOCK_MS = 50


class QueueTimeout(TimeoutError):
    """No complete batch arrived within the timeout (the message says what the queue saw meanwhile)."""


@dataclass
class QueueStats:
    """Counters of one queue object since it was created (rollouts unless the name says jobs or groups).

    dead_lettered counts every entry set aside, of which: invalid (undecodable, or failing a semantic
    check), foreign_run (another run's, or no run id), future_version (from a policy version this trainer
    has not reached), and the records of expired_groups (groups still incomplete after group_timeout_s).
    cancelled_jobs: prompt jobs deleted before any replica started them (cancel_pending_jobs, or the
    older runs' jobs when a new run starts)."""

    submitted_jobs: int = 0
    submitted_rollouts: int = 0
    received: int = 0
    acked: int = 0
    duplicates: int = 0
    dropped_stale: int = 0
    dead_lettered: int = 0
    invalid: int = 0
    foreign_run: int = 0
    future_version: int = 0
    expired_groups: int = 0
    failed_jobs: int = 0
    cancelled_jobs: int = 0
    reclaimed: int = 0


def _default_consumer() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class AsyncRolloutQueue:
    """The trainer's queue client for one namespace and one training run; `async with` or open() / close().

    url: redis:// or rediss:// URL (password and TLS from the URL). run: "new" starts a new run on the
    namespace (a new run id; the older runs' unstarted prompt jobs are cancelled and their records
    refused); "resume" continues the namespace's current run from its last published version; None
    (the default) starts a run only on a namespace that has none, and raises RunChoiceRequired on one
    that has — the choice is never made silently. consumer: this trainer's name in the consumer group; a
    restarted trainer with the same name first re-reads its own unacked records. batch_size,
    max_staleness: defaults of next_batch(), and together the in-flight limit of submit(). stale_policy:
    "drop" acks and discards records older than max_staleness versions, "keep" trains on them.
    claim_idle_s: records another trainer read and left unacked this long are taken over.
    group_timeout_s: a group still missing samples this long after its first record arrived (with
    nothing more to read) is dead-lettered. done_ttl_s: how long acked rollout ids are remembered in
    Redis to catch late duplicates. token, tls, root_certs: how the replicas' gRPC is reached (weights).
    retries: Redis retry attempts before QueueUnavailable (see redis_conn.connect). partitions: the
    namespace's partition count (StreamKeys; the replicas must be started with the same
    `--partitions`, which Redis records and checks): jobs are spread over the partitions in turn and
    every partition is read in turn. A `redis://` URL of any node of a Redis Cluster works: cluster mode
    is detected when the queue opens (docs/scaling.md "Redis Cluster").
    """

    def __init__(
        self,
        url: str,
        namespace: str = "default",
        *,
        run: RunMode | None = None,
        consumer: str | None = None,
        batch_size: int | None = None,
        max_staleness: int | None = None,
        stale_policy: StalePolicy = "drop",
        claim_idle_s: float = 60.0,
        group_timeout_s: float = 300.0,
        done_ttl_s: float = 7 * 86400,
        token: str | None = None,
        tls: bool = False,
        root_certs: bytes | None = None,
        retries: int = 10,
        partitions: int = 1,
    ) -> None:
        if stale_policy not in ("drop", "keep"):
            raise ValueError(f"stale_policy={stale_policy!r}; expected 'drop' or 'keep'")
        if run not in (None, "new", "resume"):
            raise ValueError(
                f"run={run!r}; expected 'new', 'resume' or None (new only on an empty namespace)"
            )
        if not group_timeout_s > 0:
            raise ValueError(f"group_timeout_s={group_timeout_s}; expected > 0")
        self.url = url
        self.keys = StreamKeys(namespace, partitions)  # cluster=True once open() has detected one
        self.consumer = consumer or _default_consumer()
        self.batch_size = batch_size
        self.max_staleness = max_staleness
        self.stale_policy = stale_policy
        self.claim_idle_ms = int(claim_idle_s * 1000)
        self.group_timeout_s = group_timeout_s
        self.done_ttl_ms = int(done_ttl_s * 1000)
        self.token = token
        self._tls = {"tls": tls, "root_certs": root_certs}
        self.policy_version = 0
        self.stats = QueueStats()
        self._retries = retries
        self._r = None  # the Redis or RedisCluster client, made by _connect()
        self._turn = random.randrange(partitions)  # the partition the next read starts with
        self._submit_turn = random.randrange(partitions)  # the partition of the next job
        self._run_mode = run
        self._run: RunInfo | None = None
        self._old_runs: set[str] = set()  # run ids confirmed not to be the namespace's current run
        self._ready_groups = False
        self._own_pending_read = False
        self._next_claim = 0.0
        self._flight = InFlight()
        self._batcher = GroupBatcher()
        self._job_entries: dict[str, tuple[int, bytes]] = {}  # job_id -> (partition, prompt entry)
        self._refused: Counter[str] = Counter()  # records refused, by kind (for logs and timeouts)
        self._reported: Counter[str] = Counter()  # what _report_refused has logged of it

    # ---- lifecycle and the run ------------------------------------------------------------------

    async def open(self) -> AsyncRolloutQueue:
        """Create the consumer groups and take up the run (new or resumed); `async with` and the first
        call do this too. Raises RunChoiceRequired / RunNotFound (see the class docstring)."""
        await self._connect()
        if not self._ready_groups:
            await self._call(check_layout(self._r, self.keys))
            for part in self.keys.parts:
                await self._call(ensure_group(self._r, part.rollouts, TRAINER_GROUP))
                await self._call(ensure_group(self._r, part.prompts, REPLICA_GROUP))
            self._ready_groups = True
        if self._run is None:
            run, new = await self._call(open_run(self._r, self.keys, self._run_mode, self.consumer))
            self._run, self.policy_version = run, run.version
            if new:
                # Jobs no replica has started belong to older runs: their records would only be refused.
                cancelled = []
                for part in self.keys.parts:
                    cancelled += await self._call(delete_undelivered(self._r, part.prompts, REPLICA_GROUP))
                self.stats.cancelled_jobs += len(cancelled)
                log.info(
                    "namespace %r: started run %s (%d unstarted jobs of earlier runs cancelled)",
                    self.keys.namespace,
                    run.run_id,
                    len(cancelled),
                )
            else:
                log.info("namespace %r: resuming %s", self.keys.namespace, run.describe())
        return self

    async def _connect(self) -> None:
        """Connect once, detecting a Redis Cluster (its keys then carry hash tags even with one partition)."""
        if self._r is None:
            self._r, cluster = await open_redis(self.url, retries=self._retries)
            self.keys = StreamKeys(self.keys.namespace, self.keys.partitions, cluster)

    def _rotation(self) -> list[PartitionKeys]:
        """The partitions, starting with the next one in turn (so that none is always read last)."""
        parts = self.keys.parts
        self._turn = (self._turn + 1) % len(parts)
        return [*parts[self._turn :], *parts[: self._turn]]

    def _entry(self, part: int, entry_id: bytes) -> bytes:
        """The handle of a rollout-stream entry kept while it is unacked: its id, prefixed with its
        partition when there are several (entry ids are per stream and may repeat across partitions)."""
        return entry_id if self.keys.partitions == 1 else b"%d/%s" % (part, entry_id)

    def _split(self, handle: bytes) -> tuple[PartitionKeys, bytes]:
        """(partition keys, stream entry id) of an `_entry` handle."""
        if self.keys.partitions == 1:
            return self.keys.part(0), handle
        part, _, entry_id = handle.partition(b"/")
        return self.keys.part(int(part)), entry_id

    def _by_partition(self, handles: Iterable[bytes]) -> dict[PartitionKeys, list[bytes]]:
        out: dict[PartitionKeys, list[bytes]] = {}
        for handle in handles:
            part, entry_id = self._split(handle)
            out.setdefault(part, []).append(entry_id)
        return out

    @property
    def run(self) -> RunInfo:
        """The run this queue belongs to: id, last published version and its checkpoint."""
        if self._run is None:
            raise RuntimeError("the queue is not open yet: `async with` it or `await q.open()` first")
        return self._run

    @property
    def run_id(self) -> str:
        """This trainer's run id: stamped on every job submitted, required on every record trained on."""
        return self.run.run_id

    async def cancel_pending_jobs(self) -> int:
        """Delete the prompt jobs this queue submitted that no replica has started yet, and free their
        in-flight room; returns how many. Started jobs run on (their records arrive as usual)."""
        if not self._job_entries:
            return 0
        by_entry = {entry: job for job, entry in self._job_entries.items()}
        deleted = 0
        for p in sorted({p for p, _ in by_entry}):
            ids = [entry_id for q, entry_id in by_entry if q == p]
            prompts = self.keys.part(p).prompts
            for entry_id in await self._call(delete_undelivered(self._r, prompts, REPLICA_GROUP, ids)):
                job = by_entry[(p, entry_id)]
                await self._consumed(job, self._flight.expected(job))
                self._job_entries.pop(job, None)
                deleted += 1
        self.stats.cancelled_jobs += deleted
        return deleted

    async def close(self, cancel_jobs: bool = False) -> None:
        """Close the Redis connection; unacked records stay pending for this consumer name.
        cancel_jobs: first cancel the submitted jobs no replica has started (cancel_pending_jobs)."""
        try:
            if cancel_jobs and self._run is not None:
                await self.cancel_pending_jobs()
        finally:
            if self._r is not None:
                await self._r.aclose()

    async def __aenter__(self) -> AsyncRolloutQueue:
        return await self.open()

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
        """Rollouts submitted by this queue and not yet acked, dropped, failed or cancelled."""
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
        instead of this namespace's rollout stream. The job carries this queue's run id. With several
        partitions, each job goes to the next partition in turn."""
        options = options or SamplingOptions()
        if n is not None:
            options = replace(options, n=n)
        problems = options.problems()
        prompt = np.asarray(prompt_ids, dtype=np.int32)
        if problem := prompt_problem(prompt, name="prompt_ids"):
            problems.append(problem)
        if problems:
            raise ValueError("; ".join(problems))
        limit = self.max_in_flight
        if limit is not None and options.n > limit:
            raise ValueError(
                f"n={options.n} exceeds the in-flight limit {limit} = (max_staleness + 1) × batch_size"
            )
        await self._flight.wait_for_room(options.n, limit, timeout)
        await self.open()
        job = PromptJob(
            job_id=job_id or uuid.uuid4().hex,
            prompt_ids=prompt,
            options=options,
            group_id=group_id or "",
            metadata=metadata or {},
            submitted_at=time.time(),
            rollout_stream=rollout_stream,
            run_id=self.run_id,
        )
        part = self._submit_turn
        self._submit_turn = (part + 1) % self.keys.partitions
        # No MAXLEN on the prompt stream: unconsumed jobs must never be trimmed; admission bounds it.
        entry = await self._call(
            self._r.xadd(self.keys.part(part).prompts, {F_JOB: wire.job_to_pb(job).SerializeToString()})
        )
        self._flight.submitted(job.job_id, options.n)
        self._job_entries[job.job_id] = (part, entry)
        self.stats.submitted_jobs += 1
        self.stats.submitted_rollouts += options.n
        return job.job_id

    async def _consumed(self, job_id: str, count: int) -> None:
        """`count` rollouts of `job_id` left the queue (acked, dropped, failed, expired, cancelled)."""
        await self._flight.consumed(job_id, count)
        if not self._flight.expected(job_id):
            self._job_entries.pop(job_id, None)

    # ---- consumption -----------------------------------------------------------------------------

    def set_policy_version(self, version: int) -> None:
        """The version the trainer is at now: staleness = this − a record's first-token version, and a
        record from a newer version is refused. broadcast_weights() sets it; call this only if your
        trainer moves weights to the replicas by other means."""
        self.policy_version = int(version)

    def _drops(self, rec: RolloutRecord) -> bool:
        """The staleness rule: with stale_policy "drop", a record more than max_staleness versions old."""
        return (
            self.stale_policy == "drop"
            and self.max_staleness is not None
            and self.policy_version - rec.policy_version_first > self.max_staleness
        )

    async def next_batch(
        self,
        batch_size: int | None = None,
        max_staleness: int | None = None,
        timeout: float | None = None,
        *,
        at_least: int | None = None,
    ) -> list[RolloutRecord]:
        """The next batch of whole groups (≥ batch_size records, oldest groups first). batch_size and
        max_staleness, when given, also become the defaults (and the in-flight limit). at_least: fewer
        records will do this once (whole groups adding up to at least this many), defaults unchanged —
        for a trainer that already holds part of its batch, which may be all the jobs it has left in
        flight. Raises QueueTimeout after `timeout` s (None: wait forever), saying what it saw
        meanwhile; RunSuperseded once another trainer has started a new run on the namespace. A bad or
        foreign record never raises: it is dead-lettered and counted in `stats`."""
        batch_size = batch_size or self.batch_size
        if not batch_size or batch_size < 1:
            raise ValueError("batch_size must be given (here or to the constructor) and >= 1")
        if at_least is not None and not 1 <= at_least <= batch_size:
            raise ValueError(f"at_least={at_least}; expected 1 <= at_least <= batch_size ({batch_size})")
        self.batch_size = batch_size
        wanted = at_least or batch_size
        if max_staleness is not None:
            self.max_staleness = max_staleness
        await self.open()
        deadline = None if timeout is None else time.monotonic() + timeout
        refused_before = Counter(self._refused)
        while True:
            batch, dropped = self._batcher.take(wanted, self._drops)
            for job_id, ids in dropped.items():
                await self._drop(job_id, ids)
            if batch:
                return batch
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise await self._timeout_error(wanted, timeout, self._refused - refused_before)
            read = await self._read(
                batch_size, 1000 if remaining is None else max(1, min(1000, int(remaining * 1000)))
            )
            if not read:  # nothing more to read: an incomplete group now waits only for a re-run
                await self._expire_groups()

    async def batches(
        self, batch_size: int | None = None, max_staleness: int | None = None, timeout: float | None = None
    ) -> AsyncIterator[list[RolloutRecord]]:
        """next_batch() forever: `async for batch in q.batches(...)`; ack each one after training on it."""
        while True:
            yield await self.next_batch(batch_size, max_staleness, timeout)

    async def _timeout_error(self, batch_size: int, timeout: float | None, refused: Counter) -> Exception:
        """What a trainer needs to know when no batch came: replicas alive, what was refused meanwhile."""
        current = await self._call(read_run(self._r, self.keys))
        if current is None or current.run_id != self.run_id:
            return self._superseded(current)
        reps = await self.replicas()
        parts = [f"no batch of {batch_size} rollouts within {timeout} s"]
        parts.append(f"{self._batcher.buffered} buffered in incomplete groups")
        if not reps:
            parts.append(
                f"0 live replicas in namespace {self.keys.namespace!r} (start `maskroll serve --pull "
                f"--namespace {self.keys.namespace}"
                + (f" --partitions {self.keys.partitions}" if self.keys.partitions > 1 else "")
                + "` on the same Redis)"
            )
        else:
            parts.append(
                f"{len(reps)} live replicas at policy versions {sorted({r.policy_version for r in reps})}"
            )
        if refused:
            what = {
                "invalid": "invalid",
                "foreign_run": "of another run or none",
                "future_version": f"from policy versions ahead of this trainer's {self.policy_version}",
            }
            parts.append(
                "dead-lettered meanwhile: "
                + ", ".join(f"{n} {what[k]}" for k, n in sorted(refused.items()))
                + f" (reasons in {self._dead_letter_streams()})"
            )
            if refused.get("future_version"):
                parts.append(
                    "replicas serve weights this run has not published: CheckpointPublisher.start(model) "
                    "(or broadcast_weights) makes them load this run's"
                )
        return QueueTimeout("; ".join(parts))

    def _dead_letter_streams(self) -> str:
        """Where the dead letters are: one stream per partition."""
        return ", ".join(p.dead_letters for p in self.keys.parts)

    def _superseded(self, current: RunInfo | None) -> RunSuperseded:
        now = current.describe() if current else "no run (its record was deleted)"
        return RunSuperseded(
            f"namespace {self.keys.namespace!r} now belongs to {now}, not to this trainer's run "
            f"{self.run_id}: another trainer started a new run; stop this one"
        )

    async def _read(self, batch_size: int, block_ms: int) -> int:
        """One read (own pending entries first, then reclaimed ones, then new ones); returns entries read.
        Partitions are read one by one (in a Redis Cluster a multi-stream XREADGROUP must stay in one
        slot), starting with each in turn; when none has anything, one of them is waited on."""
        r, parts = self._r, self._rotation()
        if not self._own_pending_read:
            # our own unacked entries from a previous life of this consumer name
            n = 0
            for part in parts:
                resp = await self._call(r.xreadgroup(TRAINER_GROUP, self.consumer, {part.rollouts: "0"}))
                entries = resp[0][1] if resp else []
                await self._ingest(entries, part)
                n += len(entries)
            self._own_pending_read = True
            return max(1, n)  # the new entries are still to be read
        if time.monotonic() >= self._next_claim:
            self._next_claim = time.monotonic() + max(0.5, self.claim_idle_ms / 4000)
            n = 0
            for part in parts:
                _, claimed, *_ = await self._call(
                    r.xautoclaim(
                        part.rollouts, TRAINER_GROUP, self.consumer, self.claim_idle_ms, "0-0", count=256
                    )
                )
                claimed = [e for e in claimed if e is not None]
                if claimed:
                    self.stats.reclaimed += len(claimed)
                    await self._ingest(claimed, part)
                    n += len(claimed)
            if n:
                return n
        n = 0
        if len(parts) > 1:  # a sweep that does not wait
            for part in parts:
                n += await self._read_new(part, 2 * batch_size, None)
        if not n:
            wait = block_ms if len(parts) == 1 else min(block_ms, SWEEP_BLOCK_MS)
            n = await self._read_new(parts[0], 2 * batch_size, wait)
        return n

    async def _read_new(self, part: PartitionKeys, count: int, block_ms: int | None) -> int:
        """Entries never delivered before, of one partition; returns how many were read."""
        resp = await self._call(
            self._r.xreadgroup(
                TRAINER_GROUP, self.consumer, {part.rollouts: ">"}, count=count, block=block_ms
            )
        )
        entries = resp[0][1] if resp else []
        await self._ingest(entries, part)
        return len(entries)

    async def _ingest(self, entries: list, part: PartitionKeys) -> None:
        """Entries read from `part`'s rollout stream: admit, batch, or set aside each one."""
        fresh: list[Entry] = []
        for raw_id, fields in entries:
            if not fields:  # deleted while pending
                await self._call(self._r.xack(part.rollouts, TRAINER_GROUP, raw_id))
                continue
            entry_id = self._entry(part.index, raw_id)
            if F_RECORD in fields:
                rec = await self._admit(entry_id, fields)
                if rec is not None:
                    fresh.append((entry_id, rec))
            elif F_JOB_ERROR in fields:
                await self._job_failed(entry_id, fields)
            else:
                await self._dead_letter(entry_id, fields, f"unknown fields {sorted(fields)}", "invalid")
        self._report_refused()
        if not fresh:
            return
        flags = await self._call(self._r.zmscore(part.done, [rec.rollout_id for _, rec in fresh]))
        now = time.monotonic()
        for (entry_id, rec), ack_time in zip(fresh, flags, strict=True):
            verdict = self._batcher.offer(
                entry_id, rec, acked=ack_time is not None, drop=self._drops(rec), now=now
            )
            if verdict == "duplicate":
                self.stats.duplicates += 1
                await self._finish([entry_id])
            elif verdict == "expired":
                reason = (
                    f"a late sample of group {group_key(rec)}, which was closed incomplete "
                    "(it expired, or another of its samples was refused)"
                )
                await self._dead_letter(entry_id, {F_RECORD: wire.encode_record(rec)}, reason, None)
                await self._consumed(rec.job_id, 1)
            elif verdict in ("kept", "drop"):
                self.stats.received += 1
                if verdict == "drop":
                    key = group_key(rec)
                    await self._drop(key, self._batcher.drop(key, [(entry_id, rec)]))

    async def _admit(self, entry_id: bytes, fields: dict) -> RolloutRecord | None:
        """The decoded record if this trainer may train on it; otherwise it is dead-lettered (None)."""
        try:
            rec = wire.decode_record(fields[F_RECORD])
        except wire.WireError as e:
            await self._dead_letter(entry_id, fields, str(e), "invalid")
            return None
        why = refusal(rec, run_id=self.run_id, policy_version=self.policy_version)
        if why is None:
            return rec
        kind, reason = why
        if kind == "foreign_run" and rec.run_id and rec.run_id not in self._old_runs:
            # Another run's record: an older run's leftover, unless that run has replaced ours.
            current = await self._call(read_run(self._r, self.keys))
            if current is None or current.run_id != self.run_id:
                raise self._superseded(current)  # the entry stays pending for the new run's trainer
            self._old_runs.add(rec.run_id)
        await self._dead_letter(entry_id, fields, reason, kind)
        await self._consumed(rec.job_id, 1)
        if rec.group_size > 1:  # the rest of its group can never be whole: set it aside now, not at expiry
            key = group_key(rec)
            for other_id, other in self._batcher.close(key):
                why = f"another sample of group {key} was refused: {reason}"
                await self._dead_letter(
                    other_id, {F_RECORD: wire.encode_record(other)}, why, None, warn=False
                )
                await self._consumed(other.job_id, 1)
        return None

    def _report_refused(self) -> None:
        """One warning per read for the records refused in it (a new run may refuse thousands)."""
        new = self._refused - self._reported
        if new:
            log.warning(
                "namespace %r, run %s at version %d: dead-lettered %s (reasons in %s)",
                self.keys.namespace,
                self.run_id,
                self.policy_version,
                dict(new),
                self._dead_letter_streams(),
            )
            self._reported = Counter(self._refused)

    async def _expire_groups(self) -> None:
        """Dead-letter the groups still incomplete group_timeout_s after their first record arrived."""
        for key, entries in self._batcher.expire(time.monotonic(), self.group_timeout_s).items():
            size = entries[0][1].group_size
            reason = (
                f"group {key} incomplete: {len(entries)} of {size} samples after {self.group_timeout_s:g} s"
            )
            log.warning("namespace %r: %s; dead-lettered", self.keys.namespace, reason)
            for entry_id, rec in entries:
                await self._dead_letter(
                    entry_id, {F_RECORD: wire.encode_record(rec)}, reason, None, warn=False
                )
            self.stats.expired_groups += 1
            await self._consumed(entries[0][1].job_id, self._flight.expected(entries[0][1].job_id))

    async def _drop(self, job_id: str, entry_ids: list[bytes]) -> None:
        """Stale records: ack and delete them untrained, and free their room."""
        await self._finish(entry_ids)
        self.stats.dropped_stale += len(entry_ids)
        await self._consumed(job_id, len(entry_ids))

    async def _finish(self, entry_ids: list[bytes]) -> None:
        for part, ids in self._by_partition(entry_ids).items():  # a transaction stays in one slot
            pipe = transaction(self._r)
            ack_and_delete(pipe, part.rollouts, TRAINER_GROUP, *ids)
            await self._call(pipe.execute())

    async def _dead_letter(
        self,
        entry_id: bytes,
        fields: dict,
        reason: str,
        kind: RefusalKind | None,
        *,
        warn: bool | None = None,
    ) -> None:
        part, raw_id = self._split(entry_id)
        await self._call(
            dead_letter(
                self._r,
                part,
                part.rollouts,
                TRAINER_GROUP,
                raw_id,
                fields,
                reason,
                warn=kind == "invalid" if warn is None else warn,  # the others are reported per read
            )
        )
        self.stats.dead_lettered += 1
        if kind is not None:
            setattr(self.stats, kind, getattr(self.stats, kind) + 1)
            self._refused[kind] += 1

    async def _job_failed(self, entry_id: bytes, fields: dict) -> None:
        try:
            job = wire.decode_job(fields[F_JOB_ERROR])
        except wire.WireError:  # a broken failure notice is itself dead-lettered
            await self._dead_letter(entry_id, fields, "undecodable job_error", "invalid")
            return
        reason = fields.get(F_REASON, b"").decode(errors="replace")
        log.warning("job %s failed on a replica: %s", job.job_id, reason)
        self.stats.failed_jobs += 1
        await self._finish([entry_id])
        await self._consumed(job.job_id, self._flight.expected(job.job_id))

    async def ack(self, batch: Sequence[RolloutRecord]) -> None:
        """Confirm a trained batch: XACK + XDEL and the `done` markers, in one transaction per
        partition. Records already acked are skipped; the acked rollouts free their in-flight room."""
        ids, per_job = [], {}
        rollouts: dict[PartitionKeys, list[str]] = {}
        for rec in batch:
            entry_id = self._batcher.entry_of(rec.rollout_id)
            if entry_id is None:
                continue  # already acked
            ids.append(entry_id)
            rollouts.setdefault(self._split(entry_id)[0], []).append(rec.rollout_id)
            per_job[rec.job_id] = per_job.get(rec.job_id, 0) + 1
        if not ids:
            return
        now = time.time()
        for part, entry_ids in self._by_partition(ids).items():  # a transaction stays in one slot
            pipe = transaction(self._r)
            ack_and_delete(pipe, part.rollouts, TRAINER_GROUP, *entry_ids)
            pipe.zadd(part.done, dict.fromkeys(rollouts[part], now))
            pipe.zremrangebyscore(part.done, "-inf", now - self.done_ttl_ms / 1000)  # forget old acks
            await self._call(pipe.execute())
        self._batcher.acked(batch)
        self.stats.acked += len(ids)
        for job_id, count in per_job.items():
            await self._consumed(job_id, count)

    # ---- replicas and weights (replicas.py) ------------------------------------------------------

    async def replicas(self) -> list[ReplicaInfo]:
        """Live replicas of this namespace: those whose heartbeat key has not expired."""
        await self._connect()
        return await self._call(live_replicas(self._r, self.keys))

    async def replica_weights(self, timeout: float = 10.0) -> dict[str, ReplicaWeights | str]:
        """What each live replica serves now, asked over gRPC (GetInfo): {replica_id: ReplicaWeights(run_id,
        version) | "<error>"}."""
        return await replica_weights(await self.replicas(), timeout=timeout, token=self.token, **self._tls)

    async def broadcast_weights(
        self, version: int, checkpoint_dir: str, timeout: float = 120.0
    ) -> dict[str, str]:
        """Publish `version` of this run: record it (with `checkpoint_dir`) as the run's latest, make it
        the trainer's policy version, then UpdateWeights on every live replica concurrently, each
        bounded by `timeout`. Returns {replica_id: "ok" | "unchanged" | error} and logs the replicas left
        behind; raises BroadcastError when no live replica loaded it (none alive included),
        RunSuperseded when another trainer started a new run, ValueError when `version` does not move
        the run forward (0 may be published while the run is at 0: its starting weights)."""
        await self.record_version(version, str(checkpoint_dir))
        return await self._load_everywhere(version, str(checkpoint_dir), timeout, skip_current=version == 0)

    async def record_version(self, version: int, record: str) -> None:
        """Record `version` as the run's latest, `record` saying where a replica that joins later gets it
        (a checkpoint directory, "stream", "collective": docs/records.md "Runs"), and make it the
        trainer's policy version. Every publisher calls it before the replicas load the version: their
        records must not be "future". Raises as `broadcast_weights`."""
        await self.open()
        await self._call(advance(self._r, self.keys, self.run_id, version, record))
        self._run = replace(self.run, version=int(version), checkpoint=record, updated_at=time.time())
        self.set_policy_version(version)

    async def sync_replicas(self, timeout: float = 120.0) -> dict[str, str]:
        """Make every live replica serve this run's current version (after a resume, or when replicas
        joined or were restarted): those already serving it are left alone ("unchanged"), the others
        load the run's recorded checkpoint — a replica serving another run reloads. Raises BroadcastError
        when no live replica serves it afterwards; ValueError when the run has published nothing yet."""
        await self.open()
        run = self.run
        if not run.checkpoint:
            raise ValueError(
                f"run {run.run_id} has published no weights yet (version {run.version}, no checkpoint): "
                "publish its starting weights first (CheckpointPublisher.start(model))"
            )
        return await self._load_everywhere(run.version, run.checkpoint, timeout, skip_current=True)

    async def push_weights(
        self,
        version: int,
        manifest: WeightsManifest,
        chunks: Callable[[], Iterable[tuple[int, int, bytes | memoryview]]],
        timeout: float = 120.0,
        *,
        record: str | None = "stream",
    ) -> dict[str, str]:
        """Publish `version` with the tensors in the call (PushWeights: no shared filesystem), to every
        live replica concurrently, each bounded by `timeout`; `chunks()` yields (tensor index, offset,
        bytes) in `manifest` order and is called once per replica. `record` is what the run record's
        `checkpoint` says (how a replica that joins later gets this version, docs/records.md "Runs").
        record=None re-sends the run's current version to the live replicas that do not serve it (joined
        or restarted since) and records nothing; it raises nothing when every replica is current.
        Results and errors as `broadcast_weights`."""
        await self.open()
        if record is not None:
            await self.record_version(version, record)
        manifest = replace(manifest, version=int(version), run_id=self.run_id)

        async def send(reps: list[ReplicaInfo]) -> dict[str, str]:
            return await _push_weights(reps, manifest, chunks, timeout=timeout, token=self.token, **self._tls)

        if record is None:
            return await self._load_everywhere(version, "", timeout, skip_current=True, send=send, quiet=True)
        return await self._load_everywhere(version, "", timeout, skip_current=version == 0, send=send)

    async def _load_everywhere(
        self,
        version: int,
        checkpoint_dir: str,
        timeout: float,
        *,
        skip_current: bool,
        send: Callable[[list[ReplicaInfo]], Awaitable[dict[str, str]]] | None = None,
        quiet: bool = False,
    ) -> dict[str, str]:
        """quiet: a catch-up (PushWeights of the current version): no live replica, or every one
        current, is not an error."""
        reps = await self.replicas()
        results: dict[str, str] = {}
        if skip_current:  # re-announcing a version: a replica serving it would refuse "not greater"
            serving = await replica_weights(reps, timeout=min(timeout, 10.0), token=self.token, **self._tls)
            current = {r for r, w in serving.items() if w == ReplicaWeights(self.run_id, version)}
            results = {r: "unchanged" for r in current}
            reps = [rep for rep in reps if rep.replica_id not in current]
        if send is not None:
            results.update(await send(reps))
        else:
            results.update(
                await _broadcast_weights(
                    reps,
                    version,
                    checkpoint_dir,
                    run_id=self.run_id,
                    timeout=timeout,
                    token=self.token,
                    **self._tls,
                )
            )
        failed = {r: e for r, e in results.items() if e not in ("ok", "unchanged")}
        if quiet and (not results or not failed):
            return dict(sorted(results.items()))
        if not results or len(failed) == len(results):
            raise BroadcastError(version, results, self.keys.namespace)
        if failed:
            log.warning("policy version %d of run %s: replicas behind: %s", version, self.run_id, failed)
        return dict(sorted(results.items()))


class RolloutQueue:
    """Synchronous facade over AsyncRolloutQueue: the same arguments and behaviour, each call run on a
    private event loop thread. The run is taken up when it is constructed (RunChoiceRequired /
    RunNotFound surface there). Use as a context manager or call close()."""

    def __init__(
        self,
        url: str,
        namespace: str = "default",
        *,
        run: RunMode | None = None,
        consumer: str | None = None,
        batch_size: int | None = None,
        max_staleness: int | None = None,
        stale_policy: StalePolicy = "drop",
        claim_idle_s: float = 60.0,
        group_timeout_s: float = 300.0,
        done_ttl_s: float = 7 * 86400,
        token: str | None = None,
        tls: bool = False,
        root_certs: bytes | None = None,
        retries: int = 10,
        partitions: int = 1,
    ) -> None:
        """See AsyncRolloutQueue for what each argument means; run="new" | "resume" | None above all."""
        kwargs = dict(
            run=run,
            consumer=consumer,
            batch_size=batch_size,
            max_staleness=max_staleness,
            stale_policy=stale_policy,
            claim_idle_s=claim_idle_s,
            group_timeout_s=group_timeout_s,
            done_ttl_s=done_ttl_s,
            token=token,
            tls=tls,
            root_certs=root_certs,
            retries=retries,
            partitions=partitions,
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
        q = AsyncRolloutQueue(url, namespace, **kwargs)
        try:
            return await q.open()
        except BaseException:
            await q.close()
            raise

    @property
    def stats(self) -> QueueStats:
        """Counters since this queue was created."""
        return self._q.stats

    @property
    def run(self) -> RunInfo:
        """The run this queue belongs to: id, last published version and its checkpoint."""
        return self._q.run

    @property
    def run_id(self) -> str:
        """This trainer's run id: stamped on every job submitted, required on every record trained on."""
        return self._q.run_id

    @property
    def namespace(self) -> str:
        """The namespace (key prefix maskroll:<namespace>:) of this queue."""
        return self._q.keys.namespace

    @property
    def policy_version(self) -> int:
        """The trainer's declared policy version (the run's at open, then broadcast_weights)."""
        return self._q.policy_version

    @property
    def max_in_flight(self) -> int | None:
        """(max_staleness + 1) × batch_size, or None while either is unset (no limit)."""
        return self._q.max_in_flight

    @property
    def in_flight(self) -> int:
        """Rollouts submitted by this queue and not yet acked, dropped, failed or cancelled."""
        return self._q.in_flight

    @property
    def consumer(self) -> str:
        """This trainer's consumer name in the rollout stream's group."""
        return self._q.consumer

    def room(self) -> int | None:
        """Rollouts that can be submitted now without blocking (None: no limit configured)."""
        return self._q.room()

    def set_policy_version(self, version: int) -> None:
        """The version the trainer is at now: staleness = this − a record's first-token version, and a
        record from a newer version is refused. broadcast_weights() sets it."""
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
        self,
        batch_size: int | None = None,
        max_staleness: int | None = None,
        timeout: float | None = None,
        *,
        at_least: int | None = None,
    ) -> list[RolloutRecord]:
        """The next batch of whole groups (≥ batch_size records; ≥ at_least, once, when given). Raises
        QueueTimeout after `timeout` s, RunSuperseded once another trainer started a new run; never for
        one bad record (it is dead-lettered). See AsyncRolloutQueue.next_batch."""
        return self._loop.run(self._q.next_batch(batch_size, max_staleness, timeout, at_least=at_least))

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

    def replica_weights(self, timeout: float = 10.0) -> dict[str, ReplicaWeights | str]:
        """What each live replica serves now (GetInfo): {replica_id: ReplicaWeights | error}."""
        return self._loop.run(self._q.replica_weights(timeout))

    def broadcast_weights(self, version: int, checkpoint_dir: str, timeout: float = 120.0) -> dict[str, str]:
        """Publish `version` of this run (recorded as the run's latest, then UpdateWeights on every live
        replica); {replica_id: "ok" | "unchanged" | error}. Raises BroadcastError when no live replica
        loaded it. See AsyncRolloutQueue.broadcast_weights."""
        return self._loop.run(self._q.broadcast_weights(version, checkpoint_dir, timeout))

    def record_version(self, version: int, record: str) -> None:
        """Record `version` as the run's latest (how a joining replica gets it: `record`) and make it the
        policy version, loading nothing. See AsyncRolloutQueue.record_version."""
        self._loop.run(self._q.record_version(version, record))

    def push_weights(
        self,
        version: int,
        manifest: WeightsManifest,
        chunks: Callable[[], Iterable[tuple[int, int, bytes | memoryview]]],
        timeout: float = 120.0,
        *,
        record: str | None = "stream",
    ) -> dict[str, str]:
        """Publish `version` with its tensors in the call (PushWeights) to every live replica; record=None
        re-sends the current version to replicas not serving it. See AsyncRolloutQueue.push_weights."""
        return self._loop.run(self._q.push_weights(version, manifest, chunks, timeout, record=record))

    def sync_replicas(self, timeout: float = 120.0) -> dict[str, str]:
        """Make every live replica serve this run's current version (those serving it are "unchanged").
        See AsyncRolloutQueue.sync_replicas."""
        return self._loop.run(self._q.sync_replicas(timeout))

    def cancel_pending_jobs(self) -> int:
        """Delete the submitted prompt jobs no replica has started yet; returns how many."""
        return self._loop.run(self._q.cancel_pending_jobs())

    def open(self) -> RolloutQueue:
        """Nothing to do: the sync queue is opened (run taken up) by its constructor."""
        return self

    def close(self, cancel_jobs: bool = False) -> None:
        """Close the Redis connection and the event loop thread; cancel_jobs: first cancel the
        submitted jobs no replica has started."""
        try:
            self._loop.run(self._q.close(cancel_jobs), timeout=30)
        finally:
            self._loop.close()

    def __enter__(self) -> RolloutQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
