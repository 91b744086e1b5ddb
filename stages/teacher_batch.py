"""GroupBatcher: the records of one GRPO group (one prompt) scored in one Score call when the worker holds
them together (docs/rewards.md "The teacher stage").

A group's n records reach the finished stream together (a replica publishes a job's records at once) and
the worker reads several entries per XREADGROUP, so their steps call `score` in the same few loop turns.
Each call joins the open batch of its key — (run, group, prompt ids): the Score RPC takes completions of
one prompt — and waits for its own result. A batch is sent when

- it holds the group's size (`group_size`, capped by `max_batch`: the teachers' max_n per call), or
- every record the worker may hold waits in a batch (`capacity`: its concurrency), so no sibling can come, or
- its first record has waited `wait_s`: a lone record (its siblings scored elsewhere, or reclaimed alone)
  is delayed at most that long. A record without a group (group_size <= 1) is sent at once.

What the worker keeps per record is unchanged: each record's step returns or raises for that record
alone, so acks, dedupe and dead letters stay per record (worker.py). A batch the teacher refuses
(TeacherError: one bad completion refuses the whole call) is scored again record by record, so only the
record at fault is dead-lettered; any other failure (no teacher answered) is every record's, and each
stays pending. A record whose step is cancelled (drain) leaves its batch if the batch was not sent yet.

Knows nothing of Redis or of what the scores are for: `score_many(prompt_ids, completions)` is the
teacher pool's call.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np

from maskroll.proto.records import RolloutRecord
from maskroll.proto.scoring import ScoredTokens, ScoreResult

from .teacher import TeacherError

# score_many(prompt_ids [P], completions [T_i] each) -> (ScoreResult in the completions' order, address)
ScoreMany = Callable[[np.ndarray, list[np.ndarray]], Awaitable[tuple[ScoreResult, str]]]
Scored = tuple[ScoredTokens, ScoreResult, str]  # one completion's scores, the call's result, who scored


@dataclass
class _Batch:
    prompt_ids: np.ndarray  # int32 [P]
    want: int  # send when it holds this many
    items: list[tuple[np.ndarray, asyncio.Future]] = field(default_factory=list)  # (completion [T], result)
    timer: asyncio.TimerHandle | None = None


@dataclass
class BatchCounters:
    calls: int = 0  # Score calls made, refused ones included
    records: int = 0  # records those calls scored
    split: int = 0  # refused batches scored again record by record


class GroupBatcher:
    def __init__(self, score_many: ScoreMany, *, wait_s: float, max_batch: int, capacity: int) -> None:
        if wait_s <= 0 or max_batch < 1 or capacity < 1:
            raise ValueError(
                f"wait_s={wait_s}, max_batch={max_batch}, capacity={capacity}: expected > 0, >= 1"
            )
        self.score_many, self.wait_s = score_many, wait_s
        self.max_batch, self.capacity = max_batch, capacity
        self.counters = BatchCounters()
        self._open: dict[tuple, _Batch] = {}
        self._waiting = 0  # records in open batches
        self._sent: set[asyncio.Task] = set()

    async def score(self, rec: RolloutRecord) -> Scored:
        """The scores of `rec`'s completion (at least one token), scored with its group's other records
        where they come within `wait_s`. Raises what scoring it raised (TeacherError: this record's)."""
        loop = asyncio.get_running_loop()
        key = (rec.run_id, rec.group_id, rec.prompt_ids.tobytes())
        want = min(rec.group_size, self.max_batch) if rec.group_id else 1
        batch = self._open.get(key)
        if batch is None:
            batch = self._open[key] = _Batch(np.asarray(rec.prompt_ids, np.int32), max(want, 1))
            batch.timer = loop.call_later(self.wait_s, self._send, key)
        item = (rec.completion_ids, loop.create_future())
        batch.items.append(item)
        self._waiting += 1
        if len(batch.items) >= batch.want:
            self._send(key)
        elif self._waiting >= self.capacity:  # the worker is full: nothing more can join any batch
            for k in list(self._open):
                self._send(k)
        try:
            return await item[1]
        except asyncio.CancelledError:
            if self._open.get(key) is batch and item in batch.items:  # not sent: leave the batch
                batch.items.remove(item)
                self._waiting -= 1
                if not batch.items:
                    batch.timer.cancel()
                    del self._open[key]
            raise

    def _send(self, key: tuple) -> None:
        batch = self._open.pop(key, None)
        if batch is None:
            return
        batch.timer.cancel()
        self._waiting -= len(batch.items)
        task = asyncio.get_running_loop().create_task(self._run(batch))
        self._sent.add(task)
        task.add_done_callback(self._sent.discard)

    async def _run(self, batch: _Batch) -> None:
        try:
            try:
                results = await self._call(batch.prompt_ids, [c for c, _ in batch.items])
            except TeacherError:
                if len(batch.items) == 1:
                    raise
                # one completion refused the call: which one is known only record by record
                self.counters.split += 1
                await asyncio.gather(*(self._alone(batch.prompt_ids, c, fut) for c, fut in batch.items))
                return
        except asyncio.CancelledError:
            for _, fut in batch.items:
                fut.cancel()
            raise
        except BaseException as e:  # every record of the batch gets its call's failure
            for _, fut in batch.items:
                if not fut.done():
                    fut.set_exception(e)
            return
        for (_, fut), scored in zip(batch.items, results, strict=True):
            if not fut.done():  # its step was cancelled after the call was sent
                fut.set_result(scored)

    async def _alone(self, prompt_ids: np.ndarray, completion: np.ndarray, fut: asyncio.Future) -> None:
        try:
            (scored,) = await self._call(prompt_ids, [completion])
        except asyncio.CancelledError:
            fut.cancel()
            raise
        except BaseException as e:  # this record's own failure
            if not fut.done():
                fut.set_exception(e)
            return
        if not fut.done():
            fut.set_result(scored)

    async def _call(self, prompt_ids: np.ndarray, completions: list[np.ndarray]) -> list[Scored]:
        self.counters.calls += 1
        self.counters.records += len(completions)
        result, address = await self.score_many(prompt_ids, completions)
        if len(result.completions) != len(completions):
            raise TeacherError(
                f"teacher {address} answered {len(result.completions)} completions for {len(completions)}"
            )
        return [(t, result, address) for t in result.completions]

    def close(self) -> None:
        """Cancel the calls in flight (their records' steps are cancelled with them)."""
        for task in list(self._sent):
            task.cancel()
