"""maskroll.trainer_adapter: trust-region masks and the policy loss on the learner (docs/math.md).

Divergences between the rollout's behaviour policy μ (top-K logprobs from the engine) and the training
policy π, PPO / DPPO / predictive masks, the truncated-IS loss (with its KL-to-reference term), diagnostics
and collation. Imports torch, numpy and the stdlib-pure sampling rule of `maskroll.proto.sampling` only:
nothing here knows about gRPC, Redis or the engines.
"""

from .collate import Batch, SemanticsError, collate, group_advantages
from .config import MaskConfig
from .logprobs import token_logprobs
from .loss import TokenLoss, policy_loss, token_loss
from .masks import MaskResult, compute_masks, compute_masks_for
from .processed import VocabStats, processed_logprobs
from .reference import (
    direction_agreement,
    full_kl,
    full_kl_direction,
    full_rkl,
    full_rkl_direction,
    full_tv,
    full_tv_direction,
)
from .sampled_masks import sampled_token_masks

__all__ = [
    "Batch",
    "MaskConfig",
    "MaskResult",
    "SemanticsError",
    "TokenLoss",
    "VocabStats",
    "collate",
    "compute_masks",
    "compute_masks_for",
    "direction_agreement",
    "full_kl",
    "full_kl_direction",
    "full_rkl",
    "full_rkl_direction",
    "full_tv",
    "full_tv_direction",
    "group_advantages",
    "policy_loss",
    "processed_logprobs",
    "sampled_token_masks",
    "token_logprobs",
    "token_loss",
]
