"""Bad input never crashes or wedges the server (real TorchEngine behind a real grpc.aio server).

Each request is built as raw protobuf — bypassing the client's own checks — and must end with the right
status code and a message naming the field; the same server then serves a normal request.
"""

from __future__ import annotations

import asyncio
import math

import grpc
import numpy as np
import pytest
from grpc_fixtures import replica, server_config, server_loop, torch_engine, torch_server  # noqa: F401

from maskroll.client import RolloutClient, RolloutError, SamplingOptions, SyncRolloutClient
from maskroll.proto._generated import rollout_pb2 as pb
from maskroll.proto._generated import rollout_pb2_grpc as pb_grpc

PROMPT = np.array([256, 72, 105], "<i4")  # <bos> "Hi"


def request(prompt=PROMPT, metadata=None, **options) -> pb.GenerateRequest:
    base = {"max_tokens": 4, "logprobs_k": 2}
    prompt_bytes = prompt if isinstance(prompt, bytes) else np.asarray(prompt, "<i4").tobytes()
    return pb.GenerateRequest(
        prompt_token_ids=prompt_bytes, options=pb.SamplingOptions(**{**base, **options}), metadata=metadata
    )


async def _raw_generate(address: str, req: pb.GenerateRequest) -> grpc.aio.AioRpcError | None:
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            async for _ in pb_grpc.RolloutServiceStub(channel).Generate(req, timeout=30):
                pass
        except grpc.aio.AioRpcError as exc:
            return exc
    return None


def assert_refused_then_served(
    address: str, req: pb.GenerateRequest, code: grpc.StatusCode, needle: str
) -> None:
    async def main():
        err = await _raw_generate(address, req)
        async with RolloutClient(address) as c:
            rec = await c.generate_record(
                PROMPT, SamplingOptions(max_tokens=3, logprobs_k=2, ignore_eos=True)
            )
        return err, rec

    err, rec = asyncio.run(main())
    assert err is not None, "the bad request was served"
    assert err.code() == code, (err.code(), err.details())
    assert needle in err.details(), err.details()
    assert rec.num_tokens == 3, "the next request was not served normally"


BAD = {
    "K above the maximum": (request(logprobs_k=21), "options.logprobs_k must be in [0, 20], got 21"),
    "negative K": (request(logprobs_k=-1), "options.logprobs_k"),
    "empty prompt": (request(prompt=np.zeros(0, "<i4")), "prompt_token_ids is empty"),
    "token id = vocab size": (
        request(prompt=[256, 259]),
        "prompt_token_ids[1] = 259 is outside the vocabulary",
    ),
    "negative token id": (request(prompt=[-3]), "prompt_token_ids[0] = -3"),
    "prompt not whole int32s": (request(prompt=b"\x01\x02\x03"), "prompt_token_ids: 3 bytes"),
    "max_tokens zero": (request(max_tokens=0), "options.max_tokens must be >= 1, got 0"),
    "max_tokens negative": (request(max_tokens=-7), "options.max_tokens must be >= 1, got -7"),
    "max_tokens above the context": (request(max_tokens=1022), "3 + 1022 > max_model_len 1024"),
    "max_tokens above the server cap": (request(max_tokens=5000), "exceeds the server's limit 4096"),
    "prompt fills the context": (request(prompt=np.full(1024, 65)), "prompt_token_ids has 1024 tokens"),
    "temperature zero": (request(temperature=0.0), "options.temperature must be finite and > 0, got 0.0"),
    "temperature negative": (request(temperature=-1.0), "options.temperature"),
    "temperature nan": (request(temperature=math.nan), "options.temperature must be finite and > 0, got nan"),
    "temperature inf": (request(temperature=math.inf), "options.temperature must be finite and > 0, got inf"),
    "top_p zero": (request(top_p=0.0), "options.top_p must be in (0, 1], got 0.0"),
    "top_p above one": (request(top_p=1.5), "options.top_p"),
    "top_p nan": (request(top_p=math.nan), "options.top_p must be in (0, 1], got nan"),
    "top_k below -1": (request(top_k=-2), "options.top_k"),
    "top_k above the vocabulary": (request(top_k=1000), "options.top_k"),
    "n above max_n": (request(n=65), "options.n must be in [1, 64]"),
    "n negative": (request(n=-2), "options.n"),
    "seed overflowing int64": (request(seed=2**64 - 1), "options.seed"),
    "stop token outside the vocabulary": (
        request(stop_token_ids=[1, 300]),
        "options.stop_token_ids[1] = 300",
    ),
    # Finite and > 0, but ℓ / T overflows float32: once it killed the torch engine's decode thread.
    "temperature below float32's reach": (
        request(temperature=1e-40),
        "the torch engine refused the request: temperature must be >= 2.94e-35 for the torch engine",
    ),
    "temperature denormal, n = 64": (request(temperature=5e-324, n=64), "temperature must be >= 2.94e-35"),
    "metadata with too many entries": (
        request(metadata={f"k{i}": "v" for i in range(65)}),
        "metadata has 65 entries; at most 64",
    ),
    "a metadata value of 1 MB": (
        request(metadata={"blob": "x" * 1_000_000}),
        "metadata['blob'] has 1000000 characters; at most 4096",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_invalid_argument_naming_the_field(torch_server, case):  # noqa: F811
    req, needle = BAD[case]
    assert_refused_then_served(torch_server.address, req, grpc.StatusCode.INVALID_ARGUMENT, needle)


def test_overlong_request_id_is_invalid_argument(torch_server):  # noqa: F811
    req = request()
    req.request_id = "r" * 300
    assert_refused_then_served(
        torch_server.address, req, grpc.StatusCode.INVALID_ARGUMENT, "request_id has 300"
    )


def test_rollout_stream_without_redis_is_failed_precondition(torch_server):  # noqa: F811
    req = request()
    req.rollout_stream = "maskroll:default:rollouts"
    assert_refused_then_served(
        torch_server.address,
        req,
        grpc.StatusCode.FAILED_PRECONDITION,
        "needs a server started with redis_url",
    )


def test_oversized_message_is_resource_exhausted(server_loop, torch_engine, tiny_model_dir):  # noqa: F811
    config = server_config(tiny_model_dir, max_message_bytes=64 * 1024)
    with replica(server_loop, config, torch_engine) as r:
        big = request(prompt=np.full(20_000, 65))  # 80 kB of prompt
        assert_refused_then_served(r.address, big, grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max")


def test_client_checks_what_needs_no_server(torch_server):  # noqa: F811
    with SyncRolloutClient(torch_server.address) as c:
        for opts, field in [
            (SamplingOptions(temperature=0.0), "temperature"),
            (SamplingOptions(top_p=2.0), "top_p"),
            (SamplingOptions(max_tokens=0), "max_tokens"),
        ]:
            with pytest.raises(RolloutError) as err:
                c.generate_record(PROMPT, opts)
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and field in err.value.message
        with pytest.raises(RolloutError, match="fit in int32"):
            c.generate_record([2**40], SamplingOptions(max_tokens=1))
        with pytest.raises(RolloutError, match=r"must be a 1-D array of token ids, got float64 \(2,\)"):
            c.generate_record([1.5, 2.0], SamplingOptions(max_tokens=1))
