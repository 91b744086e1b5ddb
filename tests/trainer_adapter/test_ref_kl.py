"""policy_loss's KL-to-reference term (docs/math.md §5): β · r · k3 with k3 = π_ref/π_a − log(π_ref/π_a) − 1,
r = π_a/μ_a, aggregated like the policy term — hand-computed values and gradients, finite differences of
the logits gradient in float64, the −inf tokens a replayed truncation leaves, and the refusals.

Hand case, B = 2 sequences × T = 2 tokens, A = 0 (the policy term is exactly 0):

    tok      π_a  π_ref  μ_a   response  π_ref/π_a  k3           r    r · k3         ∂(r·k3)/∂log π_a
    seq0 t0  0.5  0.25   0.25  yes       1/2        log 2 − 1/2  2    2 log 2 − 1    2 log 2
    seq0 t1  0.2  0.4    0.4   yes       2          1 − log 2    1/2  (1 − log 2)/2  −(log 2)/2
    seq1 t0  0.5  0.5    0.5   yes       1          0            1    0              0
    seq1 t1  0.9  0.1    0.3   no (padding: contributes nothing)

∂(r·k3)/∂log π_a = r · log(π_a/π_ref). Without r (kl_is_weight=False) the gradient of k3 is
1 − π_ref/π_a: 1/2, −1, 0.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from maskroll.trainer_adapter import policy_loss, token_logprobs

L = math.log
f64 = lambda xs: torch.tensor(xs, dtype=torch.float64)  # noqa: E731

PI_A = [[0.5, 0.2], [0.5, 0.9]]
REF = [[0.25, 0.4], [0.5, 0.1]]
MU_A = [[0.25, 0.4], [0.5, 0.3]]
RESP = torch.tensor([[True, True], [True, False]])
BETA = 0.1
KL_SEQ0 = [2 * L(2) - 1, (1 - L(2)) / 2]  # r · k3 of seq0's tokens; seq1's only response token has 0
KL_SUM = sum(KL_SEQ0)  # = 1.5 log 2 − 1/2 ≈ 0.5397208


def hand(aggregation: str = "token_mean", adv=(0.0, 0.0), kl_is_weight: bool = True, **kw):
    lp = torch.log(f64(PI_A)).requires_grad_(True)
    loss, metrics = policy_loss(
        lp,
        torch.log(f64(MU_A)),
        f64(adv),
        torch.ones(2, 2, dtype=torch.bool),
        aggregation=aggregation,
        response_mask=RESP,
        ref_logprobs=torch.log(f64(REF)),
        kl_coef=BETA,
        kl_is_weight=kl_is_weight,
        **kw,
    )
    return lp, loss, metrics


def test_token_mean_by_hand() -> None:
    lp, loss, m = hand("token_mean")
    # β · Σ r·k3 over the 3 response tokens / 3 ≈ 0.0179907
    assert float(loss.detach()) == pytest.approx(BETA * KL_SUM / 3, rel=1e-12)
    assert float(m["ref_kl"]) == pytest.approx(KL_SUM / 3, rel=1e-12)
    loss.backward()
    want = BETA / 3 * f64([[2 * L(2), -L(2) / 2], [0.0, 0.0]])  # β/3 · r log(π_a/π_ref)
    torch.testing.assert_close(lp.grad, want, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize(
    ("aggregation", "max_len", "want"),
    [
        ("seq_mean_token_mean", None, (KL_SUM / 2 + 0.0) / 2),  # seq0 over its 2 tokens, seq1 over 1
        ("seq_mean_token_sum_norm", None, (KL_SUM / 2 + 0.0) / 2),  # per sequence Σ / T (= 2)
        ("seq_mean_token_sum_norm", 8, (KL_SUM / 8 + 0.0) / 2),  # per sequence Σ / max_len
    ],
)
def test_sequence_aggregations_by_hand(aggregation: str, max_len, want: float) -> None:
    _, loss, _ = hand(aggregation, max_len=max_len)
    assert float(loss.detach()) == pytest.approx(BETA * want, rel=1e-12)


def test_without_the_ratio_by_hand() -> None:
    lp, loss, m = hand("token_mean", kl_is_weight=False)
    # k3: log 2 − 1/2, 1 − log 2, 0 → Σ = 1/2
    assert float(loss.detach()) == pytest.approx(BETA * 0.5 / 3, rel=1e-12)
    assert float(m["ref_kl"]) == pytest.approx(0.5 / 3, rel=1e-12)
    loss.backward()
    torch.testing.assert_close(lp.grad, BETA / 3 * f64([[0.5, -1.0], [0.0, 0.0]]), rtol=1e-12, atol=1e-15)


def test_adds_to_the_policy_term() -> None:
    # A = (1, −2): the policy term of the response tokens (w = 2, 0.5 | 1; M = 1) is unchanged, the KL
    # term is added on top: ℓ = −A·w·log π_a → seq0: −2 log 0.5, −0.5 log 0.2; seq1: 2·1·log 0.5
    _, loss, _ = hand("token_mean", adv=(1.0, -2.0))
    policy = (-2 * L(0.5) - 0.5 * L(0.2) + 2 * L(0.5)) / 3
    assert float(loss.detach()) == pytest.approx(policy + BETA * KL_SUM / 3, rel=1e-12)


def test_zero_coefficient_reports_the_metric_and_leaves_the_loss() -> None:
    lp = torch.log(f64(PI_A))
    args = (lp, torch.log(f64(MU_A)), f64([1.0, -2.0]), torch.ones(2, 2, dtype=torch.bool))
    plain, m0 = policy_loss(*args, response_mask=RESP)
    with_ref, m1 = policy_loss(*args, response_mask=RESP, ref_logprobs=torch.log(f64(REF)), kl_coef=0.0)
    assert torch.equal(plain, with_ref) and "ref_kl" not in m0
    assert float(m1["ref_kl"]) == pytest.approx(KL_SUM / 3, rel=1e-12)


def test_minus_inf_logprob_is_not_counted_and_has_no_nan_gradient() -> None:
    # token 0: a replayed truncation removed a (log π_a = −inf): its k3 is infinite, so it is left out of
    # the KL term's mean (the policy term still counts it, masked); token 1 as seq0 t0 of the hand case.
    lp = torch.tensor([-math.inf, L(0.5)], dtype=torch.float64, requires_grad=True)
    loss, m = policy_loss(
        lp,
        torch.log(f64([0.3, 0.25])),
        f64([0.0, 0.0]),
        torch.tensor([False, True]),
        ref_logprobs=torch.log(f64([0.3, 0.25])),
        kl_coef=BETA,
    )
    assert float(loss.detach()) == pytest.approx(BETA * (2 * L(2) - 1), rel=1e-12)
    assert float(m["ref_kl"]) == pytest.approx(2 * L(2) - 1, rel=1e-12)
    loss.backward()
    assert lp.grad.tolist() == pytest.approx([0.0, BETA * 2 * L(2)], rel=1e-12, abs=0)


def test_refusals() -> None:
    lp, mu, adv, keep = torch.zeros(3), torch.zeros(3), torch.ones(3), torch.ones(3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"kl_coef=0\.1 needs ref_logprobs"):
        policy_loss(lp, mu, adv, keep, kl_coef=0.1)
    with pytest.raises(ValueError, match="kl_coef=nan"):
        policy_loss(lp, mu, adv, keep, ref_logprobs=torch.zeros(3), kl_coef=float("nan"))
    with pytest.raises(ValueError, match=r"ref_logprobs has shape \(2,\); expected \(3,\)"):
        policy_loss(lp, mu, adv, keep, ref_logprobs=torch.zeros(2), kl_coef=0.1)


# ----------------------------------------------------------------------------------------------------
# the logits gradient: closed form and central finite differences, float64
# ----------------------------------------------------------------------------------------------------

B, T, V, TEMP = 3, 4, 7, 0.8


def _fd_case(seed: int = 50):
    rng = np.random.default_rng(seed)
    logits = torch.tensor(rng.standard_normal((B, T, V)) * 1.5)
    ids = torch.tensor(rng.integers(0, V, (B, T)))
    ref = token_logprobs(torch.tensor(rng.standard_normal((B, T, V)) * 1.5), ids, temperature=TEMP)
    mu = token_logprobs(logits + torch.tensor(rng.standard_normal((B, T, V))), ids, temperature=TEMP)
    resp = torch.ones(B, T, dtype=torch.bool)
    resp[1, 2:] = False
    return logits, ids, ref, mu, resp


def _kl_loss(lp, ref, mu, resp, aggregation, kl_is_weight, beta=0.3):
    loss, _ = policy_loss(
        lp,
        mu,
        torch.zeros(B, dtype=torch.float64),  # A = 0: the loss is the KL term alone, a plain function
        torch.ones(B, T, dtype=torch.bool),
        aggregation=aggregation,
        response_mask=resp,
        max_len=6,
        ref_logprobs=ref,
        kl_coef=beta,
        kl_is_weight=kl_is_weight,
    )
    return loss


def test_logits_gradient_closed_form_token_mean() -> None:
    """d loss / d ℓ = β/N · r · (log π_a − log π_ref) · (e_a − π)/T on the N response tokens."""
    logits, ids, ref, mu, resp = _fd_case()
    x = logits.clone().requires_grad_(True)
    _kl_loss(token_logprobs(x, ids, temperature=TEMP), ref, mu, resp, "token_mean", True).backward()
    lp = token_logprobs(logits, ids, temperature=TEMP)
    pi = torch.softmax(logits / TEMP, -1)
    e_a = torch.nn.functional.one_hot(ids, V).to(torch.float64)
    coef = 0.3 / int(resp.sum()) * (lp - mu).exp() * (lp - ref) * resp  # [B, T]
    torch.testing.assert_close(x.grad, coef[..., None] * (e_a - pi) / TEMP, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("kl_is_weight", [True, False])
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_logits_gradient_matches_finite_differences(aggregation: str, kl_is_weight: bool) -> None:
    """Autograd through token_logprobs and the KL term against a five-point stencil in every logit."""
    logits, ids, ref, mu, resp = _fd_case(51)
    x = logits.clone().requires_grad_(True)
    _kl_loss(token_logprobs(x, ids, temperature=TEMP), ref, mu, resp, aggregation, kl_is_weight).backward()
    h = 1e-3  # truncation ~h⁴, round-off ~1e-16/h: both far below the tolerance
    steps = torch.tensor([2 * h, h, -h, -2 * h], dtype=torch.float64)
    # every (entry, step) perturbation at once: [B·T·V·4] copies of the logits, one forward
    n = B * T * V
    z = logits.expand(n * 4, B, T, V).clone().reshape(n, 4, B * T * V)
    z[torch.arange(n), :, torch.arange(n)] += steps
    z = z.reshape(n * 4, B, T, V)
    lp = token_logprobs(z.reshape(-1, V), ids.reshape(-1).repeat(n * 4), temperature=TEMP).reshape(
        n * 4, B, T
    )
    f = torch.stack([_kl_loss(lp[i], ref, mu, resp, aggregation, kl_is_weight) for i in range(n * 4)])
    f = f.reshape(n, 4)
    fd = ((-f[:, 0] + 8 * f[:, 1] - 8 * f[:, 2] + f[:, 3]) / (12 * h)).reshape(B, T, V)
    assert float(x.grad.abs().max()) > 1e-3  # a real gradient
    assert not x.grad[1, 2:].any()  # padding
    torch.testing.assert_close(x.grad, fd, rtol=1e-6, atol=1e-9)
