"""Fan one request (`pipeline.Generation`) out into n engine streams; merge their outputs in arrival order.

Owns the lifetime of the engine streams: leaving `async with FanOut(...)` — normally, by an error, or
because the client went away and the handler was cancelled — cancels every stream still running and
waits for it, which aborts the request in the engine (Engine contract). Knows nothing of gRPC or records.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from .engine import Engine, EngineOutput, EngineRequest
from .errors import InvalidArgument

_END = object()  # a sample's engine stream ended
_ABORT = object()  # the server is draining: stop reading, the caller ends the unfinished samples


class FanOut:
    def __init__(self, engine: Engine, requests: list[EngineRequest]) -> None:
        self._engine = engine
        self._requests = requests
        # Unbounded: at most max_tokens outputs per sample, and the sample builders keep them for the record.
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self.aborted = False

    async def __aenter__(self) -> FanOut:
        self._tasks = [
            asyncio.create_task(self._pump(i, r), name=f"engine-stream:{r.request_id}")
            for i, r in enumerate(self._requests)
        ]
        return self

    async def __aexit__(self, *exc_info) -> None:
        for task in self._tasks:
            task.cancel()
        # Wait for the engine to see the cancellation, so "the stream ended" implies "the engine freed
        # the request". The pumps' own CancelledErrors are the ones raised just above.
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _pump(self, index: int, request: EngineRequest) -> None:
        produced = False
        try:
            async with contextlib.aclosing(self._engine.generate(request)) as stream:
                async for out in stream:
                    produced = True
                    self._queue.put_nowait((index, out))
        except ValueError as exc:
            # Engines raise ValueError for parameters they cannot serve (vLLM: temperature > 2), and
            # they check before the first token: a refusal of the request, not a server fault.
            if not produced:
                exc = InvalidArgument(f"the {self._engine.name} engine refused the request: {exc}")
            self._queue.put_nowait((index, exc))
        except Exception as exc:  # handed to the consumer, which re-raises it at the RPC boundary
            self._queue.put_nowait((index, exc))
        else:
            self._queue.put_nowait((index, _END))

    def abort(self) -> None:
        """Make `outputs()` return at once (drain); the unfinished samples are the caller's to end."""
        self.aborted = True
        self._queue.put_nowait((None, _ABORT))

    async def outputs(self) -> AsyncIterator[tuple[int, EngineOutput | None]]:
        """(sample index, output) in arrival order; (sample index, None) when that sample's stream ends."""
        live = len(self._requests)
        while live:
            index, item = await self._queue.get()
            if item is _ABORT:
                return
            if item is _END:
                live -= 1
                yield index, None
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
