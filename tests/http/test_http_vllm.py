"""The HTTP front end on the real vLLM engine (the session's one engine from vllm_fixtures): OpenAI top
logprobs are the processed top-K the gRPC path returns for the same seed, streaming agrees with not
streaming, and a session's record carries the replica's K. Skipped where vllm is not installed."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import openai
import pytest
from grpc_fixtures import replica, server_config
from vllm_fixtures import server_loop, vllm_engine, vllm_env  # noqa: F401  (fixtures)

from maskroll.client import RolloutClient, SamplingOptions

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def vllm_http(server_loop, vllm_engine, tiny_model_dir):  # noqa: F811
    config = server_config(tiny_model_dir, engine="vllm", http_port=0)
    with replica(server_loop, config, vllm_engine) as r:
        yield r


def grpc_record(r, prompt, **options):
    async def main():
        async with RolloutClient(r.address) as c:
            return await c.generate_record(prompt, SamplingOptions(**options))

    return asyncio.run(main())


def test_chat_top_logprobs_are_the_grpc_numbers_for_the_same_seed(vllm_http):
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{vllm_http.http.port}/v1", api_key="none", max_retries=0)
    kw = dict(
        model="model",
        messages=[{"role": "user", "content": "Hello there"}],
        max_tokens=12,
        seed=9,
        temperature=0.8,
        logprobs=True,
        top_logprobs=5,
        extra_body={"return_token_ids": True, "ignore_eos": True, "top_k": 40},
    )
    out = c.chat.completions.create(**kw)
    prompt = out.model_extra["prompt_token_ids"]
    rec = grpc_record(
        vllm_http, prompt, max_tokens=12, seed=9, temperature=0.8, top_k=40, logprobs_k=5, ignore_eos=True
    )
    choice = out.choices[0]
    assert choice.model_extra["token_ids"] == rec.completion_ids.tolist()
    tops = np.array([[t.logprob for t in e.top_logprobs] for e in choice.logprobs.content])  # [T, 5]
    assert (np.diff(tops, axis=1) <= 0).all()  # sorted by rank
    np.testing.assert_allclose(tops, rec.topk_logprobs, rtol=0, atol=1e-5)
    np.testing.assert_allclose([e.logprob for e in choice.logprobs.content], rec.sampled_logprobs, atol=1e-5)

    chunks = list(c.chat.completions.create(stream=True, **kw))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == choice.message.content
    streamed = [t for ch in chunks for t in ch.choices[0].model_extra.get("token_ids") or []]
    assert streamed == choice.model_extra["token_ids"]


def test_a_session_on_vllm_records_the_replicas_k(vllm_http):
    base = f"http://127.0.0.1:{vllm_http.http.port}"
    c = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    h = {"X-Maskroll-Session": "vllm-1"}
    msgs = [{"role": "user", "content": "2+2?"}]
    first = c.chat.completions.create(model="model", messages=msgs, max_tokens=4, seed=1, extra_headers=h)
    msgs += [first.choices[0].message, {"role": "tool", "content": "4"}]
    c.chat.completions.create(model="model", messages=msgs, max_tokens=4, seed=2, extra_headers=h)
    done = httpx.post(base + "/v1/sessions/vllm-1/finish").json()
    assert done["num_turns"] == 2 and done["record"]["semantics"]["logprobs_k"] == 20
    assert sum(done["loss_mask"]) == sum(x is not None for x in done["sampled_logprobs"])
