"""Full-vocabulary divergences, their exact P, and direction-agreement scoring (docs/math.md §2, §4, §7).

Diagnostics and tests only: these need the full μ, which a rollout never carries, and they
materialise [N, V] tensors. Inputs are normalised log-distributions (−inf allowed for zero mass).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

Tensor = torch.Tensor


def _plogq(p: Tensor, logq: Tensor) -> Tensor:
    """p · logq with 0 · log 0 = 0 (and 0 · anything = 0)."""
    return torch.where(p > 0, p * logq, 0.0)


def full_kl(mu_logprobs: Tensor, pi_logprobs: Tensor) -> Tensor:  # [N, V], [N, V] -> [N]
    """KL(μ‖π) = Σ μ (log μ − log π)."""
    mu = mu_logprobs.exp()
    return (_plogq(mu, mu_logprobs) - _plogq(mu, pi_logprobs)).sum(-1)


def full_rkl(mu_logprobs: Tensor, pi_logprobs: Tensor) -> Tensor:  # -> [N]
    """KL(π‖μ) = Σ π (log π − log μ)."""
    return full_kl(pi_logprobs, mu_logprobs)


def full_tv(mu_logprobs: Tensor, pi_logprobs: Tensor) -> Tensor:  # -> [N]
    """½ Σ |π − μ|."""
    return 0.5 * (pi_logprobs.exp() - mu_logprobs.exp()).abs().sum(-1)


def _at(x: Tensor, ids: Tensor) -> Tensor:  # [N, V], [N] -> [N]
    return x.gather(-1, ids.long().unsqueeze(-1)).squeeze(-1)


def full_kl_direction(mu_logprobs: Tensor, pi_logprobs: Tensor, sampled_ids: Tensor) -> Tensor:  # -> [N]
    """P = (π_a − μ_a) − Σ_j π_j (π_j − μ_j)."""
    pi, mu = pi_logprobs.exp(), mu_logprobs.exp()
    return (_at(pi, sampled_ids) - _at(mu, sampled_ids)) - (pi * (pi - mu)).sum(-1)


def full_rkl_direction(mu_logprobs: Tensor, pi_logprobs: Tensor, sampled_ids: Tensor) -> Tensor:  # -> [N]
    """P = π_a (log r − D) − Σ_j π_j² (log(π_j/μ_j) − D), D = KL(π‖μ), r = π_a/μ_a."""
    pi = pi_logprobs.exp()
    d = full_rkl(mu_logprobs, pi_logprobs).unsqueeze(-1)  # [N, 1]
    log_r = torch.where(pi > 0, pi_logprobs - mu_logprobs, 0.0)  # [N, V]
    return _at(pi, sampled_ids) * (_at(log_r, sampled_ids) - d.squeeze(-1)) - (pi.square() * (log_r - d)).sum(
        -1
    )


def full_tv_direction(mu_logprobs: Tensor, pi_logprobs: Tensor, sampled_ids: Tensor) -> Tensor:  # -> [N]
    """P = ½ [π_a (s_a − s̄) − Σ_j π_j² (s_j − s̄)], s = sign(π − μ), s̄ = Σ π_i s_i."""
    pi, mu = pi_logprobs.exp(), mu_logprobs.exp()
    s = torch.sign(pi - mu)
    s_bar = (pi * s).sum(-1, keepdim=True)  # [N, 1]
    return 0.5 * (
        _at(pi, sampled_ids) * (_at(s, sampled_ids) - s_bar.squeeze(-1)) - (pi.square() * (s - s_bar)).sum(-1)
    )


def _rate(hit: Tensor, where: Tensor) -> float:
    n = int(where.sum())
    return float((hit & where).sum()) / n if n else float("nan")


def direction_agreement(
    advantages: Tensor,  # [N]
    d_before: Tensor,  # [N] D(μ, π) before the step
    d_after: Tensor,  # [N] D(μ, π') after the step, same tokens
    directions: Mapping[str, Tensor],  # rule name -> [N] coefficient; "away" iff A · coefficient > 0
    far: Tensor,  # [N] bool proximity test (D > δ)
    *,
    pair: tuple[str, str] = ("ratio", "predictive"),  # the two rules whose disagreement set is scored
    response_mask: Tensor | None = None,  # [N] bool
) -> dict[str, dict[str, float]]:
    """Score each rule's predicted sign of ΔD against the realised ΔD after a real step (docs/math.md §7).

    Per rule: agree_all / agree_far / agree_disagreement (far tokens where the two `pair` rules predict
    differently), unsafe_keep = P(ΔD > 0 | kept ∧ far), wrong_mask = P(ΔD < 0 | masked). Tokens with
    A = 0 are not scored for agreement (the step does not move them). Empty sets give nan.
    """
    a = advantages.reshape(-1)
    delta = (d_after - d_before).reshape(-1)
    valid = (
        torch.ones_like(a, dtype=torch.bool) if response_mask is None else response_mask.reshape(-1).bool()
    )
    far = far.reshape(-1).bool() & valid
    scored = valid & (a != 0)
    away = {name: (a * d.reshape(-1).to(a.dtype) > 0) for name, d in directions.items()}
    disagree = (away[pair[0]] != away[pair[1]]) & far if all(p in away for p in pair) else None
    out: dict[str, dict[str, float]] = {}
    for name, d in directions.items():
        agree = torch.sign(a * d.reshape(-1).to(a.dtype)) == torch.sign(delta)
        masked = far & away[name]
        kept = valid & ~masked
        out[name] = {
            "agree_all": _rate(agree, scored),
            "agree_far": _rate(agree, scored & far),
            "agree_disagreement": _rate(agree, scored & disagree) if disagree is not None else float("nan"),
            "unsafe_keep": _rate(delta > 0, kept & far),
            "wrong_mask": _rate(delta < 0, masked),
            "mask_frac": _rate(masked, valid),
        }
    if disagree is not None:
        out["_sets"] = {"far_frac": _rate(far, valid), "disagreement_frac_far": _rate(disagree, far)}
    return out
