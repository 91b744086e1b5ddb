"""The requests a replica is running, for its one drain: the core holds one set (core.py) that every front
end adds its requests to — gRPC's and the native JSON API's Generate calls (generation/serving.py), the
OpenAI calls' choices (http_api/openai/serving.py) — and server/app.py drains. Once draining, every front
end refuses new work; `wait_idle` waits until the last running request ends; `abort_all` ends the rest now
(each unfinished sample with an "abort" record). Knows nothing of transports.
"""

from __future__ import annotations

import asyncio

from .generation.pipeline import Generation


class Running:
    def __init__(self) -> None:
        self._active: dict[str, Generation] = {}  # request_id -> the running request
        self._idle = asyncio.Event()
        self._idle.set()
        self.draining = False

    def __len__(self) -> int:
        return len(self._active)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._active

    def add(self, gen: Generation) -> None:
        self._active[gen.request_id] = gen
        self._idle.clear()

    def discard(self, gen: Generation) -> None:
        self._active.pop(gen.request_id, None)
        if not self._active:
            self._idle.set()

    def begin_drain(self) -> None:
        """Refuse new work from now on; running requests go on."""
        self.draining = True

    async def wait_idle(self, timeout: float) -> bool:
        """Whether every running request finished within `timeout` seconds."""
        if self._idle.is_set():  # wait_for(..., 0) would time out even on a set event
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    def abort_all(self) -> None:
        """End every running request now: each unfinished sample gets a record with finish_reason abort."""
        for gen in list(self._active.values()):
            gen.abort()
