"""A trainer on a namespace with no replicas, while replicas run on the same Redis under another one (a
wrong --namespace): the queue's timeout and the recipe's wait say so at once, naming the namespaces
that do have replicas. Real Redis, scripted in-process replicas."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import pytest
from scripted import scripted_replica

from maskroll.client import AsyncRolloutQueue, QueueTimeout, RolloutQueue
from maskroll.client.replicas import namespaces_with_replicas
from maskroll.proto.redis_conn import connect


@contextlib.contextmanager
def replica_in_thread(url: str, ns: str, name: str, **kw):
    """A scripted replica on its own event loop thread, for blocking (sync) trainers."""
    started, stop = threading.Event(), None
    loop = asyncio.new_event_loop()

    async def main():
        nonlocal stop
        stop = asyncio.Event()
        async with scripted_replica(url, ns, name, **kw):
            started.set()
            await stop.wait()

    t = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    t.start()
    assert started.wait(10)
    try:
        yield
    finally:
        loop.call_soon_threadsafe(stop.set)
        t.join(20)
        loop.close()


async def _until_registered(r, ns: str, n: int) -> None:
    for _ in range(100):
        if (await namespaces_with_replicas(r)).get(ns, 0) >= n:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{n} replicas never registered in {ns!r}")


def test_namespaces_with_replicas_finds_both_layouts_and_nothing_else(redis_server):
    async def main():
        r = connect(redis_server.url)
        await r.xadd("maskroll:noise:rollouts:replica:x", {b"r": b""})  # a named rollout stream
        async with (
            scripted_replica(redis_server.url, "ns-plain", "rep-a"),
            scripted_replica(redis_server.url, "ns-plain", "rep-b"),
            scripted_replica(redis_server.url, "ns-parts", "rep-c", partitions=2),
        ):
            await _until_registered(r, "ns-parts", 1)
            await _until_registered(r, "ns-plain", 2)
            found = await namespaces_with_replicas(r)
            assert {ns: found[ns] for ns in ("ns-plain", "ns-parts")} == {"ns-plain": 2, "ns-parts": 1}
            assert "noise" not in found and "noise:rollouts" not in found
            assert len(await namespaces_with_replicas(r, max_keys=1)) == 1  # bounded
        await r.aclose()

    asyncio.run(main())


def test_a_timeout_with_no_replica_names_the_namespaces_that_have_them(redis_server):
    async def main():
        async with scripted_replica(redis_server.url, "the-right-one", "rep-a"):
            await _until_registered(connect(redis_server.url), "the-right-one", 1)
            async with AsyncRolloutQueue(redis_server.url, "a-typo", batch_size=2) as q:
                t0 = time.monotonic()
                with pytest.raises(QueueTimeout) as e:
                    await q.next_batch(timeout=0.5)
                assert time.monotonic() - t0 < 5
                message = str(e.value)
                assert "0 live replicas in namespace 'a-typo'" in message
                assert "namespaces with live replicas on this Redis: 'the-right-one' (1)" in message

    asyncio.run(main())


def test_the_recipes_wait_says_at_once_and_every_period_what_is_missing_and_where_replicas_are(
    redis_server, capsys
):
    from maskroll.recipes.grpo import wait_for_replicas

    with (
        replica_in_thread(redis_server.url, "wait-right", "rep-a"),
        RolloutQueue(redis_server.url, "wait-typo", batch_size=2) as q,
    ):
        asyncio.run(_until_registered(connect(redis_server.url), "wait-right", 1))
        t0 = time.monotonic()
        with pytest.raises(TimeoutError) as e:
            wait_for_replicas(q, 1, timeout=1.5, every=0.6)
        assert time.monotonic() - t0 < 5
        assert "0 of 1 replicas registered in namespace 'wait-typo'" in str(e.value)
        assert "'wait-right' (1)" in str(e.value)
        lines = [x for x in capsys.readouterr().out.splitlines() if "waiting for replicas" in x]
        assert len(lines) in (3, 4)  # at once, then every 0.6 s until the timeout
        assert "after 0 s" in lines[0] and all("'wait-right' (1)" in x for x in lines)
        # enough replicas: no wait, no words
        assert [r.replica_id for r in wait_for_replicas(q, 0, timeout=1)] == []
