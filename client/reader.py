"""Reading the rollout streams: batches of whole groups, records set aside, acks (architecture.md flow 3).

next_batch() reads finished records through one consumer group — this consumer's own unacked entries
first (a restarted trainer), then entries another trainer left unacked past `claim_idle_s`
(XAUTOCLAIM), then new ones — and ack() confirms them after the optimiser step: at-least-once
delivery. Every record read is checked before it is batched: one that does not decode, fails a
semantic check, belongs to another run or comes from a policy version this trainer has not reached is
dead-lettered with the reason and counted (deadletters.py) — never trained on, and never raised out of
next_batch. What to batch and what is stale is batching.py's (pure); this module makes the Redis calls.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence

from maskroll.proto import wire
from maskroll.proto.records import RolloutRecord
from maskroll.proto.redis_conn import transaction
from maskroll.proto.run_record import read_run
from maskroll.proto.streams import (
    F_JOB_ERROR,
    F_REASON,
    F_RECORD,
    F_REWARD_FAILED,
    TRAINER_GROUP,
    PartitionKeys,
    ack_and_delete,
)

from .batching import Entry, GroupBatcher, group_key, refusal, too_stale
from .deadletters import DeadLetters, Handles
from .queue_state import QueueState
from .replicas import live_replicas, namespaces_with_replicas, replicas_elsewhere
from .runs import RunInfo, RunSuperseded

log = logging.getLogger("maskroll.queue")

# With several partitions, a read that found nothing on any of them waits on one (each in turn) this
# long at most, so a record arriving on another waits no longer than this to be read.
SWEEP_BLOCK_MS = 50


class QueueTimeout(TimeoutError):
    """No complete batch arrived within the timeout (the message says what the queue saw meanwhile)."""


class Reader:
    """One queue's consumer side; `opened` opens the queue (once) before the first read."""

    def __init__(
        self,
        state: QueueState,
        opened: Callable[[], Awaitable[object]],
        *,
        claim_idle_s: float,
        group_timeout_s: float,
        done_ttl_s: float,
    ) -> None:
        if not group_timeout_s > 0:
            raise ValueError(f"group_timeout_s={group_timeout_s}; expected > 0")
        self.state, self._opened = state, opened
        self.claim_idle_ms = int(claim_idle_s * 1000)
        self.group_timeout_s = group_timeout_s
        self.done_ttl_ms = int(done_ttl_s * 1000)
        self.handles = Handles(state)
        self.dead = DeadLetters(state, self.handles)
        self._batcher = GroupBatcher()
        self._old_runs: set[str] = set()  # run ids confirmed not to be the namespace's current run
        self._own_pending_read = False
        self._next_claim = 0.0

    def drops(self, rec: RolloutRecord) -> bool:
        """With stale_policy "drop", the staleness rule (batching.too_stale) on one record."""
        s = self.state
        return s.stale_policy == "drop" and too_stale([rec], s.policy_version, s.max_staleness)

    # ---- batches ----------------------------------------------------------------------------------

    async def next_batch(
        self, batch_size: int | None, max_staleness: int | None, timeout: float | None, at_least: int | None
    ) -> list[RolloutRecord]:
        """AsyncRolloutQueue.next_batch (its docstring says what each argument means)."""
        s = self.state
        batch_size = batch_size or s.batch_size
        if not batch_size or batch_size < 1:
            raise ValueError("batch_size must be given (here or to the constructor) and >= 1")
        if at_least is not None and not 1 <= at_least <= batch_size:
            raise ValueError(f"at_least={at_least}; expected 1 <= at_least <= batch_size ({batch_size})")
        s.batch_size = batch_size
        wanted = at_least or batch_size
        if max_staleness is not None:
            s.max_staleness = max_staleness
        await self._opened()
        deadline = None if timeout is None else time.monotonic() + timeout
        refused_before = Counter(self.dead.refused)
        while True:
            batch, dropped = self._batcher.take(wanted, self.drops)
            for job_id, ids in dropped.items():
                await self._drop(job_id, ids)
            if batch:
                return batch
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise await self._timeout_error(wanted, timeout, self.dead.refused - refused_before)
            read = await self._read(
                batch_size, 1000 if remaining is None else max(1, min(1000, int(remaining * 1000)))
            )
            if not read:  # nothing more to read: an incomplete group now waits only for a re-run
                await self._expire_groups()

    async def ack(self, batch: Sequence[RolloutRecord]) -> None:
        """AsyncRolloutQueue.ack: XACK + XDEL and the `done` markers, one transaction per partition."""
        s = self.state
        ids, per_job = [], {}
        rollouts: dict[PartitionKeys, list[str]] = {}
        for rec in batch:
            entry_id = self._batcher.entry_of(rec.rollout_id)
            if entry_id is None:
                continue  # already acked
            ids.append(entry_id)
            rollouts.setdefault(self.handles.split(entry_id)[0], []).append(rec.rollout_id)
            per_job[rec.job_id] = per_job.get(rec.job_id, 0) + 1
        if not ids:
            return
        now = time.time()
        for part, entry_ids in self.handles.by_partition(ids).items():  # a transaction stays in one slot
            pipe = transaction(s.r)
            ack_and_delete(pipe, part.rollouts, TRAINER_GROUP, *entry_ids)
            pipe.zadd(part.done, dict.fromkeys(rollouts[part], now))
            pipe.zremrangebyscore(part.done, "-inf", now - self.done_ttl_ms / 1000)  # forget old acks
            await s.call(pipe.execute())
        self._batcher.acked(batch)
        s.stats.acked += len(ids)
        for job_id, count in per_job.items():
            await s.consumed(job_id, count)

    # ---- what a trainer is told -----------------------------------------------------------------

    async def _timeout_error(self, batch_size: int, timeout: float | None, refused: Counter) -> Exception:
        """What a trainer needs to know when no batch came: replicas alive, what was refused meanwhile."""
        s = self.state
        current = await s.call(read_run(s.r, s.keys))
        if current is None or current.run_id != s.require_run().run_id:
            return self.superseded(current)
        reps = await s.call(live_replicas(s.r, s.keys))
        ns = s.keys.namespace
        parts = [f"no batch of {batch_size} rollouts within {timeout} s"]
        parts.append(f"{self._batcher.buffered} buffered in incomplete groups")
        if not reps:
            parts.append(
                f"0 live replicas in namespace {ns!r} (start `maskroll serve --pull --namespace {ns}"
                + (f" --partitions {s.keys.partitions}" if s.keys.partitions > 1 else "")
                + "` on the same Redis); "
                + replicas_elsewhere(ns, await s.call(namespaces_with_replicas(s.r)))
            )
        else:
            pulling = sum(rep.pulls for rep in reps)
            parts.append(
                f"{len(reps)} live replicas at policy versions {sorted({r.policy_version for r in reps})}"
                + ("" if pulling == len(reps) else f", {pulling} of them pulling prompt jobs")
            )
        if refused:
            what = {
                "invalid": "invalid",
                "foreign_run": "of another run or none",
                "future_version": f"from policy versions ahead of this trainer's {s.policy_version}",
            }
            reasons = self.dead.last_reason
            latest = "; ".join(repr(reasons[k]) for k in sorted(refused) if k in reasons)
            parts.append(
                "dead-lettered meanwhile: "
                + ", ".join(f"{n} {what[k]}" for k, n in sorted(refused.items()))
                + f" (reasons in {self.dead.streams()}; the latest: {latest})"
            )
            if refused.get("future_version"):
                parts.append(
                    "replicas serve weights this run has not published: CheckpointPublisher.start(model) "
                    "(or broadcast_weights) makes them load this run's"
                )
        return QueueTimeout("; ".join(parts))

    def superseded(self, current: RunInfo | None) -> RunSuperseded:
        now = current.describe() if current else "no run (its record was deleted)"
        return RunSuperseded(
            f"namespace {self.state.keys.namespace!r} now belongs to {now}, not to this trainer's run "
            f"{self.state.require_run().run_id}: another trainer started a new run; stop this one"
        )

    # ---- reading --------------------------------------------------------------------------------

    async def _read(self, batch_size: int, block_ms: int) -> int:
        """One read (own pending entries first, then reclaimed ones, then new ones); returns entries read.
        Partitions are read one by one (in a Redis Cluster a multi-stream XREADGROUP must stay in one
        slot), starting with each in turn; when none has anything, one of them is waited on."""
        s = self.state
        r, parts = s.r, self.handles.rotation()
        if not self._own_pending_read:
            # our own unacked entries from a previous life of this consumer name
            n = 0
            for part in parts:
                resp = await s.call(r.xreadgroup(TRAINER_GROUP, s.consumer, {part.rollouts: "0"}))
                entries = resp[0][1] if resp else []
                await self._ingest(entries, part)
                n += len(entries)
            self._own_pending_read = True
            return max(1, n)  # the new entries are still to be read
        if time.monotonic() >= self._next_claim:
            self._next_claim = time.monotonic() + max(0.5, self.claim_idle_ms / 4000)
            n = 0
            for part in parts:
                _, claimed, *_ = await s.call(
                    r.xautoclaim(
                        part.rollouts, TRAINER_GROUP, s.consumer, self.claim_idle_ms, "0-0", count=256
                    )
                )
                claimed = [e for e in claimed if e is not None]
                if claimed:
                    s.stats.reclaimed += len(claimed)
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
        s = self.state
        resp = await s.call(
            s.r.xreadgroup(TRAINER_GROUP, s.consumer, {part.rollouts: ">"}, count=count, block=block_ms)
        )
        entries = resp[0][1] if resp else []
        await self._ingest(entries, part)
        return len(entries)

    async def _ingest(self, entries: list, part: PartitionKeys) -> None:
        """Entries read from `part`'s rollout stream: admit, batch, or set aside each one."""
        s = self.state
        fresh: list[Entry] = []
        for raw_id, fields in entries:
            if not fields:  # deleted while pending
                await s.call(s.r.xack(part.rollouts, TRAINER_GROUP, raw_id))
                continue
            entry_id = self.handles.entry(part.index, raw_id)
            if F_RECORD in fields:
                rec = await self._admit(entry_id, fields)
                if rec is not None:
                    fresh.append((entry_id, rec))
            elif F_JOB_ERROR in fields:
                await self._job_failed(entry_id, fields)
            elif F_REWARD_FAILED in fields:
                await self._reward_failed(entry_id, fields)
            else:
                await self.dead.letter(entry_id, fields, f"unknown fields {sorted(fields)}", "invalid")
        self.dead.report()
        if not fresh:
            return
        flags = await s.call(s.r.zmscore(part.done, [rec.rollout_id for _, rec in fresh]))
        now = time.monotonic()
        for (entry_id, rec), ack_time in zip(fresh, flags, strict=True):
            verdict = self._batcher.offer(
                entry_id, rec, acked=ack_time is not None, drop=self.drops(rec), now=now
            )
            if verdict == "duplicate":
                s.stats.duplicates += 1
                await self._finish([entry_id])
            elif verdict == "expired":
                reason = (
                    f"a late sample of group {group_key(rec)}, which was closed incomplete "
                    "(it expired, or another of its samples was refused)"
                )
                await self.dead.letter(entry_id, {F_RECORD: wire.encode_record(rec)}, reason, None)
                await s.consumed(rec.job_id, 1)
            elif verdict in ("kept", "drop"):
                s.stats.received += 1
                if verdict == "drop":
                    key = group_key(rec)
                    await self._drop(key, self._batcher.drop(key, [(entry_id, rec)]))

    async def _admit(self, entry_id: bytes, fields: dict) -> RolloutRecord | None:
        """The decoded record if this trainer may train on it; otherwise it is dead-lettered (None)."""
        s = self.state
        try:
            rec = wire.decode_record(fields[F_RECORD])
        except wire.WireError as e:
            await self.dead.letter(entry_id, fields, str(e), "invalid")
            return None
        run_id = s.require_run().run_id
        why = refusal(rec, run_id=run_id, policy_version=s.policy_version)
        if why is None and s.reward_stage and rec.reward is None:
            why = ("invalid", "the record carries no reward, and this run is scored by a reward stage")
        if why is None:
            return rec
        kind, reason = why
        if kind == "foreign_run" and rec.run_id and rec.run_id not in self._old_runs:
            # Another run's record: an older run's leftover, unless that run has replaced ours.
            current = await s.call(read_run(s.r, s.keys))
            if current is None or current.run_id != run_id:
                raise self.superseded(current)  # the entry stays pending for the new run's trainer
            self._old_runs.add(rec.run_id)
        await self.dead.letter(entry_id, fields, reason, kind)
        await self._close_group(rec, reason)
        return None

    async def _close_group(self, rec: RolloutRecord, reason: str) -> None:
        """`rec` was set aside: free its room, and the rest of its group, which can never be whole, now."""
        s = self.state
        await s.consumed(rec.job_id, 1)
        if rec.group_size > 1:  # set the rest aside now, not at expiry
            key = group_key(rec)
            for other_id, other in self._batcher.close(key):
                why = f"another sample of group {key} was refused: {reason}"
                await self.dead.letter(other_id, {F_RECORD: wire.encode_record(other)}, why, None, warn=False)
                await s.consumed(other.job_id, 1)

    async def _reward_failed(self, entry_id: bytes, fields: dict) -> None:
        """The reward stage dead-lettered a record (the notice carries it and the reason): close its group."""
        try:
            rec = wire.decode_record(fields[F_REWARD_FAILED])
        except wire.WireError:
            await self.dead.letter(entry_id, fields, "undecodable reward_failed notice", "invalid")
            return
        reason = fields.get(F_REASON, b"").decode(errors="replace")
        log.warning("the reward stage dead-lettered %s: %s", rec.rollout_id, reason)
        self.state.stats.dead_lettered += 1  # counted as a refusal; the stage wrote the dead letter
        self.state.stats.invalid += 1
        self.dead.refused["invalid"] += 1
        await self._finish([entry_id])
        await self._close_group(rec, f"the reward stage refused it ({reason})")

    async def _expire_groups(self) -> None:
        """Dead-letter the groups still incomplete group_timeout_s after their first record arrived."""
        s = self.state
        for key, entries in self._batcher.expire(time.monotonic(), self.group_timeout_s).items():
            size = entries[0][1].group_size
            reason = (
                f"group {key} incomplete: {len(entries)} of {size} samples after {self.group_timeout_s:g} s"
            )
            log.warning("namespace %r: %s; dead-lettered", s.keys.namespace, reason)
            for entry_id, rec in entries:
                await self.dead.letter(
                    entry_id, {F_RECORD: wire.encode_record(rec)}, reason, None, warn=False
                )
            s.stats.expired_groups += 1
            await s.consumed(entries[0][1].job_id, s.flight.expected(entries[0][1].job_id))

    async def _drop(self, job_id: str, entry_ids: list[bytes]) -> None:
        """Stale records: ack and delete them untrained, and free their room."""
        await self._finish(entry_ids)
        self.state.stats.dropped_stale += len(entry_ids)
        await self.state.consumed(job_id, len(entry_ids))

    async def _finish(self, entry_ids: Iterable[bytes]) -> None:
        for part, ids in self.handles.by_partition(entry_ids).items():  # a transaction stays in one slot
            pipe = transaction(self.state.r)
            ack_and_delete(pipe, part.rollouts, TRAINER_GROUP, *ids)
            await self.state.call(pipe.execute())

    async def _job_failed(self, entry_id: bytes, fields: dict) -> None:
        s = self.state
        try:
            job = wire.decode_job(fields[F_JOB_ERROR])
        except wire.WireError:  # a broken failure notice is itself dead-lettered
            await self.dead.letter(entry_id, fields, "undecodable job_error", "invalid")
            return
        reason = fields.get(F_REASON, b"").decode(errors="replace")
        log.warning("job %s failed on a replica: %s", job.job_id, reason)
        s.stats.failed_jobs += 1
        await self._finish([entry_id])
        await s.consumed(job.job_id, s.flight.expected(job.job_id))
