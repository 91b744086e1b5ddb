"""Batch assembly for the trainer queue: whole groups, each rollout once, stale records out (flow 3).

Delivery is at-least-once, so the same rollout can arrive twice (a replica re-ran a reclaimed job, or
a reclaimed entry comes back to this consumer): `GroupBatcher` remembers which rollout ids it holds
unacked and which it acked recently, and the caller passes in Redis's `done` markers for the rest. A
GRPO group is trained whole or not at all, so records wait by job until all `group_size` are in; a
group that stays incomplete past a timeout is expired (`expire`), and a group once dropped or expired
stays closed: its late records follow it instead of waiting for samples that will never come again.

Pure state, no I/O: each method says which stream entries the caller must ack and delete
(duplicates, dropped records); the queue's reader (reader.py) makes those Redis calls and keeps the
statistics. The staleness rule (`too_stale`) and the refusal rules (`refusal`) are here too: what a
trainer must not train on, decided without I/O. So is the split of one batch between data-parallel
trainer ranks (`split_groups`: whole groups, balanced by tokens; client/ranks.py scatters it).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from maskroll.proto.records import RolloutRecord

Entry = tuple[bytes, RolloutRecord]  # (stream entry id, decoded record)
Verdict = Literal["kept", "duplicate", "redelivered", "drop", "expired"]

# Acked rollout ids remembered in memory; older ones are still caught by the `done` set in Redis.
ACKED_MEMORY = 200_000
# Closed (dropped or expired) groups remembered, so that their late records are not buffered again.
CLOSED_MEMORY = 100_000


def group_key(rec: RolloutRecord) -> str:
    """The group a record belongs to: its job (pull mode), else its request (a Generate call)."""
    return rec.job_id or rec.request_id


def split_groups(records: Sequence[RolloutRecord], ranks: int) -> list[list[RolloutRecord]]:
    """`records` (whole GRPO groups) split into `ranks` shares for data-parallel trainer ranks: every
    group whole in one share, every record in exactly one, shares balanced by completion tokens.

    Greedy (longest processing time first): groups by completion tokens, largest first (ties: the
    group seen first in `records`), each to the lightest share (ties: fewer records, then the lower
    rank). Deterministic: the same records give the same shares. The heaviest and lightest shares then
    differ by at most the largest group's tokens. Within a share, records keep their order in `records`.
    A share is empty only when there are fewer groups than ranks (more ranks than groups: the caller
    decides whether an empty share may train; `RankedQueue` needs a batch of at least `ranks` groups).
    """
    if not (isinstance(ranks, int) and not isinstance(ranks, bool) and ranks >= 1):
        raise ValueError(f"ranks={ranks!r}; expected an int >= 1")
    groups: dict[str, list[int]] = {}  # group -> indices into records, in order of first appearance
    for i, rec in enumerate(records):
        groups.setdefault(group_key(rec), []).append(i)
    tokens = {key: sum(records[i].num_tokens for i in idx) for key, idx in groups.items()}
    order = sorted(groups, key=lambda key: -tokens[key])  # stable: ties keep first appearance
    load = [(0, 0)] * ranks  # per share: (completion tokens, records)
    owner: dict[int, int] = {}  # record index -> share
    for key in order:
        share = min(range(ranks), key=lambda r: (*load[r], r))
        load[share] = (load[share][0] + tokens[key], load[share][1] + len(groups[key]))
        for i in groups[key]:
            owner[i] = share
    shares: list[list[RolloutRecord]] = [[] for _ in range(ranks)]
    for i, rec in enumerate(records):
        shares[owner[i]].append(rec)
    return shares


def staleness(records: Iterable[RolloutRecord], policy_version: int) -> int:
    """Policy versions between the trainer's `policy_version` and the oldest first token of `records`
    (one record, or a whole group)."""
    return policy_version - min(rec.policy_version_first for rec in records)


def too_stale(records: Iterable[RolloutRecord], policy_version: int, max_staleness: int | None) -> bool:
    """The staleness rule: `records` are more than `max_staleness` versions behind the trainer's policy
    (None: no bound). The queue applies it per record (stale_policy "drop"), the framework adapters'
    rollout sources per group (maskroll.integrations.rollouts)."""
    return max_staleness is not None and staleness(records, policy_version) > max_staleness


@dataclass
class _Group:
    size: int
    first_seen: float  # the caller's clock when its first record arrived
    entries: list[Entry] = field(default_factory=list)
    samples: set[int] = field(default_factory=set)


class GroupBatcher:
    """Records read but not yet acked, grouped by job, in arrival order of their completion."""

    def __init__(self) -> None:
        self._groups: dict[str, _Group] = {}
        self._complete: list[str] = []  # job ids whose group is whole, oldest first
        self._pending: dict[str, bytes] = {}  # rollout_id -> entry id, read but not acked
        self._acked: OrderedDict[str, None] = OrderedDict()  # recent acked rollout ids (LRU)
        self._closed: OrderedDict[str, Literal["drop", "expired"]] = OrderedDict()  # group key -> why

    @property
    def buffered(self) -> int:
        """Records waiting in groups (complete or not)."""
        return sum(len(g.entries) for g in self._groups.values())

    def offer(
        self, entry_id: bytes, rec: RolloutRecord, *, acked: bool, drop: bool, now: float = 0.0
    ) -> Verdict:
        """Classify one read record. acked: Redis's `done` set already holds its rollout id. drop: the
        caller's staleness rule discards it. now: the caller's clock (for `expire`). "duplicate": ack and
        delete the entry, it was trained or is held under another entry (or its sample index is);
        "redelivered": the same entry again, nothing to do; "drop": call `drop()` (also for a late record
        of a dropped group); "expired": a late record of an expired group, dead-letter it; "kept": it
        waits in its group."""
        rid, key = rec.rollout_id, group_key(rec)
        held = self._pending.get(rid)
        if acked or rid in self._acked or (held is not None and held != entry_id):
            return "duplicate"
        if held is not None:  # the same entry delivered again (own PEL / reclaim)
            return "redelivered"
        closed = self._closed.get(key)
        if closed == "expired":
            return "expired"
        group = self._groups.get(key)
        if group is not None and rec.sample_index in group.samples:
            return "duplicate"  # another rollout id for a sample the group already holds
        self._pending[rid] = entry_id
        if drop or closed == "drop":
            return "drop"
        if group is None:
            group = self._groups[key] = _Group(size=max(1, rec.group_size), first_seen=now)
        group.entries.append((entry_id, rec))
        group.samples.add(rec.sample_index)
        if len(group.entries) == group.size:
            self._complete.append(key)
        return "kept"

    def drop(self, job_id: str, entries: Iterable[Entry] = ()) -> list[bytes]:
        """Forget `entries` and whatever of group `job_id` is buffered; returns their entry ids, for the
        caller to ack and delete. The group is closed: its later records are dropped too."""
        entries = list(entries)
        group = self._groups.pop(job_id, None)
        if group is not None:
            entries += group.entries
        for _, rec in entries:
            self._pending.pop(rec.rollout_id, None)
        self._close(job_id, "drop")
        return [entry_id for entry_id, _ in entries]

    def expire(self, now: float, timeout: float) -> dict[str, list[Entry]]:
        """Incomplete groups whose first record arrived `timeout` or more before `now`: forgotten and
        closed (their late records come back as "expired"); returns {group: entries} to dead-letter."""
        old = [
            k for k, g in self._groups.items() if len(g.entries) < g.size and now - g.first_seen >= timeout
        ]
        out = {}
        for key in old:
            out[key] = self._groups.pop(key).entries
            for _, rec in out[key]:
                self._pending.pop(rec.rollout_id, None)
            self._close(key, "expired")
        return out

    def close(self, key: str) -> list[Entry]:
        """Give up on group `key` (one of its samples was refused, so it can never be whole): forgotten
        and closed like an expired group; returns the entries it held, to dead-letter."""
        group = self._groups.pop(key, None)
        entries = group.entries if group is not None else []
        for _, rec in entries:
            self._pending.pop(rec.rollout_id, None)
        if key in self._complete:
            self._complete.remove(key)
        self._close(key, "expired")
        return entries

    def incomplete(self) -> list[tuple[str, int, int]]:
        """(group, records held, group size) of every group still waiting for samples."""
        return [(k, len(g.entries), g.size) for k, g in self._groups.items() if len(g.entries) < g.size]

    def _close(self, key: str, why: Literal["drop", "expired"]) -> None:
        self._closed[key] = why
        self._closed.move_to_end(key)
        while len(self._closed) > CLOSED_MEMORY:
            self._closed.popitem(last=False)

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


RefusalKind = Literal["invalid", "foreign_run", "future_version"]


def refusal(rec: RolloutRecord, *, run_id: str, policy_version: int) -> tuple[RefusalKind, str] | None:
    """Why the trainer of run `run_id`, now at `policy_version`, must never train on `rec` — (kind,
    reason) — or None. Checked on every record read, before batching (docs/records.md, "Refused records").
    A record of another run may still be the *current* run's if this trainer was superseded: the
    caller checks that before dead-lettering "foreign_run" ones."""
    problems = rec.problems()
    if problems:
        return "invalid", "; ".join(problems)
    if not rec.run_id:
        return "foreign_run", (
            "the record carries no run id (a replica older than run ids, or a Generate call on a replica "
            "that never received this run's weights)"
        )
    if rec.run_id != run_id:
        return "foreign_run", f"the record belongs to run {rec.run_id}, not to this trainer's run {run_id}"
    if rec.version_changes:  # one version (most records) cannot go backwards
        versions = [rec.policy_version_first, *(v for _, v in rec.version_changes)]
        if any(b < a for a, b in itertools.pairwise(versions)):
            return "future_version", (
                f"its policy version goes backwards within the record ({versions}): the replica switched "
                "to another run's weights mid-generation"
            )
    if rec.max_policy_version > policy_version:
        return "future_version", (
            f"policy version {rec.max_policy_version} is ahead of this trainer's version {policy_version}: "
            "the replica serves weights this run has not published (another run's, or a lost history)"
        )
    return None
