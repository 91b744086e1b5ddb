"""Regressions of the probe of ~380 bad inputs against a real `maskroll serve` (torch engine, HTTP front end,
a private Redis), server items of the hardening issue. One replica serves the whole module; each case
sends its bad input, checks the answer (a 4xx naming the problem, fast), that /healthz kept answering
within a second meanwhile where the issue saw the process freeze, and that the next normal request is
served.

1. A 40 000-character model name froze the process for 6 s (the password-redaction regex was quadratic),
   a 20k checkpoint.path or tensor name 8 s, a 2 MB run_id for hours.
2. A 15 MiB chat message blocked the event loop for 30 s (templated and tokenized on the loop before the
   length check) and left the process 1 GB larger.
3. A non-streaming call generated on after its client disconnected; in a session the retry got 409.
5. Two concurrent pushes each declaring 60 % of the free memory were both accepted.
8. A completion and a chat call in one session both succeeded; finish metadata could replace session_id.
9. Nested JSON, "tool_calls": 5, lone surrogates, a 2**70 prompt id in a session: 500 instead of 400.
10. A finish on a full rollout stream answered 500 (no retry), not 503 with Retry-After.
12. Strings without bounds (run_id, gRPC details over the 16 KB metadata limit) and text/plain POSTs
    (a web page could reach a replica on loopback without a CORS preflight).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import grpc
import httpx
import pytest
import redis
from hardening_fixtures import served
from probe_helpers import HealthzWatch, HttpServe

from maskroll.proto import wire
from maskroll.proto._generated import rollout_pb2 as pb
from maskroll.proto._generated import rollout_pb2_grpc as pb_grpc
from maskroll.proto.streams import StreamKeys
from maskroll.proto.tensor_push import TensorSpec, WeightsManifest
from maskroll.server.weights.stream import memory_available

pytestmark = pytest.mark.slow
NS = "probe"
KEYS = StreamKeys(NS)
MAX_STREAM = 50  # --rollout-stream-max-len
SESSION = "x-maskroll-session"


@pytest.fixture(scope="module")
def probe(model_dir, weights_root, redis_server, tmp_path_factory):
    """No auth token (item 12 is about a replica without one); sessions publish to namespace "probe"."""
    log = tmp_path_factory.mktemp("probe") / "serve.log"
    s = HttpServe(
        model_dir, log, "--namespace", NS, "--replica-id", "probe-1", "--weights-root", str(weights_root),
        "--rollout-stream-max-len", str(MAX_STREAM), "--publish-wait-s", "1",
        env={"MASKROLL_REDIS_URL": redis_server.url},
    )  # fmt: skip
    s.adopt_run()  # its session records belong to a run (a finish on a replica serving none is refused)
    yield s
    code = s.stop()
    assert code == 0, f"the probe replica exited with {code}; log:\n{s.log_text()[-3000:]}"
    assert redis_server.password not in s.log_text(), "the Redis password reached the replica's log"
    assert "Traceback" not in s.log_text(), s.log_text()[-5000:]


@pytest.fixture(scope="module")
def raw(redis_server):
    r = redis.Redis.from_url(redis_server.url)
    yield r
    r.close()


def _grpc(address: str, call, timeout: float = 30):
    """Run `call(stub)` (a coroutine function) on a fresh channel; its result or its AioRpcError."""

    async def main():
        options = [("grpc.max_send_message_length", 64 << 20)]
        async with grpc.aio.insecure_channel(address, options=options) as channel:
            try:
                return await asyncio.wait_for(call(pb_grpc.RolloutServiceStub(channel)), timeout)
            except grpc.aio.AioRpcError as exc:
                return exc

    return asyncio.run(main())


def _update(address: str, version: int, path: str, run_id: str = "", timeout: float = 30):
    req = wire.update_request(version, path, run_id)
    return _grpc(address, lambda stub: stub.UpdateWeights(req, timeout=timeout), timeout + 5)


def _policy_version(address: str) -> int:
    return _grpc(address, lambda stub: stub.GetInfo(pb.GetInfoRequest())).policy_version


def _refused(err, code: grpc.StatusCode, needle: str) -> str:
    assert isinstance(err, grpc.aio.AioRpcError), f"not refused: {err}"
    assert err.code() == code, (err.code(), err.details()[:500])
    assert needle in err.details(), err.details()[:2000]
    assert len(err.details()) <= 2000, "the status details echo the client's string"
    return err.details()


# ---- 1. client strings no longer freeze the process (linear redaction, cut before echoed) ----------


def test_a_40k_character_model_name_is_refused_at_once(probe):
    body = {"model": "m" * 40_000, "messages": [{"role": "user", "content": "hi"}]}
    with HealthzWatch(probe.base) as watch, probe.http() as h:
        t0 = time.monotonic()
        r = h.post("/v1/chat/completions", json=body)
        took = time.monotonic() - t0
    assert took < 1.0 and watch.worst < 1.0, (took, watch.worst)
    assert r.status_code == 404, r.text[:500]
    message = r.json()["error"]["message"]
    assert "(40000 characters) is not served here" in message and len(message) < 300
    probe.completion_served()


@pytest.mark.parametrize(
    ("case", "run_id", "path", "needle"),
    [
        ("a 2 MB run_id", "r" * 2_000_000, "v1", "run_id has 2000000 characters; at most 256"),
        ("a 20k checkpoint.path", "", "/" + "x" * 20_000, "checkpoint.path has 20001 characters"),
    ],
)
def test_long_update_weights_strings_are_refused_at_once(probe, case, run_id, path, needle):
    before = _policy_version(probe.address)
    with HealthzWatch(probe.base) as watch:
        t0 = time.monotonic()
        err = _update(probe.address, before + 1, path, run_id, timeout=20)
        took = time.monotonic() - t0
    assert took < 2.0 and watch.worst < 1.0, (case, took, watch.worst)
    _refused(err, grpc.StatusCode.INVALID_ARGUMENT, needle)
    assert _policy_version(probe.address) == before
    assert probe.health() == "SERVING"
    assert served(probe.address) == 3


def test_a_20k_tensor_name_is_refused_at_once_with_a_short_status(probe):
    """Item 1 (8 s frozen) and item 12: the name went into the status details, over gRPC's 16 KB
    metadata limit, so the client saw RESOURCE_EXHAUSTED instead of the reason."""
    name = "t" * 20_000
    spec = TensorSpec(name=name, dtype="F32", shape=(1,), nbytes=4, crc32=0)
    manifest = WeightsManifest(version=_policy_version(probe.address) + 1, tensors=(spec, spec))

    async def push(stub):
        async def messages():
            yield wire.manifest_to_pb(manifest)

        return await stub.PushWeights(messages(), timeout=20)

    with HealthzWatch(probe.base) as watch:
        err = _grpc(probe.address, push)
    assert watch.worst < 1.0, watch.worst
    _refused(err, grpc.StatusCode.INVALID_ARGUMENT, "(20000 characters): the name has 20000 characters")
    assert served(probe.address) == 3


# ---- 2. a large body is refused before it is templated or tokenized ---------------------------------


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_a_15_mib_prompt_is_refused_without_stalling_or_growing(probe, api):
    text = "a" * (15 << 20)  # under the 16 MiB body limit
    if api == "chat":
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}
    else:
        path, body = "/v1/completions", {"prompt": text}
    body["model"] = probe.model
    data = json.dumps(body).encode()
    rss = probe.rss_mb()
    with HealthzWatch(probe.base) as watch, probe.http(timeout=120) as h:
        t0 = time.monotonic()
        r = h.post(path, content=data, headers={"Content-Type": "application/json"})
        took = time.monotonic() - t0
    assert took < 3.0 and watch.worst < 1.0, (took, watch.worst)
    assert probe.rss_mb() - rss < 150, f"RSS grew from {rss:.0f} to {probe.rss_mb():.0f} MB"
    assert r.status_code == 400, r.text[:500]
    error = r.json()["error"]
    assert error["param"] == ("messages" if api == "chat" else "prompt")
    assert "the text has 15728640 characters, more than the model's context can hold" in error["message"]
    probe.completion_served()


# ---- 3. a dropped non-streaming call stops generating --------------------------------------------------


def _drop_after(probe, seconds: float, body: dict, headers: dict | None = None) -> None:
    """POST a non-streaming completion and go away after `seconds` (the connection is closed)."""
    timeout = httpx.Timeout(30, read=seconds)
    with httpx.Client(base_url=probe.base, timeout=timeout) as h, pytest.raises(httpx.ReadTimeout):
        h.post("/v1/completions", json=body, headers=headers)


def _wait_idle(probe, timeout: float) -> float:
    t0 = time.monotonic()
    while probe.metric("maskroll_generate_in_flight") > 0:
        assert time.monotonic() - t0 < timeout, f"still generating {timeout} s after the client left"
        time.sleep(0.05)
    return time.monotonic() - t0


def test_a_dropped_non_streaming_call_stops_generating(probe):
    tokens = probe.metric("maskroll_generated_tokens_total")
    body = {"model": probe.model, "prompt": "x", "n": 8, "max_tokens": 1000, "ignore_eos": True}
    _drop_after(probe, 0.5, body)  # 8000 tokens take several seconds on this engine
    _wait_idle(probe, 2.0)
    generated = probe.metric("maskroll_generated_tokens_total") - tokens
    assert generated < 8000 * 0.6, f"{generated} tokens generated for a client that left"
    probe.completion_served()


def test_a_dropped_session_call_leaves_the_session_free_for_the_retry(probe):
    headers = {SESSION: "dropped-1"}
    body = {"model": probe.model, "prompt": "x", "max_tokens": 1000, "ignore_eos": True}
    _drop_after(probe, 0.4, body, headers)
    _wait_idle(probe, 1.0)  # before the fix the orphan ran on (and held the session) for seconds
    with probe.http() as h:
        r = h.post("/v1/completions", json={**body, "max_tokens": 3}, headers=headers)
        assert r.status_code == 200, r.text
        done = h.post("/v1/sessions/dropped-1/finish", json={"rollout_stream": KEYS.rollouts + ":dropped"})
    assert done.status_code == 200, done.text
    assert done.json()["num_turns"] == 1  # the dropped call is no turn of the episode


# ---- 5. concurrent pushes reserve the memory they will fill -----------------------------------------


def test_two_pushes_that_fit_alone_but_not_together_are_not_both_accepted(probe):
    free = memory_available()  # as the replica reads it (MemAvailable, or a cgroup limit nearer)
    assert free is not None
    n = int(free * 0.6) // 4
    spec = TensorSpec(name="model.norm.weight", dtype="F32", shape=(n,), nbytes=4 * n, crc32=0)
    manifest = WeightsManifest(version=_policy_version(probe.address) + 1, tensors=(spec,))
    release = threading.Event()

    async def main():
        async with grpc.aio.insecure_channel(probe.address) as channel:
            stub = pb_grpc.RolloutServiceStub(channel)

            async def holding():  # the manifest and one chunk, then the call stays open
                yield wire.manifest_to_pb(manifest)
                yield wire.push_chunk_to_pb(0, 0, b"\0" * 4096)
                while not release.is_set():
                    await asyncio.sleep(0.05)

            async def manifest_only():
                yield wire.manifest_to_pb(manifest)

            first = asyncio.ensure_future(stub.PushWeights(holding(), timeout=60))
            await asyncio.sleep(1.0)  # the first push is being received
            try:
                second = await stub.PushWeights(manifest_only(), timeout=20)
            except grpc.aio.AioRpcError as exc:
                second = exc
            release.set()
            try:
                await first
            except grpc.aio.AioRpcError as exc:
                first_err = exc
            # the first push is over: its reservation is gone, the same manifest is taken again
            try:
                third = await stub.PushWeights(manifest_only(), timeout=20)
            except grpc.aio.AioRpcError as exc:
                third = exc
            return second, first_err, third

    second, first, third = asyncio.run(main())
    _refused(second, grpc.StatusCode.FAILED_PRECONDITION, "reserved by pushes being received now")
    _refused(first, grpc.StatusCode.INVALID_ARGUMENT, "the push ended early")
    _refused(third, grpc.StatusCode.INVALID_ARGUMENT, "the push ended early")
    assert served(probe.address) == 3


# ---- 8. one session is one kind of call; its record names it -----------------------------------------


def test_a_session_takes_one_kind_of_call_and_keeps_its_id(probe, raw):
    headers = {SESSION: "kind-1"}
    stream = KEYS.rollouts + ":kind"
    with probe.http() as h:
        r = h.post(
            "/v1/completions", json={"model": probe.model, "prompt": "Hi", "max_tokens": 2}, headers=headers
        )
        assert r.status_code == 200, r.text
        chat = {"model": probe.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        r = h.post("/v1/chat/completions", json=chat, headers=headers)
        assert r.status_code == 400, r.text
        assert "holds completion calls; one session is one kind of call" in r.json()["error"]["message"]
        r = h.post(
            "/v1/sessions/kind-1/finish", json={"metadata": {"session_id": "other"}, "rollout_stream": stream}
        )
        assert r.status_code == 400, r.text
        assert "metadata key 'session_id'" in r.json()["error"]["message"]
        done = h.post(
            "/v1/sessions/kind-1/finish", json={"metadata": {"reward": 1}, "rollout_stream": stream}
        )
    assert done.status_code == 200, done.text
    assert done.json()["num_turns"] == 1
    rec = done.json()["record"]
    assert rec["metadata"] == {"session_id": "kind-1", "reward": "1"}
    assert raw.xlen(stream) == 1
    probe.completion_served()


# ---- 9. bad input that answered 500 ------------------------------------------------------------------

BAD_BODIES = {
    "nested 100 000 deep": ("/v1/chat/completions", None, "[" * 100_000 + "]" * 100_000, "nested"),
    "tool_calls is a number": (
        "/v1/chat/completions",
        None,
        {
            "messages": [
                {"role": "assistant", "content": "x", "tool_calls": 5},
                {"role": "user", "content": "y"},
            ]
        },
        "messages[0].tool_calls must be a list",
    ),
    "a lone surrogate in a prompt": ("/v1/completions", None, {"prompt": "a\ud800b"}, "lone surrogate"),
    "a lone surrogate in a message": (
        "/v1/chat/completions",
        None,
        {"messages": [{"role": "user", "content": "\ud800"}]},
        "messages[0].content: the text holds a lone surrogate",
    ),
    "a lone surrogate in a tool name": (
        "/v1/chat/completions",
        None,
        {
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "\udfff", "parameters": {}}}],
        },
        "tools[0].function.name: the text holds a lone surrogate",
    ),
    "a 2**70 prompt id in a session": (
        "/v1/completions",
        "big-id-1",
        {"prompt": [256, 2**70]},
        "prompt[1] = 1180591620717411303424 is outside the vocabulary",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_BODIES))
def test_bad_input_that_answered_500_is_a_400(probe, case):
    path, session, body, needle = BAD_BODIES[case]
    if isinstance(body, dict):
        content = json.dumps({"model": probe.model, "max_tokens": 2, **body}).encode()  # \ud800 escaped
    else:
        content = body.encode()
    headers = {"Content-Type": "application/json", **({SESSION: session} if session else {})}
    with probe.http() as h:
        r = h.post(path, content=content, headers=headers)
    assert r.status_code == 400, r.text[:1000]
    assert needle in r.json()["error"]["message"], r.json()
    probe.completion_served()


# ---- 10. a finish Redis cannot take now is 503 with Retry-After --------------------------------------


def test_a_finish_on_a_full_stream_is_503_with_retry_after_and_the_session_kept(probe, raw):
    stream = KEYS.rollouts + ":full"
    raw.delete(stream)
    for i in range(MAX_STREAM):
        raw.xadd(stream, {"x": str(i)})
    headers = {SESSION: "full-1"}
    with probe.http() as h:
        r = h.post(
            "/v1/completions", json={"model": probe.model, "prompt": "Hi", "max_tokens": 2}, headers=headers
        )
        assert r.status_code == 200, r.text
        t0 = time.monotonic()
        r = h.post("/v1/sessions/full-1/finish", json={"rollout_stream": stream})
        assert r.status_code == 503, r.text
        assert int(r.headers["Retry-After"]) > 0
        assert "is full" in r.json()["error"]["message"] and time.monotonic() - t0 < 10
        raw.delete(stream)  # the trainer caught up
        done = h.post("/v1/sessions/full-1/finish", json={"rollout_stream": stream})
    assert done.status_code == 200, done.text
    assert done.json()["published"] and raw.xlen(stream) == 1
    raw.delete(stream)
    probe.completion_served()


# ---- 12. bounded strings, JSON bodies only -------------------------------------------------------------


def test_a_1_mb_run_id_is_refused_and_no_record_carries_it(probe):
    before = _policy_version(probe.address)
    err = _update(probe.address, before + 1, "v1", run_id="r" * 1_000_000)
    _refused(err, grpc.StatusCode.INVALID_ARGUMENT, "run_id has 1000000 characters; at most 256")
    assert _policy_version(probe.address) == before
    info = _grpc(probe.address, lambda stub: stub.GetInfo(pb.GetInfoRequest()))
    assert len(info.run_id) <= 256
    assert served(probe.address) == 3


@pytest.mark.parametrize(
    ("path", "content_type"),
    [
        ("/v1/weights", "text/plain"),
        ("/v1/completions", "text/plain"),
        ("/v1/sessions/csrf-1/finish", "application/x-www-form-urlencoded"),
        ("/v1/generate", "multipart/form-data; boundary=x"),
    ],
)
def test_a_post_that_is_not_json_is_refused(probe, path, content_type):
    """What a web page may send across origins without a CORS preflight (text/plain, a form)."""
    before = _policy_version(probe.address)
    bodies = {
        "/v1/weights": {"version": before + 1, "checkpoint": {"path": "v1"}},
        "/v1/completions": {"model": probe.model, "prompt": "Hi", "max_tokens": 2},
        "/v1/sessions/csrf-1/finish": {},
        "/v1/generate": {"prompt_token_ids": "AQAAAA==", "options": {"max_tokens": 2}},
    }
    with probe.http() as h:
        r = h.post(path, content=json.dumps(bodies[path]).encode(), headers={"Content-Type": content_type})
    assert r.status_code == 415, r.text[:500]
    assert "Content-Type: application/json" in r.json()["error"]["message"]
    assert _policy_version(probe.address) == before
    probe.completion_served()


def test_a_cross_origin_post_without_a_body_is_refused(probe):
    headers = {SESSION: "origin-1"}
    with probe.http() as h:
        r = h.post(
            "/v1/completions", json={"model": probe.model, "prompt": "Hi", "max_tokens": 2}, headers=headers
        )
        assert r.status_code == 200, r.text
        r = h.post("/v1/sessions/origin-1/finish", headers={"Origin": "http://evil.example"})
        assert r.status_code == 403, r.text
        assert "cross-origin requests are refused" in r.json()["error"]["message"]
        assert h.delete("/v1/sessions/origin-1").status_code == 200  # still there: nothing was published
    probe.completion_served()
