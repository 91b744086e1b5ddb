"""RolloutQueue: the trainer's side of the Redis Streams rollout queue (docs/architecture.md flows 2, 3, 6).

submit() puts prompt jobs on the prompt stream (replicas pull them); next_batch() / batches() read
finished records from the rollout stream through one consumer group, and ack() confirms them after the
optimiser step: at-least-once delivery, and a trainer that dies before acking leaves its records
pending for the next one (XAUTOCLAIM after `claim_idle_s`). Every record read is checked before it is
batched: one that does not decode, fails a semantic check, belongs to another run or comes from a
policy version this trainer has not reached is dead-lettered with the reason and counted — never
trained on, and never raised out of next_batch. A queue belongs to one training run (runs.py): opened
as a new run or resuming the namespace's current one, never silently both.

`AsyncRolloutQueue` is the implementation, composed of parts that share one `QueueState`
(queue_state.py: connection, keys, counters, the run and the trainer's policy version): the run's
lifecycle (lifecycle.py), submitting (submitter.py, admission.py), reading, refusing and acking
(reader.py, deadletters.py, batching.py). The sync `RolloutQueue` runs it on a private event loop
(`_sync.sync_facade`). Moving weights onto the replicas is `maskroll.weight_sync` (broadcast.py), which
takes the queue for its replica registry (`replicas()`), run and policy version (`record_version`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Coroutine, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np

from maskroll.proto.records import RolloutRecord, SamplingOptions
from maskroll.proto.redis_conn import QueueUnavailable
from maskroll.proto.streams import StreamKeys

from ._sync import sync_facade
from .admission import QueueFull
from .lifecycle import RunLifecycle
from .queue_state import QueueState, QueueStats, StalePolicy
from .reader import QueueTimeout, Reader
from .replicas import BroadcastError, ReplicaInfo, ReplicaWeights, live_replicas, namespaces_with_replicas
from .runs import RunChoiceRequired, RunInfo, RunMode, RunNotFound, RunSuperseded
from .submitter import Submitter

__all__ = [
    "AsyncRolloutQueue",
    "BroadcastError",
    "QueueFull",
    "QueueStats",
    "QueueTimeout",
    "QueueUnavailable",
    "ReplicaInfo",
    "ReplicaWeights",
    "RolloutQueue",
    "RunChoiceRequired",
    "RunInfo",
    "RunNotFound",
    "RunSuperseded",
    "StalePolicy",
]

T = TypeVar("T")


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
    is detected when the queue opens (docs/scaling.md "Redis Cluster"). reward_stage: the run is scored
    by a reward stage (`maskroll reward`, `maskroll serve --reward`; docs/rewards.md): jobs send their
    records through it (each partition's finished stream), every record read carries its reward, and a
    record without one is refused.
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
        reward_stage: bool = False,
    ) -> None:
        self._state = QueueState(
            url,
            namespace,
            partitions=partitions,
            consumer=consumer,
            batch_size=batch_size,
            max_staleness=max_staleness,
            stale_policy=stale_policy,
            token=token,
            tls=tls,
            root_certs=root_certs,
            retries=retries,
        )
        self._state.reward_stage = reward_stage
        self._lifecycle = RunLifecycle(self._state, run)
        self._reader = Reader(
            self._state,
            self.open,
            claim_idle_s=claim_idle_s,
            group_timeout_s=group_timeout_s,
            done_ttl_s=done_ttl_s,
        )
        self._submitter = Submitter(self._state, self.open)

    # ---- lifecycle and the run ------------------------------------------------------------------

    async def open(self) -> AsyncRolloutQueue:
        """Create the consumer groups and take up the run (new or resumed); `async with` and the first
        call do this too. Raises RunChoiceRequired / RunNotFound (see the class docstring)."""
        await self._lifecycle.open()
        return self

    async def close(self, cancel_jobs: bool = False) -> None:
        """Close the Redis connection; unacked records stay pending for this consumer name.
        cancel_jobs: first cancel the submitted jobs no replica has started (cancel_pending_jobs)."""
        await self._lifecycle.close(cancel_jobs)

    async def __aenter__(self) -> AsyncRolloutQueue:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def run(self) -> RunInfo:
        """The run this queue belongs to: id, version (the last published: the policy version, which
        set_policy_version may also move) and the checkpoint of the last one recorded."""
        return self._state.require_run()

    @property
    def run_id(self) -> str:
        """This trainer's run id: stamped on every job submitted, required on every record trained on."""
        return self.run.run_id

    @property
    def policy_version(self) -> int:
        """The trainer's policy version: the run's (its last published version, `run.version`), moved
        by record_version (every publisher) or set_policy_version; 0 until the queue is open."""
        return self._state.policy_version

    def set_policy_version(self, version: int) -> None:
        """The version the trainer is at now: staleness = this − a record's first-token version, and a
        record from a newer version is refused. Publishing a version sets it (record_version); call this
        only if your trainer moves weights to the replicas by other means (nothing is recorded in Redis)."""
        self._state.set_version(version)

    async def record_version(self, version: int, record: str) -> None:
        """Record `version` as the run's latest, `record` saying where a replica that joins later gets it
        (a checkpoint directory, "stream", "collective": docs/records.md "Runs"), and make it the
        trainer's policy version. Every publisher calls it before the replicas load the version: their
        records must not be "future". Raises RunSuperseded when another trainer started a new run,
        ValueError when `version` does not move the run forward (0 may be published while the run is at
        0: its starting weights)."""
        await self._lifecycle.record_version(version, record)

    async def cancel_pending_jobs(self) -> int:
        """Delete the prompt jobs this queue submitted that no replica has started yet, and free their
        in-flight room; returns how many. Started jobs run on (their records arrive as usual)."""
        return await self._lifecycle.cancel_pending_jobs()

    async def replicas(self) -> list[ReplicaInfo]:
        """Live replicas of this namespace: those whose heartbeat key has not expired."""
        await self._state.connect()
        return await self._state.call(live_replicas(self._state.r, self._state.keys))

    async def namespaces_with_replicas(self) -> dict[str, int]:
        """{namespace: live replicas} over every namespace on this Redis (a bounded scan of the
        heartbeat keys): where the replicas are when this namespace has none."""
        await self._state.connect()
        return await self._state.call(namespaces_with_replicas(self._state.r))

    # ---- settings and counters ------------------------------------------------------------------

    @property
    def url(self) -> str:
        return self._state.url

    @property
    def keys(self) -> StreamKeys:
        """The namespace's Redis keys (cluster hash tags once open() has detected a Redis Cluster)."""
        return self._state.keys

    @property
    def namespace(self) -> str:
        """The namespace (key prefix maskroll:<namespace>:) of this queue."""
        return self._state.keys.namespace

    @property
    def consumer(self) -> str:
        """This trainer's consumer name in the rollout stream's group."""
        return self._state.consumer

    @property
    def batch_size(self) -> int | None:
        """next_batch()'s default batch size (the last one given)."""
        return self._state.batch_size

    @property
    def max_staleness(self) -> int | None:
        """The staleness bound (the last one given)."""
        return self._state.max_staleness

    @property
    def stale_policy(self) -> StalePolicy:
        return self._state.stale_policy

    @property
    def token(self) -> str | None:
        """The replicas' bearer token."""
        return self._state.replica_auth["token"]

    @property
    def replica_auth(self) -> dict[str, Any]:
        """How the replicas' gRPC is reached: RolloutClient's token, tls and root_certs arguments."""
        return dict(self._state.replica_auth)

    @property
    def stats(self) -> QueueStats:
        """Counters since this queue was created."""
        return self._state.stats

    # ---- admission control and submission ------------------------------------------------------

    @property
    def max_in_flight(self) -> int | None:
        """(max_staleness + 1) × batch_size, or None while either is unset (no limit)."""
        return self._state.max_in_flight

    @property
    def in_flight(self) -> int:
        """Rollouts submitted by this queue and not yet acked, dropped, failed or cancelled."""
        return self._state.flight.count

    def room(self) -> int | None:
        """Rollouts that can be submitted now without blocking (None: no limit configured)."""
        return self._submitter.room()

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
        return await self._submitter.submit(
            prompt_ids,
            options,
            n=n,
            group_id=group_id,
            metadata=metadata,
            job_id=job_id,
            timeout=timeout,
            rollout_stream=rollout_stream,
        )

    # ---- consumption -----------------------------------------------------------------------------

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
        return await self._reader.next_batch(batch_size, max_staleness, timeout, at_least)

    async def batches(
        self, batch_size: int | None = None, max_staleness: int | None = None, timeout: float | None = None
    ) -> AsyncIterator[list[RolloutRecord]]:
        """next_batch() forever: `async for batch in q.batches(...)`; ack each one after training on it."""
        while True:
            yield await self.next_batch(batch_size, max_staleness, timeout)

    async def ack(self, batch: Sequence[RolloutRecord]) -> None:
        """Confirm a trained batch: XACK + XDEL and the `done` markers, in one transaction per
        partition. Records already acked are skipped; the acked rollouts free their in-flight room."""
        await self._reader.ack(batch)


@sync_facade(
    AsyncRolloutQueue,
    methods=[
        "submit",
        "next_batch",
        "ack",
        "room",
        "set_policy_version",
        "record_version",
        "replicas",
        "namespaces_with_replicas",
        "cancel_pending_jobs",
    ],
    properties=[
        "stats",
        "run",
        "run_id",
        "namespace",
        "policy_version",
        "max_in_flight",
        "in_flight",
        "consumer",
        "replica_auth",
    ],
    init_doc='See AsyncRolloutQueue for what each argument means; run="new" | "resume" | None above all. '
    "The run is taken up here (RunChoiceRequired / RunNotFound surface from the constructor).",
    thread_name="maskroll-queue",
    open=AsyncRolloutQueue.open,
)
class RolloutQueue:
    """Synchronous facade over AsyncRolloutQueue: the same arguments and behaviour, each call run on a
    private event loop thread. The run is taken up when it is constructed (RunChoiceRequired /
    RunNotFound surface there). Use as a context manager or call close()."""

    _core: AsyncRolloutQueue

    def batches(
        self, batch_size: int | None = None, max_staleness: int | None = None, timeout: float | None = None
    ) -> Iterator[list[RolloutRecord]]:
        """next_batch() forever: `for batch in q.batches(...)`; ack each one after training on it."""
        while True:
            yield self.next_batch(batch_size, max_staleness, timeout)

    @property
    def aio(self) -> AsyncRolloutQueue:
        """The AsyncRolloutQueue this facade runs; use it only through `run_on_loop`."""
        return self._core

    def run_on_loop(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coro` (a call on `aio`) on this queue's event loop thread and wait for its result: how a
        module above the SDK (maskroll.weight_sync) adds blocking calls that share the queue's connection."""
        return self._loop.run(coro, timeout)

    def open(self) -> RolloutQueue:
        """Nothing to do: the sync queue is opened (run taken up) by its constructor."""
        return self

    @property
    def closed(self) -> bool:
        """close() was called: nothing runs on the queue's loop any more."""
        return self._loop.loop.is_closed()

    def close(self, cancel_jobs: bool = False) -> None:
        """Close the Redis connection and the event loop thread; cancel_jobs: first cancel the
        submitted jobs no replica has started."""
        try:
            self._loop.run(self._core.close(cancel_jobs), timeout=30)
        finally:
            self._loop.close()

    def __enter__(self) -> RolloutQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
