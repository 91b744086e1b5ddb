"""policy_loss (MATH §5) and token_logprobs: hand-computed aggregations, the logits gradient, IS cap
and log-ratio clamp, −inf on masked tokens, metrics."""

from __future__ import annotations

import math

import numpy as np
import pytest
import reference_impl as ref
import torch
from adapter_helpers import np_

from maskroll.trainer_adapter import MaskConfig, compute_masks, policy_loss, token_logprobs

L = math.log

# ----------------------------------------------------------------------------------------------------
# hand case, B = 3 sequences × T = 3 tokens
#   π_a      seq0 (0.5, 0.2, 0.675)  seq1 (0.1, 0.3, 0.6)   seq2 (0.5, 0.5, 0.5)
#   μ_a      seq0 (0.25, 0.4, 0.2)   seq1 (0.1, 0.01, 0.6)  seq2 (0.5, 0.5, 0.5)
#   w        seq0 (2, 0.5, 3.375)    seq1 (1, 30→10, 1)     seq2 (1, 1, 1)       (cap C = 10)
#   A        1 (seq0), −2 (seq1), 3 (seq2), broadcast over T
#   keep     seq0 (T, T, F)          seq1 (T, T, T)         seq2 (T, T, T)
#   response seq0 (T, T, T)          seq1 (T, T, F)         seq2 (F, F, F)   (seq2 is all padding)
# ℓ = −A·w·M·log π_a:
#   seq0: −1·2·log 0.5 = 2 log 2;  −1·0.5·log 0.2 = 0.5 log 5;  masked → 0
#   seq1: 2·1·log 0.1 = −2 log 10;  2·10·log 0.3 = 20 log 0.3;  padding
# ----------------------------------------------------------------------------------------------------
PI_A = [[0.5, 0.2, 0.675], [0.1, 0.3, 0.6], [0.5, 0.5, 0.5]]
MU_A = [[0.25, 0.4, 0.2], [0.1, 0.01, 0.6], [0.5, 0.5, 0.5]]
ADV = [1.0, -2.0, 3.0]
KEEP = [[True, True, False], [True, True, True], [True, True, True]]
RESP = [[True, True, True], [True, True, False], [False, False, False]]
SEQ0 = [2 * L(2), 0.5 * L(5), 0.0]
SEQ1 = [-2 * L(10), 20 * L(0.3)]


def hand_loss(aggregation: str, max_len=None, advantages_shape="B"):
    lp = torch.log(torch.tensor(PI_A, dtype=torch.float64)).requires_grad_(True)
    adv = torch.tensor(ADV, dtype=torch.float64)
    if advantages_shape == "BT":
        adv = adv[:, None].expand(3, 3).contiguous()
    loss, metrics = policy_loss(
        lp,
        torch.log(torch.tensor(MU_A, dtype=torch.float64)),
        adv,
        torch.tensor(KEEP),
        is_cap=10.0,
        aggregation=aggregation,
        response_mask=torch.tensor(RESP),
        max_len=max_len,
    )
    return lp, loss, metrics


@pytest.mark.parametrize("advantages_shape", ["B", "BT"])
def test_token_mean_by_hand(advantages_shape: str) -> None:
    lp, loss, _ = hand_loss("token_mean", advantages_shape=advantages_shape)
    # Σ over the 5 response tokens (the masked one counts in the denominator) / 5 ≈ −5.2987226
    assert float(loss.detach()) == pytest.approx((sum(SEQ0) + sum(SEQ1)) / 5, rel=1e-12)
    loss.backward()
    # d loss / d log π_a = −A·w·M / 5 on response tokens, 0 elsewhere
    want = torch.tensor([[-2.0, -0.5, 0.0], [2.0, 20.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64) / 5
    torch.testing.assert_close(lp.grad, want, rtol=1e-12, atol=1e-15)


def test_seq_mean_token_mean_by_hand() -> None:
    _, loss, _ = hand_loss("seq_mean_token_mean")
    # seq0: 3 response tokens, seq1: 2, seq2: none (excluded from the mean) ≈ −6.8059876
    assert float(loss.detach()) == pytest.approx((sum(SEQ0) / 3 + sum(SEQ1) / 2) / 2, rel=1e-12)


@pytest.mark.parametrize(("max_len", "norm"), [(None, 3), (8, 8)])
def test_seq_mean_token_sum_norm_by_hand(max_len, norm: int) -> None:
    _, loss, _ = hand_loss("seq_mean_token_sum_norm", max_len=max_len)
    # per sequence Σ_t ℓ / max_len (default T = 3), mean over seq0 and seq1 ≈ −4.4156016 (max_len 3)
    assert float(loss.detach()) == pytest.approx((sum(SEQ0) / norm + sum(SEQ1) / norm) / 2, rel=1e-12)


def test_metrics_by_hand() -> None:
    _, _, m = hand_loss("token_mean")
    # response tokens: seq0 ×3 (A > 0), seq1 ×2 (A < 0); masked among them: seq0 t2 only
    assert float(m["mask_frac"]) == pytest.approx(1 / 5, abs=1e-12)
    assert float(m["mask_frac_pos"]) == pytest.approx(1 / 3, abs=1e-12)
    assert float(m["mask_frac_neg"]) == pytest.approx(0.0, abs=1e-12)
    # IS weights of the response tokens (2, 0.5, 3.375, 1, 10): mean 16.875/5 = 3.375 (the masked one
    # is 3.375 too, so the mean over kept tokens is the same), max 10 (capped)
    assert float(m["is_weight_mean"]) == pytest.approx(3.375, abs=1e-12)
    assert float(m["is_weight_max"]) == pytest.approx(10.0, abs=1e-12)
    for v in m.values():
        assert isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad


def test_masked_tokens_with_minus_inf_logprob() -> None:
    # token 0 is masked with log π_a = −inf (a replayed truncation removed it), token 2 is padding
    # with −inf; both contribute exactly 0 and must not poison the loss or the gradient with nan.
    lp = torch.tensor([-math.inf, L(0.5), -math.inf], dtype=torch.float64, requires_grad=True)
    mu = torch.log(torch.tensor([0.3, 0.25, 0.5], dtype=torch.float64))
    loss, metrics = policy_loss(
        lp,
        mu,
        torch.tensor([1.0, -1.0, 1.0], dtype=torch.float64),
        torch.tensor([False, True, True]),
        response_mask=torch.tensor([True, True, False]),
    )
    # only token 1: −(−1)·2·log 0.5 over 2 response tokens = −log 2
    assert float(loss.detach()) == pytest.approx(-L(2), rel=1e-12)
    loss.backward()
    assert torch.isfinite(lp.grad).all()
    assert lp.grad.tolist() == pytest.approx([0.0, 1.0, 0.0], abs=1e-12)
    assert all(torch.isfinite(v) for v in metrics.values())
    assert float(metrics["mask_frac_pos"]) == 1.0 and float(metrics["mask_frac_neg"]) == 0.0


def test_is_cap() -> None:
    # ratios 3 and 0.5; cap 2: w = (2, 0.5)
    lp = torch.log(torch.tensor([0.6, 0.1], dtype=torch.float64)).requires_grad_(True)
    mu = torch.log(torch.tensor([0.2, 0.2], dtype=torch.float64))
    loss, m = policy_loss(
        lp, mu, torch.tensor([1.0, -1.0], dtype=torch.float64), torch.tensor([True, True]), is_cap=2.0
    )
    assert float(loss.detach()) == pytest.approx((-2 * L(0.6) + 0.5 * L(0.1)) / 2, rel=1e-12)
    assert float(m["is_weight_max"]) == pytest.approx(2.0)
    assert float(m["is_weight_mean"]) == pytest.approx(1.25)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([-1.0, 0.25], dtype=torch.float64))


def test_log_ratio_clamp_at_20() -> None:
    # log π_a − log μ_a = 999: without the clamp exp overflows to inf; with it w = e^20 (cap 1e30).
    lp = torch.tensor([-1.0], dtype=torch.float64, requires_grad=True)
    loss, _ = policy_loss(
        lp,
        torch.tensor([-1000.0], dtype=torch.float64),
        torch.tensor([0.5], dtype=torch.float64),
        torch.tensor([True]),
        is_cap=1e30,
    )
    # −0.5·e^20·(−1) = 0.5 e^20 ≈ 2.4258e8
    assert float(loss.detach()) == pytest.approx(0.5 * math.exp(20), rel=1e-12)
    # just below the clamp the exact ratio is used: log ratio 19.5
    loss, _ = policy_loss(
        lp,
        torch.tensor([-20.5], dtype=torch.float64),
        torch.tensor([0.5], dtype=torch.float64),
        torch.tensor([True]),
        is_cap=1e30,
    )
    assert float(loss.detach()) == pytest.approx(0.5 * math.exp(19.5), rel=1e-12)


# ----------------------------------------------------------------------------------------------------
# gradient w.r.t. the logits
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.8, 1.3])
def test_logits_gradient_token_mean(temperature: float) -> None:
    """d loss / d ℓ = −A·w·M·(e_a − π)/(N·T) with log π_a from token_logprobs (MATH §5, §3)."""
    rng = np.random.default_rng(40)
    n, v = 24, 64
    logits = torch.tensor(rng.standard_normal((n, v)) * 2, requires_grad=True)
    ids = torch.tensor(rng.integers(0, v, n))
    lp = token_logprobs(logits, ids, temperature=temperature)
    # μ_a = π_a / ratio, ratios spanning the cap (w = 10 for ratio 30, 12)
    ratios = torch.tensor(rng.choice([0.3, 0.8, 1.0, 2.5, 12.0, 30.0], n))
    sampled = lp.detach() - torch.log(ratios)
    adv = torch.tensor(rng.choice([-1.5, -0.5, 0.0, 0.7, 2.0], n))
    keep = torch.tensor(rng.random(n) < 0.7)
    loss, _ = policy_loss(lp, sampled, adv, keep, is_cap=10.0, aggregation="token_mean")
    loss.backward()
    pi = torch.softmax(logits.detach() / temperature, -1)
    e_a = torch.nn.functional.one_hot(ids, v).to(torch.float64)
    w = torch.clamp(ratios, max=10.0)
    want = (-adv * w * keep)[:, None] * (e_a - pi) / (n * temperature)
    torch.testing.assert_close(logits.grad, want, rtol=1e-10, atol=1e-13)
    assert float(loss.detach()) == pytest.approx(float((-adv * w * keep * lp.detach()).sum() / n), rel=1e-12)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_tokens", [1, 3, 1024])
def test_token_logprobs_matches_autograd_of_log_softmax(temperature: float, chunk_tokens: int) -> None:
    rng = np.random.default_rng(41)
    n, v = 10, 97
    base = torch.tensor(rng.standard_normal((n, v)) * 3)
    ids = torch.tensor(rng.integers(0, v, n))
    upstream = torch.tensor(rng.standard_normal(n))

    x1 = base.clone().requires_grad_(True)
    lp = token_logprobs(x1, ids, temperature=temperature, chunk_tokens=chunk_tokens)
    (lp * upstream).sum().backward()

    x2 = base.clone().requires_grad_(True)
    want = torch.log_softmax(x2 / temperature, -1).gather(1, ids[:, None])[:, 0]
    (want * upstream).sum().backward()
    torch.testing.assert_close(lp.detach(), want.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-10, atol=1e-13)


def test_token_logprobs_bfloat16() -> None:
    rng = np.random.default_rng(42)
    n, v = 16, 128
    base = torch.tensor(rng.standard_normal((n, v)) * 2, dtype=torch.float32)
    ids = torch.tensor(rng.integers(0, v, n))
    upstream = torch.tensor(rng.standard_normal(n), dtype=torch.float32)

    xb = base.to(torch.bfloat16).requires_grad_(True)
    lp = token_logprobs(xb, ids, temperature=0.9)
    (lp.float() * upstream).sum().backward()
    assert xb.grad.dtype == torch.bfloat16

    # reference: float32 on the same (bf16-rounded) logits
    xf = base.to(torch.bfloat16).to(torch.float32).requires_grad_(True)
    want = torch.log_softmax(xf / 0.9, -1).gather(1, ids[:, None])[:, 0]
    (want * upstream).sum().backward()
    torch.testing.assert_close(lp.detach().float(), want.detach(), rtol=0, atol=3e-2)
    torch.testing.assert_close(xb.grad.float(), xf.grad, rtol=2e-2, atol=1e-2)
    assert float(xb.grad.float().abs().max()) > 0.1  # a real gradient arrived


@pytest.mark.parametrize(("top_k", "top_p"), [(7, None), (None, 0.8), (12, 0.9)])
def test_token_logprobs_with_truncation_replay(top_k, top_p) -> None:
    rng = np.random.default_rng(43)
    n, v, temperature = 8, 60, 0.8
    base = torch.tensor(rng.standard_normal((n, v)) * 2)
    # sampled ids inside the kept set: the argmax and the runner-up
    order = torch.argsort(base, dim=-1, descending=True)
    ids = order[:, 0].clone()
    ids[::2] = order[::2, 1]
    x1 = base.clone().requires_grad_(True)
    lp = token_logprobs(x1, ids, temperature=temperature, top_k=top_k, top_p=top_p)
    lp.sum().backward()

    proc = np.stack([ref.processed_logprobs(base[i].numpy(), temperature, top_k, top_p) for i in range(n)])
    np.testing.assert_allclose(np_(lp), proc[np.arange(n), ids.numpy()], rtol=1e-12, atol=1e-12)
    # gradient: (e_a − π̃)/T on the kept set, 0 outside it
    pit = np.exp(proc)
    e_a = np.eye(v)[ids.numpy()]
    np.testing.assert_allclose(np_(x1.grad), (e_a - pit) / temperature, rtol=1e-10, atol=1e-13)


# ----------------------------------------------------------------------------------------------------
# metrics from a MaskResult
# ----------------------------------------------------------------------------------------------------


def test_metrics_with_mask_result() -> None:
    rec = ref.make_record(44, n=40, v=200, k=8, temperature=1.0)
    resp = np.ones(40, dtype=bool)
    resp[-6:] = False
    adv = torch.tensor(rec.advantages)
    res = compute_masks(
        torch.tensor(rec.logits),
        torch.tensor(rec.sampled_ids),
        torch.tensor(rec.sampled_logprobs),
        torch.tensor(rec.topk_ids),
        torch.tensor(rec.topk_logprobs),
        adv,
        config=MaskConfig(method="predictive", divergence="topk_kl", delta=0.08),
        response_mask=torch.tensor(resp),
    )
    lp = res.logprobs.clone().requires_grad_(True)
    _, m = policy_loss(
        lp, torch.tensor(rec.sampled_logprobs), adv, res.keep, response_mask=torch.tensor(resp), masks=res
    )
    r = resp
    a = rec.advantages
    assert float(m["divergence_mean"]) == pytest.approx(np_(res.divergence)[r].mean(), rel=1e-9)
    assert float(m["far_frac"]) == pytest.approx(np_(res.far)[r].mean(), abs=1e-12)
    assert float(m["mismatch_kl"]) == pytest.approx(np_(res.mismatch_kl)[r].mean(), rel=1e-9)
    assert float(m["mismatch_tv"]) == pytest.approx(np_(res.mismatch_tv)[r].mean(), rel=1e-9)
    away_ratio = a * np_(res.ratio_direction) > 0
    away_pred = a * np_(res.predicted_direction) > 0
    want_dis = (away_ratio != away_pred)[r].mean()
    assert want_dis > 0  # the record does have disagreements
    assert float(m["direction_disagreement"]) == pytest.approx(want_dis, abs=1e-12)
    keep = np_(res.keep)
    assert float(m["mask_frac"]) == pytest.approx((~keep)[r].mean(), abs=1e-12)
    assert float(m["mask_frac_pos"]) == pytest.approx((~keep)[r & (a > 0)].mean(), abs=1e-12)
    assert float(m["mask_frac_neg"]) == pytest.approx((~keep)[r & (a < 0)].mean(), abs=1e-12)
