"""Divergences D(μ, π) and their predicted first-order change P̂, per token (docs/math.md §2, §4).

Pure functions on the retained support S = topK ∪ {a} of each token. They know nothing of logits,
chunks or configs: `Support` carries the K+1 gathered log-probabilities, the tail masses and Σ_V π².
All shapes are [n] or [n, K+1] for n token rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Tensor = torch.Tensor
TINY = 1e-12  # docs/math.md §1: log(max(x, 1e-12)) for clamped masses


@dataclass(frozen=True)
class Support:
    """One token per row; column K is the sampled token a when a ∉ topK (else excluded)."""

    logpi: Tensor  # [n, K+1] log π on S (column K: log π_a)
    logmu: Tensor  # [n, K+1] log μ on S (column K: log μ_a = sampled logprob)
    member: Tensor  # [n, K+1] bool: entry belongs to S
    a_col: Tensor  # [n] long: the column of a in S
    sum_sq: Tensor  # [n] Σ_V π_j²
    vocab: int  # n = |V|

    @property
    def pi(self) -> Tensor:  # [n, K+1], 0 outside S
        return torch.where(self.member, self.logpi.exp(), 0.0)

    @property
    def mu(self) -> Tensor:  # [n, K+1], 0 outside S
        return torch.where(self.member, self.logmu.exp(), 0.0)


def build_support(
    logpi_topk: Tensor,  # [n, K] log π at the top-K ids
    logpi_a: Tensor,  # [n] log π_a
    topk_ids: Tensor,  # [n, K]
    topk_logprobs: Tensor,  # [n, K] log μ of the top-K
    sampled_ids: Tensor,  # [n]
    sampled_logprobs: Tensor,  # [n] log μ_a
    sum_sq: Tensor,  # [n]
    vocab: int,
) -> Support:
    hit = topk_ids == sampled_ids.unsqueeze(-1)  # [n, K]
    a_in_topk = hit.any(dim=-1)  # [n]
    k = topk_ids.shape[-1]
    a_col = torch.where(a_in_topk, hit.to(torch.int8).argmax(dim=-1), k)
    member = torch.cat([torch.ones_like(hit), (~a_in_topk).unsqueeze(-1)], dim=-1)
    logpi = torch.cat([logpi_topk, logpi_a.unsqueeze(-1)], dim=-1)
    logmu = torch.cat([topk_logprobs.to(logpi.dtype), sampled_logprobs.to(logpi.dtype).unsqueeze(-1)], dim=-1)
    return Support(logpi=logpi, logmu=logmu, member=member, a_col=a_col, sum_sq=sum_sq, vocab=vocab)


@dataclass(frozen=True)
class Buckets:
    """S entries plus the tail as one bucket (docs/math.md §1)."""

    pi: Tensor  # [n, K+1]
    mu: Tensor  # [n, K+1]
    pi_a: Tensor  # [n] π of a's S entry
    mu_a: Tensor  # [n] μ of a's S entry
    pi_tail: Tensor  # [n] π_T = max(0, 1 − Σ_S π)
    mu_tail: Tensor  # [n] μ_T = max(0, 1 − Σ_S μ)
    q_tail: Tensor  # [n] Q_T = max(0, Σ_V π² − Σ_S π²), exact
    n_tail: Tensor  # [n] |V \ S|


def buckets(s: Support) -> Buckets:
    pi, mu = s.pi, s.mu
    col = s.a_col.unsqueeze(-1)
    return Buckets(
        pi=pi,
        mu=mu,
        pi_a=pi.gather(-1, col).squeeze(-1),
        mu_a=mu.gather(-1, col).squeeze(-1),
        pi_tail=(1.0 - pi.sum(-1)).clamp_min(0.0),
        mu_tail=(1.0 - mu.sum(-1)).clamp_min(0.0),
        q_tail=(s.sum_sq - pi.square().sum(-1)).clamp_min(0.0),
        n_tail=(s.vocab - s.member.sum(-1)).to(pi.dtype),
    )


def _log_clamped(x: Tensor) -> Tensor:
    return x.clamp_min(TINY).log()


# ---- divergences (docs/math.md §2) -------------------------------------------------------------------


def topk_kl(b: Buckets, s: Support) -> Tensor:  # [n]
    """Σ_S μ_i (log μ_i − log π_i) + μ_T (log μ_T − log π_T); μ_i = 0 entries contribute 0."""
    terms = torch.where(b.mu > 0, b.mu * (s.logmu - s.logpi), 0.0)  # [n, K+1]
    tail = b.mu_tail * (_log_clamped(b.mu_tail) - _log_clamped(b.pi_tail))
    return terms.sum(-1) + tail


def topk_tv(b: Buckets, s: Support) -> Tensor:  # [n]
    """½ (Σ_S |π_i − μ_i| + |π_T − μ_T|)."""
    return 0.5 * ((b.pi - b.mu).abs().sum(-1) + (b.pi_tail - b.mu_tail).abs())


def binary_tv(logpi_a: Tensor, logmu_a: Tensor) -> Tensor:  # [n]
    """|π_a − μ_a| (DPPO Eq. 13)."""
    return (logpi_a.exp() - logmu_a.exp()).abs()


def binary_kl(logpi_a: Tensor, logmu_a: Tensor) -> Tensor:  # [n]
    """μ_a log(μ_a/π_a) + (1−μ_a) log((1−μ_a)/(1−π_a)), 1−μ_a and 1−π_a clamped at 1e-12 (DPPO Eq. 14)."""
    mu_a = logmu_a.exp()
    q = (-torch.expm1(logmu_a)).clamp_min(TINY)  # 1 − μ_a, accurate when μ_a ≈ 1
    p_bar = (-torch.expm1(logpi_a)).clamp_min(TINY)
    return torch.where(mu_a > 0, mu_a * (logmu_a - logpi_a), 0.0) + q * (q.log() - p_bar.log())


# ---- predicted direction P̂ = dD/dτ along z' = z + τ(e_a − π) (docs/math.md §4) --------------------------


def tail_concentration(b: Buckets, estimator: str) -> Tensor:  # [n] Q̂_T (docs/math.md §4.1)
    if estimator == "aggregated":
        return b.pi_tail.square()
    if estimator == "uniform":
        return b.pi_tail.square() / b.n_tail.clamp_min(1.0)
    return b.q_tail  # proportional: exact


def dpi_a_dtau(logpi_a: Tensor, sum_sq: Tensor) -> Tensor:  # [n]
    """dπ_a/dτ = π_a(1 − 2π_a + ‖π‖²) = π_a((1 − π_a)² + Σ_{j≠a} π_j²) ≥ 0, written without cancellation."""
    pi_a = logpi_a.exp()
    one_minus = -torch.expm1(logpi_a)
    return pi_a * (one_minus.square() + (sum_sq - pi_a.square()).clamp_min(0.0))


def binary_tv_direction(logpi_a: Tensor, logmu_a: Tensor, sum_sq: Tensor) -> Tensor:  # [n]
    """P = sign(π_a − μ_a) · dπ_a/dτ: same sign as the ratio direction."""
    return torch.sign(logpi_a.exp() - logmu_a.exp()) * dpi_a_dtau(logpi_a, sum_sq)


def binary_kl_direction(logpi_a: Tensor, logmu_a: Tensor, sum_sq: Tensor) -> Tensor:  # [n]
    """P = f'(π_a) · dπ_a/dτ with f' = (π_a − μ_a) / (π_a (1 − π_a)); 1 − π_a clamped as in D."""
    pi_a = logpi_a.exp()
    p_bar = (-torch.expm1(logpi_a)).clamp_min(TINY)
    # f' · π_a folded: (π_a − μ_a) / (1 − π_a) · ((1 − π_a)² + Σ_{j≠a} π_j²)
    rest = (sum_sq - pi_a.square()).clamp_min(0.0)
    return (pi_a - logmu_a.exp()) / p_bar * (p_bar.square() + rest)


def topk_kl_direction(b: Buckets, q_hat: Tensor) -> Tensor:  # [n]
    """P̂ = (π_a − μ_a) − Σ_S π_i(π_i − μ_i) + Q̂_T (μ_T/π_T − 1); tail term 0 when π_T = 0."""
    tail = torch.where(b.pi_tail > 0, q_hat * (b.mu_tail / b.pi_tail.clamp_min(TINY) - 1.0), 0.0)
    return (b.pi_a - b.mu_a) - (b.pi * (b.pi - b.mu)).sum(-1) + tail


def topk_tv_direction(b: Buckets, q_hat: Tensor) -> Tensor:  # [n]
    """P̂ = π_a(φ_a − φ̄) − Σ_S π_i²(φ_i − φ̄) − Q̂_T(φ_T − φ̄), φ = ½ sign(π − μ) per bucket."""
    phi = 0.5 * torch.sign(b.pi - b.mu)  # [n, K+1]; 0 outside S since both are 0 there
    phi_t = 0.5 * torch.sign(b.pi_tail - b.mu_tail)  # [n]
    phi_bar = (b.pi * phi).sum(-1) + b.pi_tail * phi_t  # [n]
    phi_a = 0.5 * torch.sign(b.pi_a - b.mu_a)
    s_term = (b.pi.square() * (phi - phi_bar.unsqueeze(-1))).sum(-1)
    tail = torch.where(b.pi_tail > 0, q_hat * (phi_t - phi_bar), 0.0)
    return b.pi_a * (phi_a - phi_bar) - s_term - tail
