"""The queue SDK split by concern, checked without Redis: what each module loads, the sync facade's
signatures, and the pure parts (batch assembly, admission) on hand-built records.

The Redis paths of the same code are exercised end to end in test_queue.py.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import subprocess
import sys

import numpy as np
import pytest

from maskroll.client.admission import InFlight, QueueFull, in_flight_limit
from maskroll.client.batching import GroupBatcher, refusal, staleness, too_stale
from maskroll.client.queue import AsyncRolloutQueue, RolloutQueue
from maskroll.proto.records import RolloutRecord, Semantics


def _loaded(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", f"import sys, json\n{code}\nprint(json.dumps(sorted(sys.modules)))"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return set(json.loads(out.stdout))


@pytest.mark.parametrize(
    "module",
    [
        "maskroll.client.queue",
        "maskroll.client.queue_state",
        "maskroll.client.lifecycle",
        "maskroll.client.submitter",
        "maskroll.client.reader",
        "maskroll.client.deadletters",
        "maskroll.client.replicas",
        "maskroll.client.runs",
        "maskroll.proto.streams",
        "maskroll.proto.redis_conn",
        "maskroll.client.admission",
        "maskroll.client.batching",
    ],
)
def test_queue_modules_do_not_load_grpc(module):
    # grpc belongs to the replica client; a trainer that only uses the queue never pays for it
    loaded = _loaded(f"import {module}")
    assert module in loaded
    assert not {m for m in loaded if m == "grpc" or m.startswith("grpc.")}


def test_pure_queue_modules_do_not_load_redis():
    loaded = _loaded("import maskroll.client.admission, maskroll.client.batching")
    assert not {m for m in loaded if m == "redis" or m.startswith("redis.")}


def test_public_names_resolve_to_their_owning_modules():
    import maskroll.client as c

    owners = {
        "RolloutQueue": "maskroll.client.queue",
        "AsyncRolloutQueue": "maskroll.client.queue",
        "QueueTimeout": "maskroll.client.reader",
        "QueueStats": "maskroll.client.queue_state",
        "QueueFull": "maskroll.client.admission",
        "QueueUnavailable": "maskroll.proto.redis_conn",
        "ReplicaInfo": "maskroll.proto.heartbeat",  # the contract: both sides read it
        "ReplicaWeights": "maskroll.client.replicas",
        "BroadcastError": "maskroll.client.replicas",
        "RunInfo": "maskroll.proto.run_record",
        "RunChoiceRequired": "maskroll.client.runs",
        "RunNotFound": "maskroll.client.runs",
        "RunSuperseded": "maskroll.client.runs",
    }
    assert {name: getattr(c, name).__module__ for name in owners} == owners
    import maskroll.client.queue as q  # the queue module re-exports what its callers catch

    assert q.QueueFull is c.QueueFull and q.QueueUnavailable is c.QueueUnavailable
    assert q.ReplicaInfo is c.ReplicaInfo
    assert q.QueueStats is c.QueueStats and q.QueueTimeout is c.QueueTimeout


PUBLIC = ["__init__", "submit", "next_batch", "batches", "ack", "room", "set_policy_version"]
PUBLIC += ["replicas", "namespaces_with_replicas", "record_version", "cancel_pending_jobs", "close"]
PROPERTIES = ["stats", "run", "run_id", "namespace", "policy_version", "max_in_flight", "in_flight"]
PROPERTIES += ["consumer", "replica_auth"]


@pytest.mark.parametrize("name", PUBLIC)
def test_sync_facade_has_the_async_signature_and_a_docstring(name):
    sync, async_ = getattr(RolloutQueue, name), getattr(AsyncRolloutQueue, name)
    assert inspect.signature(sync).parameters == inspect.signature(async_).parameters
    assert sync.__doc__ and (async_.__doc__ or name == "__init__")


@pytest.mark.parametrize("name", PROPERTIES)
def test_sync_facade_reads_the_async_properties(name):
    sync, async_ = getattr(RolloutQueue, name), getattr(AsyncRolloutQueue, name)
    assert isinstance(sync, property) and isinstance(async_, property)
    assert sync.__doc__ and sync.__doc__ == async_.__doc__


def test_the_queue_has_no_weight_calls():
    # moving weights is maskroll.weight_sync.broadcast's, which takes the queue (tests/weight_sync)
    for name in ("broadcast_weights", "push_weights", "sync_replicas", "replica_weights"):
        assert not hasattr(RolloutQueue, name) and not hasattr(AsyncRolloutQueue, name)


def _rec(job: str, i: int, *, size: int = 2, version: int = 0, run: str = "run-a") -> RolloutRecord:
    """A valid record with only what batching reads set: ids, group size, run and policy version."""
    z, zf = np.zeros(1, np.int32), np.zeros(1, np.float32)
    return RolloutRecord(
        rollout_id=f"{job}-{i}",
        request_id=f"{job}-{i}",
        prompt_ids=z,
        completion_ids=z,
        sampled_logprobs=zf,
        sampled_ranks=np.ones(1, np.int32),
        topk_ids=z[:, None],
        topk_logprobs=zf[:, None],
        finish_reason="stop",
        semantics=Semantics(temperature=1.0, logprobs_k=1, engine="test"),
        policy_version_first=version,
        policy_version_last=version,
        job_id=job,
        sample_index=i,
        group_size=size,
        run_id=run,
    )


def test_batcher_yields_whole_groups_oldest_first_and_each_rollout_once():
    b = GroupBatcher()
    never = lambda rec: False  # noqa: E731
    assert b.offer(b"1", _rec("a", 0), acked=False, drop=False) == "kept"
    assert b.offer(b"2", _rec("b", 0), acked=False, drop=False) == "kept"
    assert b.offer(b"3", _rec("b", 1), acked=False, drop=False) == "kept"
    assert b.take(4, never) == ([], {})  # 2 complete records < 4; "a" is not whole
    assert b.offer(b"3", _rec("b", 1), acked=False, drop=False) == "redelivered"  # same entry again
    assert b.offer(b"9", _rec("b", 1), acked=False, drop=False) == "duplicate"  # another entry, same id
    assert b.offer(b"4", _rec("a", 1), acked=False, drop=False) == "kept"
    assert b.buffered == 4
    batch, dropped = b.take(2, never)
    assert [r.rollout_id for r in batch] == ["b-0", "b-1"] and dropped == {}  # "b" was whole first
    assert b.entry_of("b-1") == b"3"
    b.acked(batch)
    assert b.entry_of("b-1") is None
    assert b.offer(b"5", _rec("b", 1), acked=False, drop=False) == "duplicate"  # remembered in memory
    assert b.offer(b"6", _rec("c", 0), acked=True, drop=False) == "duplicate"  # Redis's done set
    assert b.buffered == 2


def test_batcher_drops_a_whole_group_that_went_stale_while_waiting():
    b = GroupBatcher()
    for i, entry in enumerate((b"1", b"2")):
        b.offer(entry, _rec("old", i, version=3), acked=False, drop=False)
    b.offer(b"3", _rec("new", 0, size=1, version=5), acked=False, drop=False)
    batch, dropped = b.take(1, lambda rec: 5 - rec.policy_version_first > 1)
    assert dropped == {"old": [b"1", b"2"]}  # each entry once
    assert [r.rollout_id for r in batch] == ["new-0"]
    assert b.buffered == 0 and b.entry_of("old-0") is None
    # a record dropped on arrival takes the buffered rest of its group with it
    b.offer(b"7", _rec("j", 0, size=3), acked=False, drop=False)
    assert b.offer(b"8", _rec("j", 1, size=3), acked=False, drop=True) == "drop"
    assert b.drop("j", [(b"8", _rec("j", 1, size=3))]) == [b"8", b"7"]
    assert b.buffered == 0


def test_in_flight_limit_blocks_then_admits():
    assert in_flight_limit(8, 1) == 16 and in_flight_limit(3, 0) == 3
    assert in_flight_limit(8, None) is None and in_flight_limit(None, 0) is None

    async def main():
        f = InFlight()
        f.submitted("a", 3)
        f.submitted("b", 1)
        assert (f.count, f.room(4), f.room(None), f.expected("a")) == (4, 0, None, 3)
        with pytest.raises(QueueFull, match="4 rollouts in flight; limit 4"):
            await f.wait_for_room(2, 4, timeout=0.05)
        waiter = asyncio.create_task(f.wait_for_room(2, 4, timeout=5))
        await f.consumed("a", 1)
        await asyncio.sleep(0.01)
        assert not waiter.done()  # one free slot is not room for two
        await f.consumed("a", 5)  # capped at what "a" still has
        await asyncio.wait_for(waiter, 1)
        assert (f.count, f.expected("a"), f.expected("b")) == (1, 0, 1)
        await f.consumed("someone-else", 3)  # another submitter's job changes nothing
        assert f.count == 1

    asyncio.run(main())


def test_batcher_expires_incomplete_groups_and_keeps_closed_groups_closed():
    b = GroupBatcher()
    never = lambda rec: False  # noqa: E731
    assert b.offer(b"1", _rec("big", 0, size=1000), acked=False, drop=False, now=10.0) == "kept"
    assert b.offer(b"2", _rec("ok", 0, size=2), acked=False, drop=False, now=11.0) == "kept"
    assert b.expire(now=12.0, timeout=5.0) == {}  # not old enough
    assert b.incomplete() == [("big", 1, 1000), ("ok", 1, 2)]
    expired = b.expire(now=15.5, timeout=5.0)  # "big" waited 5.5 s, "ok" 4.5 s
    assert list(expired) == ["big"] and [e for e, _ in expired["big"]] == [b"1"]
    assert b.entry_of("big-0") is None and b.buffered == 1
    # a late sample of the expired group is not buffered again: it follows its group
    assert b.offer(b"3", _rec("big", 1, size=1000), acked=False, drop=False, now=16.0) == "expired"
    # the same sample index under another rollout id is a duplicate, not a second sample
    dup = _rec("ok", 0, size=2)
    dup.rollout_id = "forged"
    assert b.offer(b"4", dup, acked=False, drop=False, now=16.0) == "duplicate"
    assert b.offer(b"5", _rec("ok", 1, size=2), acked=False, drop=False, now=16.0) == "kept"
    batch, _ = b.take(2, never)
    assert [r.rollout_id for r in batch] == ["ok-0", "ok-1"]
    # a dropped group's late records are dropped too, instead of waiting for samples that went
    b.drop("gone")
    assert b.offer(b"6", _rec("gone", 1), acked=False, drop=False, now=17.0) == "drop"


def test_refusal_names_run_version_and_semantic_problems():
    ok = _rec("j", 0, version=3)
    assert refusal(ok, run_id="run-a", policy_version=3) is None
    assert refusal(ok, run_id="run-b", policy_version=3) == (
        "foreign_run",
        "the record belongs to run run-a, not to this trainer's run run-b",
    )
    kind, reason = refusal(_rec("j", 0, run=""), run_id="run-a", policy_version=3)
    assert kind == "foreign_run" and "no run id" in reason
    kind, reason = refusal(ok, run_id="run-a", policy_version=2)
    assert kind == "future_version" and "policy version 3 is ahead of this trainer's version 2" in reason
    back = _rec("j", 0, version=10)
    back.completion_ids = np.zeros(3, np.int32)
    back.sampled_logprobs, back.sampled_ranks = np.zeros(3, np.float32), np.ones(3, np.int32)
    back.topk_ids, back.topk_logprobs = np.zeros((3, 1), np.int32), np.zeros((3, 1), np.float32)
    back.version_changes, back.policy_version_last = [(2, 1)], 1
    kind, reason = refusal(back, run_id="run-a", policy_version=20)
    assert kind == "future_version" and "goes backwards within the record ([10, 1])" in reason
    bad = _rec("j", 5)  # sample 5 of a group of 2
    kind, reason = refusal(bad, run_id="run-a", policy_version=3)
    assert kind == "invalid" and "sample_index 5 is not in [0, group_size 2)" in reason


def test_the_staleness_rule_is_one_function_for_records_and_groups():
    group = [_rec("g", 0, version=3), _rec("g", 1, version=5)]
    assert staleness(group, 6) == 3 and staleness(group[1:], 6) == 1  # the oldest first token counts
    assert too_stale(group, 6, 2) and not too_stale(group, 5, 2)  # more than max_staleness behind
    assert not too_stale(group, 100, None)  # no bound
    assert not too_stale(group, 6, 3) and too_stale(group[:1], 7, 3)
