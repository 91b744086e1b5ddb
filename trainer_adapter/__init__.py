"""maskroll.trainer_adapter: trust-region masks and the policy loss on the learner (docs/math.md).

Divergences between the rollout's behaviour policy μ (top-K logprobs from the engine) and the training
policy π, PPO / DPPO / predictive masks, the truncated-IS loss, diagnostics and collation. Imports torch
and numpy only: nothing here knows about gRPC, Redis or the engines.
"""

from .collate import Batch, SemanticsError, collate, group_advantages
from .config import MaskConfig
from .logprobs import token_logprobs
from .loss import policy_loss
from .masks import MaskResult, compute_masks
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

__all__ = [
    "Batch",
    "MaskConfig",
    "MaskResult",
    "SemanticsError",
    "VocabStats",
    "collate",
    "compute_masks",
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
    "token_logprobs",
]
