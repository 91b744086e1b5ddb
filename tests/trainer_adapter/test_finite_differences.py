"""Central finite differences (float64) of every closed form of docs/math.md §4.

The step is the idealised one of §4: free logits z = ℓ/T move along z' = z + τ(e_a − π), and
P = dD/dτ at τ = 0. D is always evaluated by the package itself (res.divergence, full_*), so these
tests check that the package's P̂ is the derivative of the package's own D. TV divergences are
evaluated away from their kinks (every |π_i − μ_i| and |π_T − μ_T| bounded away from 0).
"""

from __future__ import annotations

import numpy as np
import pytest
import reference_impl as ref
import torch
from adapter_helpers import free_logit_step, np_

from maskroll.trainer_adapter import (
    MaskConfig,
    compute_masks,
    full_kl,
    full_kl_direction,
    full_rkl,
    full_rkl_direction,
    full_tv,
    full_tv_direction,
    token_logprobs,
)

H = 1e-5  # central difference step in τ: truncation ~H², round-off ~1e-16/H, both << the tolerance
RTOL, ATOL = 1e-6, 1e-9


def central_difference(fn, h: float = H) -> np.ndarray:
    return (fn(h) - fn(-h)) / (2 * h)


# ----------------------------------------------------------------------------------------------------
# the general identity and dπ_a/dτ
# ----------------------------------------------------------------------------------------------------


def test_general_identity_for_an_arbitrary_smooth_function_of_pi() -> None:
    """P = π_a(φ_a − φ̄) − Σ_j π_j²(φ_j − φ̄) for f(π) = (w·π)² + Σ b_j π_j³ + Σ c_j log π_j.
    This is the identity every closed form (and reference_impl) rests on."""
    rng = np.random.default_rng(0)
    v = 40
    z = torch.tensor(rng.standard_normal(v) * 2, dtype=torch.float64)
    w, b, c = (torch.tensor(rng.standard_normal(v), dtype=torch.float64) for _ in range(3))

    def f(pi):
        return (w @ pi) ** 2 + (b * pi**3).sum() + (c * torch.log(pi)).sum()

    for a in (int(torch.argmax(z)), 3, 17):
        pi = torch.softmax(z, -1)
        e_a = torch.nn.functional.one_hot(torch.tensor(a), v).to(torch.float64)
        fd = central_difference(lambda t, e_a=e_a, pi=pi: float(f(torch.softmax(z + t * (e_a - pi), -1))))
        phi = 2 * (w @ pi) * w + 3 * b * pi**2 + c / pi
        phibar = (pi * phi).sum()
        closed = pi[a] * (phi[a] - phibar) - (pi**2 * (phi - phibar)).sum()
        assert fd == pytest.approx(float(closed), rel=RTOL, abs=ATOL)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_dpi_a_dtau_through_token_logprobs(temperature: float) -> None:
    """dπ_a/dτ = π_a(1 − 2π_a + ‖π‖²) ≥ 0, with π_a from the package's token_logprobs at temperature T
    (raw logits move by T·τ(e_a − π))."""
    rng = np.random.default_rng(1)
    logits = torch.tensor(rng.standard_normal((16, 120)) * 2, dtype=torch.float64)
    ids = torch.tensor(rng.integers(0, 120, 16))
    ids[:4] = logits[:4].argmax(-1)  # include very likely tokens (1 − 2π_a < 0 there)

    def pi_a(t):
        with torch.no_grad():
            return torch.exp(
                token_logprobs(free_logit_step(logits, ids, temperature, t), ids, temperature=temperature)
            ).numpy()

    pi = torch.softmax(logits / temperature, -1)
    pa = pi.gather(1, ids[:, None])[:, 0]
    closed = (pa * (1 - 2 * pa + (pi**2).sum(-1))).numpy()
    np.testing.assert_allclose(central_difference(pi_a), closed, rtol=RTOL, atol=ATOL)
    assert (closed >= 0).all()


# ----------------------------------------------------------------------------------------------------
# full-vocabulary divergences
# ----------------------------------------------------------------------------------------------------


def full_case(seed: int, n: int = 12, v: int = 150):
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((n, v)) * 2
    mu_lp = torch.log_softmax(torch.tensor(z + rng.standard_normal((n, v)) * rng.uniform(0.1, 1, (n, 1))), -1)
    z = torch.tensor(z)
    ids = torch.tensor(rng.integers(0, v, n))
    ids[:3] = z[:3].argmax(-1)
    return z, mu_lp, ids


FULL = {
    "kl": (full_kl, full_kl_direction, ref.full_kl, ref.full_kl_direction),
    "rkl": (full_rkl, full_rkl_direction, ref.full_rkl, ref.full_rkl_direction),
    "tv": (full_tv, full_tv_direction, ref.full_tv, ref.full_tv_direction),
}


@pytest.mark.parametrize("name", list(FULL))
@pytest.mark.parametrize("seed", [10, 11])
def test_full_divergence_directions_are_derivatives(name: str, seed: int) -> None:
    div_fn, dir_fn, ref_div, ref_dir = FULL[name]
    z, mu_lp, ids = full_case(seed)

    def d(t):
        with torch.no_grad():
            return np_(div_fn(mu_lp, torch.log_softmax(free_logit_step(z, ids, 1.0, t), -1)))

    pi_lp = torch.log_softmax(z, -1)
    with torch.no_grad():
        got = np_(dir_fn(mu_lp, pi_lp, ids))
        got_d = np_(div_fn(mu_lp, pi_lp))
    if name == "tv":  # away from kinks: no |π_j − μ_j| small enough to change sign within ±H·|dπ_j/dτ|
        assert (torch.abs(pi_lp.exp() - mu_lp.exp()) > 1e-8).all()
    np.testing.assert_allclose(got, central_difference(d), rtol=RTOL, atol=ATOL)
    # and the values themselves against the independent reference
    mu_np, pi_np = mu_lp.numpy(), pi_lp.numpy()
    np.testing.assert_allclose(
        got_d, [ref_div(mu_np[i], pi_np[i]) for i in range(len(ids))], rtol=1e-9, atol=1e-12
    )
    np.testing.assert_allclose(
        got, [ref_dir(mu_np[i], pi_np[i], int(ids[i])) for i in range(len(ids))], rtol=1e-9, atol=1e-12
    )


def test_full_divergences_hand_case() -> None:
    # μ = (½, ¼, ¼), π = (¼, ½, ¼), a = 1.
    mu = torch.log(torch.tensor([[0.5, 0.25, 0.25]], dtype=torch.float64))
    pi = torch.log(torch.tensor([[0.25, 0.5, 0.25]], dtype=torch.float64))
    a = torch.tensor([1])
    ln2 = np.log(2.0)
    # KL(μ‖π) = ½ log 2 + ¼ log ½ = ¼ log 2 ≈ 0.1732868; KL(π‖μ) is the same by symmetry of the swap
    assert float(full_kl(mu, pi)[0]) == pytest.approx(0.25 * ln2, abs=1e-15)
    assert float(full_rkl(mu, pi)[0]) == pytest.approx(0.25 * ln2, abs=1e-15)
    # TV = ½(¼ + ¼ + 0) = ¼
    assert float(full_tv(mu, pi)[0]) == pytest.approx(0.25, abs=1e-15)
    # P_kl = (π_a − μ_a) − Σ π_j(π_j − μ_j) = ¼ − (¼·(−¼) + ½·¼ + 0) = ¼ − 1/16 = 0.1875
    assert float(full_kl_direction(mu, pi, a)[0]) == pytest.approx(0.1875, abs=1e-15)
    # P_rkl: log r = (log ½, log 2, 0), D = ¼ log 2:
    #   π_a(log 2 − D) − [1/16(−log 2 − D) + ¼(log 2 − D) + 1/16(−D)]
    #   = ½·¾ log 2 − [1/16·(−5/4) + ¼·¾ − 1/16·¼] log 2 = (3/8 − 6/64) log 2 = 9/32 log 2 ≈ 0.1949476
    assert float(full_rkl_direction(mu, pi, a)[0]) == pytest.approx(9 / 32 * ln2, abs=1e-15)
    # P_tv: s = (−1, 1, 0), s̄ = −¼ + ½ = ¼; ½[½(1 − ¼) − (1/16(−5/4) + ¼·¾ + 1/16(−¼))]
    #   = ½[3/8 − (−5/64 + 12/64 − 1/64)] = ½[24/64 − 6/64] = 9/64 = 0.140625
    assert float(full_tv_direction(mu, pi, a)[0]) == pytest.approx(9 / 64, abs=1e-15)


# ----------------------------------------------------------------------------------------------------
# bucketed divergences through compute_masks
# ----------------------------------------------------------------------------------------------------


def bucket_case(seed: int, temperature: float):
    rec = ref.make_record(seed, n=24, v=200, k=8, temperature=temperature, outside_frac=0.4)
    return rec, ref.record_reference(rec)


def masks_at(rec, divergence: str, logits: torch.Tensor, temperature: float):
    cfg = MaskConfig(method="predictive", divergence=divergence, estimator="proportional")
    return compute_masks(
        logits,
        torch.tensor(rec.sampled_ids),
        torch.tensor(rec.sampled_logprobs),
        torch.tensor(rec.topk_ids),
        torch.tensor(rec.topk_logprobs),
        torch.tensor(rec.advantages),
        config=cfg,
        temperature=temperature,
    )


def smooth_tokens(rec, tokens, divergence: str, margin: float = 1e-6) -> np.ndarray:
    """Tokens whose D is differentiable at τ = 0 with margin (TV kinks: some |π_i − μ_i| ≈ 0)."""
    ok = np.ones(len(tokens), dtype=bool)
    for i, t in enumerate(tokens):
        pi = np.exp(ref.processed_logprobs(rec.logits[i], rec.temperature[i]))
        s = list(rec.topk_ids[i]) + ([] if rec.sampled_ids[i] in rec.topk_ids[i] else [rec.sampled_ids[i]])
        mu = list(np.exp(rec.topk_logprobs[i])) + ([] if len(s) == len(rec.topk_ids[i]) else [t.mu_a])
        gaps = [abs(pi[j] - m) for j, m in zip(s, mu, strict=True)] + [abs(t.pi_T - t.mu_T)]
        if divergence == "topk_tv":
            ok[i] = min(gaps) > margin
        elif divergence == "binary_tv":
            ok[i] = abs(t.pi_a - t.mu_a) > margin
        assert t.mu_T > 0 and t.pi_T > 0  # no clamp active: the bucketed D is smooth in π_T
    return ok


@pytest.mark.parametrize("divergence", ref.DIVERGENCES)
@pytest.mark.parametrize(("seed", "temperature"), [(20, 1.0), (21, 0.7), (22, 1.3)])
def test_predicted_direction_is_the_derivative_of_the_divergence(divergence, seed, temperature) -> None:
    """proportional P̂ of topk_* (exact derivative of the bucketed D, MATH §4.1) and the binary P
    (f'(π_a)·dπ_a/dτ) against central differences of the package's own res.divergence."""
    rec, tokens = bucket_case(seed, temperature)
    logits = torch.tensor(rec.logits)
    ids = torch.tensor(rec.sampled_ids)

    def d(t):
        return np_(
            masks_at(rec, divergence, free_logit_step(logits, ids, temperature, t), temperature).divergence
        )

    res = masks_at(rec, divergence, logits, temperature)
    ok = smooth_tokens(rec, tokens, divergence)
    assert ok.sum() >= 20
    fd = central_difference(d)
    np.testing.assert_allclose(np_(res.predicted_direction)[ok], fd[ok], rtol=RTOL, atol=ATOL)
    # the FD is not trivially zero: P̂ carries signal on these tokens
    assert np.abs(fd[ok]).max() > 1e-3


@pytest.mark.parametrize("divergence", ref.DIVERGENCES)
def test_reference_directions_are_derivatives_of_reference_divergences(divergence: str) -> None:
    """The reference's own closed forms (used as ground truth elsewhere) against central differences
    of the reference's own D, so a wrong reference formula cannot hide."""
    rec, tokens = bucket_case(23, 0.7)
    ok = smooth_tokens(rec, tokens, divergence)
    for i in np.nonzero(ok)[0][:12]:
        a = int(rec.sampled_ids[i])
        t0 = rec.temperature[i]
        z = rec.logits[i] / t0
        pi = np.exp(ref.processed_logprobs(rec.logits[i], t0))
        step = -pi
        step[a] += 1.0

        def d(t, z=z, step=step, i=i, a=a):
            tok = ref.token_reference(
                z + t * step, a, rec.sampled_logprobs[i], rec.topk_ids[i], rec.topk_logprobs[i], 1.0
            )
            return tok.divergence[divergence]

        want = tokens[i].predicted[(divergence, "proportional")]
        assert central_difference(d) == pytest.approx(want, rel=RTOL, abs=ATOL)


@pytest.mark.parametrize("divergence", ["topk_kl", "topk_tv"])
def test_topk_equals_full_when_mu_is_proportional_to_pi_on_the_tail(divergence: str) -> None:
    """If μ ∝ π on the tail, the bucketed D equals the full D and the proportional P̂ equals the full
    exact P (MATH §4.1: 'exact ... assumes μ ∝ π on the tail'). Cross-checks full_* against topk_*."""
    rng = np.random.default_rng(30)
    n, v, k = 16, 180, 6
    z = torch.tensor(rng.standard_normal((n, v)) * 2)
    pi = torch.softmax(z, -1)
    # μ: reweight the head (top-k of π) and scale the whole tail by one factor
    mu = pi.clone()
    topk_ids = torch.empty(n, k, dtype=torch.long)
    ids = torch.empty(n, dtype=torch.long)
    for i in range(n):
        head = torch.argsort(pi[i], descending=True)[:k]
        mu[i, head] = pi[i, head] * torch.tensor(rng.uniform(0.4, 2.0, k))
        mu[i, head] *= min(1.0, 0.9 / float(mu[i, head].sum()))  # leave the tail some mass
        tail = torch.ones(v, dtype=torch.bool)
        tail[head] = False
        mu[i, tail] *= (1 - mu[i, head].sum()) / pi[i, tail].sum()  # μ_T/π_T on every tail token
        # S = head, ranked by μ (the identity needs μ ∝ π off S, not that S is μ's exact top-K)
        topk_ids[i] = head[torch.argsort(mu[i, head], descending=True)]
        ids[i] = head[0] if i % 2 else int(torch.nonzero(tail)[rng.integers(0, int(tail.sum()))])
    mu_lp = torch.log(mu)
    res = compute_masks(
        z,
        ids,
        mu_lp.gather(1, ids[:, None])[:, 0],
        topk_ids,
        mu_lp.gather(1, topk_ids),
        torch.ones(n, dtype=torch.float64),
        config=MaskConfig(method="predictive", divergence=divergence, estimator="proportional"),
    )
    pi_lp = torch.log_softmax(z, -1)
    full_d = full_kl(mu_lp, pi_lp) if divergence == "topk_kl" else full_tv(mu_lp, pi_lp)
    full_p = (full_kl_direction if divergence == "topk_kl" else full_tv_direction)(mu_lp, pi_lp, ids)
    np.testing.assert_allclose(np_(res.divergence), np_(full_d), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(np_(res.predicted_direction), np_(full_p), rtol=1e-8, atol=1e-12)


def test_bucketed_divergences_are_lower_bounds_of_the_full_ones() -> None:
    rec = ref.make_record(31, n=40, v=250, k=5, temperature=0.7)
    res = compute_masks(
        torch.tensor(rec.logits),
        torch.tensor(rec.sampled_ids),
        torch.tensor(rec.sampled_logprobs),
        torch.tensor(rec.topk_ids),
        torch.tensor(rec.topk_logprobs),
        torch.tensor(rec.advantages),
        config=MaskConfig(),
        temperature=0.7,
    )
    pi_lp = torch.log_softmax(torch.tensor(rec.logits) / 0.7, -1)
    mu_lp = torch.tensor(rec.mu_logprobs)
    kl, tv = np_(full_kl(mu_lp, pi_lp)), np_(full_tv(mu_lp, pi_lp))
    assert (np_(res.mismatch_kl) <= kl + 1e-12).all()
    assert (np_(res.mismatch_tv) <= tv + 1e-12).all()
    assert (np_(res.mismatch_kl) < kl - 1e-6).any()  # strict somewhere: the tail does hide divergence
