"""The torch engine's LoRA (server/engines/torch_lora.py) on the real tiny model, the engine driven directly
(no gRPC): base + adapter samples and scores exactly what the merged weights do (float32 rounding), one
batch mixing rows of two adapters and rows of none gives each row what it gets alone, outputs carry the
adapter's version, and what the engine cannot apply is refused by name. Plus `lora_rows` against a dense
per-row reference in float64. Each test runs its own event loop (asyncio.run), as tests/server's
test_torch_engine.py does."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import lora_helpers as lh
import numpy as np
import pytest
import torch

from maskroll.server.engines.contract import (
    AdapterRef,
    EngineOutput,
    EngineRequest,
    LoraWeights,
    SamplingParams,
    ScoreRequest,
)
from maskroll.server.engines.torch_engine import TorchEngine
from maskroll.server.engines.torch_lora import LoraPair, lora_rows

# Base + adapter vs merged weights through the same cached decode: x (W + s B A)ᵀ and x Wᵀ + s (x Aᵀ) Bᵀ
# differ by float rounding only. float32: max |Δ logprob| = 2.0e-5 on logprobs of magnitude ~4 (relative
# 5e-6) over these prompts (temperature 0.7 amplifies it), hence 1e-5 absolute plus 1e-5 relative. float64
# (test_float64_gap_is_output_rounding): max 2.4e-6, the float32 spacing of the outputs themselves.
ATOL = RTOL = 1e-5
PROMPTS = [[72, 101, 108, 108, 111], [1, 2, 3], [200, 17, 99, 5, 5, 5, 42], [10]]


def _ref(run: str, version: int, id_: int, namespace: str = "ns") -> AdapterRef:
    return AdapterRef(f"{namespace}/{run}/v{version}", id_, version, namespace, run)


REF_A = _ref("run-a", 3, 1)
REF_B = _ref("run-b", 5, 2)


def _request(prompt, rid="r", adapter=None, **params) -> EngineRequest:
    return EngineRequest(rid, np.asarray(prompt, np.int32), SamplingParams(**params), adapter)


async def _sample(engine: TorchEngine, request: EngineRequest) -> list[EngineOutput]:
    return [o async for o in engine.generate(request)]


def _cat(outputs: list[EngineOutput], name: str) -> np.ndarray:
    return np.concatenate([getattr(o, name) for o in outputs])


def _versions(outputs: list[EngineOutput]) -> np.ndarray:  # [T] the policy version of each token
    return np.concatenate([np.full(len(o.token_ids), o.policy_version) for o in outputs])


def _assert_same(got: list[EngineOutput], want: list[EngineOutput], atol=ATOL, rtol=RTOL) -> None:
    """Same tokens, ranks and top-K ids; logprobs and top-K logprobs within atol + rtol · |logprob|."""
    np.testing.assert_array_equal(_cat(got, "token_ids"), _cat(want, "token_ids"))
    np.testing.assert_array_equal(_cat(got, "sampled_ranks"), _cat(want, "sampled_ranks"))
    np.testing.assert_array_equal(_cat(got, "topk_ids"), _cat(want, "topk_ids"))
    for name in ("sampled_logprobs", "topk_logprobs"):
        np.testing.assert_allclose(_cat(got, name), _cat(want, name), atol=atol, rtol=rtol)


def _start(model_dir: Path, **kw) -> TorchEngine:
    engine = TorchEngine(model_dir, threads=1, max_logprobs=20, max_batch=8, **kw)
    asyncio.run(engine.start())
    return engine


@pytest.fixture(scope="module")
def model_dir(lora_model_dir) -> Path:  # the folder's tiny base (tests/lora/conftest.py)
    return lora_model_dir


@pytest.fixture(scope="module")
def adapter_a(model_dir):
    """Rank 4 on the attention projections, scale 2: large enough to change sampled tokens."""
    return lh.random_adapter(model_dir, rank=4, alpha=8.0, seed=1, std=0.1)


@pytest.fixture(scope="module")
def adapter_b(model_dir):
    """Another run's adapter: other modules (the MLP, o_proj), rank 2, scale 1.5."""
    return lh.random_adapter(
        model_dir, rank=2, alpha=3.0, target_modules=("o_proj", "up_proj", "down_proj"), seed=2, std=0.1
    )


@pytest.fixture(scope="module")
def engine(model_dir, adapter_a, adapter_b):
    eng = _start(model_dir, max_lora_rank=8, max_loras=3)

    async def add():
        await eng.add_adapter(REF_A, LoraWeights(*adapter_a))
        await eng.add_adapter(REF_B, LoraWeights(*adapter_b))

    asyncio.run(add())
    yield eng
    asyncio.run(eng.close())


@pytest.fixture(scope="module")
def merged_a(model_dir, adapter_a, tmp_path_factory):
    """A second engine on the base with adapter A merged into its weights (W + scale · B A)."""
    merged = lh.merged_state_dict(lh.base_state_dict(model_dir), *adapter_a)
    eng = _start(lh.write_model_dir(model_dir, merged, tmp_path_factory.mktemp("merged") / "a"))
    yield eng
    asyncio.run(eng.close())


# ---- the maths, pure ---------------------------------------------------------------------------------


def test_lora_rows_matches_dense_per_row_reference():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 6, generator=g, dtype=torch.float64)  # [B, S, in]
    w = torch.randn(4, 6, generator=g, dtype=torch.float64)  # [out, in]
    pa = LoraPair(torch.randn(2, 6, generator=g, dtype=torch.float64), torch.randn(4, 2, generator=g,
                  dtype=torch.float64), 1.5)  # fmt: skip
    pb = LoraPair(torch.randn(3, 6, generator=g, dtype=torch.float64), torch.randn(4, 3, generator=g,
                  dtype=torch.float64), 0.25)  # fmt: skip
    which = [pa, pb, None, pa, None]  # rows 0, 3: A; row 1: B; rows 2, 4: the base alone
    y = lora_rows(x @ w.T, x, [(torch.tensor([0, 3]), pa), (torch.tensor([1]), pb)])
    for i, p in enumerate(which):
        w_i = w if p is None else w + p.scale * p.b @ p.a  # the merged weight of row i's adapter
        torch.testing.assert_close(y[i], x[i] @ w_i.T, rtol=0, atol=1e-12)
    assert not torch.allclose(y[0], x[0] @ w.T)  # the adapter changed its rows
    # rows=None: every row with one adapter.
    y_all = lora_rows(x @ w.T, x, [(None, pb)])
    torch.testing.assert_close(y_all, x @ (w + pb.scale * pb.b @ pb.a).T, rtol=0, atol=1e-12)


# ---- generation and scoring against the merged weights ---------------------------------------------


def test_adapter_generation_equals_merged_weights(engine, merged_a):
    params = [
        {"temperature": 1.0},
        {"temperature": 0.7, "top_k": 20},
        {"temperature": 1.2, "top_p": 0.9},
        {"temperature": 1.0, "top_k": 50, "top_p": 0.95},
    ]

    async def run():
        changed = 0
        for i, (prompt, p) in enumerate(zip(PROMPTS, params, strict=True)):
            kw = {"max_tokens": 32, "logprobs_k": 5, "seed": 100 + i, **p}
            lora = await _sample(engine, _request(prompt, adapter=REF_A, **kw))
            merged = await _sample(merged_a, _request(prompt, **kw))
            base = await _sample(engine, _request(prompt, **kw))
            _assert_same(lora, merged)
            assert len(_cat(lora, "token_ids")) == 32
            changed += not np.array_equal(_cat(base, "token_ids"), _cat(lora, "token_ids"))
        return changed

    # The adapter is not a no-op: base-only sampling with the same seeds gives other tokens.
    assert asyncio.run(run()) == len(PROMPTS)


def test_float64_gap_is_output_rounding(model_dir, adapter_a, tmp_path):
    """In float64 base + adapter and the merged weights agree to the float32 spacing of the outputs: the
    float32 gap above is the arithmetic's rounding, not a difference in what is computed."""
    merged = lh.merged_state_dict(lh.base_state_dict(model_dir), *adapter_a)
    lora_eng = _start(model_dir, dtype=torch.float64, max_lora_rank=4)
    merged_eng = _start(lh.write_model_dir(model_dir, merged, tmp_path / "m"), dtype=torch.float64)

    async def run():
        await lora_eng.add_adapter(REF_A, LoraWeights(*adapter_a))
        kw = {"max_tokens": 32, "logprobs_k": 5, "seed": 3, "temperature": 0.7}
        return (
            await _sample(lora_eng, _request(PROMPTS[2], adapter=REF_A, **kw)),
            await _sample(merged_eng, _request(PROMPTS[2], **kw)),
        )

    try:
        lora, merged = asyncio.run(run())
    finally:
        asyncio.run(lora_eng.close())
        asyncio.run(merged_eng.close())
    _assert_same(lora, merged, atol=4e-6, rtol=0)  # float32 spacing at |logprob| < 64: 3.8e-6


def test_adapter_score_equals_merged_weights(engine, merged_a):
    """Re-scoring what base + A sampled (the records' check): scores under A equal scores on the merged
    weights, differ from the base's, and carry A's version."""
    params = SamplingParams(max_tokens=16, temperature=0.8, top_k=40, logprobs_k=4)
    prompt = np.asarray(PROMPTS[0], np.int32)

    async def run():
        samples = [
            await _sample(engine, _request(prompt, adapter=REF_A, **{**params.__dict__, "seed": s}))
            for s in (1, 2)
        ]
        completions = tuple(_cat(o, "token_ids") for o in samples)
        scores = [
            await eng.score(ScoreRequest("s", prompt, completions, params, ref))
            for eng, ref in ((engine, REF_A), (merged_a, None), (engine, None))
        ]
        return samples, scores

    samples, (lora, merged, base) = asyncio.run(run())
    for i, sample in enumerate(samples):
        np.testing.assert_array_equal(lora.ranks[i], merged.ranks[i])
        np.testing.assert_array_equal(lora.topk_ids[i], merged.topk_ids[i])
        np.testing.assert_allclose(lora.logprobs[i], merged.logprobs[i], atol=ATOL, rtol=RTOL)
        np.testing.assert_allclose(lora.topk_logprobs[i], merged.topk_logprobs[i], atol=ATOL, rtol=RTOL)
        # The score of a sampled token is the record's logprob (a full forward vs the cached decode:
        # tests/server/test_torch_engine.py's 2e-4), and the base scores it otherwise.
        np.testing.assert_allclose(lora.logprobs[i], _cat(sample, "sampled_logprobs"), atol=2e-4)
        assert not np.allclose(base.logprobs[i], lora.logprobs[i], atol=0.05)
    assert lora.policy_version == REF_A.version
    assert base.policy_version == merged.policy_version == engine.policy_version == 0


def test_a_batch_mixing_adapters_gives_each_row_what_it_gets_alone(engine):
    """Rows of A, B, none and A again decode in shared forwards: each row's tokens and logprobs are those
    of the same request run alone."""
    requests = [
        _request(PROMPTS[i], f"mix-{i}", ref, max_tokens=24, logprobs_k=3, seed=7 + i)
        for i, ref in enumerate([REF_A, REF_B, None, REF_A])
    ]

    async def alone():
        return [await _sample(engine, r) for r in [*requests, dataclasses.replace(requests[1], adapter=None)]]

    async def together():
        steps = engine.decode_steps
        outs = await asyncio.gather(*(_sample(engine, r) for r in requests))
        return outs, engine.decode_steps - steps

    *solo, b_without_b = asyncio.run(alone())
    mixed, steps = asyncio.run(together())
    # B (MLP and o_proj, rank 2) is not a no-op either: its row without it samples other tokens.
    assert not np.array_equal(_cat(solo[1], "token_ids"), _cat(b_without_b, "token_ids"))
    for got, want in zip(mixed, solo, strict=True):
        _assert_same(got, want)
    # 4 × 24 tokens took fewer batched forwards than 4 × 23 alone would: rows did share forwards.
    assert steps < 4 * 23
    assert all(set(_versions(o)) == {v} for o, v in zip(mixed, [3, 5, engine.policy_version, 3], strict=True))


# ---- versions, removal, refusals -------------------------------------------------------------------


def test_adapter_outputs_keep_the_adapter_version_across_a_full_weight_update(model_dir, adapter_a):
    """Every token of a request with an adapter says ref.version, even after a full-weights update lands
    mid-sample; a base request in flight switches to the update's version."""
    eng = _start(model_dir, max_lora_rank=4)
    base_sd = lh.base_state_dict(model_dir)

    async def run():
        await eng.add_adapter(REF_A, LoraWeights(*adapter_a))
        kw = {"max_tokens": 600, "seed": 1}
        lora_gen = eng.generate(_request(PROMPTS[0], "lora", REF_A, **kw))
        base_gen = eng.generate(_request(PROMPTS[0], "base", **kw))
        lora_out, base_out = [await anext(lora_gen)], [await anext(base_gen)]
        await eng.update_weights_from_tensors(9, dict(base_sd), "the same base")
        lora_out += [o async for o in lora_gen]
        base_out += [o async for o in base_gen]
        return lora_out, base_out

    try:
        lora_out, base_out = asyncio.run(run())
    finally:
        asyncio.run(eng.close())
    assert len(_versions(lora_out)) == 600
    assert set(_versions(lora_out)) == {REF_A.version}
    assert set(_versions(base_out)) == {0, 9}  # the update landed while both were sampling


def test_removed_adapter_is_refused_by_name(model_dir, adapter_a):
    eng = _start(model_dir, max_lora_rank=4)
    ref_c = _ref("run-c", 1, 7)

    async def run():
        await eng.add_adapter(ref_c, LoraWeights(*adapter_a))
        before = await _sample(eng, _request(PROMPTS[1], adapter=ref_c, max_tokens=4, seed=0))
        await eng.remove_adapter(ref_c)
        with pytest.raises(ValueError, match=r"adapter 'ns/run-c/v1' \(id 7\) is not resident"):
            await _sample(eng, _request(PROMPTS[1], adapter=ref_c, max_tokens=4, seed=0))
        score = ScoreRequest("s", np.asarray(PROMPTS[1], np.int32), (np.asarray([1, 2], np.int32),),
                             SamplingParams(max_tokens=2), ref_c)  # fmt: skip
        with pytest.raises(ValueError, match="not resident"):
            await eng.score(score)
        with pytest.raises(ValueError, match="not resident"):
            await eng.remove_adapter(ref_c)
        # A ref under a resident id but another name (another version) is not that adapter.
        await eng.add_adapter(ref_c, LoraWeights(*adapter_a))
        with pytest.raises(ValueError, match="not resident"):
            await _sample(eng, _request(PROMPTS[1], adapter=dataclasses.replace(ref_c, version=2),
                                        max_tokens=4))  # fmt: skip
        return before, await _sample(eng, _request(PROMPTS[1], adapter=ref_c, max_tokens=4, seed=0))

    try:
        before, again = asyncio.run(run())
    finally:
        asyncio.run(eng.close())
    _assert_same(again, before)  # added again: the same adapter samples the same tokens


def test_removing_an_adapter_in_use_ends_its_rows_alone(model_dir, adapter_a):
    """The adapter table removes only adapters no request names; if one is removed anyway, the rows still
    sampling with it end with a clear error and the batch's other rows go on exactly as alone."""
    eng = _start(model_dir, max_lora_rank=4)
    ref_c = _ref("run-c", 1, 7)
    base_req = _request(PROMPTS[0], "base", max_tokens=300, logprobs_k=2, seed=5)

    async def run():
        await eng.add_adapter(ref_c, LoraWeights(*adapter_a))
        lora_gen = eng.generate(_request(PROMPTS[1], "lora", ref_c, max_tokens=600, seed=4))
        base_gen = eng.generate(base_req)
        await anext(lora_gen)
        base_out = [await anext(base_gen)]
        await eng.remove_adapter(ref_c)
        with pytest.raises(ValueError, match=r"adapter 'ns/run-c/v1' was removed while the request sampled"):
            async for _ in lora_gen:
                pass
        base_out += [o async for o in base_gen]
        return base_out, await _sample(eng, base_req)

    try:
        base_out, alone = asyncio.run(run())
        assert eng.num_active == 0
    finally:
        asyncio.run(eng.close())
    _assert_same(base_out, alone)


def test_what_the_engine_cannot_apply_is_refused_by_name(model_dir, adapter_a):
    eng = _start(model_dir, max_lora_rank=4, max_loras=2)
    spec, tensors = adapter_a
    q = "model.layers.0.self_attn.q_proj"

    def refused(ref, spec=spec, tensors=tensors):
        async def go():
            await eng.add_adapter(ref, LoraWeights(spec, tensors))

        with pytest.raises(ValueError) as e:
            asyncio.run(go())
        return str(e.value)

    try:
        ref = _ref("bad", 1, 11)
        # rank above max_lora_rank
        big = lh.random_adapter(model_dir, rank=8, alpha=8.0, seed=3)
        assert "rank 8 is not in [1, max_lora_rank 4]" in refused(ref, *big)
        # a module the model lacks
        ghost = {k.replace(q, "model.layers.7.self_attn.q_proj"): v for k, v in tensors.items()}
        assert "the model has no module 'model.layers.7.self_attn.q_proj'" in refused(ref, tensors=ghost)
        # a module that is not a Linear
        norm = {
            "model.norm.lora_A.weight": torch.zeros(4, 128),
            "model.norm.lora_B.weight": torch.zeros(1, 4),
        }
        assert "module 'model.norm' is a LlamaRMSNorm, not a Linear" in refused(ref, tensors=norm)
        # lora_A of the wrong width
        wide = {**tensors, q + ".lora_A.weight": torch.zeros(4, 129)}
        assert f"module {q!r}: lora_A [4, 129] and lora_B [128, 4] are not [4, 128]" in refused(
            ref, tensors=wide
        )
        # lone half, NaN, a name that is no LoRA tensor
        lone = {k: v for k, v in tensors.items() if k != q + ".lora_B.weight"}
        assert f"module {q!r} has lora_A without lora_B" in refused(ref, tensors=lone)
        nan = {**tensors, q + ".lora_B.weight": torch.full((128, 4), float("nan"))}
        assert f"{q + '.lora_B.weight'!r} is not finite" in refused(ref, tensors=nan)
        assert "is not '<module>.lora_A.weight'" in refused(
            ref, tensors={q + ".weight": torch.zeros(128, 128)}
        )
        # max_loras: two resident, a third refused naming the limit; the two keep serving
        asyncio.run(eng.add_adapter(_ref("r1", 0, 1), LoraWeights(spec, tensors)))
        asyncio.run(eng.add_adapter(_ref("r2", 0, 2), LoraWeights(spec, tensors)))
        assert "max_loras 2 adapters are resident already" in refused(ref)
        assert "id 2 is resident already" in refused(_ref("r3", 0, 2))
        out = asyncio.run(_sample(eng, _request(PROMPTS[0], adapter=_ref("r2", 0, 2), max_tokens=3)))
        assert set(_versions(out)) == {0} and len(_cat(out, "token_ids")) == 3
    finally:
        asyncio.run(eng.close())


def test_lora_off_refuses_adapters(model_dir, adapter_a):
    eng = _start(model_dir)  # max_lora_rank 0
    try:
        assert eng.max_lora_rank == 0
        with pytest.raises(ValueError, match="takes no LoRA adapters"):
            asyncio.run(eng.add_adapter(REF_A, LoraWeights(*adapter_a)))
        with pytest.raises(ValueError, match="takes no LoRA adapters"):
            asyncio.run(_sample(eng, _request(PROMPTS[0], adapter=REF_A, max_tokens=2)))
    finally:
        asyncio.run(eng.close())


def test_factory_passes_the_lora_settings(model_dir):
    from maskroll.server.config import ServerConfig
    from maskroll.server.engines.factory import make_engine

    eng = make_engine(ServerConfig(model=model_dir, engine="torch", port=0, max_lora_rank=16, max_loras=3))
    assert (eng.max_lora_rank, eng._max_loras) == (16, 3)
