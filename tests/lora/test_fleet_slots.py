"""The job slots several namespaces' pullers share on one replica (server/pull/slots.py): the free slots are
shared out among the waiting pullers in the order they asked, a freed slot goes to the next in line, an
idle puller asks for one, a cancelled wait reserves nothing. Then two real PromptPullers on a real Redis
sharing pull_concurrency = 2: never more than 2 jobs at once, and a run whose 10 jobs arrive behind
another run's backlog of 40 gets every other slot, not the leftovers."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from maskroll.local.redis_server import LocalRedis
from maskroll.proto import wire
from maskroll.proto.records import PromptJob, SamplingOptions
from maskroll.proto.redis_conn import open_redis
from maskroll.proto.streams import F_JOB, StreamKeys
from maskroll.server.pull.publisher import RolloutPublisher
from maskroll.server.pull.puller import PromptPuller
from maskroll.server.pull.slots import JobSlots


async def _settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


def test_free_slots_are_shared_among_the_waiting_in_the_order_they_asked():
    async def main():
        slots = JobSlots(7)
        held = await slots.reserve(3)  # alone, with slots free: what it asked for
        assert (held, slots.free) == (3, 4)
        assert await slots.reserve(7) == 4  # alone again: every free slot
        a, b, c = (asyncio.ensure_future(slots.reserve(7)) for _ in range(3))
        await _settle()
        assert not any(f.done() for f in (a, b, c))  # the pool is full: all three wait, in this order
        slots.give_back(4)
        await _settle()
        # 4 free over 3 waiting: ceil(4/3) = 2 to the first, ceil(2/2) = 1, ceil(1/1) = 1
        assert [a.result(), b.result(), c.result()] == [2, 1, 1] and slots.free == 0
        # the pool is full: the next two freed slots go one each, in the order the pullers asked again
        c2, a2 = asyncio.ensure_future(slots.reserve(7)), None
        await _settle()
        a2 = asyncio.ensure_future(slots.reserve(7))
        slots.give_back(1)
        await _settle()
        assert c2.done() and c2.result() == 1 and not a2.done()
        slots.give_back(1)
        await _settle()
        assert a2.result() == 1 and slots.taken == 7

    asyncio.run(main())


def test_jobs_hold_their_slot_until_they_end_and_a_cancelled_wait_reserves_nothing():
    async def main():
        slots = JobSlots(2)
        got = await slots.reserve(2)
        slots.job_started()
        slots.give_back(got - 1)  # the read filled one of two
        assert (slots.taken, slots.running, slots.free) == (1, 1, 1)
        idle = await slots.reserve(1)  # an idle puller looks with one slot
        assert idle == 1 and slots.free == 0
        waiting = asyncio.ensure_future(slots.reserve(2))
        await _settle()
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        slots.give_back(1)
        slots.job_ended()
        assert (slots.taken, slots.running, slots.free) == (0, 0, 2)  # the cancelled wait took none
        with pytest.raises(ValueError, match="giving back 1 slots of 0 taken"):
            slots.give_back(1)

    asyncio.run(main())


def _job(i: int, ns: str) -> bytes:
    job = PromptJob(f"{ns}-{i:03d}", np.array([1, 2, 3], np.int32), SamplingOptions(max_tokens=2))
    return wire.job_to_pb(job).SerializeToString()


@pytest.mark.slow
def test_two_pullers_share_pull_concurrency_and_take_jobs_in_turn(tmp_path):
    started: list[str] = []
    running, most = [0], [0]

    async def run_job(job: PromptJob):
        started.append(job.job_id.split("-")[0])
        running[0] += 1
        most[0] = max(most[0], running[0])
        try:
            await asyncio.sleep(0.05)
            return []
        finally:
            running[0] -= 1

    async def main(url: str):
        r, cluster = await open_redis(url)
        slots = JobSlots(2)
        keys = {ns: StreamKeys(ns, 1, cluster) for ns in ("run-a", "run-b")}
        for i in range(40):  # run A's backlog first, then run B's jobs behind it
            await r.xadd(keys["run-a"].prompts, {F_JOB: _job(i, "a")})
        for i in range(10):
            await r.xadd(keys["run-b"].prompts, {F_JOB: _job(i, "b")})
        pullers = [
            PromptPuller(
                r,
                k,
                "rep-1",
                run_job,
                RolloutPublisher(r, k.rollouts, keys=k),
                concurrency=2,
                replica_info=lambda: {"address": "127.0.0.1:1"},
                slots=slots,
            )
            for k in keys.values()
        ]
        tasks = [asyncio.create_task(p.run()) for p in pullers]
        deadline = time.monotonic() + 60
        while len(started) < 50:
            assert time.monotonic() < deadline, f"only {len(started)} of 50 jobs started"
            await asyncio.sleep(0.05)
        for p in pullers:
            p.stop()
        for p in pullers:
            await p.drain(5)
        await asyncio.gather(*tasks)
        for k in keys.values():
            assert await r.xlen(k.prompts) == 0  # every job acked
        assert (slots.taken, slots.running) == (0, 0)
        await r.aclose()

    with LocalRedis(data_dir=tmp_path) as srv:
        asyncio.run(main(srv.url))
    assert most[0] == 2, f"{most[0]} jobs ran at once with pull_concurrency 2"
    assert started.count("a") == 40 and started.count("b") == 10
    # B's 10 jobs are taken in turn with A's backlog (seen: aaababab...ab then A's rest): all of them
    # within the first 24 starts (10 for B, 10 for A in turn, A's first grant of 2, slack for the order
    # of the first asks), not after A's 40 as when one puller takes every free slot
    last_b = max(i for i, ns in enumerate(started) if ns == "b")
    assert last_b < 24, f"run B's last job started {last_b + 1}th: {''.join(started)}"
    assert started[:20].count("a") >= 9, "".join(started)
