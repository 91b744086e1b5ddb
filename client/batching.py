"""Batch assembly for the trainer queue: whole groups, each rollout once, stale records out (flow 3).

Delivery is at-least-once, so the same rollout can arrive twice (a replica re-ran a reclaimed job, or
a reclaimed entry comes back to this consumer): `GroupBatcher` remembers which rollout ids it holds
unacked and which it acked recently, and the caller passes in Redis's `done` markers for the rest. A
GRPO group is trained whole or not at all, so records wait by job until all `group_size` are in.

Pure state, no I/O: each method says which stream entries the caller must ack and delete
(duplicates, dropped records); `AsyncRolloutQueue` makes those Redis calls and keeps the statistics.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from .records import RolloutRecord

Entry = tuple[bytes, RolloutRecord]  # (stream entry id, decoded record)
Verdict = Literal["kept", "duplicate", "redelivered", "drop"]

# Acked rollout ids remembered in memory; older ones are still caught by the `done` set in Redis.
ACKED_MEMORY = 200_000


@dataclass
class _Group:
    size: int
    entries: list[Entry] = field(default_factory=list)


class GroupBatcher:
    """Records read but not yet acked, grouped by job, in arrival order of their completion."""

    def __init__(self) -> None:
        self._groups: dict[str, _Group] = {}
        self._complete: list[str] = []  # job ids whose group is whole, oldest first
        self._pending: dict[str, bytes] = {}  # rollout_id -> entry id, read but not acked
        self._acked: OrderedDict[str, None] = OrderedDict()  # recent acked rollout ids (LRU)

    @property
    def buffered(self) -> int:
        """Records waiting in groups (complete or not)."""
        return sum(len(g.entries) for g in self._groups.values())

    def offer(self, entry_id: bytes, rec: RolloutRecord, *, acked: bool, drop: bool) -> Verdict:
        """Classify one read record. acked: Redis's `done` set already holds its rollout id. drop: the
        caller's staleness rule discards it. "duplicate": ack and delete the entry, it was trained or is
        held under another entry; "redelivered": the same entry again, nothing to do; "drop": call
        `drop()`; "kept": it waits in its group."""
        rid = rec.rollout_id
        held = self._pending.get(rid)
        if acked or rid in self._acked or (held is not None and held != entry_id):
            return "duplicate"
        if held is not None:  # the same entry delivered again (own PEL / reclaim)
            return "redelivered"
        self._pending[rid] = entry_id
        if drop:
            return "drop"
        group = self._groups.setdefault(rec.job_id, _Group(size=max(1, rec.group_size)))
        group.entries.append((entry_id, rec))
        if len(group.entries) == group.size:
            self._complete.append(rec.job_id)
        return "kept"

    def drop(self, job_id: str, entries: Iterable[Entry] = ()) -> list[bytes]:
        """Forget `entries` and whatever of `job_id`'s group is buffered; returns their entry ids, for
        the caller to ack and delete. Later records of the job are judged on their own when they come."""
        entries = list(entries)
        group = self._groups.pop(job_id, None)
        if group is not None:
            entries += group.entries
        for _, rec in entries:
            self._pending.pop(rec.rollout_id, None)
        return [entry_id for entry_id, _ in entries]

    def take(
        self, batch_size: int, drop: Callable[[RolloutRecord], bool]
    ) -> tuple[list[RolloutRecord], dict[str, list[bytes]]]:
        """Whole groups, oldest first, once they add up to `batch_size` records (else an empty batch).
        Complete groups holding a record `drop` rejects now (the policy moved on while they waited) are
        dropped first: returns (batch, {job_id: entry ids to ack and delete}). A batch may exceed
        `batch_size` by part of a group, never split one."""
        dropped, ready = {}, []
        for job_id in self._complete:
            if any(drop(rec) for _, rec in self._groups[job_id].entries):
                dropped[job_id] = self.drop(job_id)
            else:
                ready.append(job_id)
        self._complete = ready
        if sum(len(self._groups[j].entries) for j in ready) < batch_size:
            return [], dropped
        out: list[RolloutRecord] = []
        while self._complete and len(out) < batch_size:
            out.extend(rec for _, rec in self._groups.pop(self._complete.pop(0)).entries)
        return out, dropped

    def entry_of(self, rollout_id: str) -> bytes | None:
        """The stream entry of a record read and not yet acked (None: unknown or already acked)."""
        return self._pending.get(rollout_id)

    def acked(self, batch: Sequence[RolloutRecord]) -> None:
        """`batch` is acked in Redis: remember its ids so a late duplicate is caught without a round trip."""
        for rec in batch:
            if self._pending.pop(rec.rollout_id, None) is not None:
                self._acked[rec.rollout_id] = None
        while len(self._acked) > ACKED_MEMORY:
            self._acked.popitem(last=False)
