"""streams.GroupConsumer against a real Redis: the take / reclaim / keep-claimed / drain half of the
at-least-once rules that the prompt puller and the stage workers share — new entries on every partition,
a dead consumer's entries taken over with their delivery counts (a poison entry's count grows with each
death), a live consumer's entries never taken over while it re-claims them."""

from __future__ import annotations

import asyncio

from maskroll.proto.consumer import GroupConsumer
from maskroll.proto.redis_conn import open_redis
from maskroll.proto.streams import StreamKeys, ensure_group

GROUP = "g"


class Recorder:
    """A handle that records each entry it gets and then works on it until released (or cancelled)."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, bytes, int]] = []  # (partition, payload, deliveries)
        self.release = asyncio.Event()

    async def __call__(self, part, entry_id, fields, deliveries) -> None:
        self.seen.append((part.index, fields[b"x"], deliveries))
        await self.release.wait()


def _consumer(r, keys, name, handle, claim_idle_s, **kw) -> GroupConsumer:
    return GroupConsumer(
        r,
        keys,
        lambda p: p.prompts,
        GROUP,
        name,
        handle,
        claim_idle_s=claim_idle_s,
        min_reclaim_every_s=0,
        **kw,
    )


async def _setup(url: str, namespace: str, payloads: dict[int, list[bytes]]):
    r, _ = await open_redis(url)
    keys = StreamKeys(namespace, partitions=2)
    for part in keys.parts:
        await ensure_group(r, part.prompts, GROUP)
        for x in payloads.get(part.index, []):
            await r.xadd(part.prompts, {b"x": x})
    return r, keys


def test_a_dead_consumers_entries_are_taken_over_with_their_delivery_counts(redis_server, namespace) -> None:
    async def main():
        r, keys = await _setup(redis_server.url, namespace, {0: [b"a"], 1: [b"b", b"c"]})
        sizes: list[int] = []
        first = Recorder()
        a = _consumer(r, keys, "a", first, 0.2, on_active=sizes.append)
        assert await a.take(10) == 0  # new entries, none reclaimed: one partition swept, then the other
        assert await a.take(10) == 0
        await asyncio.sleep(0)  # the tasks start
        assert sorted(first.seen) == [(0, b"a", 1), (1, b"b", 1), (1, b"c", 1)]
        assert sizes == [1, 2, 3] and len(a.active) == 3
        assert await a.drain(0) == 3  # a dies: its entries stay pending
        assert a.active == {} and sizes[-1] == 0

        await asyncio.sleep(0.3)  # past claim_idle_s
        second = Recorder()
        b = _consumer(r, keys, "b", second, 0.2)
        assert await b.take(2) == 2  # at most `free`
        await asyncio.sleep(0.1)  # the next reclaim pass is due claim_idle_s / 4 later
        assert await b.take(2) == 1
        await asyncio.sleep(0)
        assert sorted(second.seen) == [(0, b"a", 2), (1, b"b", 2), (1, b"c", 2)]
        await b.drain(0)

        await asyncio.sleep(0.3)  # b died too: a third delivery each (a poison entry's count keeps growing)
        third = Recorder()
        c = _consumer(r, keys, "c", third, 0.2)
        assert await c.take(10) == 3
        await asyncio.sleep(0)
        assert sorted(third.seen) == [(0, b"a", 3), (1, b"b", 3), (1, b"c", 3)]
        third.release.set()
        assert await c.drain(5) == 0 and c.active == {}
        await r.aclose()

    asyncio.run(main())


def test_a_live_consumer_keeps_its_entries_and_redelivery_counts_only_takes(redis_server, namespace) -> None:
    async def main():
        r, keys = await _setup(redis_server.url, namespace, {1: [b"slow"]})
        mine = Recorder()
        a = _consumer(r, keys, "a", mine, 1.0)
        await a.take(1)
        await a.take(1)
        await asyncio.sleep(0)
        assert mine.seen == [(1, b"slow", 1)]

        await asyncio.sleep(1.1)  # idle past claim_idle_s, but a is alive and re-claims it
        await a.keep_claimed()
        other = Recorder()
        b = _consumer(r, keys, "b", other, 1.0)
        assert await b.take(5) == 0 and other.seen == [] and b.active == {}
        pending = await r.xpending_range(keys.part(1).prompts, GROUP, "-", "+", 10)
        assert [(p["consumer"], p["times_delivered"]) for p in pending] == [(b"a", 1)]  # JUSTID: not counted

        await a.drain(0)  # a dies
        await asyncio.sleep(1.1)
        assert await b.take(5) == 1
        await asyncio.sleep(0)
        assert other.seen == [(1, b"slow", 2)]
        await b.drain(0)
        await r.aclose()

    asyncio.run(main())


def test_each_redis_call_of_take_goes_through_call(redis_server, namespace) -> None:
    async def main():
        r, keys = await _setup(redis_server.url, namespace, {0: [b"a"]})
        calls: list[float] = []

        async def call(aw):  # the puller's: it times each call for its health
            calls.append(asyncio.get_running_loop().time())
            return await aw

        rec = Recorder()
        a = _consumer(r, keys, "a", rec, 60.0, call=call)
        await a.take(4)
        assert len(calls) == 4  # XAUTOCLAIM on both partitions (nothing idle), then a sweep of both
        await a.take(4)
        # no reclaim due for claim_idle/4 = 15 s: a sweep of both finds nothing, one blocking read waits
        assert len(calls) == 4 + 3
        await asyncio.sleep(0)
        assert rec.seen == [(0, b"a", 1)]
        await a.drain(0)
        await r.aclose()

    asyncio.run(main())
