"""maskroll.trainer_adapter: trust-region masks and the policy loss on the learner (docs/math.md).

Divergences between the rollout's behaviour policy μ (top-K logprobs from the engine) and the training
policy π, PPO / DPPO / predictive masks, the truncated-IS loss (with its KL-to-reference term and the
rollout corrections), distillation from a teacher's top-K, diagnostics and collation. Imports torch,
numpy and the stdlib-pure sampling rule of `maskroll.proto.sampling` only: nothing here knows about
gRPC, Redis or the engines.
"""

from .collate import Batch, SemanticsError, collate, group_advantages
from .config import MaskConfig
from .corrections import CORRECTIONS, rollout_correction
from .distill import StudentLogprobs, distill_advantages, distill_loss, student_logprobs
from .distributed import TorchCollective, World, single_process, torch_world
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
    "CORRECTIONS",
    "Batch",
    "MaskConfig",
    "MaskResult",
    "SemanticsError",
    "StudentLogprobs",
    "TokenLoss",
    "TorchCollective",
    "VocabStats",
    "World",
    "collate",
    "compute_masks",
    "compute_masks_for",
    "direction_agreement",
    "distill_advantages",
    "distill_loss",
    "full_kl",
    "full_kl_direction",
    "full_rkl",
    "full_rkl_direction",
    "full_tv",
    "full_tv_direction",
    "group_advantages",
    "policy_loss",
    "processed_logprobs",
    "rollout_correction",
    "sampled_token_masks",
    "single_process",
    "student_logprobs",
    "token_logprobs",
    "token_loss",
    "torch_world",
]
