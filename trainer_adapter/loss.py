"""policy_loss: the truncated-IS policy-gradient loss with a token mask, an optional KL-to-reference term,
and its metrics (docs/math.md §5).

ℓ_token = −A · w · M · log π_a,  w = min(exp(min(log π_a − log μ_a, 20)), C); w and M are constants.
With `ref_logprobs`: + β · r · k3, k3 = π_ref/π_a − log(π_ref/π_a) − 1, r = π_a/μ_a (with gradient).

`token_loss` is ℓ_token alone, for a trainer that aggregates itself (verl's `agg_loss` across ranks);
`policy_loss` aggregates it by one of `AGGREGATIONS`, adds the KL term and reports the metrics.
With a `MaskConfig`, its rollout correction (`corrections`, docs/math.md §9) sets w and ands its mask
into M; without one, w is the token-level truncated IS above (`token_tis`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal, NamedTuple

import torch

from .config import MaskConfig
from .corrections import rollout_correction
from .distributed import World
from .inputs import check_shape, per_token
from .masks import MaskResult

Tensor = torch.Tensor
Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]


def _mean(x: Tensor, where: Tensor) -> Tensor:
    """Mean of x over `where`; nan over an empty set (an honest "no such tokens")."""
    return torch.where(where > 0, x * where, 0.0).sum() / where.sum()


# ---- aggregations (docs/math.md §5, "Across ranks"): per-token values, 0 off `valid`, → a scalar ------


def _normalise(total: Tensor, count: Tensor, world: World | None) -> Tensor:
    """total / count, this rank's; with `world`, W · total / (count summed over the ranks): the one place
    the denominator is chosen. The W cancels the 1/W of the gradient averaging that DDP, FSDP2 and
    accelerate do, so W ranks step exactly as one rank on the union of their records (docs/math.md
    "Across ranks"). The count is a constant (detached) either way, and summed as an integer: exact at
    any size, and the loss keeps total's dtype."""
    if world is None:
        return total / count.clamp_min(1)
    return world.world_size * total / world.sum(count).clamp_min(1)


def _token_mean(per_tok: Tensor, valid: Tensor, max_len: int | None, world: World | None = None) -> Tensor:
    return _normalise(per_tok.sum(), valid.sum(), world)


def _seq_mean(
    per_tok: Tensor, valid: Tensor, max_len: int | None, world: World | None, *, sum_norm: bool
) -> Tensor:
    if per_tok.dim() != 2:
        raise ValueError("sequence aggregations need batched [B, T] inputs")
    if sum_norm and world is not None and max_len is None:
        # The default L = T is this rank's padded length: it differs between ranks, and between a rank and
        # one process on all records, so the ranks' step would not be the one-process step.
        raise ValueError(
            "seq_mean_token_sum_norm across ranks needs max_len (one constant L for every rank, e.g. the "
            "generation's max_tokens); the default L = T is this rank's padded length"
        )
    n_tok = valid.sum(-1)  # [B]
    denom = float(max_len or per_tok.shape[-1]) if sum_norm else n_tok.clamp_min(1)
    per_seq = per_tok.sum(-1) / denom  # [B]
    has = n_tok > 0
    return _normalise((per_seq * has).sum(), has.sum(), world)


def _seq_mean_token_mean(p: Tensor, v: Tensor, m: int | None, world: World | None = None) -> Tensor:
    return _seq_mean(p, v, m, world, sum_norm=False)


def _seq_mean_token_sum_norm(p: Tensor, v: Tensor, m: int | None, world: World | None = None) -> Tensor:
    return _seq_mean(p, v, m, world, sum_norm=True)


# aggregation → its function, looked up once per call (STYLE.md §3). Each takes the per-token values
# ([N] or [B, T], 0 off `valid`), the bool `valid`, seq_mean_token_sum_norm's constant and the World (None:
# this process's batch is the whole batch).
AGGREGATIONS: dict[str, Callable[[Tensor, Tensor, int | None, World | None], Tensor]] = {
    "token_mean": _token_mean,
    "seq_mean_token_mean": _seq_mean_token_mean,
    "seq_mean_token_sum_norm": _seq_mean_token_sum_norm,
}


# ---- the per-token policy term ----------------------------------------------------------------------


class TokenLoss(NamedTuple):
    """token_loss's outputs, each shaped like `logprobs`; all but `loss` detached."""

    loss: Tensor  # ℓ_token (× the token weight); 0 where M = 0 or off the response; grad via log π_a only
    is_weight: Tensor  # w, capped at C
    is_weight_raw: Tensor  # exp(min(log π_a − log μ_a, 20)), before the cap
    kept: Tensor  # bool: M ∧ response
    advantages: Tensor  # A per token, in logprobs' dtype
    response_mask: Tensor  # bool
    correction_keep: Tensor  # bool: the correction's own mask (docs/math.md §9); True off the response


def token_loss(
    logprobs: Tensor,  # [N] or [B, T] log π_a, with grad
    sampled_logprobs: Tensor,  # [N] or [B, T] rollout log μ_a
    advantages: Tensor,  # [N], [B, T] or per sequence [B]
    keep: Tensor,  # bool, like logprobs: M
    *,
    is_cap: float = 10.0,
    response_mask: Tensor | None = None,  # bool like logprobs; default all tokens
    token_weights: Tensor | None = None,  # like logprobs, constant: multiplies ℓ_token (verl's rollout IS)
    config: MaskConfig | None = None,  # its rollout correction (docs/math.md §9); None: token_tis
) -> TokenLoss:
    """ℓ_token = −A · w · M · log π_a per token, not aggregated (docs/math.md §5); w and the extra mask of
    `config.correction` (docs/math.md §9)."""
    if not is_cap > 0:
        raise ValueError(f"is_cap={is_cap}; expected > 0")
    lead = logprobs.shape
    check_shape(sampled_logprobs, tuple(lead), "sampled_logprobs")
    check_shape(keep, tuple(lead), "keep")
    valid = torch.ones_like(keep, dtype=torch.bool) if response_mask is None else response_mask.to(torch.bool)
    check_shape(valid, tuple(lead), "response_mask")
    if token_weights is not None:
        check_shape(token_weights, tuple(lead), "token_weights")
    adv = per_token(advantages, lead, "advantages", logprobs.dtype).to(logprobs.device).reshape(lead)

    with torch.no_grad():
        log_ratio = logprobs.detach() - sampled_logprobs.to(logprobs.dtype)
        corr = rollout_correction(
            log_ratio,
            valid,
            name=config.correction if config is not None else "token_tis",
            is_cap=is_cap,
            low=config.correction_low if config is not None else None,
            high=config.correction_high if config is not None else None,
        )
        raw_w, w = corr.raw_weight, corr.weight
        m = keep.to(torch.bool) & valid & corr.keep
        coef = adv * w * m  # like logprobs
        if token_weights is not None:
            coef = coef * token_weights.to(logprobs.dtype)
    # where() rather than a product: a masked token may carry log π_a = −inf (truncated by replay).
    per_tok = -coef * torch.where(coef != 0, logprobs, torch.zeros_like(logprobs))
    return TokenLoss(per_tok, w, raw_w, m, adv, valid, corr.keep | ~valid)


# ---- the KL-to-reference term -----------------------------------------------------------------------


def ref_kl(
    logprobs: Tensor,  # [N] or [B, T] log π_a, with grad
    ref_logprobs: Tensor,  # like logprobs: log π_ref(a), constant
    sampled_logprobs: Tensor,  # like logprobs: log μ_a
    valid: Tensor,  # bool like logprobs: response tokens
    *,
    is_weight: bool = True,
) -> tuple[Tensor, Tensor]:  # per token r · k3 (0 where not counted), bool: counted
    """The k3 estimate of KL(π‖π_ref) per token, times r = π_a/μ_a if `is_weight` (docs/math.md §5).

    Counted: response tokens where it is finite (a replayed truncation may leave log π_a = −inf); the
    others are 0 with a zero, not nan, gradient.
    """

    def k3(lp: Tensor, ref: Tensor, mu: Tensor) -> Tensor:
        d = ref - lp  # log(π_ref / π_a)
        kl = torch.exp(d) - d - 1
        return kl * torch.exp(lp - mu) if is_weight else kl

    with torch.no_grad():
        counted = valid & torch.isfinite(k3(logprobs, ref_logprobs, sampled_logprobs))
    # Evaluated on inputs zeroed outside `counted`: where() after an infinite exp() would backpropagate
    # 0 · inf = nan into log π_a.
    safe = (torch.where(counted, t, torch.zeros_like(t)) for t in (logprobs, ref_logprobs, sampled_logprobs))
    kl = k3(*safe)
    return torch.where(counted, kl, 0.0), counted


# ---- policy_loss ------------------------------------------------------------------------------------


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
    ref_logprobs: Tensor | None = None,  # like logprobs: log π_ref(a); adds the KL term and `ref_kl`
    kl_coef: float = 0.0,  # β of the KL term
    kl_is_weight: bool = True,  # the KL term's r = π_a/μ_a (TRL's use_bias_correction_kl)
    config: MaskConfig | None = None,  # its rollout correction (docs/math.md §9); None: token_tis
    world: World | None = None,  # the trainer ranks (distributed.torch_world()); None: this batch is all
) -> tuple[Tensor, dict[str, Tensor]]:
    """Scalar loss and a dict of 0-dim detached metric tensors (docs/math.md §5).

    With `ref_logprobs`: + kl_coef · (r · k3 aggregated by `aggregation` over the tokens where it is
    finite), and the metric `ref_kl`, its mean over those tokens.

    With `world` (W data-parallel ranks, each calling this on its share of the global batch): every
    aggregation's denominator is the global one, summed over the ranks — response tokens for
    token_mean, sequences with a response token for the sequence means, the KL term's own count — and
    the loss is W · (this rank's sum) / (global denominator), so that after the gradient *averaging* of
    DDP, FSDP2 or accelerate the W ranks take exactly the step one process takes on all their records
    (docs/math.md "Across ranks"). seq_mean_token_sum_norm then needs `max_len`. Each call is one or two
    collectives (`world.sum`): every rank must call it with the same options, an empty share included.
    The metrics stay this rank's (means over its own tokens), not global ones.
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation={aggregation!r}; expected one of {tuple(AGGREGATIONS)}")
    if not math.isfinite(kl_coef):
        raise ValueError(f"kl_coef={kl_coef}; expected a finite number")
    if kl_coef != 0.0 and ref_logprobs is None:
        raise ValueError(f"kl_coef={kl_coef} needs ref_logprobs (log π_ref of the sampled tokens)")
    aggregate = AGGREGATIONS[aggregation]
    if response_mask is None and masks is not None:
        response_mask = masks.response_mask
    t = token_loss(
        logprobs,
        sampled_logprobs,
        advantages,
        keep,
        is_cap=is_cap,
        response_mask=response_mask,
        config=config,
    )
    valid, w, raw_w, m, adv = t.response_mask, t.is_weight, t.is_weight_raw, t.kept, t.advantages
    loss = aggregate(t.loss, valid, max_len, world)
    if ref_logprobs is not None:
        check_shape(ref_logprobs, tuple(logprobs.shape), "ref_logprobs")
        kl, counted = ref_kl(logprobs, ref_logprobs, sampled_logprobs, valid, is_weight=kl_is_weight)
        loss = loss + kl_coef * aggregate(kl, counted, max_len, world)

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
            "correction_mask_frac": _mean((~t.correction_keep).to(w.dtype), vf),
        }
        if ref_logprobs is not None:
            metrics["ref_kl"] = kl.detach().sum() / counted.sum().clamp_min(1)
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
