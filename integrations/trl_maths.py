"""The TRL adapter's maths as plain functions: GRPO advantages exactly as TRL computes them, maskroll's
loss on a collated generation batch, micro-batches that drop no row (the completion logits are the
recipe's too: `trainer_adapter.forward`).
`MaskrollGRPOTrainer` (trl.py) calls them; they are tested alone (tests/integrations/test_trl.py).
"""

from __future__ import annotations

import itertools
import warnings

import torch

from maskroll.trainer_adapter import MaskConfig, MaskResult, compute_masks_for, policy_loss, token_logprobs
from maskroll.trainer_adapter.distributed import World

with warnings.catch_warnings():
    # TRL warns at import about the vLLM version installed next to it; generation never uses TRL's vLLM.
    warnings.filterwarnings("ignore", message="TRL currently supports vLLM", category=UserWarning)
    from trl.trainer.utils import nanstd

Tensor = torch.Tensor


def trl_advantages(
    rewards_per_func: Tensor,  # [B, F], nan where a reward function did not apply
    weights: Tensor,  # [F]
    num_generations: int,
    scale_rewards: str,
    multi_objective_aggregation: str,
) -> tuple[Tensor, Tensor, Tensor]:  # advantages [B], rewards [B], std == 0 [B]
    """GRPO advantages exactly as TRL 1.16's `_generate_and_score_completions` computes them."""
    g = num_generations
    unscorable = torch.isnan(rewards_per_func).all(dim=1)  # [B]
    if multi_objective_aggregation == "sum_then_normalize":
        rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
        rewards[unscorable] = torch.nan
        mean = torch.nanmean(rewards.view(-1, g), dim=1).repeat_interleave(g)
        if scale_rewards in ("group", "none"):
            std = (
                nanstd(rewards.view(-1, g), dim=1).repeat_interleave(g)
                if g > 1
                else torch.zeros_like(rewards)
            )
        elif scale_rewards == "batch":
            std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
        else:
            raise ValueError(f"scale_rewards={scale_rewards!r}; expected 'batch', 'group' or 'none'")
        adv = rewards - mean
        if scale_rewards != "none":
            adv = adv / (std + 1e-4)
    elif multi_objective_aggregation == "normalize_then_sum":
        grouped = rewards_per_func.view(-1, g, rewards_per_func.shape[1])
        mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
        std_k = nanstd(grouped, dim=1, keepdim=True) if g > 1 else torch.zeros_like(mean_k)
        reward_k = ((grouped - mean_k) / (std_k + 1e-4)).view(-1, rewards_per_func.shape[1])
        rewards = (reward_k * weights.unsqueeze(0)).nansum(dim=1)
        rewards[unscorable] = torch.nan
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
        adv = (rewards - torch.nanmean(rewards)) / (std + 1e-4)
    else:
        raise ValueError(f"multi_objective_aggregation={multi_objective_aggregation!r}")
    return torch.nan_to_num(adv, nan=0.0), rewards, torch.isclose(std, torch.zeros_like(std))


def maskroll_loss(
    logits: Tensor,  # [B, T, V] logits that predict completion_ids, with grad
    batch: dict[str, Tensor],  # the collated records (MaskrollGRPOTrainer's generation output)
    *,
    mask: MaskConfig,
    is_cap: float,
    aggregation: str,
    max_len: int,
    top_k: int | None = None,
    top_p: float | None = None,
    beta: float = 0.0,
    bias_correction_kl: bool = True,
    world: World | None = None,
) -> tuple[Tensor, dict[str, Tensor], MaskResult]:
    """Scalar loss, detached metrics and the masks: `policy_loss` (docs/math.md §5) on
    `compute_masks` (§3–§4), with TRL's β · k3 KL to the reference (`batch["ref_logprobs"]`) as its KL
    term: TRL's use_bias_correction_kl weights it by π_a/μ_a, μ (the rollout) as the old policy.
    world: the data-parallel ranks (a collective: every rank calls this), whose global batch the
    aggregation normalises over (docs/math.md "Across ranks"); None: this batch is the whole batch."""
    temp = batch["temperature"]  # [B]
    lp, stats = token_logprobs(
        logits, batch["completion_ids"], temperature=temp, top_k=top_k, top_p=top_p, return_stats=True
    )  # [B, T]
    res = compute_masks_for(batch, logits.detach(), config=mask, top_k=top_k, top_p=top_p, vocab_stats=stats)
    loss, metrics = policy_loss(
        lp,
        batch["sampled_logprobs"],
        batch["advantages"],
        res.keep,
        is_cap=is_cap,
        aggregation=aggregation,
        max_len=max_len,
        masks=res,
        config=mask,  # its rollout correction (MaskConfig.correction, docs/math.md §9)
        ref_logprobs=batch["ref_logprobs"] if beta != 0.0 else None,
        kl_coef=beta,
        kl_is_weight=bias_correction_kl,
        world=world,
    )
    return loss, metrics, res


def split_rows(batch: dict[str, Tensor], chunks: int) -> list[dict[str, Tensor]]:
    """A generation batch → `chunks` micro-batches, every row in exactly one (sizes differ by at most one;
    0-d entries go to every chunk). TRL's split_tensor_dict cuts equal chunks and drops the remainder:
    with several processes a rank's share is whole groups balanced by tokens, not a multiple of chunks."""
    n = next(v for v in batch.values() if v.dim() > 0).shape[0]
    if n < chunks:
        raise ValueError(f"{n} rows cannot fill {chunks} micro-steps (steps_per_generation)")
    bounds = [n * i // chunks for i in range(chunks + 1)]
    return [
        {k: v[a:b] if v.dim() > 0 else v for k, v in batch.items()} for a, b in itertools.pairwise(bounds)
    ]
