"""The torch reference engine on a real tiny model: its logprobs are the processed μ a trainer recomputes,
batching does not change results, seeds fix tokens, cancellation frees rows, weight updates land between
steps. Every test drives the real engine thread; each test runs its own event loop (asyncio.run)."""

from __future__ import annotations

import asyncio
import copy
import inspect
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from maskroll.app.model_init import encode_text, init_model
from maskroll.server.engines.contract import EngineOutput, EngineRequest, SamplingParams
from maskroll.server.engines.torch_engine import TorchEngine
from maskroll.trainer_adapter.processed import processed_logprobs

# Engine vs one-forward recompute in float32: max |Δ| = 5.2e-5 over 48 requests × 64 tokens × 20 top-K
# entries (logprobs of magnitude 1..15; a KV-cached batch vs one [P + T] forward round differently).
# In float64 the same comparison agrees to 1e-12 (test_float64_engine_agrees_to_rounding), so the gap
# is rounding, not semantics.
ATOL = 2e-4


@dataclass
class Sample:
    outputs: list[EngineOutput]

    def cat(self, field: str) -> np.ndarray:
        return np.concatenate([getattr(o, field) for o in self.outputs])

    @property
    def tokens(self) -> np.ndarray:
        return self.cat("token_ids")

    @property
    def versions(self) -> np.ndarray:  # [T] policy version of each token
        return np.concatenate([np.full(len(o.token_ids), o.policy_version) for o in self.outputs])


def _request(prompt: list[int], rid: str = "r", **params) -> EngineRequest:
    return EngineRequest(rid, np.asarray(prompt, np.int32), SamplingParams(**params))


async def _sample(engine: TorchEngine, prompt: list[int], **params) -> Sample:
    return Sample([o async for o in engine.generate(_request(prompt, **params))])


async def _wait_idle(engine: TorchEngine, timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if engine.num_active == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine still holds {engine.num_active} requests")


def _engine(model_dir: Path, **kw) -> TorchEngine:
    engine = TorchEngine(model_dir, threads=1, **kw)  # 1 intra-op thread: the CI box is small and shared
    asyncio.run(engine.start())
    return engine


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path):
    eng = _engine(tiny_model_dir, max_logprobs=20)
    yield eng
    asyncio.run(eng.close())


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


def _trainer_mu(
    model, prompt: list[int], completion: np.ndarray, temperature: float, top_k: int, top_p: float
):
    """The trainer's μ: one forward over prompt + completion, processed logprobs at each completion token."""
    ids = torch.tensor([[*prompt, *completion.tolist()]])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1]  # [T, V]: position i predicts completion[i]
    return processed_logprobs(logits, temperature, top_k, top_p)  # [T, V]


PROMPT = "The quick brown fox"


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 12, 1.0), (0.7, 0, 0.8), (1.3, 40, 0.9)],
)
def test_logprobs_match_the_trainer_recompute(
    engine, hf_model, tiny_model_dir, temperature, top_k, top_p
) -> None:
    prompt = encode_text(tiny_model_dir, PROMPT)
    k = 8
    s = asyncio.run(
        _sample(
            engine,
            prompt,
            max_tokens=32,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            logprobs_k=k,
            seed=11,
        )
    )
    assert len(s.tokens) == 32 and s.outputs[-1].finish_reason == "length"
    mu = _trainer_mu(hf_model, prompt, s.tokens, temperature, top_k, top_p)  # [T, V]
    tokens = torch.from_numpy(s.tokens).long()
    # (a) sampled-token logprob and the top-K entries are μ of the recompute
    want_sampled = mu.gather(1, tokens[:, None])[:, 0]
    torch.testing.assert_close(torch.from_numpy(s.cat("sampled_logprobs")), want_sampled, atol=ATOL, rtol=0)
    topk_ids, topk_lp = torch.from_numpy(s.cat("topk_ids")).long(), torch.from_numpy(s.cat("topk_logprobs"))
    assert topk_ids.shape == topk_lp.shape == (32, k) and topk_ids.dtype == torch.int64
    assert s.cat("topk_ids").dtype == np.int32 and s.cat("topk_logprobs").dtype == np.float32
    torch.testing.assert_close(topk_lp, mu.gather(1, topk_ids), atol=ATOL, rtol=0)  # -inf == -inf allowed
    torch.testing.assert_close(topk_lp, mu.topk(k, dim=-1).values, atol=ATOL, rtol=0)
    # the semantics matter: the raw T = 1 untruncated logprobs are far from the record's μ
    raw = _trainer_mu(hf_model, prompt, s.tokens, 1.0, 0, 1.0).gather(1, tokens[:, None])[:, 0]
    if (temperature, top_k, top_p) != (1.0, 0, 1.0):
        assert (raw - want_sampled).abs().max() > 0.05
    if top_k:
        assert bool((mu.isfinite().sum(-1) <= top_k + 1).all())  # the kept set is the top-k (plus ties)
    if top_p < 1.0:
        assert bool((mu.isfinite().sum(-1) < mu.shape[-1]).all())
    if top_p < 1.0 and not top_k:  # the kept set is the smallest prefix with mass >= p
        kept_mass = _trainer_mu(hf_model, prompt, s.tokens, temperature, 0, 1.0).exp().where(mu.isfinite(), 0)
        assert bool((kept_mass.sum(-1) >= top_p - 1e-4).all())


def test_float64_engine_agrees_to_rounding(tiny_model_dir, hf_model) -> None:
    eng = _engine(tiny_model_dir, dtype=torch.float64)
    prompt = encode_text(tiny_model_dir, PROMPT)
    try:
        s = asyncio.run(
            _sample(eng, prompt, max_tokens=24, temperature=0.7, top_k=30, top_p=0.9, logprobs_k=5, seed=2)
        )
    finally:
        asyncio.run(eng.close())
    model64 = copy.deepcopy(hf_model).double()
    mu = _trainer_mu(model64, prompt, s.tokens, 0.7, 30, 0.9)  # [T, V] float64
    ids = torch.from_numpy(s.cat("topk_ids")).long()
    # the record stores float32: compare at float32 resolution (|lp| < 16 → spacing < 2e-6)
    torch.testing.assert_close(
        torch.from_numpy(s.cat("topk_logprobs")).double(), mu.gather(1, ids), atol=2e-6, rtol=0
    )


def test_ranks_and_sorted_topk(engine, hf_model, tiny_model_dir) -> None:
    prompt = encode_text(tiny_model_dir, "Ranks of sampled tokens")
    k = 4
    s = asyncio.run(_sample(engine, prompt, max_tokens=48, temperature=1.2, logprobs_k=k, seed=5))
    lp, ranks = s.cat("sampled_logprobs"), s.cat("sampled_ranks")
    ids, top = s.cat("topk_ids"), s.cat("topk_logprobs")
    assert ranks.dtype == np.int32 and bool((ranks >= 1).all())
    assert bool((np.diff(top, axis=1) <= 0).all())  # sorted by μ, descending
    assert all(len(set(row)) == k for row in ids.tolist())  # exactly K distinct entries
    for t, (tok, r) in enumerate(zip(s.tokens.tolist(), ranks.tolist(), strict=True)):
        if r <= k:  # the sampled token sits at its rank in the top-K
            assert ids[t, r - 1] == tok and top[t, r - 1] == lp[t]
        else:
            assert tok not in ids[t] and lp[t] <= top[t, -1]
    # rank = #{μ_j >= μ_a} (vLLM's convention), checked against the recompute up to float ties
    mu = _trainer_mu(hf_model, prompt, s.tokens, 1.2, 0, 1.0)
    lp_t = torch.from_numpy(lp)[:, None]
    lo = 1 + (mu > lp_t + ATOL).sum(-1)
    hi = 1 + (mu > lp_t - ATOL).sum(-1)
    assert bool(((lo <= torch.from_numpy(ranks)) & (torch.from_numpy(ranks) <= hi)).all())
    assert ranks.max() > k  # T = 1.2 on a ~3.5-nat distribution: some samples fall outside the top 4


def _mixed_params(i: int) -> dict:
    return dict(
        max_tokens=20 + 3 * (i % 5),
        temperature=(1.0, 0.7, 1.3)[i % 3],
        top_k=(0, 16)[i % 2],
        top_p=(1.0, 0.9, 1.0, 0.8)[i % 4],
        logprobs_k=(0, 5, 20)[i % 3],
        seed=100 + i,
    )


def test_sixteen_concurrent_requests_equal_the_same_requests_alone(engine, tiny_model_dir) -> None:
    # 11..29 tokens: different cache lengths, so merging left-pads both the batch and the newcomer
    prompts = [encode_text(tiny_model_dir, f"request {i}: " + "abc" * (i % 6)) for i in range(16)]

    async def concurrent() -> list[Sample]:
        # Half start together; the other half join while the first half is decoding, so rows are merged
        # into a running batch with different cache lengths (left padding on both sides).
        first = [asyncio.create_task(_sample(engine, prompts[i], **_mixed_params(i))) for i in range(8)]
        await asyncio.sleep(0.02)
        later = [asyncio.create_task(_sample(engine, prompts[i], **_mixed_params(i))) for i in range(8, 16)]
        return await asyncio.gather(*first, *later)

    steps0 = engine.decode_steps
    together = asyncio.run(concurrent())
    steps = engine.decode_steps - steps0
    alone = [asyncio.run(_sample(engine, prompts[i], **_mixed_params(i))) for i in range(16)]
    total = sum(len(s.tokens) for s in together)
    assert total == sum(_mixed_params(i)["max_tokens"] for i in range(16))
    for a, b in zip(together, alone, strict=True):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.cat("sampled_logprobs"), b.cat("sampled_logprobs"), atol=ATOL, rtol=0)
        np.testing.assert_allclose(a.cat("topk_logprobs"), b.cat("topk_logprobs"), atol=ATOL, rtol=0)
        np.testing.assert_array_equal(a.cat("topk_ids").shape, b.cat("topk_ids").shape)
    # batched: one forward per step for all rows, so steps ≈ the longest request, not the token total
    assert steps < total / 4, (steps, total)
    assert engine.num_active == 0


def test_cancellation_frees_the_engine(engine, tiny_model_dir) -> None:
    prompt = encode_text(tiny_model_dir, "cancel me")

    async def scenario() -> None:
        # consumer closes the stream (aclose) after three outputs
        stream = engine.generate(_request(prompt, max_tokens=900, seed=1))
        for _ in range(3):
            await stream.__anext__()
        await stream.aclose()
        await _wait_idle(engine)
        # consumer task cancelled while waiting for tokens
        task = asyncio.create_task(_sample(engine, prompt, max_tokens=900, seed=2))
        await asyncio.sleep(0.05)
        assert engine.num_active == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _wait_idle(engine)
        steps = engine.decode_steps
        await asyncio.sleep(0.05)
        assert engine.decode_steps == steps  # nothing decodes for the abandoned rows
        s = await _sample(engine, prompt, max_tokens=5, seed=3)  # the next request is served normally
        assert len(s.tokens) == 5 and s.outputs[-1].finish_reason == "length"

    asyncio.run(scenario())
    assert engine.num_active == 0


def test_queued_request_beyond_max_batch_waits_and_can_be_cancelled(tiny_model_dir) -> None:
    eng = _engine(tiny_model_dir, max_batch=1)
    prompt = encode_text(tiny_model_dir, "one at a time")

    async def scenario() -> None:
        running = asyncio.create_task(_sample(eng, prompt, max_tokens=200, seed=1))
        queued = asyncio.create_task(_sample(eng, prompt, max_tokens=200, seed=1))
        await asyncio.sleep(0.02)
        assert eng.num_active == 2  # one decoding, one waiting for a free row
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        assert eng.num_active == 1  # a waiting request is freed at once
        assert len((await running).tokens) == 200
        a, b = await asyncio.gather(*(_sample(eng, prompt, max_tokens=10, seed=4) for _ in range(2)))
        np.testing.assert_array_equal(a.tokens, b.tokens)  # served one after the other, same seed

    try:
        asyncio.run(scenario())
        assert eng.num_active == 0
    finally:
        asyncio.run(eng.close())


def test_seed_fixes_the_outputs(engine, tiny_model_dir) -> None:
    prompt = encode_text(tiny_model_dir, "seeded")
    params = dict(max_tokens=24, temperature=0.9, top_p=0.95, logprobs_k=6)
    a, b, c = (asyncio.run(_sample(engine, prompt, seed=s, **params)) for s in (7, 7, 8))
    for field in ("token_ids", "sampled_logprobs", "sampled_ranks", "topk_ids", "topk_logprobs"):
        np.testing.assert_array_equal(a.cat(field), b.cat(field))
    assert not np.array_equal(a.tokens, c.tokens)
    unseeded = [asyncio.run(_sample(engine, prompt, **params)).tokens for _ in range(2)]
    assert not np.array_equal(*unseeded)


def test_stop_token_and_context_limit(engine, tiny_model_dir) -> None:
    prompt = encode_text(tiny_model_dir, "stop")
    free = asyncio.run(_sample(engine, prompt, max_tokens=30, seed=9)).tokens
    stop = int(free[5])
    first = int(np.argmax(free == stop))  # its first occurrence, at index <= 5
    s = asyncio.run(_sample(engine, prompt, max_tokens=30, seed=9, stop_token_ids=(stop, 999)))
    np.testing.assert_array_equal(s.tokens, free[: first + 1])  # the stop token is included
    assert s.outputs[-1].finish_reason == "stop"
    max_len = engine.limits.max_model_len
    long_prompt = (prompt * max_len)[: max_len - 3]
    s = asyncio.run(_sample(engine, long_prompt, max_tokens=50, seed=9))
    assert len(s.tokens) == 3 and s.outputs[-1].finish_reason == "length"


def test_limits_and_bad_requests(engine, tiny_model_dir) -> None:
    lim = engine.limits
    assert (lim.vocab_size, lim.max_model_len, lim.max_logprobs) == (259, 1024, 20)
    assert engine.name == "torch" and engine.version

    async def fails(prompt, **params) -> str:
        with pytest.raises(ValueError) as exc:
            await _sample(engine, prompt, **params)
        return str(exc.value)

    assert "prompt_ids" in asyncio.run(fails([], max_tokens=3))
    assert "prompt_ids" in asyncio.run(fails([1, 259], max_tokens=3))
    assert "logprobs_k" in asyncio.run(fails([1, 2], max_tokens=3, logprobs_k=21))
    assert "max_model_len" in asyncio.run(fails([1] * 1024, max_tokens=3))
    # finite and > 0, but ℓ / T would overflow float32 (issue 11: it killed the decode thread)
    assert "temperature must be >= 2.94e-35 for the torch engine, got 1e-40" in asyncio.run(
        fails([1, 2], max_tokens=3, temperature=1e-40)
    )
    assert len(asyncio.run(_sample(engine, [1, 2], max_tokens=3)).tokens) == 3
    assert engine.num_active == 0


def _save(tensors: dict, directory: Path) -> Path:
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def test_update_weights_between_steps(tiny_model_dir, hf_model, tmp_path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, DynamicCache

    new_dir = init_model(tmp_path / "policy1", seed=1)
    new_model = AutoModelForCausalLM.from_pretrained(new_dir).eval()
    eng = _engine(tiny_model_dir)
    prompt = encode_text(tiny_model_dir, "weights")
    params = dict(max_tokens=16, logprobs_k=4, seed=3)

    async def scenario() -> None:
        before = await _sample(eng, prompt, **params)
        assert eng.policy_version == 0 and set(before.versions) == {0}
        # an in-flight request keeps going through the update and records where the version changed
        stream = eng.generate(_request(prompt, max_tokens=900, logprobs_k=4, seed=4))
        outs = [await stream.__anext__() for _ in range(2)]
        in_flight = await eng.update_weights(5, new_dir)
        assert in_flight == 1 and eng.policy_version == 5
        async for o in stream:  # read on until 20 tokens of the new version, then hang up
            outs.append(o)
            if sum(len(x.token_ids) for x in outs if x.policy_version == 5) >= 20:
                break
        await stream.aclose()
        s = Sample(outs)
        change = int(np.argmax(s.versions == 5))
        assert change >= 2 and set(s.versions[:change]) == {0} and set(s.versions[change:]) == {5}
        assert all(o.finish_reason is None for o in outs)
        # Before the change: μ of the old weights. After it: the new weights reading the KV cache the
        # old weights wrote (the update does not recompute the cache, as vLLM does not).
        tokens = s.tokens.tolist()
        old_mu = _trainer_mu(hf_model, prompt, s.tokens, 1.0, 0, 1.0)[:change]  # [change, V]
        cache = DynamicCache()
        # transformers renamed past_key_values to cache; an unknown keyword is silently ignored
        kw = "cache" if "cache" in inspect.signature(hf_model.forward).parameters else "past_key_values"
        with torch.no_grad():
            hf_model(torch.tensor([prompt + tokens[: change - 1]]), **{kw: cache}, use_cache=True)
            new_mu = new_model(torch.tensor([tokens[change - 1 : -1]]), **{kw: cache}, use_cache=True).logits[
                0
            ]
        want = torch.cat([old_mu, new_mu.log_softmax(-1)]).gather(1, torch.tensor(tokens)[:, None])[:, 0]
        np.testing.assert_allclose(s.cat("sampled_logprobs"), want.numpy(), atol=ATOL, rtol=0)
        fresh_new = _trainer_mu(new_model, prompt, s.tokens, 1.0, 0, 1.0)[change:]
        fresh_lp = fresh_new.gather(1, torch.tensor(tokens[change:])[:, None])[:, 0]
        assert (fresh_lp - want[change:]).abs().max() > 0.01  # so the cache really was the old one
        # the same seeded request now gives other tokens under version 5
        after = await _sample(eng, prompt, **params)
        assert set(after.versions) == {5} and not np.array_equal(after.tokens, before.tokens)
        # bad checkpoints: ValueError naming the key, model and version unchanged
        good = load_file(str(new_dir / "model.safetensors"))
        missing = {k: v for k, v in good.items() if k != "model.norm.weight"}
        extra = {**good, "model.extra.weight": torch.zeros(2)}
        wrong = {**good, "lm_head.weight": torch.zeros(3, 128)}
        for i, (tensors, key) in enumerate(
            [(missing, "model.norm.weight"), (extra, "model.extra.weight"), (wrong, "lm_head.weight")]
        ):
            with pytest.raises(ValueError, match=key.replace(".", r"\.")):
                await eng.update_weights(6, _save(tensors, tmp_path / f"bad{i}"))
        with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
            await eng.update_weights(6, tmp_path)
        assert eng.policy_version == 5
        again = await _sample(eng, prompt, **params)
        np.testing.assert_array_equal(again.tokens, after.tokens)
        np.testing.assert_array_equal(again.cat("sampled_logprobs"), after.cat("sampled_logprobs"))
        assert await eng.update_weights(7, new_dir) == 0  # idle engine: nothing in flight

    try:
        asyncio.run(scenario())
    finally:
        asyncio.run(eng.close())


def test_engine_reports_the_model_eos(tiny_model_dir):
    from maskroll.app.model_init import EOS_ID
    from maskroll.server.engines.torch_engine import TorchEngine

    assert TorchEngine(tiny_model_dir, threads=1).limits.eos_token_ids == (EOS_ID,)


def test_a_row_whose_distribution_is_not_finite_fails_alone(tiny_model_dir, monkeypatch) -> None:
    """The guard bypassed, a temperature of 1e-40 in a shared batch makes that row's μ NaN: it ends with
    a SamplingError naming it while the other rows of the same batch run to the end (before issue 11,
    the exception killed the decode thread and every request hung)."""
    from maskroll.server.engines import torch_engine, torch_sampling

    monkeypatch.setattr(torch_sampling, "MIN_TEMPERATURE", 0.0)
    eng = _engine(tiny_model_dir)

    async def scenario():
        long = asyncio.create_task(_sample(eng, [256, 72], rid="long", max_tokens=40, logprobs_k=2))
        await asyncio.sleep(0.05)  # `long` is in the batch when the others join
        bad = _sample(eng, [256, 72], rid="bad", max_tokens=5, temperature=1e-40)
        ok = _sample(eng, [256, 73], rid="ok", max_tokens=20, seed=1)
        return await asyncio.gather(bad, ok, long, return_exceptions=True)

    try:
        bad, ok, long = asyncio.run(scenario())
        assert isinstance(bad, torch_engine.SamplingError), bad
        assert "request bad: the next-token distribution is not finite at completion token 0" in str(bad)
        assert len(ok.tokens) == 20 and len(long.tokens) == 40
        assert eng.failure() is None and eng.num_active == 0
        assert len(asyncio.run(_sample(eng, [1, 2], max_tokens=3)).tokens) == 3
    finally:
        asyncio.run(eng.close())


def test_a_checkpoint_with_non_finite_values_is_refused(tiny_model_dir, tmp_path) -> None:
    from safetensors.torch import load_file

    eng = _engine(tiny_model_dir)
    good = load_file(str(tiny_model_dir / "model.safetensors"))

    async def scenario():
        before = await _sample(eng, [256, 72], max_tokens=8, seed=3, logprobs_k=2)
        for i, value in enumerate([float("nan"), float("inf"), -float("inf")]):
            bad = {k: v.clone() for k, v in good.items()}
            bad["model.layers.0.mlp.up_proj.weight"][3, :2] = value
            with pytest.raises(
                ValueError, match=r"'model\.layers\.0\.mlp\.up_proj\.weight' in .* has 2 non-finite"
            ):
                await eng.update_weights(1, _save(bad, tmp_path / f"bad{i}"))
        after = await _sample(eng, [256, 72], max_tokens=8, seed=3, logprobs_k=2)
        assert eng.policy_version == 0 and set(after.versions) == {0}
        np.testing.assert_array_equal(after.tokens, before.tokens)  # the old weights, untouched

    try:
        asyncio.run(scenario())
    finally:
        asyncio.run(eng.close())


def test_a_stuck_forward_kills_the_engine_and_fails_what_is_in_flight(tiny_model_dir) -> None:
    import threading
    import time

    from maskroll.server.engines.contract import EngineDead

    eng = _engine(tiny_model_dir, stall_timeout_s=0.5)
    real, stuck = eng._forward, threading.Event()

    def forward(**kwargs):
        if stuck.is_set():
            time.sleep(2)
        return real(**kwargs)

    eng._forward = forward

    async def scenario():
        stream = eng.generate(_request([256, 72], max_tokens=500))
        await stream.__anext__()
        stuck.set()
        while eng.failure() is None:  # the health monitor's poll
            await asyncio.sleep(0.05)
        with pytest.raises(EngineDead, match=r"no forward finished for 0\.5 s"):
            async for _ in stream:
                pass
        with pytest.raises(EngineDead, match="restart the replica"):
            await _sample(eng, [1, 2], max_tokens=2)
        assert eng.num_active == 0

    try:
        asyncio.run(scenario())
    finally:
        asyncio.run(eng.close())
