"""GRPOConfig: the one validated configuration of the GRPO recipe (`grpo.train`, `trl_grpo.train`).

Kept apart from grpo.py so that a command line can be parsed and checked (`maskroll demo`) before torch,
gRPC and Redis are imported; it imports only the mask's own config. The mask is nested, not restated:
`GRPOConfig(steps=50, mask=MaskConfig(method="dppo", delta=0.1))`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from maskroll.trainer_adapter.config import MaskConfig


@dataclass(frozen=True)
class GRPOConfig:
    """The GRPO recipe's settings: run length, sampling, optimiser, held-out evaluation and the mask.

    steps: training steps (optimiser steps; each one publishes a policy version)
    seed: seed of the prompts, torch and the demo's model
    mask: the trust-region mask (trainer_adapter.MaskConfig: method, divergence, estimator, δ)
    prompts_per_step: prompts per training batch (one GRPO group each)
    n: samples per prompt (GRPO group size)
    max_tokens: completion tokens per sample
    logprobs_k: top-K logprobs the replicas return per sampled token (the top-K divergences use them)
    temperature: sampling temperature of the rollouts
    lr: Adam learning rate
    max_staleness: policy versions generation may run ahead of the optimiser (admission control)
    eval_prompts: held-out prompts scored before and after training
    eval_n: samples per held-out prompt
    """

    steps: int = 30
    seed: int = 0
    mask: MaskConfig = field(default_factory=MaskConfig)
    prompts_per_step: int = 8
    n: int = 8
    max_tokens: int = 16
    logprobs_k: int = 20
    temperature: float = 1.0
    lr: float = 2e-3
    max_staleness: int = 1
    eval_prompts: int = 16
    eval_n: int = 4

    def __post_init__(self) -> None:
        if not isinstance(self.mask, MaskConfig):
            raise TypeError(f"GRPOConfig.mask must be a MaskConfig, got {type(self.mask).__name__}")
        if not (isinstance(self.seed, int) and not isinstance(self.seed, bool)):
            raise ValueError(f"GRPOConfig.seed={self.seed!r}; expected an int")
        for name, low in (
            ("steps", 1),
            ("prompts_per_step", 1),
            ("n", 2),  # a group needs two samples: its advantages are rewards minus the group's mean
            ("max_tokens", 1),
            ("logprobs_k", 0),
            ("max_staleness", 0),
            ("eval_prompts", 1),
            ("eval_n", 1),
        ):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= low):
                raise ValueError(f"GRPOConfig.{name}={value!r}; expected an int >= {low}")
        # temperature: SamplingOptions applies the one rule for it (maskroll.proto.sampling) when train starts
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr >= 0):
            raise ValueError(f"GRPOConfig.lr={self.lr!r}; expected a finite number >= 0")

    @property
    def batch_size(self) -> int:
        return self.prompts_per_step * self.n
