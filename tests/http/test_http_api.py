"""The HTTP surface with plain httpx against a real replica: auth (401 without the token, health open),
400 on every bad input the gRPC path refuses (tests/server/test_bad_input.py's list, case by case) with
the server serving on, the native JSON API (the proto's JSON image, numbers equal to gRPC's), limits
(413) and drain (503, abort)."""

from __future__ import annotations

import asyncio
import json
import math
import ssl
import threading

import httpx
import numpy as np
import pytest
from google.protobuf import json_format
from http_fixtures import TOKEN, make_served
from test_bad_input import BAD

from maskroll.client import RecordAssembler, RolloutClient, SamplingOptions
from maskroll.proto import wire
from maskroll.proto._generated import rollout_pb2 as pb
from maskroll.server.http_api.errors import STATUS_OF_CODE

PROMPT = [256, 72, 105]  # <bos> "Hi", as test_bad_input's

# gRPC bad-input case -> (JSON fields over BASE, words the 400's message must hold, the error's param).
# JSON has no NaN or infinity, but Python's reader (and many clients' writers) spell them NaN /
# Infinity: sent raw. JSON carries whole ids, never partial int32s: the nearest mistake in the OpenAI
# API is an id past int32 (a partial int32 reaches the native API, which gets every case below too).
C = "/v1/completions"
BASE = {"model": "model", "prompt": PROMPT, "max_tokens": 4, "logprobs": 2}
T = "temperature must be finite and > 0, got"
HTTP_BAD = {
    "K above the maximum": ({"logprobs": 21}, "logprobs must be in [0, 20], got 21", "logprobs"),
    "negative K": ({"logprobs": -1}, "logprobs must be in [0, 20], got -1", "logprobs"),
    "empty prompt": ({"prompt": []}, "prompt is empty", "prompt"),
    "token id = vocab size": ({"prompt": [256, 259]}, "prompt[1] = 259 is outside the vocabulary", "prompt"),
    "negative token id": ({"prompt": [-3]}, "prompt[0] = -3", "prompt"),
    "prompt not whole int32s": ({"prompt": [2**40]}, "prompt[0] = 1099511627776 is outside", "prompt"),
    "max_tokens zero": ({"max_tokens": 0}, "max_tokens must be >= 1, got 0", "max_tokens"),
    "max_tokens negative": ({"max_tokens": -7}, "max_tokens must be >= 1, got -7", "max_tokens"),
    "max_tokens above the context": ({"max_tokens": 1022}, "3 + 1022 > max_model_len 1024", "max_tokens"),
    "max_tokens above the server cap": (
        {"max_tokens": 5000},
        "exceeds the server's limit 4096",
        "max_tokens",
    ),
    "prompt fills the context": ({"prompt": [65] * 1024}, "prompt has 1024 tokens", "prompt"),
    "temperature zero": ({"temperature": 0.0}, f"{T} 0.0", "temperature"),
    "temperature negative": ({"temperature": -1.0}, f"{T} -1.0", "temperature"),
    "temperature nan": ({"temperature": math.nan}, f"{T} nan", "temperature"),
    "temperature inf": ({"temperature": math.inf}, f"{T} inf", "temperature"),
    "temperature below float32's reach": (
        {"temperature": 1e-40},
        "the torch engine refused the request: temperature must be >= 2.94e-35",
        None,
    ),
    "temperature denormal, n = 64": (
        {"temperature": 5e-324, "n": 64},
        "temperature must be >= 2.94e-35",
        None,
    ),
    "top_p zero": ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0", "top_p"),
    "top_p above one": ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5", "top_p"),
    "top_p nan": ({"top_p": math.nan}, "top_p must be in (0, 1], got nan", "top_p"),
    "top_k below -1": ({"top_k": -2}, "top_k must be in [1, 259]", "top_k"),
    "top_k above the vocabulary": ({"top_k": 1000}, "top_k must be in [1, 259]", "top_k"),
    "n above max_n": ({"n": 65}, "n must be in [1, 64]", "n"),
    "n negative": ({"n": -2}, "n must be in [1, 64]", "n"),
    "seed overflowing int64": (
        {"seed": 2**64 - 1},
        "seed = 18446744073709551615: seed + n - 1 must be",
        "seed",
    ),
    "stop token outside the vocabulary": (
        {"stop_token_ids": [1, 300]},
        "stop_token_ids[1] = 300",
        "stop_token_ids",
    ),
}
# Cases whose field the OpenAI API does not have: the native API gets them (below), and a session's
# finish applies the same metadata rule (test_http_sessions.py).
NO_OPENAI_FIELD = {"metadata with too many entries", "a metadata value of 1 MB"}


def post_raw(client: httpx.Client, path: str, body: dict) -> httpx.Response:
    # json.dumps writes NaN / Infinity (allow_nan): the server's reader accepts them, as the check needs
    return client.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})


def assert_served_on(c: httpx.Client) -> None:
    ok = c.post(C, json={**BASE, "max_tokens": 2, "ignore_eos": True, "unknown_field": "ignored"})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2, ok.text


def test_every_grpc_bad_input_has_an_openai_case():
    assert set(BAD) - set(HTTP_BAD) == NO_OPENAI_FIELD
    assert not set(HTTP_BAD) - set(BAD)


@pytest.mark.parametrize("case", sorted(HTTP_BAD))
def test_bad_input_is_400_naming_the_openai_field_and_the_server_serves_on(served, case):
    fields, needle, param = HTTP_BAD[case]
    with served.http() as c:
        r = post_raw(c, C, {**BASE, **fields})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert needle in err["message"], err
        assert (err["type"], err["code"], err["param"]) == (
            "invalid_request_error",
            "invalid_argument",
            param,
        )
        assert_served_on(c)


@pytest.mark.parametrize("case", sorted(BAD))
def test_grpc_bad_input_is_400_with_the_grpc_message_on_the_native_api(served, case):
    req, needle = BAD[case]
    with served.http() as c:
        r = c.post("/v1/generate", json=json_format.MessageToDict(req, preserving_proto_field_name=True))
        assert r.status_code == 400, r.text
        assert needle in r.json()["error"]["message"]
        assert_served_on(c)


def test_chat_bad_input_names_the_chat_field(served):
    with served.http() as c:
        chat = {"model": "model", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
        cases = [
            ({"logprobs": True, "top_logprobs": 21}, "top_logprobs must be in [0, 20], got 21"),
            ({"messages": []}, "messages is empty"),
            ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role must be one of"),
            ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "only text parts"),
            ({"temperature": "hot"}, "temperature: Input should be a valid number"),
            ({"max_completion_tokens": 0}, "max_tokens must be >= 1, got 0"),
        ]
        for fields, needle in cases:
            r = c.post("/v1/chat/completions", json={**chat, **fields})
            assert r.status_code == 400 and needle in r.json()["error"]["message"], (fields, r.text)
        r = c.post("/v1/chat/completions", content=b"{not json", headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]


def test_every_route_but_health_needs_the_token(served):
    routes = [
        ("GET", "/v1/models"),
        ("GET", "/v1/info"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/generate"),
        ("POST", "/v1/weights"),
        ("POST", "/v1/sessions/s/finish"),
        ("DELETE", "/v1/sessions/s"),
    ]
    for token in (None, "wrong", TOKEN[:-1], TOKEN + "x"):
        headers = {} if token is None else {"Authorization": f"Bearer {token}"}
        with httpx.Client(base_url=served.base_url, headers=headers) as c:
            for method, path in routes:
                r = c.request(method, path, json=BASE)
                assert r.status_code == 401, (token, path, r.text)
                assert r.json()["error"]["type"] == "authentication_error"
            assert c.get("/healthz").json() == {"status": "live"}
            assert c.get("/readyz").status_code == 200
    with served.http() as c:
        assert c.get("/v1/models").status_code == 200
        assert c.get("/nowhere").status_code == 404


def test_info_is_getinfo_as_json(served):
    async def grpc_info():
        async with RolloutClient(served.grpc_address, token=TOKEN) as c:
            return await c.info()

    with served.http() as c:
        body = c.get("/v1/info").json()
    info = wire.info_from_pb(json_format.ParseDict(body, pb.ServerInfo()))
    assert info == asyncio.run(grpc_info())
    assert body["max_logprobs_k"] == 20 and body["logprobs_mode"] == "processed"


def _native_request(**options) -> dict:
    req = wire.generate_request(PROMPT, SamplingOptions(**options), include_record_arrays=True)
    return json_format.MessageToDict(req, preserving_proto_field_name=True)


def test_generate_streams_the_proto_chunks_as_ndjson_and_sse(served):
    opts = dict(max_tokens=6, logprobs_k=3, seed=21, n=2, ignore_eos=True)

    async def grpc_records():
        async with RolloutClient(served.grpc_address, token=TOKEN) as c:
            return await c.generate_records(PROMPT, SamplingOptions(**opts))

    want = asyncio.run(grpc_records())
    with served.http() as c:
        ndjson = c.post("/v1/generate", json=_native_request(**opts))
        sse = c.post("/v1/generate", json=_native_request(**opts), headers={"Accept": "text/event-stream"})
    assert ndjson.headers["content-type"].startswith("application/x-ndjson")
    lines = [json.loads(line) for line in ndjson.text.splitlines()]
    events = [e.removeprefix("data: ") for e in sse.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    for chunks in (lines, [json.loads(e) for e in events[:-1]]):
        asm, got = RecordAssembler(), {}
        for d in chunks:
            rec = asm.add(wire.chunk_from_pb(json_format.ParseDict(d, pb.GenerateChunk())))
            if rec is not None:
                got[rec.sample_index] = rec
        for i, w in enumerate(want):
            assert got[i].completion_ids.tolist() == w.completion_ids.tolist()
            # The same tokens, and the same numbers up to float32 batching: the torch engine may take a
            # request's two samples into its batch at different decode steps, which moves a logprob by
            # ~1e-6 (1.5e-6 seen); a transport that altered values would be off by far more.
            np.testing.assert_allclose(got[i].topk_logprobs, w.topk_logprobs, atol=1e-5, rtol=0)


def test_native_request_errors_are_400_and_weights_refused_as_grpc(served):
    with served.http() as c:
        r = c.post("/v1/generate", json={**_native_request(max_tokens=2), "request_id": "r" * 300})
        assert r.status_code == 400 and "request_id has 300" in r.json()["error"]["message"]
        r = c.post("/v1/generate", json={"no_such_field": 1})
        assert r.status_code == 400 and "GenerateRequest" in r.json()["error"]["message"]
        # UpdateWeights refused as gRPC refuses it (no weights_root): the same code, the same words
        r = c.post("/v1/weights", json={"version": 1, "checkpoint": {"path": "/tmp"}})
        assert r.status_code == STATUS_OF_CODE["PERMISSION_DENIED"] == 403
        assert "without a weights_root" in r.json()["error"]["message"]


def test_body_over_max_message_bytes_is_413_and_tls_serves_https(
    http_loop, http_engine, tiny_model_dir, tmp_path
):
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make a certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    small = make_served(
        http_loop, http_engine, tiny_model_dir, max_message_bytes=64 * 1024, tls_cert=cert, tls_key=key
    )
    with small as s:
        url = s.base_url.replace("http://", "https://")
        with httpx.Client(
            base_url=url, headers=s.headers, verify=ssl.create_default_context(cafile=cert)
        ) as c:
            r = c.post(C, json={**BASE, "prompt": [65] * 30_000})  # 90 kB of JSON
            assert r.status_code == 413 and "max_message_bytes 65536" in r.json()["error"]["message"]
            assert c.post(C, json={**BASE, "max_tokens": 1}).status_code == 200
        with pytest.raises(httpx.HTTPError):
            httpx.get(s.base_url + "/healthz")  # plaintext to a TLS port


def test_drain_refuses_new_calls_and_aborts_running_ones(http_loop, http_engine, tiny_model_dir):
    with make_served(http_loop, http_engine, tiny_model_dir, drain_timeout_s=1) as s:
        body = {**BASE, "max_tokens": 1020, "stream": True, "extra": 1, "ignore_eos": True}
        events: list[str] = []
        first = threading.Event()

        def consume():
            with (
                httpx.Client(base_url=s.base_url, headers=s.headers, timeout=60) as c,
                c.stream("POST", C, json=body) as r,
            ):
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        first.set()

        t = threading.Thread(target=consume)
        t.start()
        assert first.wait(30)
        s.replica.core.running.begin_drain()  # the whole replica: both front ends refuse
        with s.http() as c:
            assert c.get("/readyz").status_code == 503
            r = c.post(C, json={**BASE, "max_tokens": 1})
            assert r.status_code == 503 and "draining" in r.json()["error"]["message"]
        http_loop.run(s.replica.drain(0.2))  # far less than 1020 tokens take
        t.join(30)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "abort"


def test_metrics_are_served_on_the_http_port_with_the_token(served):
    with served.http() as c:
        before = c.get("/metrics")
        assert before.status_code == 200 and before.headers["content-type"].startswith("text/plain")
        r = c.post("/v1/generate", json=_native_request(max_tokens=4, ignore_eos=True))
        assert r.status_code == 200
        after = c.get("/metrics").text

    def tokens(text: str) -> float:
        line = next(x for x in text.splitlines() if x.startswith("maskroll_generated_tokens_total "))
        return float(line.split()[1])

    assert tokens(after) - tokens(before.text) == 4  # the four completion tokens just generated
    import httpx

    assert httpx.get(served.base_url + "/metrics").status_code == 401  # no token, no metrics


def test_info_reports_the_replicas_load(served):
    """/v1/info (GetInfo) carries the load the metrics count: running now, and counters since start."""
    with served.http() as c:
        before = c.get("/v1/info").json()
        r = c.post("/v1/completions", json={**BASE, "max_tokens": 5, "ignore_eos": True})
        assert r.status_code == 200, r.text
        after = c.get("/v1/info").json()
    assert int(after["generated_tokens"]) - int(before.get("generated_tokens", 0)) == 5
    assert after.get("in_flight", 0) == 0  # nothing running between the calls
