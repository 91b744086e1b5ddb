"""Fan one request (`pipeline.Generation`) out into n engine streams; merge what they produce in order.

Owns the lifetime of the engine streams: leaving `async with FanOut(...)` — normally, by an error, or
because the client went away and the handler was cancelled — cancels every stream still running and
waits for it, which aborts the request in the engine (Engine contract). Each engine output is handed to
`on_output(index, output)` (or `sinks[index](output)`) in the task that read it; that callback `emit`s
what the consumer should see (by default the output itself), so a caller that gathers several outputs
into one item wakes the consumer once per item, not once per output. Knows nothing of gRPC or records.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from ..engines.contract import Engine, EngineOutput, EngineRequest
from ..errors import InvalidArgument

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
        # Called in the engine stream's task for each output; it may raise (the request then fails).
        self.on_output: Callable[[int, EngineOutput], None] = self.emit
        # Or one callback per sample, called with the output alone (one call less per token).
        self.sinks: list[Callable[[EngineOutput], None]] | None = None
        # Called in a sample's engine stream's task when that stream ends normally, before the consumer
        # is told: anything the sample would emit later (a timer's chunk) would come after its end.
        self.ends: list[Callable[[], None]] | None = None

    def emit(self, index: int, item: Any) -> None:
        """Hand `item` of sample `index` to the consumer (`items()`), after everything emitted before."""
        self._queue.put_nowait((index, item))

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
        sink = self.sinks[index] if self.sinks is not None else functools.partial(self.on_output, index)
        try:
            async with contextlib.aclosing(self._engine.generate(request)) as stream:
                async for out in stream:
                    produced = True
                    sink(out)
        except ValueError as exc:
            # Engines raise ValueError for parameters they cannot serve (vLLM: temperature > 2), and
            # they check before the first token: a refusal of the request, not a server fault.
            if not produced:
                exc = InvalidArgument(f"the {self._engine.name} engine refused the request: {exc}")
            self._queue.put_nowait((index, exc))
        except Exception as exc:  # handed to the consumer, which re-raises it at the RPC boundary
            self._queue.put_nowait((index, exc))
        else:
            if self.ends is not None:
                self.ends[index]()
            self._queue.put_nowait((index, _END))

    def abort(self) -> None:
        """Make `items()` return at once (drain); the unfinished samples are the caller's to end."""
        self.aborted = True
        self._queue.put_nowait((None, _ABORT))

    async def items(self) -> AsyncIterator[tuple[int, Any]]:
        """(sample index, item) in the order emitted; (sample index, None) when that sample's stream ends."""
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

    def leftover(self) -> Iterator[tuple[int, Any]]:
        """After an abort and the end of `async with`: the items emitted that `items()` did not reach
        (the callback may already have counted them as sent, so they must not be lost)."""
        while not self._queue.empty():
            index, item = self._queue.get_nowait()
            if item is not _ABORT and item is not _END and not isinstance(item, Exception):
                yield index, item
