"""Job slots shared by the pullers of one replica that serves several namespaces (several LoRA runs on one
fleet, docs/lora.md "Several runs, one fleet"): `pull_concurrency` jobs at once over all of them, taken
in turn so that no run starves another.

A puller reserves slots before it reads its prompt stream (`reserve`), starts as many jobs as the read
returned and gives the rest back (`give_back`); a job gives its slot back when it ends (`job_ended`). The
pullers waiting for slots are served in the order they asked, and a puller asks again after each read, so
the turns go round: free slots are shared out among the waiting pullers (the first in line gets
ceil(free / waiting), the next ceil of what is left over the rest, ...), and when slots are scarce each
slot that frees goes to the next puller in line. A puller whose last read found nothing asks for one slot
only (`IDLE_WANT`): an idle run holds at most one slot while it waits on its stream, never a share.

Each run's own in-flight limit is its trainer's (admission in the SDK); this only divides the replica's
engine among the runs that have work. Pure asyncio state, no I/O; one event loop.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque

IDLE_WANT = 1  # what a puller whose last read was empty asks for: a slot to look with


class JobSlots:
    """`total` slots; `taken` = reserved by a puller reading now + held by running jobs."""

    def __init__(self, total: int) -> None:
        if total < 1:
            raise ValueError(f"total must be >= 1, got {total}")
        self.total = total
        self.taken = 0
        self.running = 0  # jobs started and not ended (the maskroll_pull_jobs_active gauge)
        self._waiting: deque[tuple[asyncio.Future, int]] = deque()  # (grant, want), first in line first

    @property
    def free(self) -> int:
        return self.total - self.taken

    async def reserve(self, want: int) -> int:
        """Wait for this puller's turn with a slot free; returns the slots reserved for it (1..want). A
        cancelled wait reserves nothing (a grant made meanwhile is given back)."""
        if want < 1:
            raise ValueError(f"want must be >= 1, got {want}")
        grant = asyncio.get_running_loop().create_future()
        self._waiting.append((grant, want))
        self._serve()
        try:
            return await grant
        except asyncio.CancelledError:
            if grant.done() and not grant.cancelled():
                self.give_back(grant.result())
            else:
                self._waiting = deque(w for w in self._waiting if w[0] is not grant)
            raise

    def give_back(self, n: int) -> None:
        """`n` reserved slots that the read did not fill."""
        if not 0 <= n <= self.taken:
            raise ValueError(f"giving back {n} slots of {self.taken} taken")
        self.taken -= n
        self._serve()

    def job_started(self) -> None:
        """One reserved slot now holds a running job (no change to `taken`)."""
        self.running += 1

    def job_ended(self) -> None:
        """A running job ended: its slot is free."""
        self.running -= 1
        self.give_back(1)

    def _serve(self) -> None:
        """Share the free slots among the waiting pullers, first in line first."""
        while self._waiting and self.free > 0:
            grant, want = self._waiting.popleft()
            if grant.done():  # cancelled: reserve() removes it, but the wake-up may come first
                continue
            n = min(want, math.ceil(self.free / (len(self._waiting) + 1)))
            self.taken += n
            grant.set_result(n)
