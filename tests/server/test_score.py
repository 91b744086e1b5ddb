"""Score on the torch reference engine, through a real replica (gRPC and HTTP): the score of tokens the
engine just sampled is the record's logprobs, ranks and top-K; the top-K is an independent transformers
forward's at the temperature; bad input is INVALID_ARGUMENT naming the field, and the next call is served.
"""

from __future__ import annotations

import asyncio

import grpc
import httpx
import numpy as np
import pytest
import torch
from google.protobuf import json_format
from grpc_fixtures import replica, server_config, server_loop, torch_engine  # noqa: F401

from maskroll.client import RolloutClient, SamplingOptions
from maskroll.proto import wire
from maskroll.proto._generated import rollout_pb2 as pb
from maskroll.proto._generated import rollout_pb2_grpc as pb_grpc
from maskroll.proto.scoring import ScoreJob, ScoreOptions

PROMPT = [256, 72, 101, 108, 108, 111]  # <bos> "Hello"
VOCAB = 259


@pytest.fixture(scope="module")
def scorer(server_loop, torch_engine, tiny_model_dir):  # noqa: F811
    with replica(server_loop, server_config(tiny_model_dir, http_port=0), torch_engine) as r:
        yield r


def _score(address, prompt, completions, options, **kw):
    async def main():
        async with RolloutClient(address) as c:
            return await c.score(prompt, completions, options, **kw)

    return asyncio.run(main())


@pytest.mark.parametrize(
    "opts",
    [
        dict(temperature=1.0),
        dict(temperature=0.7, top_k=40, top_p=0.95),
    ],
    ids=["T1", "T0.7-topk40-topp0.95"],
)
def test_score_of_sampled_tokens_is_the_record(scorer, opts):
    """Generate (seed, K = 5, n = 2), then Score the same tokens with the same options: the sampled
    logprobs, ranks and top-K come back, to float32 rounding of a full forward against a cached decode."""
    sampling = SamplingOptions(max_tokens=32, logprobs_k=5, n=2, seed=11, ignore_eos=True, **opts)

    async def main():
        async with RolloutClient(scorer.address) as c:
            records = await c.generate_records(PROMPT, sampling)
            scored = await c.score(
                PROMPT, [r.completion_ids for r in records], ScoreOptions(logprobs_k=5, **opts)
            )
            return records, scored

    records, scored = asyncio.run(main())
    assert len(scored.completions) == 2 and scored.policy_version == 0
    s = scored.semantics
    assert (s.logprobs_mode, s.engine, s.logprobs_k, s.temperature) == (
        "processed",
        "torch",
        5,
        opts["temperature"],
    )
    assert (s.top_k, s.top_p) == (opts.get("top_k", 0), opts.get("top_p", 1.0))
    for rec, sc in zip(records, scored.completions, strict=True):
        assert sc.num_tokens == rec.num_tokens == 32
        np.testing.assert_allclose(sc.logprobs, rec.sampled_logprobs, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(sc.ranks, rec.sampled_ranks)
        np.testing.assert_array_equal(sc.topk_ids, rec.topk_ids)
        np.testing.assert_allclose(sc.topk_logprobs, rec.topk_logprobs, rtol=1e-5, atol=1e-5)
        assert sc.logprobs.dtype == np.float32 and sc.topk_ids.dtype == np.int32


def _reference(model_dir, prompt, completion, temperature, top_k, k):
    """An independent forward: transformers in float64, log_softmax(ℓ / T) (top-k masked by hand)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).double().eval()
    ids = torch.tensor([prompt + completion], dtype=torch.long)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]  # [T, V]
    x = logits / temperature
    if top_k:
        kth = x.sort(dim=-1, descending=True).values[:, top_k - 1 : top_k]  # [T, 1]
        x = x.masked_fill(x < kth, float("-inf"))
    mu = x.log_softmax(dim=-1)  # [T, V]
    given = mu.gather(1, torch.tensor(completion)[:, None])[:, 0]  # [T]
    ranks = (mu >= given[:, None]).sum(dim=1)  # [T]
    top = mu.topk(k, dim=-1)
    return given.numpy(), ranks.numpy(), top.indices.numpy(), top.values.numpy()


def test_top_k_matches_a_transformers_forward_with_temperature(scorer, tiny_model_dir):
    completions = [[104, 101, 114, 101, 33, 257], [32, 119, 111, 114, 108, 100, 10, 70, 71, 72, 73]]
    for temperature, top_k in ((0.6, 0), (1.3, 8)):
        scored = _score(
            scorer.address,
            PROMPT,
            completions,
            ScoreOptions(logprobs_k=6, temperature=temperature, top_k=top_k),
        )
        for c, sc in zip(completions, scored.completions, strict=True):
            given, ranks, ids, vals = _reference(tiny_model_dir, PROMPT, c, temperature, top_k, 6)
            np.testing.assert_array_equal(sc.topk_ids, ids)
            # the float32 engine against a float64 forward: the engine's own rounding, ~1e-5 at |log μ| ~ 4
            np.testing.assert_allclose(sc.topk_logprobs, vals, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(sc.logprobs, given, rtol=1e-5, atol=1e-5)  # -inf == -inf where cut
            np.testing.assert_array_equal(sc.ranks, ranks)
            if top_k:  # a given token outside the top-k: log μ = -inf, rank V
                cut = sc.ranks > top_k
                assert cut.any() and np.all(np.isneginf(sc.logprobs[cut])) and np.all(sc.ranks[cut] == VOCAB)


BAD = [
    # (request fields, the field the message starts with)
    (
        dict(completion_token_ids=[[1, 2, VOCAB]]),
        "completion_token_ids[0][2] = 259 is outside the vocabulary",
    ),
    (dict(completion_token_ids=[[1], []]), "completion_token_ids[1] is empty"),
    (dict(completion_token_ids=[]), "completion_token_ids is empty"),
    (dict(prompt=[7] * 1000, completion_token_ids=[[1] * 25]), "completion_token_ids[0] has 25 tokens"),
    (dict(logprobs_k=21), "logprobs_k must be in [0, 20], got 21"),
    (dict(temperature=0.0), "temperature must be finite and > 0"),
    (dict(top_p=1.5), "top_p must be in (0, 1]"),
    (dict(prompt=[0, 300]), "prompt_token_ids[1] = 300 is outside the vocabulary"),
    (dict(completion_token_ids=[[1]] * 65), "completion_token_ids has 65 completions; at most 64"),
]


def _pb_request(prompt=PROMPT, completion_token_ids=([104, 105],), logprobs_k=3, **kw) -> pb.ScoreRequest:
    return pb.ScoreRequest(
        prompt_token_ids=np.asarray(prompt, "<i4").tobytes(),
        completion_token_ids=[np.asarray(c, "<i4").tobytes() for c in completion_token_ids],
        logprobs_k=logprobs_k,
        **kw,
    )


@pytest.mark.parametrize(
    "fields,message", BAD, ids=[m.split(" ")[0] + f"-{i}" for i, (_, m) in enumerate(BAD)]
)
def test_bad_input_is_invalid_argument_naming_the_field_and_the_next_call_is_served(scorer, fields, message):
    async def main():
        async with grpc.aio.insecure_channel(scorer.address) as ch:
            stub = pb_grpc.RolloutServiceStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Score(_pb_request(**fields))
            ok = await stub.Score(_pb_request())
            return err.value, ok

    err, ok = asyncio.run(main())
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith(message), err.details()
    assert len(ok.completions) == 1 and ok.completions[0].num_tokens == 2


def test_http_score_equals_grpc_score(scorer):
    request = _pb_request(
        completion_token_ids=[[104, 101, 114, 101], [33, 10]],
        logprobs_k=4,
        temperature=0.9,
        top_p=0.9,
        request_id="same",
    )

    async def grpc_call():
        async with grpc.aio.insecure_channel(scorer.address) as ch:
            return await pb_grpc.RolloutServiceStub(ch).Score(request)

    by_grpc = asyncio.run(grpc_call())
    body = json_format.MessageToDict(request, preserving_proto_field_name=True)
    r = httpx.post(f"http://127.0.0.1:{scorer.http.port}/v1/score", json=body, timeout=60)
    assert r.status_code == 200, r.text
    by_http = json_format.ParseDict(r.json(), pb.ScoreResponse())
    assert by_http == by_grpc
    assert wire.score_result_from_pb(by_http).completions[1].topk_ids.shape == (2, 4)
    bad = httpx.post(
        f"http://127.0.0.1:{scorer.http.port}/v1/score", json={**body, "logprobs_k": 99}, timeout=60
    )
    assert bad.status_code == 400 and "logprobs_k" in bad.text


def test_wire_round_trip_and_packed_size():
    """A ScoreResponse is packed like a record: [T, K] ids and logprobs are T·K·4 bytes each."""
    job = ScoreJob(np.array([1, 2], np.int32), (np.array([3, 4, 5], np.int32),), ScoreOptions(logprobs_k=2))
    assert wire.score_from_pb(wire.score_request(job)).completions[0].tolist() == [3, 4, 5]
    from maskroll.proto.records import Semantics
    from maskroll.proto.scoring import ScoredTokens, ScoreResult

    tokens = ScoredTokens(
        np.array([-0.1, -2.5, -np.inf], np.float32),
        np.array([1, 3, 259], np.int32),
        np.array([[3, 9], [8, 1], [0, 2]], np.int32),
        np.array([[-0.1, -3.0], [-0.5, -1.5], [-0.2, -2.0]], np.float32),
    )
    msg = wire.score_result_to_pb(ScoreResult("r", [tokens], Semantics(logprobs_k=2), 7))
    assert len(msg.completions[0].topk_logprobs) == 3 * 2 * 4
    back = wire.score_result_from_pb(pb.ScoreResponse.FromString(msg.SerializeToString()))
    assert back.policy_version == 7 and back.semantics.logprobs_k == 2
    for name in ("logprobs", "ranks", "topk_ids", "topk_logprobs"):
        np.testing.assert_array_equal(getattr(back.completions[0], name), getattr(tokens, name))


def test_an_engine_that_cannot_score_answers_unimplemented():
    """The contract's default `score` (a test fake has none): UNIMPLEMENTED, not an internal error."""
    from fake_engine import FakeEngine

    from maskroll.server.errors import Unimplemented
    from maskroll.server.generation import serving, validation

    engine = FakeEngine()
    caps = validation.Caps.of(engine.limits, max_logprobs=20, max_tokens=64, max_n=8)
    job = ScoreJob(np.array([1, 2], np.int32), (np.array([3], np.int32),), ScoreOptions(logprobs_k=2))
    with pytest.raises(Unimplemented, match="the fake engine does not score"):
        asyncio.run(serving.score_job(engine, job, caps))


def test_sync_client_scores_and_k_zero_keeps_the_given_token(scorer):
    from maskroll.client import SyncRolloutClient

    with SyncRolloutClient(scorer.address) as c:
        scored = c.score(PROMPT, [[104, 105, 33]], ScoreOptions(logprobs_k=2)).completions[0]
        bare = c.score(PROMPT, [[104, 105, 33]], ScoreOptions(logprobs_k=0)).completions[0]
    assert scored.topk_ids.shape == (3, 2) and bare.topk_ids.shape == (3, 0)
    np.testing.assert_array_equal(bare.logprobs, scored.logprobs)
    np.testing.assert_array_equal(bare.ranks, scored.ranks)
