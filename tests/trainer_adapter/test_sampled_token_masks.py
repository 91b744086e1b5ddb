"""What a trainer with only the sampled tokens' logprobs uses (verl): `sampled_token_masks` decides as
compute_masks does for binary divergences (docs/math.md §3–§4), and `token_loss` is policy_loss's per-token
term, by hand, with per-token weights."""

from __future__ import annotations

import math

import numpy as np
import pytest
import reference_impl as ref
import torch
from adapter_helpers import np_, run_masks

from maskroll.trainer_adapter import MaskConfig, policy_loss, sampled_token_masks, token_loss
from maskroll.trainer_adapter import divergences as dv

L = math.log


@pytest.mark.parametrize("divergence", ["binary_kl", "binary_tv"])
@pytest.mark.parametrize("method", ["none", "ppo", "dppo", "predictive"])
def test_decisions_equal_compute_masks(method: str, divergence: str) -> None:
    rec = ref.make_record(60, n=64, v=200, k=8, temperature=0.9)
    resp = np.ones(64, dtype=bool)
    resp[-5:] = False
    cfg = MaskConfig(method=method, divergence=divergence, delta=0.04, eps_low=0.1, eps_high=0.1)
    full = run_masks(rec, cfg, response_mask=resp)
    mu = torch.tensor(rec.sampled_logprobs)
    got = sampled_token_masks(
        full.logprobs, mu, torch.tensor(rec.advantages), config=cfg, response_mask=torch.tensor(resp)
    )
    masked = int((~full.keep[torch.tensor(resp)]).sum())
    assert method == "none" or 0 < masked < int(resp.sum()), "the case must mask some tokens, not all"
    for name in ("keep", "far", "response_mask"):
        assert torch.equal(getattr(got, name), getattr(full, name)), name
    for name in ("divergence", "ratio_direction", "logprobs"):
        torch.testing.assert_close(getattr(got, name), getattr(full, name), rtol=1e-12, atol=1e-15)
    assert torch.equal(torch.sign(got.direction), torch.sign(full.direction))
    # P̂ with π_a² for Σ π²: the same sign, a magnitude no larger (Σ π² ≥ π_a² only adds to dπ_a/dτ)
    assert torch.equal(torch.sign(got.predicted_direction), torch.sign(full.predicted_direction))
    assert bool((got.predicted_direction.abs() <= full.predicted_direction.abs() + 1e-15).all())
    # the mismatch on S = {a}: the binary divergences, 0 at padding
    lp, lm = full.logprobs.double(), mu
    want_kl = torch.where(torch.tensor(resp), dv.binary_kl(lp, lm), 0.0)
    torch.testing.assert_close(got.mismatch_kl, want_kl, rtol=1e-12, atol=1e-15)
    assert float(got.mismatch_tv[-1]) == 0.0 and float(got.mismatch_tv[0]) == pytest.approx(
        abs(math.exp(float(lp[0])) - math.exp(float(lm[0]))), rel=1e-12
    )


def test_batched_shapes_and_per_sequence_advantages() -> None:
    # [B, T] = [2, 2]; A per sequence: +1, −1. dppo on binary_tv, δ = 0.1:
    #   seq0: π_a − μ_a = +0.3 (far, away: masked), +0.05 (near: kept)
    #   seq1: π_a − μ_a = +0.3 (far, A < 0 moves it back: kept), padding
    pi = torch.tensor([[0.5, 0.3], [0.6, 0.9]], dtype=torch.float64)
    mu = torch.tensor([[0.2, 0.25], [0.3, 0.1]], dtype=torch.float64)
    res = sampled_token_masks(
        pi.log(),
        mu.log(),
        torch.tensor([1.0, -1.0], dtype=torch.float64),
        config=MaskConfig(method="dppo", divergence="binary_tv", delta=0.1),
        response_mask=torch.tensor([[True, True], [True, False]]),
    )
    assert res.keep.tolist() == [[False, True], [True, False]]
    assert res.far.tolist() == [[True, False], [True, False]]
    torch.testing.assert_close(res.divergence, torch.tensor([[0.3, 0.05], [0.3, 0.0]], dtype=torch.float64))


def test_a_top_k_divergence_is_refused() -> None:
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="divergence='topk_kl' needs the rollout's top-K"):
        sampled_token_masks(x, x, x, config=MaskConfig(method="dppo", divergence="topk_kl"))


def test_token_loss_by_hand_with_token_weights() -> None:
    # ratios 3 and 0.5, cap 2: w = (2, 0.5); A = (1, −1); token weights (3, 0.5):
    # ℓ = −A·w·tw·log π_a = (−6 log 0.6, 0.25 log 0.1); d ℓ / d log π_a = −A·w·tw = (−6, 0.25)
    lp = torch.log(torch.tensor([0.6, 0.1], dtype=torch.float64)).requires_grad_(True)
    mu = torch.log(torch.tensor([0.2, 0.2], dtype=torch.float64))
    adv, keep = torch.tensor([1.0, -1.0], dtype=torch.float64), torch.tensor([True, True])
    t = token_loss(lp, mu, adv, keep, is_cap=2.0, token_weights=torch.tensor([3.0, 0.5], dtype=torch.float64))
    assert t.loss.tolist() == pytest.approx([-6 * L(0.6), 0.25 * L(0.1)], rel=1e-12)
    assert t.is_weight.tolist() == pytest.approx([2.0, 0.5]) and t.is_weight_raw.tolist() == pytest.approx(
        [3.0, 0.5]
    )
    t.loss.sum().backward()
    assert lp.grad.tolist() == pytest.approx([-6.0, 0.25], rel=1e-12)
    # policy_loss aggregates exactly this per-token term (no token weights there)
    plain = token_loss(lp, mu, adv, keep, is_cap=2.0)
    loss, _ = policy_loss(lp, mu, adv, keep, is_cap=2.0)
    assert torch.equal(loss, plain.loss.sum() / 2)
    assert float(loss.detach()) == pytest.approx((-2 * L(0.6) + 0.5 * L(0.1)) / 2, rel=1e-12)
    assert np_(plain.kept).tolist() == [True, True]
