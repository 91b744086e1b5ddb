"""Agent sessions that survive their replica (issue 27): the state codec, the fleet-wide lease and the
fenced writes against the shared real Redis; then two real `maskroll serve` processes on one Redis — a
session whose replica is SIGKILLed between turns is finished on the other as one record published once,
and one session called on both replicas at once gets exactly one 409."""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request

import httpx
import numpy as np
import pytest
import redis
import redis.asyncio as aioredis

from maskroll.local.replica import LocalReplica
from maskroll.proto import wire
from maskroll.proto.records import RolloutRecord, Semantics
from maskroll.proto.streams import F_RECORD, StreamKeys
from maskroll.server.errors import AlreadyExists
from maskroll.server.http_api.sessions.durable import Lease, LeaseLost, SessionRedis
from maskroll.server.http_api.sessions.state import StateError, decode_state, encode_state
from maskroll.server.http_api.sessions.trajectory import Plan, Session

K = 3
SEM = Semantics(temperature=0.7, top_k=5, logprobs_k=K, engine="torch", model="tiny")


def turn_record(
    ids: list[int], *, first: int, changes=(), reason="stop", run="run-1", seed=0
) -> RolloutRecord:
    """A turn's record as the pipeline makes it: ids sampled, distinct logprobs, ranks and top-K."""
    rng = np.random.default_rng(seed)
    t = len(ids)
    return RolloutRecord(
        rollout_id="x",
        request_id="x",
        prompt_ids=np.asarray([1, 2], np.int32),
        completion_ids=np.asarray(ids, np.int32),
        sampled_logprobs=-rng.random(t).astype(np.float32),
        sampled_ranks=rng.integers(1, 5, t).astype(np.int32),
        topk_ids=rng.integers(0, 250, (t, K)).astype(np.int32),
        topk_logprobs=-rng.random((t, K)).astype(np.float32),
        finish_reason=reason,
        semantics=SEM,
        policy_version_first=first,
        policy_version_last=changes[-1][1] if changes else first,
        version_changes=list(changes),
        run_id=run,
    )


def three_turn_session() -> Session:
    """Turn 1 (version 3 → 4 at its token 2), a continuation, turn 2 (version 4, a length cut), an edited
    history (new segment), turn 3 (version 5)."""
    s = Session("ep-1", "grp", 0.0, kind="chat")
    s.add_turn(
        Plan(np.asarray([5, 6, 7], np.int32), []),
        turn_record([10, 11, 12, 13], first=3, changes=[(2, 4)]),
        stop_token=13,
        messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
    )
    none = np.zeros(0, np.int32)
    more = [{"role": "user", "content": "more"}]
    s.add_turn(Plan(none, [20, 21]), turn_record([14, 15], first=4, reason="length", seed=1), stop_token=None,
               messages=more, tools=[{"type": "function"}])  # fmt: skip
    edited = [{"role": "user", "content": "edited"}]
    s.add_turn(Plan(none, [5, 6, 9], new_segment=True), turn_record([16], first=5, seed=2), stop_token=16,
               messages=edited)  # fmt: skip
    return s


def record_of(s: Session) -> RolloutRecord:
    return s.record(metadata={"m": "1"}, group_size=4, sample_index=2, replica_id="r", now=123.0)


# ---- the state codec -------------------------------------------------------------------------------


def test_state_round_trip_gives_the_same_record_and_continues_alike():
    s = three_turn_session()
    header, data = encode_state(s)
    back = decode_state(header, data, now=7.0)
    assert wire.encode_record(record_of(back)) == wire.encode_record(record_of(s))  # byte for byte
    rec = record_of(back)
    # ids after the first prompt: turn 1, the continuation, turn 2, the new segment, turn 3
    assert rec.completion_ids.tolist() == [10, 11, 12, 13, 20, 21, 14, 15, 5, 6, 9, 16]
    assert rec.loss_mask.astype(int).tolist() == [1, 1, 1, 1, 0, 0, 1, 1, 0, 0, 0, 1]
    assert rec.segment_starts == [8]
    assert rec.token_versions().tolist() == [3, 3, 4, 4, 4, 4, 4, 4, 4, 4, 4, 5]
    assert rec.policy_version_first == 3 and rec.policy_version_last == 5
    assert rec.finish_reason == "stop" and rec.num_turns == 3 and rec.run_id == "run-1"
    t2 = s.turns[1].record
    np.testing.assert_array_equal(rec.sampled_logprobs[6:8], t2.sampled_logprobs)
    np.testing.assert_array_equal(rec.topk_ids[6:8], t2.topk_ids)
    assert (rec.sampled_logprobs[[4, 5, 8, 9, 10]] == 0).all()
    assert back.prompt_ids.tolist() == [5, 6, 7] and back.nonce == s.nonce and back.group_id == "grp"
    assert back.messages == [{"role": "user", "content": "edited"}] and back.stop_token == 16
    assert [t.start for t in back.turns] == [0, 6, 11] and back.touched == 7.0
    # the decoded session takes a further turn exactly as the original does
    for x in (s, back):
        more = turn_record([31, 32], first=5, changes=[(1, 6)], seed=3)
        x.add_turn(Plan(np.zeros(0, np.int32), [30]), more, stop_token=None)
    assert wire.encode_record(record_of(back)) == wire.encode_record(record_of(s))
    assert record_of(back).version_changes == [(2, 4), (11, 5), (14, 6)]  # [30] at 12, then 31, 32


def test_state_codec_refuses_what_it_cannot_read():
    s = three_turn_session()
    header, data = encode_state(s)
    with pytest.raises(StateError, match="version 99"):
        decode_state(header.replace(b'"v":1', b'"v":99'), data)
    with pytest.raises(StateError, match="unreadable"):
        decode_state(b"{not json", data)
    with pytest.raises(ValueError, match="no turn"):
        encode_state(Session("fresh", "", 0.0))


# ---- the lease and the fenced writes (real Redis) ---------------------------------------------------


def run(coro_fn, redis_url: str):
    async def main():
        r = aioredis.Redis.from_url(redis_url)
        try:
            return await coro_fn(r)
        finally:
            await r.aclose()

    return asyncio.run(main())


def store(r, ns: str, **kw) -> SessionRedis:
    return SessionRedis(r, StreamKeys(ns).part(0), ttl_s=60, **kw)


def test_lease_one_holder_owner_only_release_and_expiry(redis_server):
    async def go(r):
        st = store(r, "lease-test", lease_s=2.0)
        a = await st.lease("s1")
        with pytest.raises(AlreadyExists, match="has a call running"):
            await st.lease("s1")
        other = await st.lease("s2")  # another session's lease is independent
        # Someone else's token releases nothing; the owner's does, once.
        impostor = Lease(r, a.key, "not-the-owner", 2.0)
        assert await impostor.release() is False
        assert await r.get(a.key) == a.token.encode()
        assert await a.release() is True
        assert await a.release() is False  # idempotent
        b = await st.lease("s1")
        # A holder that died (its renewals stopped) loses the lease when it expires: the next call gets it.
        b._stop()
        deadline = time.monotonic() + 20
        while await r.exists(b.key):
            assert time.monotonic() < deadline, "the lease never expired"
            await asyncio.sleep(0.05)
        c = await st.lease("s1")
        # The dead holder's late release must not free the new holder's lease.
        assert await Lease(r, b.key, b.token, 2.0).release() is False
        assert await r.get(c.key) == c.token.encode()
        assert 0 < await r.pttl(c.key) <= 2000
        await c.release()
        await other.release()

    run(go, redis_server.url)


def test_a_renewed_lease_outlives_its_ttl(redis_server):
    async def go(r):
        st = store(r, "lease-renew", lease_s=1.0)
        a = await st.lease("s")
        await asyncio.sleep(2.5)  # 2.5 lease lengths: alive only because it was renewed
        assert await r.get(a.key) == a.token.encode() and not a.lost
        with pytest.raises(AlreadyExists):
            await st.lease("s")
        await a.release()

    run(go, redis_server.url)


def test_writes_are_fenced_by_the_lease_and_finish_publishes_once(redis_server):
    keys = StreamKeys("fence-test")

    async def go(r):
        st = store(r, "fence-test")
        s = three_turn_session()
        a = await st.lease(s.id)
        await st.save(a, s)
        assert s.seq == 1 and await st.seq(s.id) == 1
        loaded = await st.load(s.id)
        assert loaded.seq == 1 and wire.encode_record(record_of(loaded)) == wire.encode_record(record_of(s))
        # The lease expires and another call takes it: the old holder's save is refused, nothing changes.
        await r.delete(a.key)
        b = await st.lease(s.id)
        with pytest.raises(LeaseLost):
            await st.save(a, s)
        assert await st.seq(s.id) == 1
        # A stale copy (seq behind the stored one) is refused even under the lease.
        stale = await st.load(s.id)
        await st.save(b, s)
        with pytest.raises(LeaseLost, match="not the one"):
            await st.save(b, stale)
        data = wire.encode_record(record_of(s))
        assert await st.finish(a, s.id, data, keys.rollouts, max_len=100, wait_s=1) is False
        assert await r.xlen(keys.rollouts) == 0
        assert await st.finish(b, s.id, data, keys.rollouts, max_len=100, wait_s=1) is True
        entries = await r.xrange(keys.rollouts)
        assert [e[1][F_RECORD] for e in entries] == [data]
        assert await st.finished(s.id) == (data, keys.rollouts)
        assert await st.seq(s.id) == 0 and await st.load(s.id) is None
        assert 0 < await r.pttl(keys.part(0).session_done(s.id)) <= 60_000
        # A full stream: nothing published, the state kept (a retry publishes).
        await b.release()
        s2 = three_turn_session()
        s2.id = "ep-2"
        c = await st.lease(s2.id)
        await st.save(c, s2)
        with pytest.raises(TimeoutError):
            await st.finish(c, s2.id, data, keys.rollouts, max_len=1, wait_s=0.3)
        assert await r.xlen(keys.rollouts) == 1 and await st.seq(s2.id) == 1
        # A delete leaves a tombstone: a copy some replica still holds is known to be stale.
        assert await st.status(s2.id) == (1, False)
        assert await st.delete(c, s2.id) is True
        assert await st.status(s2.id) == (0, True) and await st.finished(s2.id) is None
        assert await st.delete(c, s2.id) is False  # nothing left to delete
        await c.release()
        with pytest.raises(LeaseLost):
            await st.delete(c, s2.id)

    run(go, redis_server.url)


# ---- two real replicas on one Redis -----------------------------------------------------------------

NS = "durable-sessions"


@pytest.fixture(scope="module")
def two_replicas(tiny_model_dir, redis_server, tmp_path_factory):
    """Two `maskroll serve` processes (torch engine, HTTP) on one Redis and namespace, both serving
    version 0 of run "test-run"; only these PIDs are ever killed. Shared by the two tests below, in file
    order: the race needs both alive, the last test kills A."""
    tmp_path = tmp_path_factory.mktemp("two_replicas")
    from maskroll.client import RolloutClient

    common = ["--model", str(tiny_model_dir), "--engine", "torch", "--threads", "1", "--port", "0",
              "--http-port", "0", "--metrics-port", "0", "--redis-url", redis_server.url,
              "--namespace", NS]  # fmt: skip
    reps = [
        LocalReplica(
            [*common, "--replica-id", f"rep-{c}"], env={"OMP_NUM_THREADS": "1"}, log=tmp_path / f"{c}.log"
        )
        for c in "ab"
    ]
    try:
        for rep in reps:
            rep.start()
        for rep in reps:
            rep.wait_ready(180)

        async def adopt(address: str) -> None:
            async with RolloutClient(address) as c:
                info = await c.info()
                if not info.run_id:
                    await c.adopt_weights(info.weights_fingerprint, run_id="test-run")

        for rep in reps:
            asyncio.run(adopt(rep.address))
        yield reps
    finally:
        for rep in reps:
            if rep.poll() is None:
                rep.kill()


def chat(url: str, session: str, messages: list[dict], **kw) -> httpx.Response:
    body = {
        "model": "model",
        "messages": messages,
        "max_tokens": 6,
        "logprobs": True,
        "return_token_ids": True,
    }
    return httpx.post(
        url + "/v1/chat/completions",
        json={**body, **kw},
        headers={"X-Maskroll-Session": session},
        timeout=120,
    )


def metric(rep: LocalReplica, name: str) -> float:
    body = urllib.request.urlopen(f"http://{rep.metrics}/metrics", timeout=10).read().decode()
    m = re.search(rf"^{re.escape(name)} (\S+)$", body, re.M)
    return float(m.group(1)) if m else 0.0


@pytest.mark.slow
def test_one_session_called_on_two_replicas_at_once_gets_one_409(two_replicas):
    a, b = two_replicas
    user = [{"role": "user", "content": "Tell me a long story."}]
    first = chat(a.http_url, "ep-race", user, max_tokens=4)  # turn 1 (A's counts start at 0)
    assert first.status_code == 200, first.text
    history = [*user, {"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
               {"role": "user", "content": "Go on."}]  # fmt: skip
    long = {"model": "model", "messages": history, "max_tokens": 400, "ignore_eos": True, "stream": True}
    statuses = []
    # A's call holds the session while it streams; B's call of the same session meanwhile is refused.
    with httpx.stream("POST", a.http_url + "/v1/chat/completions", json=long,
                      headers={"X-Maskroll-Session": "ep-race"}, timeout=120) as streaming:  # fmt: skip
        lines = streaming.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # A is generating
        other = chat(b.http_url, "ep-race", history, max_tokens=4)
        statuses += [streaming.status_code, other.status_code]
        assert "has a call running" in other.text
        rest = list(lines)
    assert statuses == [200, 409]
    assert [line for line in rest if line][-1] == "data: [DONE]"
    # Once A's call ended, the session is free on both: the next turn goes to B.
    after = chat(b.http_url, "ep-race", history, max_tokens=4)
    assert after.status_code == 200, after.text
    # A served turns 1 and 2 from its own copy; B loaded the session (2 turns) from Redis.
    assert metric(a, 'maskroll_session_turns_total{source="new"}') == 1
    assert metric(a, 'maskroll_session_turns_total{source="local"}') == 1
    assert metric(b, 'maskroll_session_turns_total{source="moved"}') == 1
    # ... and prefilled all of it again: turn 1's ids and at least A's 400 sampled ones.
    p1, c1 = first.json()["prompt_token_ids"], first.json()["choices"][0]["token_ids"]
    assert metric(b, "maskroll_session_reprefill_tokens_total") >= len(p1) + len(c1) + 400


@pytest.mark.slow
def test_a_session_survives_its_replica_being_killed(two_replicas, redis_server):
    a, b = two_replicas
    keys = StreamKeys(NS)
    r = redis.Redis.from_url(redis_server.url)
    before = r.xlen(keys.rollouts)
    moved, reprefill = (metric(b, 'maskroll_session_turns_total{source="moved"}'),
                        metric(b, "maskroll_session_reprefill_tokens_total"))  # fmt: skip
    user1 = {"role": "user", "content": "What is 2+3?"}
    one = chat(a.http_url, "ep-kill", [user1], temperature=1.0, seed=1)
    assert one.status_code == 200, one.text
    p1, c1 = one.json()["prompt_token_ids"], one.json()["choices"][0]["token_ids"]
    reply = one.json()["choices"][0]["message"]

    assert a.kill() is not None  # SIGKILL between turns: nothing of the session is in A any more
    user2 = {"role": "user", "content": "And times 4?"}
    two = chat(b.http_url, "ep-kill", [user1, {"role": "assistant", "content": reply["content"]}, user2],
               temperature=1.0, seed=2)  # fmt: skip
    assert two.status_code == 200, two.text
    p2, c2 = two.json()["prompt_token_ids"], two.json()["choices"][0]["token_ids"]
    lp2 = [e["logprob"] for e in two.json()["choices"][0]["logprobs"]["content"]]
    assert p2[: len(p1) + len(c1)] == p1 + c1  # turn 1's ids re-prefilled as stored, never re-tokenized

    fin = httpx.post(b.http_url + "/v1/sessions/ep-kill/finish", json={"metadata": {"reward": 1}}, timeout=60)
    assert fin.status_code == 200, fin.text
    ans = fin.json()
    gap = len(p2) - len(p1) - len(c1)  # the template's turn end and the user's message: not sampled
    assert ans["prompt_token_ids"] == p1
    assert ans["token_ids"] == c1 + p2[len(p1) + len(c1) :] + c2
    assert ans["loss_mask"] == [1] * len(c1) + [0] * gap + [1] * len(c2)
    assert ans["num_turns"] == 2 and ans["published"] is True

    recs = [wire.decode_record(f[F_RECORD]) for _, f in r.xrange(keys.rollouts)][before:]
    assert len(recs) == 1  # published once
    rec = recs[0]
    assert rec.rollout_id == ans["rollout_id"] and rec.run_id == "test-run" and rec.replica_id == "rep-b"
    assert rec.completion_ids.tolist() == ans["token_ids"]
    assert rec.loss_mask.astype(int).tolist() == ans["loss_mask"]
    np.testing.assert_allclose(rec.sampled_logprobs[-len(c2) :], lp2, rtol=0, atol=1e-6)
    assert (rec.sampled_logprobs[len(c1) : len(c1) + gap] == 0).all()
    assert rec.metadata == {"session_id": "ep-kill", "reward": "1"}

    # A retried finish (the answer lost on the way) gets the same answer; nothing is published again.
    again = httpx.post(b.http_url + "/v1/sessions/ep-kill/finish", json={}, timeout=60)
    assert again.status_code == 200 and again.json() == ans
    assert r.xlen(keys.rollouts) == before + 1
    # B served a moved session: turn 2 re-prefilled turn 1's stored trajectory.
    assert metric(b, 'maskroll_session_turns_total{source="moved"}') == moved + 1
    assert metric(b, "maskroll_session_reprefill_tokens_total") == reprefill + len(p1) + len(c1)
    r.close()
