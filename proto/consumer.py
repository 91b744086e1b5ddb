"""`GroupConsumer`: one consumer of a consumer group on every partition's stream of one kind — the
at-least-once half the replicas' prompt puller (server/pull/puller.py) and the stage workers
(stages/worker.py) share: take new entries, reclaim stuck ones with their delivery counts, keep its own
claimed while it works on them, drain. Built on streams.py's keys and primitives.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis

from .streams import PartitionKeys, StreamKeys

log = logging.getLogger("maskroll.streams")


# ---- one consumer of a group: taking entries, reclaiming them, keeping them --------------------------

# With several partitions and nothing on any of them, one is waited on (each in turn) this long: an entry
# arriving on another waits no longer than this to be taken.
SWEEP_BLOCK_MS = 100

Handle = Callable[[PartitionKeys, bytes, dict, int], Awaitable[None]]


class GroupConsumer:
    """One consumer of a group on every partition's stream of one kind (a replica on the prompt streams,
    a stage worker on the finished streams), and the entries it is working on (`active`, a task each,
    keyed by (partition, entry id)). The at-least-once half both sides share:

    - `take` reads entries never delivered (XREADGROUP ">", each partition in turn) and, at most every
      claim_idle/4, reclaims those a consumer left pending past `claim_idle_s` (XAUTOCLAIM: it died),
      with how often Redis has delivered each: an entry delivered again and again killed its consumer
      each time (a poison entry), which `handle` dead-letters past its own `max_deliveries`;
    - `keep_claimed` (from the consumer's heartbeat) re-claims its entries (XCLAIM JUSTID), so that a live
      consumer's slow entries are never taken over;
    - `drain` waits for them, then cancels the rest (they stay pending, and are reclaimed).

    `stream(part)` names the partition's stream; `handle(part, entry_id, fields, deliveries)` works on one
    entry (its task leaves `active` when it returns). `call` wraps each Redis call `take` makes (the
    puller times them: health); `on_active(n)` hears the number of entries in `active` after each change."""

    def __init__(
        self,
        r: aioredis.Redis,
        keys: StreamKeys,
        stream: Callable[[PartitionKeys], str],
        group: str,
        consumer: str,
        handle: Handle,
        *,
        claim_idle_s: float,
        min_reclaim_every_s: float,
        call: Callable[[Awaitable], Awaitable] | None = None,
        on_active: Callable[[int], object] | None = None,
    ) -> None:
        self.r, self.keys, self.stream, self.group, self.consumer = r, keys, stream, group, consumer
        self.handle = handle
        self.claim_idle_ms = int(claim_idle_s * 1000)
        self.min_reclaim_every_s = min_reclaim_every_s
        self._call = call
        self._on_active = on_active
        self.active: dict[tuple[int, bytes], asyncio.Task] = {}
        self.next_reclaim = 0.0  # time.monotonic() of the next XAUTOCLAIM pass; 0: the next take
        self._turn = 0  # the partition the next take starts with

    async def _redis(self, aw: Awaitable):
        return await (self._call(aw) if self._call is not None else aw)

    def _rotation(self) -> list[PartitionKeys]:
        """The partitions, starting with the next one in turn (so that none is always read last)."""
        parts = self.keys.parts
        self._turn = (self._turn + 1) % len(parts)
        return [*parts[self._turn :], *parts[: self._turn]]

    async def take(self, free: int) -> int:
        """Start at most `free` entries: reclaimed ones when a reclaim pass is due and finds any, else new
        ones (a sweep of every partition that does not wait, then one blocking read: 500 ms on a single
        partition, SWEEP_BLOCK_MS with several). Returns how many of them were reclaimed."""
        parts = self._rotation()
        taken = 0
        if time.monotonic() >= self.next_reclaim:
            self.next_reclaim = time.monotonic() + max(self.min_reclaim_every_s, self.claim_idle_ms / 4000)
            for part in parts:
                if taken < free:
                    taken += await self._reclaim(part, free - taken)
        if taken:
            return taken
        if len(parts) > 1:  # a sweep that does not wait
            for part in parts:
                if taken < free:
                    taken += await self._read_new(part, free - taken, None)
        if not taken:
            await self._read_new(parts[0], free, 500 if len(parts) == 1 else SWEEP_BLOCK_MS)
        return 0

    async def _reclaim(self, part: PartitionKeys, count: int) -> int:
        """Take over `part`'s entries idle past claim_idle_s (a dead consumer's); returns how many started."""
        _, claimed, *_ = await self._redis(
            self.r.xautoclaim(
                self.stream(part), self.group, self.consumer, self.claim_idle_ms, "0-0", count=count
            )
        )
        entries = [e for e in claimed if e is not None and (part.index, e[0]) not in self.active]
        for entry_id, fields in entries:  # delivered before, maybe many times (a poison entry)
            self._start(part, entry_id, fields, await self._deliveries(part, entry_id))
        return len(entries)

    async def _deliveries(self, part: PartitionKeys, entry_id: bytes) -> int:
        """How often Redis has delivered this entry (XREADGROUP and XAUTOCLAIM count, XCLAIM JUSTID not)."""
        pending = await self._redis(
            self.r.xpending_range(self.stream(part), self.group, entry_id, entry_id, 1)
        )
        return int(pending[0]["times_delivered"]) if pending else 1

    async def _read_new(self, part: PartitionKeys, count: int, block_ms: int | None) -> int:
        """Read entries of `part` never delivered before and start them; returns how many started."""
        resp = await self._redis(
            self.r.xreadgroup(
                self.group, self.consumer, {self.stream(part): ">"}, count=count, block=block_ms
            )
        )
        started = 0
        for entry_id, fields in resp[0][1] if resp else []:
            if (part.index, entry_id) not in self.active:
                self._start(part, entry_id, fields, 1)
                started += 1
        return started

    def _start(self, part: PartitionKeys, entry_id: bytes, fields: dict, deliveries: int) -> None:
        key = (part.index, entry_id)
        self.active[key] = asyncio.create_task(self._run(key, part, entry_id, fields, deliveries))
        self._changed()

    async def _run(self, key: tuple[int, bytes], part: PartitionKeys, entry_id: bytes, fields: dict, n: int):
        try:
            await self.handle(part, entry_id, fields, n)
        finally:
            self.active.pop(key, None)
            self._changed()

    def _changed(self) -> None:
        if self._on_active is not None:
            self._on_active(len(self.active))

    async def keep_claimed(self) -> None:
        """Re-claim the entries in `active` (XCLAIM JUSTID: no delivery counted), so that their idle time
        stays below claim_idle_s and no other consumer takes them over while this one works on them."""
        for p in sorted({p for p, _ in self.active}):
            running = [entry_id for q, entry_id in self.active if q == p]
            await self.r.xclaim(
                self.stream(self.keys.part(p)), self.group, self.consumer, 0, running, justid=True
            )

    async def drain(self, timeout: float) -> int:
        """Wait up to `timeout` for the entries in `active`; cancel the rest (they stay pending and are
        reclaimed). Returns how many were cancelled."""
        tasks = list(self.active.values())
        if not tasks:
            return 0
        _, pending = await asyncio.wait(tasks, timeout=timeout)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        return len(pending)
