"""The real path: RolloutClient → grpc.aio server on port 0 → TorchEngine on the tiny model.

Reassembly against the server's own record, numbers against a trainer-side recompute, 16 concurrent
streams, cancellation freeing the engine, GetInfo and the health service.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from grpc_fixtures import server_loop, torch_engine, torch_server, wait_until  # noqa: F401

from maskroll.client import RecordAssembler, RolloutClient, SamplingOptions

ARRAYS = ("completion_ids", "sampled_logprobs", "sampled_ranks", "topk_ids", "topk_logprobs")
PROMPT = [256, 72, 101, 108, 108, 111]  # <bos> "Hello"


def test_streamed_chunks_reassemble_to_exactly_the_final_record(torch_server, tiny_model_dir):  # noqa: F811
    opts = SamplingOptions(
        max_tokens=24, logprobs_k=5, n=4, seed=3, temperature=0.8, top_k=40, top_p=0.95, ignore_eos=True
    )

    async def main():
        async with RolloutClient(torch_server.address) as c:
            return [ch async for ch in c.generate(PROMPT, opts, job_id="j", include_record_arrays=True)]

    chunks = asyncio.run(main())
    assert all(ch.policy_version == 0 for ch in chunks)
    assembler, done = RecordAssembler(), {}
    for ch in chunks:
        rec = assembler.add(ch)
        if rec is not None:
            done[ch.sample_index] = (rec, ch.record)
    assert sorted(done) == [0, 1, 2, 3]
    for assembled, sent in done.values():
        for name in ARRAYS:
            a, b = getattr(assembled, name), getattr(sent, name)
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), name
        rec = sent
        assert rec.num_tokens == 24 and rec.finish_reason == "length" and rec.topk_ids.shape == (24, 5)
        lp = rec.topk_logprobs  # -inf past the top-p nucleus: >= rather than diff, which gives nan there
        assert np.all(lp[:, :-1] >= lp[:, 1:]), "top-K must be sorted by rank"
        assert np.all(rec.sampled_logprobs <= 0) and np.all(rec.sampled_ranks >= 1)
        inside = np.flatnonzero(rec.sampled_ranks <= 5)
        rows = rec.sampled_ranks[inside] - 1
        np.testing.assert_array_equal(rec.topk_ids[inside, rows], rec.completion_ids[inside])
        np.testing.assert_array_equal(rec.topk_logprobs[inside, rows], rec.sampled_logprobs[inside])
        assert np.all(rec.sampled_ranks <= 40), "top_k=40: nothing outside the top 40 can be sampled"
        s = rec.semantics
        assert (s.engine, s.model, s.logprobs_k, s.top_k, s.logprobs_mode) == (
            "torch",
            str(tiny_model_dir),
            5,
            40,
            "processed",
        )
    # Different seeds per sample: the four completions differ.
    assert len({rec.completion_ids.tobytes() for rec, _ in done.values()}) == 4


def test_sampled_and_topk_logprobs_match_a_trainer_side_recompute(torch_server, tiny_model_dir):  # noqa: F811
    """log_softmax(logits / T) of the same model on prompt + completion (no top-k / top-p: μ = softmax/T)."""
    import torch
    from transformers import AutoModelForCausalLM

    temperature = 0.7
    opts = SamplingOptions(max_tokens=32, logprobs_k=8, seed=11, temperature=temperature)

    async def main():
        async with RolloutClient(torch_server.address) as c:
            return await c.generate_record(PROMPT, opts)

    rec = asyncio.run(main())
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    ids = torch.tensor([PROMPT + rec.completion_ids.tolist()])
    with torch.no_grad():
        logits = model(ids).logits[0, len(PROMPT) - 1 : -1].double()  # [T, V]
    mu = torch.log_softmax(logits / temperature, dim=-1)
    sampled = mu.gather(1, torch.as_tensor(rec.completion_ids, dtype=torch.long)[:, None])[:, 0]
    np.testing.assert_allclose(rec.sampled_logprobs, sampled.numpy(), atol=5e-5)
    top = mu.topk(8, dim=-1)
    np.testing.assert_allclose(rec.topk_logprobs, top.values.numpy(), atol=5e-5)
    np.testing.assert_array_equal(rec.topk_ids, top.indices.numpy())
    ranks = (mu >= sampled[:, None]).sum(dim=1)  # vLLM's convention (engine.py)
    np.testing.assert_array_equal(rec.sampled_ranks, ranks.numpy())


def test_16_concurrent_streams_all_finish_and_match_their_sequential_runs(torch_server):  # noqa: F811
    def opts(seed):
        return SamplingOptions(max_tokens=40, logprobs_k=4, seed=seed, ignore_eos=True)

    async def main():
        async with RolloutClient(torch_server.address) as c:
            together = await asyncio.gather(*(c.generate_record(PROMPT, opts(s)) for s in range(16)))
            alone = [await c.generate_record(PROMPT, opts(s)) for s in (0, 7, 15)]
            return together, alone

    together, alone = asyncio.run(main())
    assert [r.num_tokens for r in together] == [40] * 16
    assert len({r.rollout_id for r in together}) == 16
    for s, rec in zip((0, 7, 15), alone, strict=True):
        # A seed fixes the tokens whatever else shares the batch; logprobs agree to float rounding.
        np.testing.assert_array_equal(together[s].completion_ids, rec.completion_ids)
        np.testing.assert_allclose(together[s].sampled_logprobs, rec.sampled_logprobs, atol=1e-4)


def test_breaking_out_of_a_stream_frees_the_engine_request(torch_server, torch_engine):  # noqa: F811
    wait_until(lambda: torch_engine.num_active == 0, what="an idle engine")
    steps_before = torch_engine.decode_steps

    async def main():
        async with RolloutClient(torch_server.address) as c:
            seen = 0
            async for ch in c.generate(PROMPT, SamplingOptions(max_tokens=900, n=2, ignore_eos=True)):
                seen += len(ch.token_ids)
                if seen >= 4:
                    break
            # The engine is still generating the 900 tokens unless the break cancelled it.
            return seen

    assert asyncio.run(main()) >= 4
    wait_until(lambda: torch_engine.num_active == 0, timeout=10, what="the engine to drop the cancelled rows")
    # Freed by the cancellation, not by finishing: far fewer decode steps than the 900 asked for.
    assert torch_engine.decode_steps - steps_before < 300
    wait_until(lambda: len(torch_server.core.running) == 0, what="the servicer to finish the call")


def test_get_info_reports_the_model_and_limits(torch_server, tiny_model_dir):  # noqa: F811
    import transformers

    async def main():
        async with RolloutClient(torch_server.address) as c:
            return await c.info()

    info = asyncio.run(main())
    assert (info.engine, info.engine_version, info.model) == (
        "torch",
        transformers.__version__,
        str(tiny_model_dir),
    )
    assert (info.vocab_size, info.max_model_len, info.max_logprobs_k) == (259, 1024, 20)
    assert (info.max_tokens, info.max_n, info.logprobs_mode, info.replica_id) == (
        1023,
        64,
        "processed",
        "test-replica",
    )
    assert info.policy_version == 0 and info.maskroll_version


def test_health_service_reports_serving(torch_server):  # noqa: F811
    async def main():
        async with RolloutClient(torch_server.address) as c:
            return await c.health(), await c.health("maskroll.v1.RolloutService")

    assert asyncio.run(main()) == ("SERVING", "SERVING")


@pytest.mark.parametrize("k", [0, 1, 20])
def test_k_from_zero_to_the_maximum(torch_server, k):  # noqa: F811
    async def main():
        async with RolloutClient(torch_server.address) as c:
            return await c.generate_record(PROMPT, SamplingOptions(max_tokens=5, logprobs_k=k, seed=1))

    rec = asyncio.run(main())
    assert rec.topk_ids.shape == (5, k) and rec.topk_logprobs.shape == (5, k) and rec.logprobs_k == k
    assert rec.semantics.logprobs_k == k and np.all(np.isfinite(rec.sampled_logprobs))
