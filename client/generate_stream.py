"""The client's end of a GenerateStream call: many generate requests over one gRPC call.

`RolloutClient.generate` sends every request over one such call per client (docs/architecture.md, flow
1): a gRPC call costs the replica ~0.3 ms of CPU and each message ~0.07 ms (bench/grpc_floor.py), and on
one call the replica batches the chunks of all its requests into few messages. Each request is a `Lane`: the
call's reader task routes every event to its lane by tag, and a lane yields its chunks, then ends with
the status the request ended with (the same a Generate call would have ended with). Cancelling a lane
sends a cancel for its tag; its timeout ends it with DEADLINE_EXCEEDED and cancels it. When the call
itself fails (the replica went away, the channel closed), every open lane ends with the call's status
and the client opens a new call for the next request.

Knows grpc and the generated protobuf only; `rollout_client` converts chunks and owns the channel.
"""

from __future__ import annotations

import asyncio
import collections
import itertools

import grpc

from maskroll.proto._generated import rollout_pb2 as pb


class StreamFailed(Exception):
    """A lane's request ended with a non-OK status: (code, message), as an RPC's."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code, self.message = code, message


_CODES = {c.value[0]: c for c in grpc.StatusCode}
_HIDDEN = "Internal error from Core"  # grpc.aio's status for a call whose status a failed write hid
_END = object()  # a lane's queue entry: the request ended OK


class Lane:
    """One request on a GenerateStream call: its chunks (pb.GenerateChunk) in order, then its end."""

    def __init__(self, call: GenerateStreamCall, tag: int, timeout: float | None) -> None:
        self._call, self.tag, self.loop = call, tag, call.loop
        self._items: collections.deque = collections.deque()  # chunks, then _END or a StreamFailed
        self._waiter: asyncio.Future | None = None
        self.received = 0  # events received: a lane that got none may be retried elsewhere
        self.ended = False  # its end was received (or made here: timeout, cancel, the call's failure)
        self._timer = None if timeout is None else self.loop.call_later(timeout, self._expire)

    async def read(self) -> pb.GenerateChunk | None:
        """The next chunk, or None after the last one; raises StreamFailed when the request failed."""
        while not self._items:
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = self._items.popleft()
        if item is _END:
            self._items.append(item)  # every later read ends too
            return None
        if isinstance(item, StreamFailed):
            self._items.append(item)
            raise item
        return item

    def cancel(self) -> None:
        """Stop the request (on the replica too) unless it has ended; later reads raise CANCELLED."""
        self._stop(StreamFailed(grpc.StatusCode.CANCELLED, "the request was cancelled"))

    def deliver(self, event: pb.StreamEvent) -> None:
        """From the call's reader: this lane's next event."""
        self.received += 1
        if event.HasField("chunk"):
            self._push(event.chunk)
        elif event.end.code == 0:
            self._finish(_END)
        else:
            code = _CODES.get(event.end.code, grpc.StatusCode.UNKNOWN)
            self._finish(StreamFailed(code, event.end.message))

    def fail(self, error: StreamFailed) -> None:
        """From the call: it failed, and this lane with it."""
        if not self.ended:
            self._finish(error)

    def _expire(self) -> None:
        self._timer = None
        self._stop(StreamFailed(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))

    def _stop(self, error: StreamFailed) -> None:
        """End the lane here with `error` and tell the replica to drop the request, unless it ended."""
        if not self.ended:
            self._finish(error)
            self._call.send_cancel(self.tag)

    def _finish(self, item) -> None:
        self.ended = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._call.forget(self.tag)
        self._push(item)

    def _push(self, item) -> None:
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class GenerateStreamCall:
    """One GenerateStream call on the client's loop: `open` a lane per request; `failed` once it broke."""

    def __init__(self, stub, metadata) -> None:
        self.loop = asyncio.get_running_loop()
        self._call = stub.GenerateStream(metadata=metadata)
        self._lanes: dict[int, Lane] = {}
        self._tags = itertools.count(1)
        self._outbox: asyncio.Queue[pb.StreamRequest] = asyncio.Queue()
        self.failed: StreamFailed | None = None
        self.messages = 0  # messages received: fewer than the chunks when the replica batched them
        self._writer = asyncio.create_task(self._write(), name="maskroll-generate-stream-writer")
        self._reader = asyncio.create_task(self._read(), name="maskroll-generate-stream-reader")

    def open(self, request: pb.GenerateRequest, timeout: float | None) -> Lane:
        lane = Lane(self, next(self._tags), timeout)
        self._lanes[lane.tag] = lane
        self._outbox.put_nowait(pb.StreamRequest(tag=lane.tag, generate=request))
        return lane

    def send_cancel(self, tag: int) -> None:
        if self.failed is None:
            self._outbox.put_nowait(pb.StreamRequest(tag=tag, cancel=True))

    def forget(self, tag: int) -> None:
        self._lanes.pop(tag, None)

    async def close(self) -> None:
        self._fail(StreamFailed(grpc.StatusCode.CANCELLED, "the client was closed"))
        self._call.cancel()
        for task in (self._writer, self._reader):
            task.cancel()
        await asyncio.gather(self._writer, self._reader, return_exceptions=True)

    async def _write(self) -> None:
        try:
            # The replica sends its initial metadata as the call starts (session.py): until then a call it
            # refuses at once (no such method, a bad token) could end under a write, and grpc would report
            # INTERNAL in place of the real status (see _read).
            await self._call.initial_metadata()
            if self._call.done():
                return  # refused: the reader gets the status
            while True:
                await self._call.write(await self._outbox.get())
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
            pass  # the call ended: the reader sees why and fails every lane

    async def _read(self) -> None:
        try:
            while True:
                message = await self._call.read()
                if message is grpc.aio.EOF:
                    raise StreamFailed(
                        grpc.StatusCode.UNAVAILABLE, "the replica ended the GenerateStream call"
                    )
                self.messages += 1
                lanes = self._lanes
                for event in message.events:
                    lane = lanes.get(event.tag)
                    if lane is not None:  # else: a request this side cancelled
                        lane.deliver(event)
        except grpc.aio.AioRpcError as exc:
            code, details = exc.code(), exc.details() or ""
            if code is grpc.StatusCode.INTERNAL and details == _HIDDEN:
                # A write raced with the end of the call (the replica stopped, the channel broke): grpc.aio
                # then replaces the call's status with this one (aio/_call.py `_write`). Report what a
                # replica going away is, so that callers retry elsewhere as they would for Generate.
                code, details = grpc.StatusCode.UNAVAILABLE, "the GenerateStream call broke: " + details
            self._fail(StreamFailed(code, details))
        except StreamFailed as exc:
            self._fail(exc)
        except asyncio.CancelledError:
            self._fail(StreamFailed(grpc.StatusCode.CANCELLED, "the client was closed"))
            raise
        except Exception as exc:  # a message that does not parse: the call cannot be trusted further
            self._fail(StreamFailed(grpc.StatusCode.INTERNAL, f"GenerateStream: {type(exc).__name__}: {exc}"))
            self._call.cancel()

    def _fail(self, error: StreamFailed) -> None:
        if self.failed is None:
            self.failed = error
        for lane in list(self._lanes.values()):
            lane.fail(error)
        self._lanes.clear()
        self._writer.cancel()
