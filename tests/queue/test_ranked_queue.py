"""RankedQueue (client/ranks.py) on one rank against a real Redis and a scripted replica: it behaves as a
RolloutQueue (whole groups, acks), its consumer name is stable so a restarted rank 0 re-reads its own
records at once, `skip_trained` acks a published version's records untrained, and ranks > 0 are told
what only rank 0 holds. Several ranks over torch.distributed: tests/learner (the recipe under torchrun).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest
import redis
from scripted import scripted_replica

from maskroll.client import RankedQueue, RankFailed, SamplingOptions, SingleRank
from maskroll.proto.streams import StreamKeys

OPTS = SamplingOptions(max_tokens=5, logprobs_k=2)


@contextlib.contextmanager
def background_replica(url: str, ns: str):
    """The scripted pull-mode replica on its own event loop thread, while the sync queue is used here."""
    ready, stop = threading.Event(), None
    loop = asyncio.new_event_loop()

    async def serve():
        nonlocal stop
        stop = asyncio.Event()
        async with scripted_replica(url, ns):
            ready.set()
            await stop.wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    assert ready.wait(20)
    try:
        yield
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(20)
        loop.close()


def _done(url: str, ns: str) -> set[str]:
    r = redis.Redis.from_url(url)
    try:
        return {m.decode() for m in r.zrange(StreamKeys(ns).done, 0, -1)}
    finally:
        r.close()


def test_one_rank_is_a_rolloutqueue_with_a_stable_consumer(redis_server, namespace):
    url = redis_server.url
    with background_replica(url, namespace):
        with RankedQueue(SingleRank(), url, namespace, run="new", batch_size=8, max_staleness=1) as rq:
            assert rq.is_main and rq.consumer == f"{namespace}-rank0"
            jobs = [rq.submit([1, 2, 3], OPTS, n=4) for _ in range(4)]
            batch = rq.next_batch(timeout=20)
            assert len(batch) == 8 and rq.policy_version == 0
            assert all(sum(r.job_id == j for r in batch) in (0, 4) for j in jobs)  # whole groups
            assert sorted(r.rollout_id for r in rq.global_batch) == sorted(r.rollout_id for r in batch)
            rq.ack(batch)
            assert _done(url, namespace) == {r.rollout_id for r in batch} and rq.stats.acked == 8
            with pytest.raises(ValueError, match="acked 4 records, not the 0"):
                rq.ack(batch[:4])  # nothing held: a rank acking what it was not given is refused
            held = rq.next_batch(timeout=20)  # two more groups, read and never acked: rank 0 "killed"
        # a restarted rank 0 (same consumer name) gets its own unacked records back at once; those
        # a published version already trained on are acked untrained and never handed out
        trained = {r.rollout_id for r in held}
        with RankedQueue(SingleRank(), url, namespace, run="resume", batch_size=4, max_staleness=1) as rq:
            rq.skip_trained(trained)
            rq.submit([4, 5, 6], OPTS, n=4)
            again = rq.next_batch(timeout=20)
            assert not {r.rollout_id for r in again} & trained
            assert trained <= _done(url, namespace)
            assert rq.stats.reclaimed == 0  # read back as its own pending entries, not reclaimed
            rq.ack(again)


def test_refill_runs_while_rank_0_waits(redis_server, namespace):
    """next_batch(refill=...): rank 0 tops up while it waits, so room freed during the wait is used."""
    url = redis_server.url
    calls = []
    with (
        background_replica(url, namespace),
        RankedQueue(SingleRank(), url, namespace, run="new", batch_size=4, max_staleness=0) as rq,
    ):

        def refill():  # nothing was submitted before the wait: only a refill makes the batch
            calls.append(rq.room())
            if rq.room() >= 4:
                rq.submit([7, 8], OPTS, n=4)

        batch = rq.next_batch(timeout=30, refill=refill)
        assert len(batch) == 4 and calls[0] == 4  # the first refill saw the whole in-flight room
        rq.ack(batch)


class _OtherRank:
    """Rank 1 of 2, whose collectives answer what rank 0 would send (the test plays rank 0)."""

    rank, world_size = 1, 2

    def __init__(self, sent: tuple) -> None:
        self.sent = sent

    def broadcast(self, obj, src=0):
        return self.sent

    def scatter(self, objs, src=0):
        return self.sent

    def all_gather(self, obj):
        return [obj, obj]

    def barrier(self):
        return None


def test_other_ranks_hold_no_queue_and_hear_rank_0s_errors(redis_server, namespace):
    rq = RankedQueue(_OtherRank(("ok", None)), redis_server.url, namespace, run="new")
    assert rq.queue is None and not rq.is_main
    for call in (lambda: rq.submit([1], OPTS), lambda: rq.room(), lambda: rq.skip_trained([])):
        with pytest.raises(ValueError, match=r"rank 0's .* this is rank 1 of 2"):
            call()
    with pytest.raises(ValueError, match=r"RankedQueue\.run_id is rank 0's"):
        rq.run_id  # noqa: B018
    # rank 0 could not open the queue (another run owns the namespace, ...): every rank raises
    with pytest.raises(RankFailed, match="rank 0 failed: RunChoiceRequired: taken"):
        RankedQueue(_OtherRank(("error", ("RunChoiceRequired", "taken"))), redis_server.url, namespace)
    failed = RankedQueue(_OtherRank(("ok", None)), redis_server.url, namespace)
    failed.collective.sent = ("error", ("QueueTimeout", "no batch of 8 rollouts within 1 s"))
    with pytest.raises(RankFailed, match="QueueTimeout: no batch of 8"):
        failed.next_batch(timeout=1)
