"""StageWorker: finished records → a step that scores each one → the trainer's rollout stream
(docs/rewards.md, "The reward stage" and "The teacher stage"; docs/architecture.md flow 8).

The step (the worker's `scorer`) is a reward function (reward_call.RewardStep: `maskroll reward`, `serve
--reward`) or a teacher fleet, optionally after a reward function (teacher.TeacherStep: `maskroll
teacher`); everything below is the same for both. Each kind reads through its own consumer group
(`scorer.group`), so a namespace runs one kind of stage: a worker refuses to start while a live worker of
the other kind is registered (a record read by both groups would be published twice).

Replicas publish the records of jobs a trainer submitted with `RolloutQueue(reward_stage=True)` to their
partition's *finished* stream instead of its rollout stream. Every reward worker reads every partition's
finished stream through one consumer group (REWARD_GROUP, or TEACHER_GROUP), like replicas read prompt jobs
(server/pull/puller.py), with the same rules and the same primitives of proto/streams.py:

- at-least-once: a record leaves the finished stream only in the script that publishes it, scored, to the
  rollout stream of the same partition (`streams.forward`: ack + delete + XADD, one slot), so a worker
  killed at any point leaves it pending, and another worker (or its restart) takes it over once it has
  been idle `claim_idle_s` (XAUTOCLAIM). A live worker keeps its records' idle time low (XCLAIM JUSTID).
  Both: `proto.consumer.GroupConsumer`, as the replicas' prompt puller does.
- deduplicated: `forward` publishes a rollout id at most once (the partition's `scored` set) and never
  an entry another worker has already acked; the trainer's own dedupe (the `done` set) stays behind it.
- dead letters with the reason: a record the step cannot score (the reward function raised, hung past
  `timeout_s`, returned NaN or garbage — reward_call.RewardError; the teacher refused its tokens —
  teacher.TeacherError), one that does not decode, or one whose
  scoring killed its worker `max_deliveries` times goes to the partition's dead letters, atomically
  with its ack, with a `reward_failed` notice on the rollout stream so the trainer closes its group at
  once and frees its admission slot. The stage never invents a reward; the next record is scored.
- job errors (a job a replica could not run) pass through to the rollout stream unchanged.
- backpressure: past `max_len` unconsumed records on a rollout stream the worker waits, never trims.

Knows nothing of how the records were generated, nor of the trainer: only the stream layout.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from maskroll.proto import wire
from maskroll.proto.consumer import GroupConsumer
from maskroll.proto.redaction import redact
from maskroll.proto.redis_conn import REDIS_DOWN
from maskroll.proto.streams import (
    F_JOB_ERROR,
    F_REASON,
    F_RECORD,
    F_REWARD_FAILED,
    REWARD_GROUP,
    TEACHER_GROUP,
    PartitionKeys,
    StreamKeys,
    check_layout,
    dead_letter,
    ensure_group,
    forward,
)

from .config import StageConfig
from .reward_call import StageError, StageWedged

log = logging.getLogger("maskroll.reward")

GROUPS = {"reward": REWARD_GROUP, "teacher": TEACHER_GROUP}  # the consumer group of each kind of step
ROOM_CHECK_S = 0.5  # how often a rollout stream's backlog is measured (one XLEN per partition at most)


@dataclass
class StageCounters:
    """What one worker has done since it started (its heartbeat and activity line)."""

    scored: int = 0
    failed: int = 0  # dead-lettered: no reward
    duplicates: int = 0  # not published again: already published, or finished by another worker
    job_errors: int = 0  # passed through
    reclaimed: int = 0


class StageWorker:
    """One consumer of the stage's group. `run()` until `stop()`; `supervise()` restarts it after errors.

    scorer: the step — `kind` ("reward" | "teacher": its consumer group, GROUPS), `label` (what scores,
    for the heartbeat), `what` (what a failed record goes without), `hung`, `close()`, and
    `await scorer(rec)`, which scores the record in place or raises reward_call.StageError. cfg: the stage's
    config (RewardStageConfig or TeacherStageConfig: the limits of their StageConfig)."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: StreamKeys,
        scorer,
        cfg: StageConfig,
        worker_id: str,
    ) -> None:
        self.redis, self.keys, self.scorer, self.cfg = redis, keys, scorer, cfg
        self.group = GROUPS[scorer.kind]
        self.worker_id = worker_id
        self.counters = StageCounters()
        self.records = GroupConsumer(
            redis,
            keys,
            lambda part: part.finished,
            self.group,
            worker_id,
            self._handle,
            claim_idle_s=cfg.claim_idle_s,
            min_reclaim_every_s=0.2,
        )
        self._room_ok: dict[str, float] = {}  # rollout stream -> when it last had room
        self._stopping = asyncio.Event()
        self._wedged: StageWedged | None = None
        self.started_at = time.time()

    # ---- lifecycle ----------------------------------------------------------------------------------

    async def supervise(self) -> None:
        """run() until stop(), restarted with backoff after an error (Redis away, a lost group). A
        wedged scorer (too many hung sync calls) is not restarted here: it raises, and the process exits."""
        wait = 1.0
        while not self._stopping.is_set():
            try:
                await self.run()
                return
            except asyncio.CancelledError:
                raise
            except StageWedged:
                raise
            except Exception:
                log.error(
                    "%s worker %s failed; restarting in %.0f s",
                    self.scorer.kind,
                    self.worker_id,
                    wait,
                    exc_info=True,
                )
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), wait)
                wait = min(2 * wait, 30.0)

    async def start(self) -> None:
        """Check the layout and create the groups (the worker is ready to score after this)."""
        await check_layout(self.redis, self.keys)
        await self._check_alone()
        for part in self.keys.parts:
            await ensure_group(self.redis, part.finished, self.group)

    async def _check_alone(self) -> None:
        """ValueError naming a live worker of the other kind of stage on this namespace."""
        async for key in self.redis.scan_iter(match=self.keys.rewarder_pattern, count=100):
            raw = await self.redis.get(key)
            other = json.loads(raw) if raw else {}
            if other and other.get("stage", "reward") != self.scorer.kind:
                raise ValueError(
                    f"namespace {self.keys.namespace!r} has a live {other.get('stage', 'reward')} stage "
                    f"worker ({other.get('worker_id')}): a namespace runs one stage; stop it, or run "
                    "`maskroll teacher --reward MODULE:FUNCTION`, which scores both (docs/rewards.md)"
                )

    async def run(self) -> None:
        await self.start()
        beat = asyncio.create_task(self._heartbeat(), name="stage-heartbeat")
        self.records.next_reclaim = 0.0  # a (re)start reclaims at once
        try:
            while not self._stopping.is_set():
                if self._wedged is not None:
                    raise self._wedged
                free = self.cfg.concurrency - len(self.records.active)
                if free <= 0:
                    await asyncio.sleep(0.01)
                    continue
                try:
                    self.counters.reclaimed += await self.records.take(free)
                except REDIS_DOWN as e:
                    log.warning(
                        "stage worker %s: Redis unreachable (%s); retrying", self.worker_id, redact(repr(e))
                    )
                    await asyncio.sleep(1.0)
                except ResponseError as e:
                    if "NOGROUP" not in str(e):
                        raise
                    log.warning("the %s group is gone (Redis flushed?); recreating it", self.group)
                    await self.start()
        finally:
            beat.cancel()
            await asyncio.gather(beat, return_exceptions=True)

    def stop(self) -> None:
        self._stopping.set()

    @property
    def _active(self) -> dict[tuple[int, bytes], asyncio.Task]:
        """The records being scored (stages/run.py's activity line counts them)."""
        return self.records.active

    async def drain(self, timeout: float) -> int:
        """Wait up to `timeout` for the records being scored; cancel the rest (they stay pending and are
        taken over). Returns how many were cancelled."""
        return await self.records.drain(timeout)

    async def unregister(self) -> None:
        await self.redis.delete(self.keys.rewarder(self.worker_id))

    # ---- one record ----------------------------------------------------------------------------------

    async def _handle(self, part: PartitionKeys, entry_id: bytes, fields: dict, deliveries: int) -> None:
        try:
            if not fields:  # deleted while pending
                await self.redis.xack(part.finished, self.group, entry_id)
                return
            if F_JOB_ERROR in fields:
                await self._forward(part, entry_id, fields, f"job_error:{entry_id.decode()}")
                self.counters.job_errors += 1
                return
            try:
                rec = wire.decode_record(fields.get(F_RECORD, b""))
            except wire.WireError as e:
                await dead_letter(self.redis, part, part.finished, self.group, entry_id, fields, str(e))
                self.counters.failed += 1
                return
            try:
                if deliveries > self.cfg.max_deliveries:
                    raise StageError(
                        f"delivered {deliveries} times and never scored "
                        "(its worker died scoring it each time)"
                    )
                await self.scorer(rec)
            except StageError as e:
                what = e.what if type(e) is not StageError else self.scorer.what
                await self._fail(part, entry_id, fields, f"{what} for {rec.rollout_id}: {e}")
                return
            await self._forward(part, entry_id, {F_RECORD: wire.encode_record(rec)}, rec.rollout_id)
        except asyncio.CancelledError:
            raise  # stays pending: taken over after claim_idle_s
        except StageWedged as e:
            self._wedged = e  # run() raises it: the process restarts
        except REDIS_DOWN as e:
            log.warning("record %s: Redis unreachable (%s); left pending", entry_id, redact(repr(e)))
        except Exception:
            log.exception("record %s (delivery %d) failed in the stage; left pending", entry_id, deliveries)

    async def _forward(self, part: PartitionKeys, entry_id: bytes, fields: dict, dedupe_id: str) -> None:
        await self._wait_for_room(part.rollouts)
        done = await forward(
            self.redis,
            part.finished,
            self.group,
            entry_id,
            part.rollouts,
            fields,
            dedupe=part.scored,
            dedupe_id=dedupe_id,
            dedupe_ttl_s=self.cfg.dedupe_ttl_s,
        )
        if done == 1:
            self.counters.scored += F_RECORD in fields
        else:
            self.counters.duplicates += 1

    async def _fail(self, part: PartitionKeys, entry_id: bytes, fields: dict, reason: str) -> None:
        notice = {F_REWARD_FAILED: fields[F_RECORD], F_REASON: reason[:1000]}
        await dead_letter(
            self.redis,
            part,
            part.finished,
            self.group,
            entry_id,
            fields,
            reason,
            notify=(part.rollouts, notice),
        )
        self.counters.failed += 1

    async def _wait_for_room(self, stream: str) -> None:
        """Backpressure: wait while the trainer's rollout stream holds max_len unconsumed entries."""
        while time.monotonic() - self._room_ok.get(stream, -1e9) > ROOM_CHECK_S:
            if await self.redis.xlen(stream) < self.cfg.max_len:
                self._room_ok[stream] = time.monotonic()
                return
            await asyncio.sleep(0.25)

    # ---- heartbeat --------------------------------------------------------------------------------

    def heartbeat(self) -> dict:
        c = self.counters
        return {
            "worker_id": self.worker_id,
            "stage": self.scorer.kind,
            "reward": self.scorer.label,
            "scored": c.scored,
            "failed": c.failed,
            "duplicates": c.duplicates,
            "job_errors": c.job_errors,
            "active": len(self.records.active),
            "hung": self.scorer.hung,
            "started_at": self.started_at,
            "pid": os.getpid(),
        }

    async def _heartbeat(self) -> None:
        """Refresh the registry key and keep the records being scored claimed (their idle time low)."""
        period = max(0.1, min(self.cfg.heartbeat_ttl_s / 3, self.cfg.claim_idle_s / 3))
        while True:
            try:
                await self.redis.set(
                    self.keys.rewarder(self.worker_id),
                    json.dumps(self.heartbeat()),
                    px=int(self.cfg.heartbeat_ttl_s * 1000),
                )
                await self.records.keep_claimed()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.warning("stage heartbeat failed", exc_info=True)
            await asyncio.sleep(period)


RewardWorker = StageWorker  # the reward stage's worker (its name before the teacher stage shared it)
