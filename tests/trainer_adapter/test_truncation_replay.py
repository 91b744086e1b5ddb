"""Truncated sampling (MATH §6): processed_logprobs against an independent numpy replay of vLLM's
top-k / top-p, hand cases (ties at the k-th value, top-k before top-p), refusal without replay, and
compute_masks with replay against the reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
import reference_impl as ref
import torch
from adapter_helpers import np_, run_masks

from maskroll.trainer_adapter import MaskConfig, processed_logprobs

NEG_INF = -math.inf


def proc(logits, temperature=1.0, top_k=None, top_p=None) -> np.ndarray:
    x = torch.tensor(np.atleast_2d(np.asarray(logits, dtype=np.float64)))
    with torch.no_grad():
        return np_(processed_logprobs(x, temperature=temperature, top_k=top_k, top_p=top_p))


def assert_logprobs_equal(got: np.ndarray, want: np.ndarray) -> None:
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------------------------------
# hand cases
# ----------------------------------------------------------------------------------------------------


def test_top_k_keeps_ties_at_the_kth_value() -> None:
    # logits (3, 2, 2, 1, 0), k = 2: the 2nd largest is 2 and both 2s are kept → 3 tokens
    got = proc([3.0, 2.0, 2.0, 1.0, 0.0], top_k=2)[0]
    z = math.log(math.exp(3) + 2 * math.exp(2))
    assert_logprobs_equal(got, np.array([3 - z, 2 - z, 2 - z, NEG_INF, NEG_INF]))


def test_top_p_hand_case() -> None:
    # π = (0.5, 0.3, 0.15, 0.05), p = 0.75: ascending cumsum (0.05, 0.2, 0.5, 1.0); drop ≤ 0.25
    # → keep {0.5, 0.3}, renormalised (0.625, 0.375)
    logits = np.log([0.5, 0.3, 0.15, 0.05])
    assert_logprobs_equal(
        proc(logits, top_p=0.75)[0], np.array([math.log(0.625), math.log(0.375), NEG_INF, NEG_INF])
    )
    # p = 0.9: drop ≤ 0.1 → only 0.05 goes
    assert_logprobs_equal(
        proc(logits, top_p=0.9)[0], np.array([*np.log([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95]), NEG_INF])
    )
    # p tiny: everything but the largest would be dropped, the largest is always kept
    assert_logprobs_equal(proc(logits, top_p=0.01)[0], np.array([0.0, NEG_INF, NEG_INF, NEG_INF]))


@pytest.mark.parametrize(("top_p", "kept"), [(0.5, 2), (0.75, 3), (0.25, 1), (0.8, 4)])
def test_top_p_drops_a_cumulative_mass_equal_to_one_minus_p(top_p: float, kept: int) -> None:
    # four equal logits: π = ¼ each, exactly, and the ascending cumsum is exactly (¼, ½, ¾, 1).
    # "drop cumsum <= 1 − p": p = 0.5 drops the two tokens whose cumsum is ≤ ½ → 2 kept (each ½);
    # p = 0.8: 1 − p = 0.19999999999999996 < ¼ → nothing dropped. Which of the tied tokens go
    # depends on the sort; how many does not.
    got = proc([0.0, 0.0, 0.0, 0.0], top_p=top_p)[0]
    assert int(np.isfinite(got).sum()) == kept
    np.testing.assert_allclose(got[np.isfinite(got)], math.log(1 / kept), rtol=0, atol=1e-15)


def test_top_k_is_applied_before_top_p() -> None:
    # π = (0.5, 0.3, 0.15, 0.05), k = 2, p = 0.55. top-k first: (0.625, 0.375); drop cumsum ≤ 0.45
    # → 0.375 goes, only token 0 is left. (top-p first would keep {0, 1}.)
    logits = np.log([0.5, 0.3, 0.15, 0.05])
    assert_logprobs_equal(proc(logits, top_k=2, top_p=0.55)[0], np.array([0.0, NEG_INF, NEG_INF, NEG_INF]))


def test_temperature_is_applied_before_truncation() -> None:
    # logits (2, 1, 0, −1) at T = 2 → x = (1, 0.5, 0, −0.5); k = 2 keeps (1, 0.5)
    got = proc([2.0, 1.0, 0.0, -1.0], temperature=2.0, top_k=2)[0]
    z = math.log(math.exp(1) + math.exp(0.5))
    assert_logprobs_equal(got, np.array([1 - z, 0.5 - z, NEG_INF, NEG_INF]))


@pytest.mark.parametrize(
    ("top_k", "top_p"), [(None, None), (0, None), (-1, None), (None, 1.0), (0, 1.0), (500, None)]
)
def test_truncation_off_values(top_k, top_p) -> None:
    rng = np.random.default_rng(50)
    logits = rng.standard_normal((4, 300)) * 2
    want = np_(torch.log_softmax(torch.tensor(logits) / 0.7, -1))
    np.testing.assert_allclose(proc(logits, 0.7, top_k, top_p), want, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------------------------------
# random cases against the numpy replay
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("top_k", "top_p"),
    [(1, None), (5, None), (50, None), (None, 0.5), (None, 0.9), (None, 0.99), (20, 0.8), (3, 0.95)],
)
@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.3])
def test_processed_logprobs_matches_numpy_replay(top_k, top_p, temperature) -> None:
    rng = np.random.default_rng(51)
    logits = rng.standard_normal((12, 400)) * 2.5
    logits[:3] = np.round(logits[:3])  # many ties, for top-k
    got = proc(logits, temperature, top_k, top_p)
    for i in range(logits.shape[0]):
        if i < 3 and top_p is not None:
            continue  # ties inside the top-p prefix depend on the sort order; not specified
        assert_logprobs_equal(got[i], ref.processed_logprobs(logits[i], temperature, top_k, top_p))
    assert np.isneginf(got).any()


# ----------------------------------------------------------------------------------------------------
# compute_masks with truncation
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("top_k", "top_p"), [(50, None), (None, 0.9), (20, 0.95)])
def test_truncated_record_is_refused_without_replay(top_k, top_p) -> None:
    rec = ref.make_record(52, n=8, v=200, k=5)
    with pytest.raises(ValueError, match="replay_truncation"):
        run_masks(rec, MaskConfig(), top_k=top_k, top_p=top_p)


@pytest.mark.parametrize(("top_k", "top_p"), [(0, None), (-1, 1.0), (None, 1.0)])
def test_truncation_off_is_not_refused(top_k, top_p) -> None:
    rec = ref.make_record(52, n=8, v=200, k=5)
    plain = run_masks(rec, MaskConfig())
    res = run_masks(rec, MaskConfig(), top_k=top_k, top_p=top_p)
    torch.testing.assert_close(res.divergence, plain.divergence, rtol=0, atol=0)


def truncated_record(seed: int, top_k, top_p, k: int = 20, temperature: float = 0.8, drift: float = 0.0):
    """A record sampled from a truncated distribution: μ is the processed distribution of (drifted)
    logits restricted to the kept set of π's replay and renormalised there (so μ and π share a
    support); top-K entries beyond the kept set carry −inf, as an engine returns them."""
    rng = np.random.default_rng(seed)
    rec = ref.make_record(seed, n=24, v=150, k=k, temperature=temperature, outside_frac=0.0)
    n, v = rec.logits.shape
    mu_lp = np.empty((n, v))
    for i in range(n):
        kept = np.isfinite(ref.processed_logprobs(rec.logits[i], temperature, top_k, top_p))
        x = rec.logits[i] / temperature + drift * rng.standard_normal(v)
        x = np.where(kept, x, -np.inf)
        mu_lp[i] = x - ref.logsumexp(x)
    order = np.argsort(-mu_lp, axis=1, kind="stable")
    rec.topk_ids = order[:, :k].copy()
    rec.topk_logprobs = np.take_along_axis(mu_lp, rec.topk_ids, axis=1)
    for i in range(n):
        p = np.exp(mu_lp[i])
        rec.sampled_ids[i] = rng.choice(v, p=p / p.sum())
    rec.sampled_logprobs = mu_lp[np.arange(n), rec.sampled_ids]
    rec.mu_logprobs = mu_lp
    return rec


@pytest.mark.parametrize(("top_k", "top_p"), [(5, None), (None, 0.7), (10, 0.9)])
def test_replayed_identical_policy_masks_nothing(top_k, top_p) -> None:
    rec = truncated_record(53, top_k, top_p)
    assert np.isneginf(rec.topk_logprobs).any()  # the top-K reaches past the kept set
    for method in ref.METHODS:
        for divergence in ref.DIVERGENCES:
            for estimator in ref.ESTIMATORS:
                cfg = MaskConfig(
                    method=method,
                    divergence=divergence,
                    estimator=estimator,
                    replay_truncation=True,
                    delta=1e-6,
                    eps_low=1e-6,
                    eps_high=1e-6,
                )
                res = run_masks(rec, cfg, top_k=top_k, top_p=top_p)
                tag = f"{method}/{divergence}/{estimator}"
                assert bool(res.keep.all()), tag
                for name in ("divergence", "mismatch_kl", "mismatch_tv", "ratio_direction"):
                    np.testing.assert_allclose(
                        np_(getattr(res, name)), 0.0, atol=1e-12, err_msg=f"{name} {tag}"
                    )
                np.testing.assert_allclose(np_(res.logprobs), rec.sampled_logprobs, rtol=0, atol=1e-12)
                for name in ("direction", "predicted_direction"):
                    assert np.isfinite(np_(getattr(res, name))).all(), f"{name} {tag}"


@pytest.mark.parametrize(("top_k", "top_p"), [(5, None), (None, 0.7), (10, 0.9)])
def test_replay_against_reference(top_k, top_p) -> None:
    rec = truncated_record(54, top_k, top_p, drift=0.8)
    tokens = ref.record_reference(rec, top_k, top_p)
    for divergence in ref.DIVERGENCES:
        for estimator in ref.ESTIMATORS:
            cfg = MaskConfig(
                method="predictive", divergence=divergence, estimator=estimator, replay_truncation=True
            )
            res = run_masks(rec, cfg, top_k=top_k, top_p=top_p)
            want = ref.masks_reference(
                tokens,
                rec.advantages,
                method="predictive",
                divergence=divergence,
                estimator=estimator,
                delta_low=cfg.delta_low,
                delta_high=cfg.delta_high,
            )
            tag = f"{divergence}/{estimator}"
            for name, w in (
                ("divergence", want.divergence),
                ("predicted_direction", want.predicted),
                ("mismatch_kl", want.mismatch_kl),
                ("mismatch_tv", want.mismatch_tv),
                ("logprobs", want.logprobs),
            ):
                got = np_(getattr(res, name))
                assert np.isfinite(got).all(), f"{name} {tag}"
                np.testing.assert_allclose(got, w, rtol=1e-9, atol=1e-9, err_msg=f"{name} {tag}")
            np.testing.assert_array_equal(np_(res.keep), want.keep, err_msg=tag)
