"""compute_masks against the independent float64 reference (reference_impl.py) on random records.

Every method × divergence × estimator, temperatures 0.7 / 1.0 / 1.3 (and a per-token temperature
tensor), sampled tokens outside the top-K, zero advantages, both signs, δ_low ≠ δ_high. Thresholds
are set between order statistics of the reference D so that every config has near and far tokens
and no token sits on a threshold.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import reference_impl as ref
import torch
from adapter_helpers import np_, run_masks, temperature_arg

from maskroll.trainer_adapter import MaskConfig, compute_masks, token_logprobs

# (seed, V, K, temperature, per_token_temperature)
CASES = [
    (1, 300, 5, 1.0, False),
    (2, 300, 20, 0.7, False),
    (3, 300, 10, 1.3, False),
    (4, 257, 5, 0.7, False),
    (5, 300, 20, (0.7, 1.0, 1.3), True),
]
ATOL = 1e-9


@functools.cache
def case(i: int):
    seed, v, k, temp, _ = CASES[i]
    if isinstance(temp, tuple):
        rng = np.random.default_rng(100 + seed)
        temp = rng.choice(temp, size=48)
    rec = ref.make_record(seed, n=48, v=v, k=k, temperature=temp)
    return rec, ref.record_reference(rec)


def thresholds(tokens, divergence: str) -> tuple[float, float]:
    """δ_low, δ_high midway between consecutive order statistics of the reference D (35 % / 60 %)."""
    d = np.sort([t.divergence[divergence] for t in tokens])
    j_low, j_high = int(0.35 * len(d)), int(0.6 * len(d))
    return 0.5 * (d[j_low] + d[j_low + 1]), 0.5 * (d[j_high] + d[j_high + 1])


def assert_close(got: torch.Tensor, want: np.ndarray, what: str) -> None:
    assert got.dtype == torch.float64, what
    np.testing.assert_allclose(np_(got), want, rtol=1e-9, atol=ATOL, err_msg=what)


@pytest.mark.parametrize("method", ref.METHODS)
@pytest.mark.parametrize("divergence", ref.DIVERGENCES)
@pytest.mark.parametrize("ci", range(len(CASES)))
def test_matches_reference(ci: int, divergence: str, method: str) -> None:
    rec, tokens = case(ci)
    per_token = CASES[ci][4]
    d_low, d_high = thresholds(tokens, divergence)
    for estimator in ref.ESTIMATORS:
        cfg = MaskConfig(
            method=method, divergence=divergence, estimator=estimator, delta_low=d_low, delta_high=d_high
        )
        res = run_masks(rec, cfg, per_token_temperature=per_token)
        want = ref.masks_reference(
            tokens,
            rec.advantages,
            method=method,
            divergence=divergence,
            estimator=estimator,
            delta_low=d_low,
            delta_high=d_high,
        )
        tag = f"{method}/{divergence}/{estimator}"
        assert_close(res.divergence, want.divergence, f"divergence {tag}")
        assert_close(res.predicted_direction, want.predicted, f"predicted_direction {tag}")
        assert_close(res.ratio_direction, want.ratio_direction, f"ratio_direction {tag}")
        assert_close(res.direction, want.direction, f"direction {tag}")
        assert_close(res.mismatch_kl, want.mismatch_kl, f"mismatch_kl {tag}")
        assert_close(res.mismatch_tv, want.mismatch_tv, f"mismatch_tv {tag}")
        assert_close(res.logprobs, want.logprobs, f"logprobs {tag}")
        np.testing.assert_array_equal(np_(res.far), want.far, err_msg=f"far {tag}")
        np.testing.assert_array_equal(np_(res.keep), want.keep, err_msg=f"keep {tag}")
        assert res.keep.dtype == torch.bool and res.far.dtype == torch.bool
        assert bool(res.response_mask.all())
        if method != "none":
            # the thresholds are chosen so that every masking config masks something, not everything
            assert 0 < int((~res.keep).sum()) < len(tokens), tag


@pytest.mark.parametrize("ci", [0, 2])
def test_matches_reference_with_response_mask(ci: int) -> None:
    rec, tokens = case(ci)
    resp = np.random.default_rng(7).random(len(tokens)) < 0.8
    resp[:2] = [False, True]
    for divergence in ("topk_kl", "binary_tv"):
        d_low, d_high = thresholds(tokens, divergence)
        cfg = MaskConfig(method="predictive", divergence=divergence, delta_low=d_low, delta_high=d_high)
        res = run_masks(rec, cfg, response_mask=resp)
        want = ref.masks_reference(
            tokens,
            rec.advantages,
            method="predictive",
            divergence=divergence,
            estimator="proportional",
            delta_low=d_low,
            delta_high=d_high,
            response_mask=resp,
        )
        np.testing.assert_array_equal(np_(res.keep), want.keep)
        np.testing.assert_array_equal(np_(res.response_mask), resp)
        assert not np_(res.keep)[~resp].any()
    res = run_masks(rec, MaskConfig(method="none"), response_mask=resp)
    np.testing.assert_array_equal(np_(res.keep), resp)


def test_ppo_with_other_clip_range() -> None:
    rec, tokens = case(1)
    cfg = MaskConfig(method="ppo", eps_low=0.05, eps_high=0.5)
    res = run_masks(rec, cfg)
    want = ref.masks_reference(
        tokens,
        rec.advantages,
        method="ppo",
        divergence="topk_kl",
        estimator="proportional",
        delta_low=0.05,
        delta_high=0.05,
        eps_low=0.05,
        eps_high=0.5,
    )
    np.testing.assert_array_equal(np_(res.far), want.far)
    np.testing.assert_array_equal(np_(res.keep), want.keep)
    np.testing.assert_allclose(np_(res.direction), [t.ratio - 1 for t in tokens], rtol=1e-9, atol=ATOL)


def test_random_cases_exercise_the_differences() -> None:
    """Guard on the data above: without tokens where the rules disagree, the comparison would not
    tell predictive from dppo, or one estimator from another, or a token outside the top-K from one
    inside."""
    pred_vs_ratio = est_differ = outside = 0
    for ci in range(len(CASES)):
        rec, tokens = case(ci)
        outside += sum(int(a not in set(row)) for a, row in zip(rec.sampled_ids, rec.topk_ids, strict=True))
        d_low, d_high = thresholds(tokens, "topk_kl")
        masks = {
            (m, e): ref.masks_reference(
                tokens,
                rec.advantages,
                method=m,
                divergence="topk_kl",
                estimator=e,
                delta_low=d_low,
                delta_high=d_high,
            ).keep
            for m in ("dppo", "predictive")
            for e in ref.ESTIMATORS
        }
        pred_vs_ratio += int((masks[("dppo", "proportional")] != masks[("predictive", "proportional")]).sum())
        est_differ += sum(
            int(
                np.sign(t.predicted[("topk_kl", "aggregated")])
                != np.sign(t.predicted[("topk_kl", "uniform")])
            )
            for t in tokens
        )
    assert outside >= 20
    assert pred_vs_ratio >= 3
    assert est_differ >= 1


@pytest.mark.parametrize("ci", [0, 1])
def test_float32_logits_give_float32_outputs_close_to_reference(ci: int) -> None:
    rec, tokens = case(ci)
    d_low, d_high = thresholds(tokens, "topk_kl")
    cfg = MaskConfig(method="predictive", divergence="topk_kl", delta_low=d_low, delta_high=d_high)
    res = run_masks(rec, cfg, dtype=torch.float32)
    want = ref.masks_reference(
        tokens,
        rec.advantages,
        method="predictive",
        divergence="topk_kl",
        estimator="proportional",
        delta_low=d_low,
        delta_high=d_high,
    )
    for name in (
        "divergence",
        "direction",
        "predicted_direction",
        "ratio_direction",
        "mismatch_kl",
        "mismatch_tv",
        "logprobs",
    ):
        assert getattr(res, name).dtype == torch.float32, name
    np.testing.assert_allclose(np_(res.divergence), want.divergence, rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(np_(res.predicted_direction), want.predicted, rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(np_(res.logprobs), want.logprobs, rtol=1e-5, atol=2e-5)
    # keep agrees wherever the decision is not within float32 noise of a threshold
    clear = (np.abs(want.divergence - np.where(rec.advantages >= 0, d_high, d_low)) > 1e-4) & (
        np.abs(want.direction) > 1e-4
    )
    np.testing.assert_array_equal(np_(res.keep)[clear], want.keep[clear])
    assert clear.sum() >= 40


def test_bfloat16_logits() -> None:
    """bf16 logits (upcast per chunk): float32 outputs, equal to the float64 reference computed on the
    same bf16-rounded logits up to float32 rounding."""
    rec, _ = case(2)
    rounded = torch.tensor(rec.logits).to(torch.bfloat16)
    rec_bf = ref.Record(**{**rec.__dict__, "logits": rounded.to(torch.float64).numpy()})
    tokens = ref.record_reference(rec_bf)
    d_low, d_high = thresholds(tokens, "topk_kl")
    cfg = MaskConfig(method="predictive", divergence="topk_kl", delta_low=d_low, delta_high=d_high)
    res = compute_masks(
        rounded,
        torch.tensor(rec.sampled_ids),
        torch.tensor(rec.sampled_logprobs),
        torch.tensor(rec.topk_ids),
        torch.tensor(rec.topk_logprobs),
        torch.tensor(rec.advantages),
        config=cfg,
        temperature=float(rec.temperature[0]),
    )
    want = ref.masks_reference(
        tokens,
        rec.advantages,
        method="predictive",
        divergence="topk_kl",
        estimator="proportional",
        delta_low=d_low,
        delta_high=d_high,
    )
    assert res.divergence.dtype == torch.float32
    np.testing.assert_allclose(np_(res.divergence), want.divergence, rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(np_(res.predicted_direction), want.predicted, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("ci", [1, 4])
def test_vocab_stats_from_token_logprobs_give_the_same_masks(ci: int) -> None:
    """token_logprobs(..., return_stats=True) hands its logsumexp and Σπ² to compute_masks, which then
    skips its own pass over the vocabulary (MATH §8): the results must not change."""
    rec, _ = case(ci)
    temp = temperature_arg(rec, per_token=CASES[ci][4])
    logits = torch.tensor(rec.logits, requires_grad=True)
    ids = torch.tensor(rec.sampled_ids)
    lp, stats = token_logprobs(logits, ids, temperature=temp, return_stats=True)
    for divergence in ref.DIVERGENCES:
        cfg = MaskConfig(method="predictive", divergence=divergence, delta=0.05)
        args = (
            logits.detach(),
            ids,
            torch.tensor(rec.sampled_logprobs),
            torch.tensor(rec.topk_ids),
            torch.tensor(rec.topk_logprobs),
            torch.tensor(rec.advantages),
        )
        plain = compute_masks(*args, config=cfg, temperature=temp)
        shared = compute_masks(*args, config=cfg, temperature=temp, vocab_stats=stats)
        assert torch.equal(plain.keep, shared.keep)
        for name in (
            "divergence",
            "predicted_direction",
            "ratio_direction",
            "mismatch_kl",
            "mismatch_tv",
            "logprobs",
        ):
            torch.testing.assert_close(getattr(shared, name), getattr(plain, name), rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(lp.detach(), plain.logprobs, rtol=1e-12, atol=1e-13)
