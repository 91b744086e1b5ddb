"""The gRPC path with the real vLLM engine (the session's one engine from vllm_fixtures) behind it:
reassembly, an engine-specific refusal mapped to INVALID_ARGUMENT, cancellation, concurrency.
Skipped where vllm is not installed."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
from grpc_fixtures import replica, server_config, wait_until
from vllm_fixtures import server_loop, vllm_engine, vllm_env  # noqa: F401  (fixtures)

from maskroll.client import RecordAssembler, RolloutClient, RolloutError, SamplingOptions

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
PROMPT = [256, 72, 101, 108, 108, 111]


@pytest.fixture(scope="module")
def vllm_server(server_loop, vllm_engine, tiny_model_dir):  # noqa: F811
    with replica(server_loop, server_config(tiny_model_dir, engine="vllm"), vllm_engine) as r:
        yield r


def _run(server, fn):
    async def main():
        async with RolloutClient(server.address) as c:
            return await fn(c)

    return asyncio.run(main())


def test_get_info_reports_the_engine_settings(vllm_server):
    async def fn(c):
        return await c.info()

    info = _run(vllm_server, fn)
    assert (info.engine, info.max_model_len, info.max_tokens, info.dtype, info.seed) == (
        "vllm",
        1024,
        1023,
        "float32",
        0,
    )
    assert (info.tensor_parallel_size, info.quantization, info.kv_cache_bytes) == (1, "", 1 << 30)
    assert (info.gpu_memory_utilization, info.kv_cache_tokens) == (0.0, (1 << 30) // 2048)
    assert info.max_batch == 64 and info.prefix_caching == vllm_server.engine.settings.prefix_caching


def test_chunks_reassemble_to_the_record(vllm_server):
    opts = SamplingOptions(max_tokens=16, logprobs_k=5, n=2, seed=3, temperature=0.8, top_k=40)

    async def fn(c):
        return [ch async for ch in c.generate(PROMPT, opts, include_record_arrays=True)]

    assembler, done = RecordAssembler(), []
    for ch in _run(vllm_server, fn):
        rec = assembler.add(ch)
        if rec is not None:
            done.append((rec, ch.record))
    assert len(done) == 2
    for assembled, sent in done:
        for name in ("completion_ids", "sampled_logprobs", "sampled_ranks", "topk_ids", "topk_logprobs"):
            assert getattr(assembled, name).tobytes() == getattr(sent, name).tobytes(), name
        assert sent.topk_ids.shape == (16, 5) and sent.semantics.engine == "vllm"
        lp = sent.topk_logprobs
        assert np.all(lp[:, :-1] >= lp[:, 1:]) and np.all(sent.sampled_ranks <= 40)


def test_engine_refusal_is_invalid_argument_and_the_next_request_is_served(vllm_server):
    async def fn(c):
        with pytest.raises(RolloutError) as err:
            await c.generate_record(PROMPT, SamplingOptions(max_tokens=2, temperature=3.0))
        return err.value, await c.generate_record(PROMPT, SamplingOptions(max_tokens=2, ignore_eos=True))

    err, rec = _run(vllm_server, fn)
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in err.message
    assert rec.num_tokens == 2


def test_breaking_out_frees_the_engine(vllm_server, vllm_engine, server_loop):  # noqa: F811
    async def fn(c):
        async for _ in c.generate(PROMPT, SamplingOptions(max_tokens=900, n=2, ignore_eos=True)):
            break

    _run(vllm_server, fn)
    wait_until(
        lambda: server_loop.run(vllm_engine.unfinished_requests()) == (0, False),
        timeout=30,
        what="vLLM to abort the cancelled requests",
    )


def test_16_concurrent_streams(vllm_server):
    async def fn(c):
        opts = [SamplingOptions(max_tokens=32, logprobs_k=4, seed=s, ignore_eos=True) for s in range(16)]
        return await asyncio.gather(*(c.generate_record(PROMPT, o) for o in opts))

    records = _run(vllm_server, fn)
    assert [r.num_tokens for r in records] == [32] * 16
