"""Properties of compute_masks (hypothesis where cheap): identical policies mask nothing, predictive ≡
dppo on binary divergences, monotone in δ / ε, TV ∈ [0, 1], estimator ordering, chunking invariance,
batched ≡ flat, padding never kept."""

from __future__ import annotations

import numpy as np
import pytest
import reference_impl as ref
import torch
from adapter_helpers import np_, run_masks
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from maskroll.trainer_adapter import MaskConfig, compute_masks, policy_loss

# derandomize: the same examples on every run, so CI cannot flake on a newly drawn one
SETTINGS = settings(
    max_examples=15, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)

records = st.builds(
    lambda seed, v, k, t: ref.make_record(seed, n=16, v=v, k=k, temperature=t),
    seed=st.integers(0, 2**31 - 1),
    v=st.integers(50, 300),
    k=st.integers(1, 20),
    t=st.sampled_from([0.6, 0.7, 1.0, 1.3]),
)


def identical_record(seed: int, v: int, k: int, temperature: float) -> ref.Record:
    """μ = the trainer's own processed distribution: top-K and the sampled logprob read off
    log_softmax(ℓ/T)."""
    rec = ref.make_record(seed, n=16, v=v, k=k, temperature=temperature)
    lp = np_(torch.log_softmax(torch.tensor(rec.logits) / temperature, -1))
    rec.topk_ids = np.argsort(-lp, axis=1, kind="stable")[:, :k].copy()
    rec.topk_logprobs = np.take_along_axis(lp, rec.topk_ids, axis=1)
    rec.sampled_logprobs = lp[np.arange(16), rec.sampled_ids]
    rec.mu_logprobs = lp
    return rec


@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    v=st.integers(50, 300),
    k=st.integers(1, 20),
    t=st.sampled_from([0.7, 1.0, 1.3]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    estimator=st.sampled_from(ref.ESTIMATORS),
)
def test_identical_policies_mask_nothing(seed, v, k, t, dtype, estimator) -> None:
    rec = identical_record(seed, v, k, t)
    for method in ref.METHODS:
        for divergence in ref.DIVERGENCES:
            res = run_masks(
                rec, MaskConfig(method=method, divergence=divergence, estimator=estimator), dtype=dtype
            )
            assert bool(res.keep.all()), (method, divergence, estimator)
            assert not bool(res.far.any())
            tol = 1e-12 if dtype == torch.float64 else 1e-5
            assert float(res.divergence.abs().max()) < tol
            assert float(res.mismatch_kl.abs().max()) < tol
            assert float(res.mismatch_tv.abs().max()) < tol


@SETTINGS
@given(
    rec=records,
    delta=st.floats(0.0, 0.3),
    divergence=st.sampled_from(["binary_tv", "binary_kl"]),
    estimator=st.sampled_from(ref.ESTIMATORS),
)
def test_predictive_equals_dppo_for_binary_divergences(rec, delta, divergence, estimator) -> None:
    kw = dict(divergence=divergence, estimator=estimator, delta=delta)
    pred = run_masks(rec, MaskConfig(method="predictive", **kw))
    dppo = run_masks(rec, MaskConfig(method="dppo", **kw))
    assert torch.equal(pred.keep, dppo.keep)
    assert torch.equal(pred.far, dppo.far)
    # sign(P) = sign(π_a − μ_a): P = f'(π_a)·dπ_a/dτ and dπ_a/dτ > 0
    clear = pred.ratio_direction.abs() > 1e-12
    assert torch.equal(torch.sign(pred.predicted_direction[clear]), torch.sign(pred.ratio_direction[clear]))


@SETTINGS
@given(
    rec=records,
    divergence=st.sampled_from(ref.DIVERGENCES),
    method=st.sampled_from(["dppo", "predictive"]),
    deltas=st.lists(st.floats(0.0, 0.5), min_size=2, max_size=2),
)
def test_masks_monotone_in_delta(rec, divergence, method, deltas) -> None:
    lo, hi = sorted(deltas)
    small = run_masks(rec, MaskConfig(method=method, divergence=divergence, delta=lo))
    large = run_masks(rec, MaskConfig(method=method, divergence=divergence, delta=hi))
    assert not bool((~large.keep & small.keep).any())  # larger δ never masks more
    # per side as well: only δ_high grows
    side = run_masks(rec, MaskConfig(method=method, divergence=divergence, delta_low=lo, delta_high=hi))
    assert not bool((~side.keep & small.keep).any())
    assert not bool((~large.keep & side.keep).any())


@SETTINGS
@given(rec=records, eps=st.lists(st.floats(0.0, 0.9), min_size=2, max_size=2))
def test_ppo_monotone_in_eps(rec, eps) -> None:
    lo, hi = sorted(eps)
    small = run_masks(rec, MaskConfig(method="ppo", eps_low=lo, eps_high=lo))
    large = run_masks(rec, MaskConfig(method="ppo", eps_low=hi, eps_high=hi))
    assert not bool((~large.keep & small.keep).any())


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), drift=st.floats(0.0, 30.0), k=st.integers(1, 20))
def test_divergence_ranges(seed, drift, k) -> None:
    """TV ∈ [0, 1] and KL ≥ 0, up to wildly different policies (drift 30 makes π and μ nearly
    disjoint, TV → 1)."""
    rec = ref.make_record(seed, n=16, v=80, k=k)
    rec.logits = rec.logits + drift * np.random.default_rng(seed).standard_normal(rec.logits.shape)
    for divergence in ref.DIVERGENCES:
        res = run_masks(rec, MaskConfig(divergence=divergence))
        d = np_(res.divergence)
        assert np.isfinite(d).all()
        if divergence.endswith("tv"):
            assert (d >= 0).all() and (d <= 1 + 1e-12).all()
        else:
            assert (d >= -1e-12).all()
        tv = np_(res.mismatch_tv)
        assert (tv >= 0).all() and (tv <= 1 + 1e-12).all()
        assert (np_(res.mismatch_kl) >= -1e-12).all()


def test_tv_reaches_one_for_disjoint_policies() -> None:
    # π puts (almost) everything on token 5, μ on tokens 0 and 1: topk_tv ≈ 1, binary_tv ≈ μ_a
    v = 10
    logits = torch.full((1, v), -60.0, dtype=torch.float64)
    logits[0, 5] = 60.0
    res = compute_masks(
        logits,
        torch.tensor([0]),
        torch.log(torch.tensor([0.7], dtype=torch.float64)),
        torch.tensor([[0, 1]]),
        torch.log(torch.tensor([[0.7, 0.3]], dtype=torch.float64)),
        torch.tensor([1.0], dtype=torch.float64),
        config=MaskConfig(divergence="topk_tv"),
    )
    assert float(res.divergence[0]) == pytest.approx(1.0, abs=1e-12)
    assert float(res.mismatch_tv[0]) == pytest.approx(1.0, abs=1e-12)


@SETTINGS
@given(rec=records, divergence=st.sampled_from(["topk_kl", "topk_tv"]))
def test_estimators_are_ordered(rec, divergence) -> None:
    """π_T²/n_T ≤ Q_T ≤ π_T² (Cauchy–Schwarz) and the tail term is linear in Q̂_T with one
    coefficient, so P̂_proportional lies between P̂_uniform and P̂_aggregated."""
    p = {
        e: np_(run_masks(rec, MaskConfig(divergence=divergence, estimator=e)).predicted_direction)
        for e in ref.ESTIMATORS
    }
    assert ((p["proportional"] - p["uniform"]) * (p["aggregated"] - p["proportional"]) >= -1e-15).all()


@SETTINGS
@given(rec=records, method=st.sampled_from(ref.METHODS), divergence=st.sampled_from(ref.DIVERGENCES))
def test_keep_is_consistent_with_its_own_fields(rec, method, divergence) -> None:
    res = run_masks(rec, MaskConfig(method=method, divergence=divergence, delta=0.03))
    a = torch.tensor(rec.advantages)
    if method == "none":
        assert bool(res.keep.all())
        torch.testing.assert_close(res.direction, res.ratio_direction, rtol=0, atol=0)
    else:
        assert torch.equal(res.keep, ~(res.far & (a * res.direction > 0)))
    assert bool(res.keep[a == 0].all())  # A = 0 always keeps
    # P̂ is computed for every method, identically
    other = run_masks(rec, MaskConfig(method="predictive", divergence=divergence, delta=0.03))
    torch.testing.assert_close(res.predicted_direction, other.predicted_direction, rtol=0, atol=0)
    torch.testing.assert_close(res.divergence, other.divergence, rtol=0, atol=0)


@pytest.mark.parametrize("divergence", ref.DIVERGENCES)
def test_chunking_does_not_change_results(divergence: str) -> None:
    rec = ref.make_record(60, n=37, v=2000, k=20, temperature=0.7)
    base = None
    for chunk in (1, 3, 1024):
        res = run_masks(rec, MaskConfig(method="predictive", divergence=divergence, chunk_tokens=chunk))
        if base is None:
            base = res
            continue
        assert torch.equal(res.keep, base.keep) and torch.equal(res.far, base.far)
        for name in (
            "divergence",
            "direction",
            "predicted_direction",
            "ratio_direction",
            "mismatch_kl",
            "mismatch_tv",
            "logprobs",
        ):
            torch.testing.assert_close(getattr(res, name), getattr(base, name), rtol=0, atol=1e-13)


# ----------------------------------------------------------------------------------------------------
# batched [B, T, ...] ≡ flat
# ----------------------------------------------------------------------------------------------------


def batched_case(seed: int = 61, b: int = 3, t: int = 7, v: int = 120, k: int = 6):
    temps_seq = np.array([0.7, 1.0, 1.3])[:b]
    rec = ref.make_record(seed, n=b * t, v=v, k=k, temperature=np.repeat(temps_seq, t))
    adv_seq = np.array([1.0, -0.5, 2.0])[:b]
    rec.advantages = np.repeat(adv_seq, t)
    resp = np.ones((b, t), dtype=bool)
    resp[0, 5:] = False
    resp[1, 3:] = False
    resp[2, 0] = False  # a hole at the start too (prompt-side)
    flat_resp = resp.reshape(-1)
    # padding holds zeros, as a collator pads: id 0, logprob 0, top-K ids and logprobs 0
    rec.sampled_ids[~flat_resp] = 0
    rec.sampled_logprobs[~flat_resp] = 0.0
    rec.topk_ids[~flat_resp] = 0
    rec.topk_logprobs[~flat_resp] = 0.0
    return rec, resp, temps_seq, adv_seq


def call_batched(rec, resp, temps_seq, adv_seq, cfg, b=3, t=7, per_token=False):
    """Advantages and temperatures per sequence [B] (broadcast over T), or per token [B, T]."""
    v, k = rec.logits.shape[1], rec.topk_ids.shape[1]
    adv, temp = torch.tensor(adv_seq), torch.tensor(temps_seq)
    if per_token:
        adv, temp = adv[:, None].expand(b, t).contiguous(), temp[:, None].expand(b, t).contiguous()
    return compute_masks(
        torch.tensor(rec.logits).reshape(b, t, v),
        torch.tensor(rec.sampled_ids).reshape(b, t),
        torch.tensor(rec.sampled_logprobs).reshape(b, t),
        torch.tensor(rec.topk_ids).reshape(b, t, k),
        torch.tensor(rec.topk_logprobs).reshape(b, t, k),
        adv,
        config=cfg,
        temperature=temp,
        response_mask=torch.tensor(resp),
    )


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("method", ref.METHODS)
@pytest.mark.parametrize("divergence", ["topk_kl", "binary_tv", "topk_tv"])
def test_batched_equals_flat_on_valid_tokens(method: str, divergence: str, per_token: bool) -> None:
    rec, resp, temps_seq, adv_seq = batched_case()
    cfg = MaskConfig(method=method, divergence=divergence, delta=0.04)
    res = call_batched(rec, resp, temps_seq, adv_seq, cfg, per_token=per_token)
    assert res.keep.shape == (3, 7)
    valid = resp.reshape(-1)
    sub = ref.Record(
        logits=rec.logits[valid],
        temperature=rec.temperature[valid],
        sampled_ids=rec.sampled_ids[valid],
        sampled_logprobs=rec.sampled_logprobs[valid],
        topk_ids=rec.topk_ids[valid],
        topk_logprobs=rec.topk_logprobs[valid],
        advantages=rec.advantages[valid],
        mu_logprobs=rec.mu_logprobs[valid],
    )
    flat = run_masks(sub, cfg, per_token_temperature=True)
    m = torch.tensor(resp)
    assert not bool(res.keep[~m].any())  # padding is never kept
    assert torch.equal(res.response_mask, m)
    assert torch.equal(res.keep[m], flat.keep)
    assert torch.equal(res.far[m], flat.far)
    for name in (
        "divergence",
        "direction",
        "predicted_direction",
        "ratio_direction",
        "mismatch_kl",
        "mismatch_tv",
        "logprobs",
    ):
        torch.testing.assert_close(getattr(res, name)[m], getattr(flat, name), rtol=1e-12, atol=1e-13)
    if method != "none":
        assert 0 < int((~flat.keep).sum()) < len(flat.keep)


def test_batched_padding_gives_finite_loss_and_metrics() -> None:
    rec, resp, temps_seq, adv_seq = batched_case()
    res = call_batched(rec, resp, temps_seq, adv_seq, MaskConfig(delta=0.04))
    lp = res.logprobs.clone().requires_grad_(True)
    for aggregation in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"):
        loss, metrics = policy_loss(
            lp,
            torch.tensor(rec.sampled_logprobs).reshape(3, 7),
            torch.tensor(adv_seq),
            res.keep,
            aggregation=aggregation,
            response_mask=torch.tensor(resp),
            masks=res,
        )
        assert torch.isfinite(loss)
        for key in (
            "divergence_mean",
            "far_frac",
            "mismatch_kl",
            "mismatch_tv",
            "direction_disagreement",
            "mask_frac",
            "is_weight_mean",
            "is_weight_max",
        ):
            assert torch.isfinite(metrics[key]), (aggregation, key)
        m = torch.tensor(resp)
        assert float(metrics["divergence_mean"]) == pytest.approx(float(res.divergence[m].mean()), rel=1e-9)


def test_response_mask_none_means_all_tokens() -> None:
    rec = ref.make_record(62, n=20, v=100, k=5)
    a = run_masks(rec, MaskConfig(delta=0.04))
    b = run_masks(rec, MaskConfig(delta=0.04), response_mask=np.ones(20, dtype=bool))
    assert bool(a.response_mask.all())
    assert torch.equal(a.keep, b.keep)
