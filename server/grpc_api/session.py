"""One GenerateStream call: many Generate requests over one gRPC call, their chunks batched into messages.

gRPC costs the server ~0.3 ms of CPU per call and ~0.07 ms per message on top of maskroll's own work
(bench/grpc_floor.py; docs/benchmarks.md, "Serving path, third cut"): at 128 tokens a request in ~7
chunks that was half the serving path's CPU. Here a client's requests share one call, and every chunk
that is ready when the previous message has gone leaves in the next one: chunks emitted in the same
event-loop turn (the first tokens of one engine step, the coalescing timers that fall due together:
`pipeline.Coalescing`) share a message.

    session = StreamSession(run, observe, max_message_bytes)
    async for message in session.messages(requests):   # bytes of a pb.StreamEvents
        yield message

Each request runs as a task of its own through `run` (the servicer's `push_request`: the same checks,
adapter, records and metrics as a Generate call), and ends with a StreamEnd event carrying the status
a Generate call would have ended with; a request the client cancels ends without one (the client has
forgotten it). The call ends when the client has stopped sending and every request has ended; when the
call itself ends early (the client went away, the server stops) every running request is cancelled,
which aborts its engine requests. Messages are written as bytes framed here (the response serializer
is the identity): each chunk is serialised once, and a message's size is known without protobuf.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from maskroll.proto import varint
from maskroll.proto._generated import rollout_pb2 as pb

from .errors import Observer, status_of

# Runs a request, handing each of its pb.GenerateChunk messages to the callback as soon as it is made
# (raises what Generate would abort with).
Run = Callable[[pb.GenerateRequest, Callable[[pb.GenerateChunk], None]], Awaitable[None]]

_EVENTS = b"\x0a"  # StreamEvents.events (1, length-delimited)
_TAG = b"\x08"  # StreamEvent.tag (1, varint)
_CHUNK = b"\x12"  # StreamEvent.chunk (2, length-delimited)
_END = b"\x1a"  # StreamEvent.end (3, length-delimited)


def _framed(tag: int, key: bytes, body: bytes) -> bytes:
    """A StreamEvent (tag, and `body` under `key`) as one element of StreamEvents.events."""
    event = b"".join((_TAG, varint.encode(tag), key, varint.encode(len(body)), body))
    return b"".join((_EVENTS, varint.encode(len(event)), event))


def end_event(tag: int, code: grpc.StatusCode = grpc.StatusCode.OK, message: str = "") -> bytes:
    return _framed(tag, _END, pb.StreamEnd(code=code.value[0], message=message).SerializeToString())


class StreamSession:
    def __init__(self, run: Run, observe: Observer, max_message_bytes: int) -> None:
        self._run = run
        self._observe = observe  # each request is reported as a "Generate" call would be
        self._max_bytes = max_message_bytes
        self._tasks: dict[int, asyncio.Task] = {}  # tag -> the request's task
        self._out: list[bytes] = []  # framed events not sent yet, in order
        self._wake = asyncio.Event()  # set when an event is queued, or the client stopped sending
        self._reader: asyncio.Task | None = None

    async def messages(self, requests: AsyncIterator[pb.StreamRequest]) -> AsyncIterator[bytes]:
        """The call's messages (serialised pb.StreamEvents) until the client has stopped sending and
        every request ended. Raises what reading the client's messages raised."""
        self._reader = asyncio.create_task(self._read(requests))
        try:
            while True:
                if self._out:
                    yield self._take()
                elif self._reader.done() and not self._tasks:
                    self._reader.result()  # a broken request stream ends the call with its error
                    return
                else:
                    self._wake.clear()
                    await self._wake.wait()
        finally:
            await self._cancel_all()

    def _take(self) -> bytes:
        """As many queued events as fit in one message (at least one), in order."""
        out, size, n = self._out, 0, 0
        for event in out:
            size += len(event)
            if n and size > self._max_bytes:
                break
            n += 1
        if n == len(out):
            self._out = []
            return b"".join(out)
        self._out = out[n:]
        return b"".join(out[:n])

    def _put(self, event: bytes) -> None:
        self._out.append(event)
        self._wake.set()

    async def _read(self, requests: AsyncIterator[pb.StreamRequest]) -> None:
        try:
            async for m in requests:
                action = m.WhichOneof("action")
                if action == "generate":
                    if m.tag in self._tasks:
                        self._refuse(m.tag, f"tag {m.tag} is already in flight on this call")
                    else:
                        self._tasks[m.tag] = asyncio.create_task(self._request(m.tag, m.generate))
                elif action == "cancel":
                    if (task := self._tasks.get(m.tag)) is not None:
                        task.cancel()
                else:
                    self._refuse(m.tag, "a StreamRequest needs generate or cancel")
        finally:
            self._wake.set()

    def _refuse(self, tag: int, message: str) -> None:
        self._put(end_event(tag, grpc.StatusCode.INVALID_ARGUMENT, message))

    async def _request(self, tag: int, request: pb.GenerateRequest) -> None:
        t0, code = time.perf_counter(), grpc.StatusCode.OK
        try:
            await self._run(request, lambda chunk: self._put(_framed(tag, _CHUNK, chunk.SerializeToString())))
            self._put(end_event(tag))
        except asyncio.CancelledError:  # the client cancelled it, or the call ended: nobody waits for an end
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception as exc:
            code, message = status_of("Generate", exc)
            self._put(end_event(tag, code, message))
        finally:
            self._tasks.pop(tag, None)
            if not self._tasks:
                self._wake.set()
            self._observe("Generate", code.name, time.perf_counter() - t0)

    async def _cancel_all(self) -> None:
        tasks = [t for t in (self._reader, *self._tasks.values()) if t is not None and not t.done()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
