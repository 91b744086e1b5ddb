"""GenerateStream: many generate requests over one gRPC call (server/grpc_api/session.py on the
replica, client/generate_stream.py in the SDK).

The session alone first (no gRPC: a scripted `run` per request, so that which events share a message is
exact), then the whole path over a real grpc.aio server around the scripted FakeEngine: the same
records as one Generate call per request, a cancelled or timed-out request that leaves the others
running, per-request errors, a replica without GenerateStream, and a call that breaks.
"""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
from grpc_fixtures import replica, server_config, server_loop, wait_until  # noqa: F401

from maskroll.client import RecordAssembler, RolloutClient, RolloutError, SamplingOptions
from maskroll.proto._generated import rollout_pb2 as pb
from maskroll.server.errors import InvalidArgument
from maskroll.server.grpc_api.session import StreamSession

# ---- the session alone ------------------------------------------------------------------------------


def chunk(request: pb.GenerateRequest, i: int) -> pb.GenerateChunk:
    return pb.GenerateChunk(request_id=request.request_id, start_index=i, token_ids=bytes([i, 0, 0, 0]))


class Script:
    """Each request's `run` (the servicer's push_request): a chunk per step, handed to `send`, the steps
    released for every request at once."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.released = 0
        self._step = asyncio.Condition()
        self.closed: list[str] = []  # requests whose run was closed before its last chunk
        self.observed: list[tuple[str, str]] = []

    async def release(self) -> None:
        async with self._step:
            self.released += 1
            self._step.notify_all()

    async def run(self, request: pb.GenerateRequest, send) -> None:
        if request.request_id.startswith("bad"):
            raise InvalidArgument("request_id: refused by the script")
        if request.request_id.startswith("crash"):
            raise RuntimeError("the script broke")
        done = False
        try:
            for i in range(self.steps):
                async with self._step:
                    await self._step.wait_for(lambda i=i: self.released > i)
                send(chunk(request, i))
            done = True
        finally:
            if not done:
                self.closed.append(request.request_id)

    def observe(self, method: str, code: str, seconds: float) -> None:
        self.observed.append((method, code))


class Requests:
    """The client's side of the call: messages put by the test, ended by `close()`."""

    def __init__(self) -> None:
        self._q: asyncio.Queue = asyncio.Queue()

    def generate(self, tag: int, request_id: str) -> None:
        self._q.put_nowait(pb.StreamRequest(tag=tag, generate=pb.GenerateRequest(request_id=request_id)))

    def cancel(self, tag: int) -> None:
        self._q.put_nowait(pb.StreamRequest(tag=tag, cancel=True))

    def send(self, m: pb.StreamRequest) -> None:
        self._q.put_nowait(m)

    def close(self) -> None:
        self._q.put_nowait(None)

    def __aiter__(self):
        return self

    async def __anext__(self) -> pb.StreamRequest:
        m = await self._q.get()
        if m is None:
            raise StopAsyncIteration
        return m


def session_of(steps: int, max_message_bytes: int = 1 << 20) -> tuple[Script, Requests, StreamSession]:
    """A session running `Script(steps)`'s requests, and the client side that feeds it."""
    script = Script(steps)
    return script, Requests(), StreamSession(script.run, script.observe, max_message_bytes)


async def collect(session: StreamSession, requests: Requests) -> list[list[pb.StreamEvent]]:
    return [list(pb.StreamEvents.FromString(m).events) async for m in session.messages(requests)]


async def settle() -> None:
    for _ in range(10):  # every ready task runs to its next wait
        await asyncio.sleep(0)


def test_chunks_of_one_step_share_a_message_then_every_request_ends():
    async def main():
        script, requests, session = session_of(3)
        for tag in (1, 2, 3, 4):
            requests.generate(tag, f"r{tag}")
        requests.close()
        consumer = asyncio.create_task(collect(session, requests))
        for _ in range(3):
            await settle()
            await script.release()
        return await consumer, script

    messages, script = asyncio.run(main())
    # One message per step; the last one also carries every request's end.
    assert [len(m) for m in messages] == [4, 4, 8]
    for tag in (1, 2, 3, 4):
        events = [e for m in messages for e in m if e.tag == tag]
        assert [e.chunk.start_index for e in events[:3]] == [0, 1, 2]
        assert [e.chunk.request_id for e in events[:3]] == [f"r{tag}"] * 3
        assert events[3].WhichOneof("event") == "end" and events[3].end.code == 0
    assert script.observed == [("Generate", "OK")] * 4


def test_a_message_holds_what_fits_and_at_least_one_event():
    async def main(limit: int):
        script, requests, session = session_of(1, limit)
        for tag in range(1, 7):
            requests.generate(tag, "x" * 40)
        requests.close()
        consumer = asyncio.create_task(session.messages(requests).__anext__())
        await settle()
        await script.release()
        first = await consumer  # the whole step is queued by the time the first message is taken
        events = pb.StreamEvents.FromString(first).events
        return len(first), sum(e.HasField("chunk") for e in events)  # each chunk is followed by a tiny end

    one_event = len(
        pb.StreamEvents(
            events=[pb.StreamEvent(tag=1, chunk=chunk(pb.GenerateRequest(request_id="x" * 40), 0))]
        ).SerializeToString()
    )
    size, n = asyncio.run(main(limit=int(2.5 * one_event)))
    assert n == 2 and 2 * one_event < size <= 2.5 * one_event
    size, n = asyncio.run(main(limit=1))  # an event larger than the limit still goes, alone
    assert n == 1 and size == one_event


def test_errors_end_their_request_with_its_status_and_cancel_ends_it_silently():
    async def main():
        script, requests, session = session_of(2)
        requests.generate(1, "bad-1")
        requests.generate(2, "crash-2")
        requests.generate(3, "ok-3")
        requests.generate(4, "cancelled-4")
        requests.generate(3, "again")  # tag 3 is in flight
        requests.send(pb.StreamRequest(tag=9))  # neither generate nor cancel
        consumer = asyncio.create_task(collect(session, requests))
        await settle()
        requests.cancel(4)
        await settle()
        await script.release()
        await script.release()
        requests.close()
        return await consumer, script

    messages, script = asyncio.run(main())
    events = [e for m in messages for e in m]
    ends = {e.tag: e.end for e in events if e.WhichOneof("event") == "end"}
    assert ends[1].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert ends[1].message == "request_id: refused by the script"
    assert ends[2].code == grpc.StatusCode.INTERNAL.value[0] and "the script broke" in ends[2].message
    assert (
        ends[9].code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "generate or cancel" in ends[9].message
    )
    assert ends[3].code == 0 and 4 not in ends  # a cancelled request gets no end: its client forgot it
    assert [e.chunk.start_index for e in events if e.tag == 3 and e.HasField("chunk")] == [0, 1]
    refused = [e for e in events if e.tag == 3 and e.HasField("end")]
    assert [e.end.code for e in refused] == [grpc.StatusCode.INVALID_ARGUMENT.value[0], 0]
    assert "tag 3 is already in flight" in refused[0].end.message
    assert script.closed == ["cancelled-4"]
    assert sorted(script.observed) == sorted(
        [
            ("Generate", "INVALID_ARGUMENT"),
            ("Generate", "INTERNAL"),
            ("Generate", "OK"),
            ("Generate", "CANCELLED"),
        ]
    )


def test_leaving_the_call_cancels_every_running_request():
    async def main():
        script, requests, session = session_of(5)
        requests.generate(1, "a")
        requests.generate(2, "b")
        messages = session.messages(requests)
        consumer = asyncio.create_task(messages.__anext__())
        await settle()
        await script.release()
        await consumer
        await messages.aclose()  # the call ended (the client went away, the server stops)
        return script

    script = asyncio.run(main())
    assert sorted(script.closed) == ["a", "b"]


# ---- over gRPC --------------------------------------------------------------------------------------


def options(seed: int, **kw) -> SamplingOptions:
    return SamplingOptions(
        **{"max_tokens": 12, "logprobs_k": 3, "n": 2, "seed": seed, "ignore_eos": True, **kw}
    )


def test_concurrent_requests_on_one_call_match_one_call_each(fake):
    r, _ = fake(config={"chunk_interval_ms": 20}, token_delay_s=0.003)
    chunks = []

    async def records(client: RolloutClient, i: int) -> list:
        assembler, out = RecordAssembler(), {}
        async for c in client.generate([1, 2, 3 + i], options(i), request_id=f"q{i}"):
            chunks.append(c)
            if (record := assembler.add(c)) is not None:
                out[record.sample_index] = record
        return [out[0], out[1]]

    async def run(client: RolloutClient) -> list:
        return await asyncio.gather(*[records(client, i) for i in range(8)])

    async def main():
        async with RolloutClient(r.address) as multi, RolloutClient(r.address, multiplex=False) as single:
            together = await run(multi)
            call, n_chunks = multi._stream, len(chunks)
            alone = await run(single)
            return together, alone, call, multi._stream, call.failed, single._stream, n_chunks

    together, alone, call, call_after, failed, no_call, n_chunks = asyncio.run(main())
    assert call is not None and call is call_after and failed is None and no_call is None
    # 16 samples of 12 tokens, ~36 ms each, in chunks of at most 20 ms: >= 3 chunks per sample
    assert n_chunks >= 48 and 1 <= call.messages < n_chunks  # chunks of several requests shared messages
    for a, b in zip(together, alone, strict=True):
        for x, y in zip(a, b, strict=True):
            assert x.request_id == y.request_id and x.sample_index == y.sample_index
            assert x.finish_reason == y.finish_reason == "length"
            np.testing.assert_array_equal(x.completion_ids, y.completion_ids)
            np.testing.assert_array_equal(x.sampled_logprobs, y.sampled_logprobs)
            np.testing.assert_array_equal(x.topk_ids, y.topk_ids)
            np.testing.assert_array_equal(x.topk_logprobs, y.topk_logprobs)
            assert len(x.completion_ids) == 12


def test_a_cancelled_or_timed_out_request_ends_alone(fake):
    r, engine = fake(token_delay_s=0.01)

    async def main():
        async with RolloutClient(r.address) as c:
            slow = asyncio.create_task(
                c.generate_record([4, 5], options(1, n=1, max_tokens=40), request_id="survivor")
            )
            stream = c.generate([4, 5], options(2, n=1, max_tokens=200), request_id="dropped")
            async for _ in stream:
                break
            await stream.aclose()
            with pytest.raises(RolloutError) as late:
                await c.generate_record(
                    [4, 5], options(3, n=1, max_tokens=200), request_id="late", timeout=0.2
                )
            record = await slow
            after = await c.generate_record([4, 5], options(4, n=1, max_tokens=3))
            return record, late.value, after

    record, late, after = asyncio.run(main())
    assert late.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert record.request_id == "survivor" and len(record.completion_ids) == 40
    assert len(after.completion_ids) == 3
    # the engine dropped both: the cancel reached the replica
    wait_until(lambda: {"dropped-0", "late-0"} <= set(engine.aborted), what="the engine to abort both")


def test_an_invalid_request_fails_alone(fake):
    r, _ = fake(vocab_size=50)

    async def main():
        async with RolloutClient(r.address) as c:
            good, bad = await asyncio.gather(
                c.generate_record([1, 2], options(1, n=1)),
                c.generate_record([1, 999], options(2, n=1)),  # 999 is past the vocabulary
                return_exceptions=True,
            )
            call = c._stream
            after = await c.generate_record([3, 4], options(3, n=1, max_tokens=5))  # the same call serves on
            return good, bad, after, call is c._stream and call.failed is None

    good, bad, after, same_call = asyncio.run(main())
    assert len(good.completion_ids) == 12
    assert isinstance(bad, RolloutError) and bad.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt" in bad.message
    assert len(after.completion_ids) == 5 and same_call


def test_a_replica_without_generate_stream_gets_one_call_per_request(fake, server_loop):  # noqa: F811
    r, _ = fake()

    async def old_server():  # only Generate and GetInfo, as a replica built before GenerateStream
        servicer = r.servicer
        handlers = {
            "Generate": grpc.unary_stream_rpc_method_handler(
                servicer.Generate,
                request_deserializer=pb.GenerateRequest.FromString,
                response_serializer=pb.GenerateChunk.SerializeToString,
            )
        }
        server = grpc.aio.server()
        server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    pb.DESCRIPTOR.services_by_name["RolloutService"].full_name, handlers
                ),
            )
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = server_loop.run(old_server())
    try:

        async def main():
            async with RolloutClient(f"127.0.0.1:{port}") as c:
                first = await asyncio.gather(*[c.generate_record([1, 2], options(i, n=1)) for i in range(3)])
                second = await c.generate_record([1, 2], options(7, n=1))
                return first, second, c._multiplex

        first, second, multiplex = asyncio.run(main())
    finally:
        server_loop.run(server.stop(0))
    assert [len(x.completion_ids) for x in [*first, second]] == [12] * 4
    assert multiplex is False  # it stopped trying GenerateStream


def test_a_broken_call_fails_its_requests_and_the_next_request_opens_a_new_one(fake, server_loop):  # noqa: F811
    r, _ = fake(token_delay_s=0.01)

    async def main():
        async with RolloutClient(r.address) as c:
            await c.generate_record([1, 2], options(1, n=1, max_tokens=2))
            first = c._stream
            stream = c.generate([1, 2], options(2, n=1, max_tokens=200))
            async for _ in stream:
                break
            await asyncio.to_thread(server_loop.run, r.server.stop(0))  # the replica goes away
            with pytest.raises(RolloutError) as broken:
                async for _ in stream:
                    pass
            with pytest.raises(RolloutError) as refused:
                await c.generate_record([1, 2], options(3, n=1, max_tokens=2), timeout=5)
            return first, c._stream, broken.value, refused.value

    first, second, broken, refused = asyncio.run(main())
    assert first.failed is not None and second is not first
    assert broken.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
    assert refused.code == grpc.StatusCode.UNAVAILABLE
