"""maskroll's trust-region masks as verl policy losses (`actor.policy_loss.loss_mode=maskroll_...`).

Importing this module registers, with verl's `register_policy_loss`:

    maskroll_ppo                                  ratio clip as a mask (docs/math.md §3)
    maskroll_dppo_kl, maskroll_dppo_tv            D(μ, π) > δ and the ratio direction
    maskroll_predictive_kl, maskroll_predictive_tv D(μ, π) > δ and the predicted direction P̂
    maskroll_dppo, maskroll_predictive            the binary-KL variants under short names

Each takes verl's call (old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
rollout_is_weights) and returns (loss, metrics) the way verl's own losses do: the masks of the trainer
adapter's `sampled_token_masks` (docs/math.md §3), its per-token loss −A · w · M · log π_a (`token_loss`,
§5) times the rollout IS weights, aggregated by verl's `agg_loss` with the actor's global batch info (the
normalisation across data-parallel ranks is verl's); `actor/pg_clipfrac` is the masked fraction,
`actor/pg_clipfrac_lower` the fraction at the IS cap, `actor/ppo_kl` as verl computes it, plus
`actor/maskroll/*`.

verl hands a policy loss sampled-token logprobs only, so only the binary divergences are possible:
μ_a is `old_log_prob` (the rollout's, or the policy before the update, as verl's rollout correction
decides). For binary divergences the predicted direction has the sign of π_a − μ_a (docs/math.md §4),
so `maskroll_predictive_*` masks exactly like `maskroll_dppo_*`; the top-K divergences need the
records' top-K tensors in verl's batch (docs/integrations.md says what to patch).

Thresholds, read from the actor config: δ_low / δ_high (ε for maskroll_ppo) from
`policy_loss.maskroll_delta_low/_high` (or `maskroll_delta`) where the policy_loss section carries them
(a DictConfig), else verl's own DPPO convention `clip_ratio_low` / `clip_ratio_high` (falling back to
`clip_ratio`); the IS cap C from `policy_loss.maskroll_is_cap`, else `clip_ratio_c`. The rollout
correction (docs/math.md §9) by name from `policy_loss.maskroll_correction` (token_tis, seq_tis,
token_mis, seq_mis, icepop, geo_mask; default token_tis) with its band from
`policy_loss.maskroll_correction_low/_high`; it acts on r = π_a/μ_a with μ_a = `old_log_prob`, on top of
verl's own `rollout_is_weights` (leave verl's rollout_corr off when choosing one here: both would apply).
Load it in every Ray worker with `VERL_USE_EXTERNAL_MODULES=maskroll.integrations.verl`.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from verl.trainer.ppo.core_algos import agg_loss, register_policy_loss

from maskroll.trainer_adapter import MaskConfig, sampled_token_masks, token_loss

Tensor = torch.Tensor

# loss mode → (method, divergence); the divergence only matters for dppo / predictive.
LOSS_MODES: dict[str, tuple[str, str]] = {
    "maskroll_ppo": ("ppo", "binary_kl"),
    "maskroll_dppo_kl": ("dppo", "binary_kl"),
    "maskroll_dppo_tv": ("dppo", "binary_tv"),
    "maskroll_predictive_kl": ("predictive", "binary_kl"),
    "maskroll_predictive_tv": ("predictive", "binary_tv"),
    "maskroll_dppo": ("dppo", "binary_kl"),
    "maskroll_predictive": ("predictive", "binary_kl"),
}


def _setting(config: Any, name: str, fallback: Any) -> Any:
    """`policy_loss.<name>` if the section carries it, else `fallback`."""
    section = config.get("policy_loss", None) if config is not None else None
    value = section.get(name, None) if section is not None else None
    return fallback if value is None else value


def mask_config(config: Any, method: str, divergence: str) -> tuple[MaskConfig, float]:
    """The MaskConfig and IS cap a verl actor config asks for (see the module docstring)."""
    if config is None:
        raise ValueError("maskroll verl losses need the actor config (thresholds and the IS cap)")
    clip = config.get("clip_ratio", None)
    low = _setting(config, "maskroll_delta_low", _setting(config, "maskroll_delta", None))
    high = _setting(config, "maskroll_delta_high", _setting(config, "maskroll_delta", None))
    low = config.get("clip_ratio_low", None) if low is None else low
    high = config.get("clip_ratio_high", None) if high is None else high
    low, high = (clip if low is None else low), (clip if high is None else high)
    is_cap = float(_setting(config, "maskroll_is_cap", config.get("clip_ratio_c", 10.0)))
    band = {
        "correction": str(_setting(config, "maskroll_correction", "token_tis")),
        "correction_low": _setting(config, "maskroll_correction_low", None),
        "correction_high": _setting(config, "maskroll_correction_high", None),
    }
    band = {k: float(v) if k != "correction" and v is not None else v for k, v in band.items()}
    if method == "ppo":
        cfg = MaskConfig(
            method="ppo", divergence=divergence, eps_low=float(low), eps_high=float(high), **band
        )
    else:
        cfg = MaskConfig(
            method=method, divergence=divergence, delta_low=float(low), delta_high=float(high), **band
        )
    return cfg, is_cap


def _masked_mean(x: Tensor, where: Tensor) -> float:
    return float((x * where).sum() / where.sum().clamp_min(1))


def maskroll_policy_loss(
    old_log_prob: Tensor,  # [B, T] log μ_a
    log_prob: Tensor,  # [B, T] log π_a, with grad
    advantages: Tensor,  # [B, T]
    response_mask: Tensor,  # [B, T]
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Tensor | None = None,  # [B, T]
    *,
    method: str,
    divergence: str,
) -> tuple[Tensor, dict[str, float]]:
    """verl's policy-loss call convention around maskroll's binary-divergence masks and loss (§3–§5)."""
    cfg, is_cap = mask_config(config, method, divergence)
    valid = response_mask.bool()
    res = sampled_token_masks(log_prob, old_log_prob, advantages, config=cfg, response_mask=valid)
    t = token_loss(
        log_prob,
        old_log_prob,
        advantages,
        res.keep,
        is_cap=is_cap,
        response_mask=valid,
        token_weights=rollout_is_weights,
        config=cfg,
    )
    loss = agg_loss(
        loss_mat=t.loss,
        loss_mask=response_mask,
        loss_agg_mode=loss_agg_mode,
        **(config.get("global_batch_info", None) or {}),
    )
    with torch.no_grad():
        lp, lm = log_prob.detach(), old_log_prob.to(log_prob.dtype)
        vf = valid.to(lp.dtype)
        metrics = {
            "actor/pg_clipfrac": _masked_mean((~res.keep).to(lp.dtype), vf),
            "actor/ppo_kl": _masked_mean(lm - lp, vf),
            "actor/pg_clipfrac_lower": _masked_mean((t.is_weight_raw > is_cap).to(lp.dtype), vf),
            "actor/maskroll/far_frac": _masked_mean(res.far.to(lp.dtype), vf),
            "actor/maskroll/divergence_mean": _masked_mean(res.divergence, vf),
            "actor/maskroll/is_weight_mean": _masked_mean(t.is_weight, vf),
            "actor/maskroll/correction_mask_frac": _masked_mean((~t.correction_keep).to(lp.dtype), vf),
        }
    return loss, metrics


for _name, (_method, _divergence) in LOSS_MODES.items():
    register_policy_loss(_name)(partial(maskroll_policy_loss, method=_method, divergence=_divergence))
