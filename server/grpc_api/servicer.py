"""RolloutServicer: the gRPC front end of the replica's core, each method validate → convert → call →
yield (STYLE.md §6).

What a request means is the core's (server/core.py): serving a Generate or a Score is
`generation.serving`'s, every change of weights `weights.updates`', GetInfo's answer `core.info()`.
Protobuf ⇄ domain conversion is `maskroll.proto.wire`'s and the mapping of exceptions to status codes
`errors.rpc_boundary`'s. What is left here is gRPC's own part: the calls' shapes (a GenerateStream call
multiplexing requests, session.py; PushWeights' bytes served raw, `add_raw_handlers`), a push whose
client went away ended, and a refused push's remaining messages read (`drain_push`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from maskroll.proto import wire
from maskroll.proto._generated import rollout_pb2 as pb
from maskroll.proto._generated import rollout_pb2_grpc as pb_grpc

from ..core import ReplicaCore
from ..errors import InvalidArgument, ServiceError
from .errors import rpc_boundary
from .session import StreamSession


class RolloutServicer(pb_grpc.RolloutServiceServicer):
    def __init__(self, core: ReplicaCore) -> None:
        self._core = core
        self._serving, self._updates = core.serving, core.updates
        self._metrics = core.metrics
        self._max_message_bytes = core.config.max_message_bytes

    def observe_rpc(self, method: str, code: str, seconds: float) -> None:
        self._metrics.rpc_done(method, code, seconds)

    # ---- Generate -------------------------------------------------------------------------------

    @rpc_boundary("Generate")
    async def Generate(self, request: pb.GenerateRequest, context):
        async with contextlib.aclosing(self._serve(request)) as chunks:
            async for chunk in chunks:
                yield chunk

    @rpc_boundary("GenerateStream")
    async def GenerateStream(self, requests, context):
        """Many Generate requests over one call, each run by `push_request` (session.py); yields the
        bytes of each pb.StreamEvents message (its handler's response serializer is the identity)."""
        # At once, so that the client's first write cannot race a refusal (client/generate_stream.py).
        await context.send_initial_metadata(())
        stream = StreamSession(self.push_request, self.observe_rpc, self._max_message_bytes)
        async with contextlib.aclosing(stream.messages(requests)) as messages:
            async for message in messages:
                yield message

    async def _serve(self, request: pb.GenerateRequest, send=None) -> AsyncIterator[pb.GenerateChunk]:
        """One request's pb.GenerateChunk messages, or with `send` each handed to it (yielding none)."""
        self._serving.check()  # before the request is read: a draining replica refuses it as it is
        served = wire.generate_from_pb(request)
        arrays = served.include_record_arrays
        if send is not None:
            await self._serving.push(
                served, lambda chunk: send(wire.chunk_to_pb(chunk, record_arrays=arrays))
            )
            return
        async with contextlib.aclosing(self._serving.generate(served)) as chunks:
            async for chunk in chunks:
                yield wire.chunk_to_pb(chunk, record_arrays=arrays)

    async def push_request(
        self, request: pb.GenerateRequest, send: Callable[[pb.GenerateChunk], None]
    ) -> None:
        """A GenerateStream call's request: each chunk handed to `send` as soon as it is made (the call's
        outbox); returns when the request has ended, raises what a Generate call would end with."""
        async with contextlib.aclosing(self._serve(request, send)) as nothing:
            async for _ in nothing:  # pushing: the generator yields nothing
                pass

    # ---- Score ----------------------------------------------------------------------------------

    @rpc_boundary("Score")
    async def Score(self, request: pb.ScoreRequest, context) -> pb.ScoreResponse:
        """Given completions scored without sampling (records.md "Scoring")."""
        self._serving.check()
        result = await self._serving.score(wire.score_from_pb(request), request.namespace)
        return wire.score_result_to_pb(result)

    # ---- weights --------------------------------------------------------------------------------

    @rpc_boundary("UpdateWeights")
    async def UpdateWeights(self, request: pb.UpdateWeightsRequest, context) -> pb.UpdateWeightsResponse:
        return wire.update_result_to_pb(await self._updates.update(wire.update_from_pb(request)))

    @rpc_boundary("PushWeights")
    async def PushWeights(self, request_iterator, context) -> pb.UpdateWeightsResponse:
        """UpdateWeights with the tensors in the call (weights/stream.py): the push's rules are asked on
        the manifest, before any byte is received (weights/updates.py). A refusal reads what the client
        still sends (`drain_push`) before the status goes. When the client goes away (a deadline, a
        dropped connection) the request iterator may wait on: the receiving task is ended then, so
        nothing partial is kept; once received, the load runs to its end whatever the client does."""
        try:
            first = await anext(request_iterator)
        except StopAsyncIteration:
            raise InvalidArgument("PushWeights ended before its manifest") from None
        try:
            manifest = wire.manifest_from_pb(first)
        except ValueError as e:
            raise InvalidArgument(str(e)) from e
        try:
            receiving = asyncio.current_task()
            context.add_done_callback(lambda _: receiving is not None and receiving.cancel())
            try:
                received = await self._updates.receive(manifest, _push_chunks(request_iterator))
            finally:
                receiving = None
        except ServiceError:
            await drain_push(request_iterator, manifest.total_bytes)
            raise
        return wire.update_result_to_pb(await self._updates.apply(received))

    # ---- GetInfo --------------------------------------------------------------------------------

    @rpc_boundary("GetInfo")
    async def GetInfo(self, request: pb.GetInfoRequest, context) -> pb.ServerInfo:
        return wire.info_to_pb(self._core.info())


async def _push_chunks(messages: AsyncIterator) -> AsyncIterator[tuple[int, int, memoryview]]:
    """A PushWeights call's data messages (raw bytes: `add_raw_handlers`) as (tensor, offset, bytes)."""
    async for message in messages:
        try:
            yield wire.push_chunk_from_pb(message)
        except ValueError as e:
            raise InvalidArgument(str(e)) from e


async def drain_push(rest: AsyncIterator, max_bytes: int, timeout_s: float = 60.0) -> None:
    """Read and drop what a refused push still sends, up to `max_bytes` (its manifest's size) plus the
    messages' framing, or `timeout_s`. A client-streaming call that the server ends while the client is
    still writing can fail on the client with "INTERNAL: Internal error from Core" instead of the
    server's status (a write racing the status: grpc/aio/_call.py `_write`; about 1 refusal in 100 on
    loopback), and the reason of the refusal is lost. Best effort: whatever ends the reading ends it."""

    async def read() -> None:
        seen = 0
        async for message in rest:
            seen += len(message) if isinstance(message, bytes) else message.ByteSize()
            if seen > max_bytes + (16 << 20):  # room for 16 bytes of framing per 1 KiB message
                return

    with contextlib.suppress(Exception):  # a reset or expired call, the time limit: nothing more to read
        await asyncio.wait_for(read(), timeout_s)


def add_raw_handlers(servicer: RolloutServicer, server) -> None:
    """Serve two methods with bytes where protobuf would copy (after `add_RolloutServiceServicer_to_server`,
    which this overrides for them): PushWeights with no request deserializer, so that
    `wire.push_chunk_from_pb` takes the tensor bytes as a view into each message, where protobuf's parse
    and field access would copy every pushed byte twice more (bench/weights.py); and GenerateStream with
    no response serializer, as its messages are framed from chunks serialised once (session.py)."""
    import grpc

    push = grpc.stream_unary_rpc_method_handler(
        servicer.PushWeights, response_serializer=pb.UpdateWeightsResponse.SerializeToString
    )
    stream = grpc.stream_stream_rpc_method_handler(
        servicer.GenerateStream, request_deserializer=pb.StreamRequest.FromString
    )
    service = pb.DESCRIPTOR.services_by_name["RolloutService"].full_name
    server.add_registered_method_handlers(service, {"PushWeights": push, "GenerateStream": stream})
