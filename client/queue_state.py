"""What the parts of one `AsyncRolloutQueue` share: the connection, the keys, the settings, the counters,
the run — and with it the trainer's policy version — and the rollouts in flight.

The queue is made of parts that each own one concern and hold this one object: the run's lifecycle
(lifecycle.py), submitting jobs (submitter.py) and reading, refusing and acking records (reader.py).
None of them inherits from another; they read and change this state.

The trainer's policy version has one owner: `QueueState.run.version`. Opening the queue sets it to the
run's last published version, `record_version` (every publisher calls it) advances it together with the
run record in Redis, and `set_policy_version` declares it for a trainer that moves weights by other
means. The queue's `policy_version`, its `run.version`, every publisher's `version` and the framework
trainers read it from here.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass, replace
from typing import Literal, TypeVar

from maskroll.proto.redis_conn import call, open_redis
from maskroll.proto.run_record import RunInfo
from maskroll.proto.streams import StreamKeys

from .admission import InFlight, in_flight_limit

StalePolicy = Literal["drop", "keep"]
T = TypeVar("T")


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


def default_consumer() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class QueueState:
    """One queue's shared state (see the module docstring); the arguments are AsyncRolloutQueue's."""

    def __init__(
        self,
        url: str,
        namespace: str,
        *,
        partitions: int,
        consumer: str | None,
        batch_size: int | None,
        max_staleness: int | None,
        stale_policy: StalePolicy,
        token: str | None,
        tls: bool,
        root_certs: bytes | None,
        retries: int,
    ) -> None:
        if stale_policy not in ("drop", "keep"):
            raise ValueError(f"stale_policy={stale_policy!r}; expected 'drop' or 'keep'")
        self.url = url
        self.keys = StreamKeys(namespace, partitions)  # cluster=True once connect() has detected one
        self.consumer = consumer or default_consumer()
        self.batch_size = batch_size
        self.max_staleness = max_staleness
        self.stale_policy = stale_policy
        self.replica_auth = {"token": token, "tls": tls, "root_certs": root_certs}
        self.retries = retries
        self.r = None  # the Redis or RedisCluster client, made by connect()
        self.stats = QueueStats()
        self.run: RunInfo | None = None  # the run, once taken up; run.version is the policy version
        self.flight = InFlight()
        self.job_entries: dict[str, tuple[int, bytes]] = {}  # job_id -> (partition, prompt entry)
        self.reward_stage = False  # records go through the reward stage (AsyncRolloutQueue's docstring)

    async def connect(self) -> None:
        """Connect once, detecting a Redis Cluster (its keys then carry hash tags even with one partition)."""
        if self.r is None:
            self.r, cluster = await open_redis(self.url, retries=self.retries)
            self.keys = StreamKeys(self.keys.namespace, self.keys.partitions, cluster)

    async def call(self, aw: Awaitable[T]) -> T:
        """One Redis call under the connection policy (QueueUnavailable when Redis stays away)."""
        return await call(aw, self.url)

    # ---- the run and the policy version -----------------------------------------------------------

    def require_run(self) -> RunInfo:
        if self.run is None:
            raise RuntimeError("the queue is not open yet: `async with` it or `await q.open()` first")
        return self.run

    @property
    def policy_version(self) -> int:
        """The trainer's policy version: the run's (0 until the queue is open)."""
        return 0 if self.run is None else self.run.version

    def set_version(self, version: int, **recorded: object) -> None:
        """Make `version` the policy version; `recorded`: the run record's fields that changed with it
        (checkpoint, updated_at) when it was recorded in Redis."""
        self.run = replace(self.require_run(), version=int(version), **recorded)

    # ---- admission ------------------------------------------------------------------------------

    @property
    def max_in_flight(self) -> int | None:
        """(max_staleness + 1) × batch_size, or None while either is unset (no limit)."""
        return in_flight_limit(self.batch_size, self.max_staleness)

    async def consumed(self, job_id: str, count: int) -> None:
        """`count` rollouts of `job_id` left the queue (acked, dropped, failed, expired, cancelled)."""
        await self.flight.consumed(job_id, count)
        if not self.flight.expected(job_id):
            self.job_entries.pop(job_id, None)
