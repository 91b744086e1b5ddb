"""Where a framework adapter's rollouts come from: the Redis queue (pull-mode replicas) or direct gRPC.

Both sources speak in *jobs* (one prompt, `n` samples, the framework's rows that go with it) and
*groups* (a job's finished records, ordered by sample index), and share the queue's admission rule
(`maskroll.client.admission.in_flight_limit`: at most (max_staleness + 1) × batch_size rollouts in
flight), so a trainer that submits ahead of its optimiser steps never runs further ahead than the
staleness bound allows. A group the queue's staleness rule (`maskroll.client.batching.too_stale`)
refuses when it is taken is not trained on: it is confirmed (acked) and its prompt submitted again, so
no prompt is lost and none is trained stale.

- `QueueSource`: `RolloutQueue` submit / next_batch / ack; replicas pull jobs, any number of them. Its
  consumer name is stable (`<namespace>-rank0`), so a restarted trainer gets its unacked records back at
  once; those a published version already trained on (`skip_trained`, from the ledger beside the
  checkpoints) are acked untrained, those of jobs it did not submit (no rows to train them with: a
  previous life's read-ahead) dropped as foreign — their prompts are the dataset's, read again.
- `GrpcSource`: no Redis — each job is one `Generate` call to a replica (round robin), on a thread pool.

Knows nothing of TRL or verl: `integrations/trl.py` drives it. What a weight publisher publishes through
is `source.broadcaster`: the queue itself, or (no queue) a fleet of the fixed addresses — UpdateWeights
on each, and the policy version, which then has no run to live in.
"""

from __future__ import annotations

import collections
import itertools
import logging
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from maskroll.client import QueueTimeout, RolloutQueue, RolloutRecord, SamplingOptions, SyncRolloutClient
from maskroll.client.admission import in_flight_limit
from maskroll.client.batching import too_stale
from maskroll.client.ranks import REFILL_S
from maskroll.client.replicas import replicas_elsewhere
from maskroll.client.runs import RunMode

log = logging.getLogger("maskroll.integrations")

Group = list[RolloutRecord]  # one job's records, by sample index


@dataclass
class Job:
    """One prompt to sample `n` times, with the framework's rows (one per sample) kept trainer-side."""

    prompt_ids: list[int]
    rows: list[Any]  # [n] whatever the framework needs back with the completions (TRL: dataset rows)
    job_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def n(self) -> int:
        return len(self.rows)


class GenerationError(RuntimeError):
    """Rollouts cannot arrive: a replica rejected a job, or none came within the timeout."""


@dataclass
class SourceStats:
    """Counters since the source was opened (groups unless the name says otherwise)."""

    submitted: int = 0
    taken: int = 0
    stale_resubmitted: int = 0
    foreign_dropped: int = 0  # records of jobs this trainer did not submit (a previous run's leftovers)
    trained_skipped: int = 0  # records a published version already trained on (skip_trained), acked


def _groups(records: Sequence[RolloutRecord]) -> list[Group]:
    """Records of whole groups → one list per job, jobs in arrival order, each by sample index."""
    by_job: dict[str, Group] = {}
    for rec in records:
        by_job.setdefault(rec.job_id, []).append(rec)
    return [sorted(g, key=lambda r: r.sample_index) for g in by_job.values()]


class _Source:
    """What both sources share: the job ledger, admission, the staleness rule."""

    def __init__(self, *, batch_size: int, max_staleness: int, options: SamplingOptions, timeout: float):
        self.batch_size, self.max_staleness = batch_size, max_staleness
        self.options, self.timeout = options, timeout
        self.jobs: dict[str, Job] = {}  # submitted, not yet done
        self.stats = SourceStats()
        self._ready: collections.deque[Group] = collections.deque()  # taken from the wire, not yet handed out
        self._skip: set[str] = set()  # rollout ids a published version trained on (skip_trained)

    @property
    def limit(self) -> int:
        """Rollouts in flight at most: the queue's admission rule."""
        return in_flight_limit(self.batch_size, self.max_staleness)

    def _options(self, job: Job) -> SamplingOptions:
        return replace(self.options, n=job.n)

    def skip_trained(self, rollout_ids: Iterable[str]) -> None:
        """Records with these ids were trained on by a version the run has already published (a trainer
        killed between publishing and acking them, `weight_sync.read_trained`): when they come back
        they are acked untrained (`stats.trained_skipped`), never handed out."""
        self._skip.update(rollout_ids)

    def take(
        self, count: int, version: int, refill: Callable[[], object] | None = None
    ) -> list[tuple[Group, Job]]:
        """Whole groups totalling `count` records, none more than max_staleness versions old, with jobs.
        refill: called every REFILL_S while no records arrive (the trainer's top-up of prompt jobs, as
        `RankedQueue.next_batch(refill=)`): room freed meanwhile — records dropped as stale, a previous
        life's jobs read first — is filled only by a new submit."""
        out, have = [], 0
        deadline = time.monotonic() + self.timeout
        while have < count:
            if not self._ready:
                # Ask only for what is missing: the groups already held may leave fewer jobs in flight
                # than a whole batch (e.g. after a stale group was resubmitted), and waiting for more
                # than can come would wait forever.
                self._ready.extend(self._receive(deadline, count - have, refill))
                continue
            group = self._ready.popleft()
            done = {r.rollout_id for r in group} & self._skip
            if done:  # in a published version already (a restart between publish and ack): not twice
                self._confirm([r for r in group if r.rollout_id in done])
                self._skip -= done
                self.stats.trained_skipped += len(done)
                log.warning("acked %d records a published version already trained on, untrained", len(done))
                group = [r for r in group if r.rollout_id not in done]  # a trained batch was whole groups
                if not group:
                    continue
            job = self.jobs.get(group[0].job_id)
            if job is None:
                self.stats.foreign_dropped += len(group)
                self._confirm(group)
                continue
            if too_stale(group, version, self.max_staleness):
                # Confirm the stale copy first: that frees the room the resubmitted job takes.
                self._confirm(group)
                del self.jobs[job.job_id]
                self.stats.stale_resubmitted += 1
                self.submit(Job(job.prompt_ids, job.rows))
                continue
            out.append((group, job))
            have += len(group)
        if have != count:
            raise GenerationError(f"groups of {[len(g) for g, _ in out]} records do not add up to {count}")
        self.stats.taken += len(out)
        return out

    def done(self, groups: Sequence[Group]) -> None:
        """The optimiser steps that used these groups are over: confirm them and free their room."""
        for g in groups:
            self.jobs.pop(g[0].job_id, None)
        self._confirm([r for g in groups for r in g])

    # per transport
    def room(self) -> int: ...
    def submit(self, job: Job) -> None: ...
    def _receive(
        self, deadline: float, need: int, refill: Callable[[], object] | None = None
    ) -> list[Group]: ...
    def _confirm(self, records: Sequence[RolloutRecord]) -> None: ...
    def generate_now(self, prompt_ids: Sequence[int], n: int) -> Group: ...
    def close(self) -> None: ...


class QueueSource(_Source):
    """Jobs on the namespace's prompt stream; records from its rollout stream, acked when done."""

    def __init__(
        self,
        url: str,
        namespace: str,
        *,
        batch_size: int,
        max_staleness: int,
        options: SamplingOptions,
        timeout: float = 600.0,
        token: str | None = None,
        root_certs: bytes | None = None,
        run: RunMode | None = None,
        partitions: int = 1,
        reward_stage: bool = False,
        consumer: str | None = None,
    ) -> None:
        super().__init__(batch_size=batch_size, max_staleness=max_staleness, options=options, timeout=timeout)
        # stale_policy "keep": the staleness rule is applied here, per group, so a stale group's prompt
        # can be submitted again (the queue's "drop" would ack it and the prompt would be lost).
        # consumer: stable for the namespace (RankedQueue's rank-0 name), so a restarted trainer reads its
        # own unacked records back at once — those a published version trained on are then acked
        # (skip_trained) — instead of after claim_idle_s under a new host-and-pid name.
        self.queue = RolloutQueue(
            url,
            namespace,
            consumer=consumer or f"{namespace}-rank0",
            run=run,
            partitions=partitions,
            batch_size=batch_size,
            max_staleness=max_staleness,
            stale_policy="keep",
            token=token,
            tls=root_certs is not None,
            root_certs=root_certs,
            reward_stage=reward_stage,
        )
        self.broadcaster = self.queue  # CheckpointPublisher: UpdateWeights on every live replica
        self.namespace = namespace
        self._token, self._root_certs = token, root_certs
        self._failed_seen = 0

    def wait_for_replicas(self, count: int, timeout: float = 120.0, every: float = 10.0) -> None:
        """Until `count` replicas are registered; says at once and every `every` s what is missing and
        which namespaces on this Redis have replicas (a wrong namespace shows at once)."""
        start = told = time.monotonic()
        first = True
        while len(reps := self.queue.replicas()) < count:
            now = time.monotonic()
            if first or now - told >= every or now - start > timeout:
                elsewhere = replicas_elsewhere(self.namespace, self.queue.namespaces_with_replicas())
                missing = (
                    f"{len(reps)} of {count} replicas registered in namespace {self.namespace!r} after "
                    f"{now - start:.0f} s; {elsewhere}"
                )
                if now - start > timeout:
                    raise GenerationError(
                        f"{missing}: start `maskroll serve --pull` replicas on the same Redis and namespace"
                    )
                log.warning("waiting for replicas: %s", missing)
                first, told = False, now
            time.sleep(0.2)

    def room(self) -> int:
        return self.queue.room() or 0

    def submit(self, job: Job) -> None:
        # the row's scalar columns (a reference answer, tests) reach a reward stage as the job's metadata
        # (rows are the framework's own: only a mapping, e.g. a TRL dataset row, has columns to send)
        row = job.rows[0] if job.rows else None
        scalars = row.items() if isinstance(row, Mapping) else ()
        meta = {k: str(v) for k, v in scalars if k != "prompt" and isinstance(v, (str, int, float))}
        self.queue.submit(
            job.prompt_ids, self._options(job), job_id=job.job_id, group_id=job.job_id, metadata=meta
        )
        self.jobs[job.job_id] = job
        self.stats.submitted += 1

    def _receive(self, deadline: float, need: int, refill: Callable[[], object] | None = None) -> list[Group]:
        """Whole groups adding up to at least `need` records (a queue batch holds ≥ need); refill()
        after every REFILL_S without them."""
        while True:
            failed = self.queue.stats.failed_jobs
            if failed > self._failed_seen:
                self._failed_seen = failed
                raise GenerationError(
                    f"{failed} prompt job(s) were rejected by a replica (its log and the warning above say "
                    "why, e.g. a prompt longer than the replica's max_model_len)"
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise GenerationError(
                    f"no rollouts within {self.timeout:.0f} s ({len(self.queue.replicas())} live replicas, "
                    f"{self.queue.in_flight} rollouts in flight)"
                )
            try:  # short waits, so a rejected job is reported promptly instead of at the deadline
                batch = self.queue.next_batch(
                    self.batch_size, timeout=min(remaining, REFILL_S), at_least=min(need, self.batch_size)
                )
                return _groups(batch)
            except QueueTimeout:
                if refill is not None:
                    refill()

    def _confirm(self, records: Sequence[RolloutRecord]) -> None:
        self.queue.ack(records)

    def generate_now(self, prompt_ids: Sequence[int], n: int) -> Group:
        """n samples of one prompt from the first live replica, over gRPC (evaluation: not queued)."""
        reps = self.queue.replicas()
        if not reps:
            raise GenerationError("no live replica to evaluate on")
        with SyncRolloutClient(reps[0].address, token=self._token, root_certs=self._root_certs) as c:
            return c.generate_records(list(prompt_ids), replace(self.options, n=n))

    def close(self) -> None:
        # Jobs read ahead that no replica has started will never be trained on: take them back.
        self.queue.close(cancel_jobs=True)


class _GrpcBroadcaster:
    """A fixed list of replicas as a weight publisher's fleet (`maskroll.weight_sync.directory.Fleet`):
    UpdateWeights on each, and the policy version. With no queue there is no run to hold the version,
    so this object owns it: it starts where the caller says (the replicas' own, GrpcSource's
    replica_version) and each broadcast advances it."""

    def __init__(self, clients: dict[str, SyncRolloutClient]) -> None:
        self.clients = clients
        self.version = 0

    def broadcast_weights(self, version: int, checkpoint_dir: str, timeout: float = 120.0) -> dict[str, str]:
        self.version = int(version)
        results = {}
        for address, c in self.clients.items():
            try:
                c.update_weights(version, checkpoint_dir, timeout=timeout)
                results[address] = "ok"
            except Exception as e:  # reported per replica; CheckpointPublisher decides whether to raise
                results[address] = f"{type(e).__name__}: {e}"
        return results


class GrpcSource(_Source):
    """No Redis: each job is one streaming Generate call to the next replica, on a thread pool."""

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        batch_size: int,
        max_staleness: int,
        options: SamplingOptions,
        timeout: float = 600.0,
        token: str | None = None,
        root_certs: bytes | None = None,
        workers: int = 16,
    ) -> None:
        if not addresses:
            raise ValueError("GrpcSource needs at least one replica address (host:port)")
        super().__init__(batch_size=batch_size, max_staleness=max_staleness, options=options, timeout=timeout)
        auth = {"token": token, "tls": root_certs is not None, "root_certs": root_certs}
        self.clients = {a: SyncRolloutClient(a, **auth) for a in addresses}
        self.broadcaster = _GrpcBroadcaster(self.clients)
        self._next_client = itertools.cycle(list(self.clients.values()))
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="maskroll-generate")
        self._futures: collections.deque[Future] = collections.deque()  # in submission order
        self._in_flight = 0

    def room(self) -> int:
        return max(0, self.limit - self._in_flight)

    def replica_version(self) -> int:
        """The newest policy version the replicas report (GetInfo)."""
        return max(c.info().policy_version for c in self.clients.values())

    def submit(self, job: Job) -> None:
        client = next(self._next_client)
        self._futures.append(
            self._pool.submit(
                client.generate_records,
                job.prompt_ids,
                self._options(job),
                job_id=job.job_id,
                group_id=job.job_id,
            )
        )
        self.jobs[job.job_id] = job
        self._in_flight += job.n
        self.stats.submitted += 1

    def _receive(self, deadline: float, need: int, refill: Callable[[], object] | None = None) -> list[Group]:
        """The oldest submitted job's group (one group per call, whatever `need` is; no refill: every
        job submitted here is in flight until its call returns)."""
        if not self._futures:
            raise GenerationError("nothing was submitted: no rollouts can arrive")
        fut = self._futures.popleft()
        try:
            return [fut.result(timeout=max(0.0, deadline - time.monotonic()))]
        except TimeoutError:
            raise GenerationError(f"no rollouts within {self.timeout:.0f} s") from None

    def _confirm(self, records: Sequence[RolloutRecord]) -> None:
        self._in_flight -= len(records)

    def generate_now(self, prompt_ids: Sequence[int], n: int) -> Group:
        return next(self._next_client).generate_records(list(prompt_ids), replace(self.options, n=n))

    def close(self) -> None:
        for f in self._futures:
            f.cancel()
        self._pool.shutdown(wait=True, cancel_futures=True)
        for c in self.clients.values():
            c.close()
