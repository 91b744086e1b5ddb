"""policy_loss: the truncated-IS policy-gradient loss with a token mask, and its metrics (docs/math.md §5).

ℓ_token = −A · w · M · log π_a,  w = min(exp(min(log π_a − log μ_a, 20)), C); w and M are constants.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

from .inputs import check_shape, per_token
from .masks import MaskResult

Tensor = torch.Tensor
Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
LOG_RATIO_MAX = 20.0  # keeps exp() finite before the cap applies


def _mean(x: Tensor, where: Tensor) -> Tensor:
    """Mean of x over `where`; nan over an empty set (an honest "no such tokens")."""
    return torch.where(where > 0, x * where, 0.0).sum() / where.sum()


def _token_mean(per_tok: Tensor, valid: Tensor, max_len: int | None) -> Tensor:
    return per_tok.sum() / valid.sum().clamp_min(1)


def _seq_mean(per_tok: Tensor, valid: Tensor, max_len: int | None, *, sum_norm: bool) -> Tensor:
    if per_tok.dim() != 2:
        raise ValueError("sequence aggregations need batched [B, T] inputs")
    n_tok = valid.sum(-1)  # [B]
    denom = float(max_len or per_tok.shape[-1]) if sum_norm else n_tok.clamp_min(1)
    per_seq = per_tok.sum(-1) / denom  # [B]
    has = n_tok > 0
    return (per_seq * has).sum() / has.sum().clamp_min(1)


_AGGREGATIONS: dict[str, Callable[[Tensor, Tensor, int | None], Tensor]] = {
    "token_mean": _token_mean,
    "seq_mean_token_mean": lambda p, v, m: _seq_mean(p, v, m, sum_norm=False),
    "seq_mean_token_sum_norm": lambda p, v, m: _seq_mean(p, v, m, sum_norm=True),
}


def policy_loss(
    logprobs: Tensor,  # [N] or [B, T] log π_a, with grad
    sampled_logprobs: Tensor,  # [N] or [B, T] rollout log μ_a
    advantages: Tensor,  # [N], [B, T] or per sequence [B]
    keep: Tensor,  # bool, like logprobs: M
    *,
    is_cap: float = 10.0,
    aggregation: Aggregation = "token_mean",
    response_mask: Tensor | None = None,  # bool; default: masks.response_mask, else all tokens
    max_len: int | None = None,  # seq_mean_token_sum_norm's constant; default T
    masks: MaskResult | None = None,  # adds divergence / direction / mismatch metrics
) -> tuple[Tensor, dict[str, Tensor]]:
    """Scalar loss and a dict of 0-dim detached metric tensors (docs/math.md §5)."""
    if aggregation not in _AGGREGATIONS:
        raise ValueError(f"aggregation={aggregation!r}; expected one of {tuple(_AGGREGATIONS)}")
    if not is_cap > 0:
        raise ValueError(f"is_cap={is_cap}; expected > 0")
    lead = logprobs.shape
    check_shape(sampled_logprobs, tuple(lead), "sampled_logprobs")
    check_shape(keep, tuple(lead), "keep")
    if response_mask is None and masks is not None:
        response_mask = masks.response_mask
    valid = torch.ones_like(keep, dtype=torch.bool) if response_mask is None else response_mask.to(torch.bool)
    check_shape(valid, tuple(lead), "response_mask")
    adv = per_token(advantages, lead, "advantages", logprobs.dtype).to(logprobs.device).reshape(lead)

    with torch.no_grad():
        log_ratio = (logprobs.detach() - sampled_logprobs.to(logprobs.dtype)).clamp(max=LOG_RATIO_MAX)
        raw_w = log_ratio.exp()
        w = raw_w.clamp(max=is_cap)
        m = keep.to(torch.bool) & valid
        coef = adv * w * m  # [N]
    # where() rather than a product: a masked token may carry log π_a = −inf (truncated by replay).
    selected = coef != 0
    per_tok = -coef * torch.where(selected, logprobs, torch.zeros_like(logprobs))
    loss = _AGGREGATIONS[aggregation](per_tok, valid, max_len)

    with torch.no_grad():
        vf = valid.to(w.dtype)
        masked = (valid & ~m).to(w.dtype)
        metrics = {
            "tokens": vf.sum(),
            "mask_frac": _mean(masked, vf),
            "mask_frac_pos": _mean(masked, vf * (adv > 0)),
            "mask_frac_neg": _mean(masked, vf * (adv < 0)),
            "is_weight_mean": _mean(w, vf),
            "is_weight_max": torch.where(valid, w, 0.0).max() if valid.any() else w.new_tensor(float("nan")),
            "is_weight_capped_frac": _mean((raw_w > is_cap).to(w.dtype), vf),
        }
        if masks is not None:
            a = adv.to(masks.divergence.dtype)
            ratio_away = a * masks.ratio_direction > 0
            pred_away = a * masks.predicted_direction > 0
            disagree = (ratio_away != pred_away).to(vf.dtype)
            far = masks.far.to(vf.dtype)
            metrics.update(
                divergence_mean=_mean(masks.divergence.to(vf.dtype), vf),
                far_frac=_mean(far, vf),
                mismatch_kl=_mean(masks.mismatch_kl.to(vf.dtype), vf),
                mismatch_tv=_mean(masks.mismatch_tv.to(vf.dtype), vf),
                direction_disagreement=_mean(disagree, vf),
                direction_disagreement_far=_mean(disagree, vf * far),
            )
    return loss, metrics
