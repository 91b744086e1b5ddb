"""Rollout corrections: the IS weight w and the correction mask of the policy-gradient term (docs/math.md §9).

What verl's `rollout_corr`, TRL's vLLM importance-sampling correction and SkyRL's off-policy correction
offer, on maskroll's r = π_a/μ_a against the rollout's processed μ: token- and sequence-level truncated
IS, token- and sequence-level masked IS, IcePop's two-sided token mask and a geometric-mean sequence
mask. `MaskConfig.correction` picks one by name; `token_loss` applies it on top of the trust-region mask,
so every correction composes with ppo / dppo / predictive (the token is kept iff both keep it).

Plain functions of log r (detached) and the response mask; they know nothing of logits or masks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

Tensor = torch.Tensor
LOG_RATIO_MAX = 20.0  # keeps exp() finite before the cap applies


class Correction(NamedTuple):
    """Per token, shaped like log r; all detached."""

    weight: Tensor  # w: the IS weight of ℓ_token (after the cap)
    raw_weight: Tensor  # w before the cap: exp(min(log r, 20)) or the sequence's ρ (icepop: 1)
    keep: Tensor  # bool: the correction keeps the token (True off the response too; token_loss ands it)


# Each takes log r ([N] or [B, T], finite or −inf at a token a replayed truncation removed), the bool
# response mask, the IS cap C and the band (low, high); returns a Correction.
CorrectionFn = Callable[[Tensor, Tensor, float, float | None, float | None], Correction]


def _token_ratio(log_r: Tensor) -> Tensor:
    return log_r.clamp(max=LOG_RATIO_MAX).exp()


def _in_band(x: Tensor, low: float, high: float) -> Tensor:  # bool; closed band, as verl and TRL
    return (x >= low) & (x <= high)


def _sequence(log_r: Tensor, valid: Tensor, name: str) -> Tensor:  # [B, T] -> [B, 1]: Σ_t log r_t
    if log_r.dim() != 2:
        raise ValueError(f"correction {name!r} is sequence-level: it needs batched [B, T] inputs")
    return torch.where(valid, log_r, 0.0).sum(-1, keepdim=True)


def token_tis(log_r: Tensor, valid: Tensor, cap: float, low: float | None, high: float | None) -> Correction:
    """w = min(r, C): today's truncated IS (docs/math.md §5)."""
    raw = _token_ratio(log_r)
    return Correction(raw.clamp(max=cap), raw, torch.ones_like(valid))


def seq_tis(log_r: Tensor, valid: Tensor, cap: float, low: float | None, high: float | None) -> Correction:
    """w_t = min(ρ, C) for every token of the sequence, ρ = exp(min(Σ_t log r_t, 20)) over its response."""
    rho = _sequence(log_r, valid, "seq_tis").clamp(max=LOG_RATIO_MAX).exp().expand_as(log_r)  # [B, T]
    return Correction(rho.clamp(max=cap), rho, torch.ones_like(valid))


def token_mis(log_r: Tensor, valid: Tensor, cap: float, low: float | None, high: float | None) -> Correction:
    """Keep iff r ∈ [low, high]; w = min(r, C)."""
    raw = _token_ratio(log_r)
    return Correction(raw.clamp(max=cap), raw, _in_band(raw, low, high))


def seq_mis(log_r: Tensor, valid: Tensor, cap: float, low: float | None, high: float | None) -> Correction:
    """Keep a sequence iff ρ ∈ [low, high]; w = min(ρ, C)."""
    rho = _sequence(log_r, valid, "seq_mis").clamp(max=LOG_RATIO_MAX).exp().expand_as(log_r)  # [B, T]
    return Correction(rho.clamp(max=cap), rho, _in_band(rho, low, high))


def icepop(log_r: Tensor, valid: Tensor, cap: float, low: float | None, high: float | None) -> Correction:
    """Keep iff r ∈ [low, high]; w = 1: IcePop masks the mismatch and never reweights by it."""
    one = torch.ones_like(log_r)
    return Correction(one, one, _in_band(_token_ratio(log_r), low, high))


def geo_mask(log_r: Tensor, valid: Tensor, cap: float, low: float | None, high: float | None) -> Correction:
    """Keep a sequence iff exp(mean_t log r_t) over its response ∈ [low, high]; w = min(r, C) per token.
    A sequence without response tokens has mean 0 (ratio 1); its tokens are padding anyway."""
    n = valid.sum(-1, keepdim=True).clamp_min(1)  # [B, 1]
    geo = (_sequence(log_r, valid, "geo_mask") / n).exp()  # [B, 1]; −inf sums give 0
    raw = _token_ratio(log_r)
    return Correction(raw.clamp(max=cap), raw, _in_band(geo, low, high).expand_as(log_r))


# MaskConfig.correction → its function, looked up once per call (STYLE.md §3).
CORRECTIONS: dict[str, CorrectionFn] = {
    "token_tis": token_tis,
    "seq_tis": seq_tis,
    "token_mis": token_mis,
    "seq_mis": seq_mis,
    "icepop": icepop,
    "geo_mask": geo_mask,
}


def rollout_correction(
    log_ratio: Tensor,  # [N] or [B, T] log π_a − log μ_a, detached
    valid: Tensor,  # bool like log_ratio: response tokens
    *,
    name: str = "token_tis",
    is_cap: float = 10.0,
    low: float | None = None,
    high: float | None = None,
) -> Correction:
    """The correction `name` (MaskConfig.correction) on these tokens (docs/math.md §9)."""
    if name not in CORRECTIONS:
        raise ValueError(f"correction={name!r}; expected one of {tuple(CORRECTIONS)}")
    with torch.no_grad():
        return CORRECTIONS[name](log_ratio.detach(), valid.to(torch.bool), is_cap, low, high)
