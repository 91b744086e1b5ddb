"""GRPOConfig: the one validated configuration of the GRPO recipe (`grpo.train`, `trl_grpo.train`).

Kept apart from grpo.py so that a command line can be parsed and checked (`maskroll demo`) before torch,
gRPC and Redis are imported; it imports only the mask's own config. The mask is nested, not restated:
`GRPOConfig(steps=50, mask=MaskConfig(method="dppo", delta=0.1))`; LoRA likewise:
`GRPOConfig(lora=LoraConfig(lora_rank=8))`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from maskroll.trainer_adapter.config import MaskConfig


@dataclass(frozen=True)
class LoraConfig:
    """LoRA training (PEFT's `get_peft_model`): only the adapters train, and only they are published (a
    few MB per version instead of the model). The fields are named as TRL's ModelConfig names them.

    lora_rank: LoRA rank r of every adapted Linear; 0 trains the full model (LoRA off). The replicas must be
        started with --max-lora-rank >= r
    lora_alpha: LoRA alpha (the update is scaled by alpha / r); unset: 2 × rank
    lora_dropout: dropout on the adapters' input during training
    lora_target_modules: the Linear modules adapted, by their short names (PEFT's target_modules)
    """

    lora_rank: int = 0
    lora_alpha: float | None = None
    lora_dropout: float = 0.0
    lora_target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")

    def __post_init__(self) -> None:
        r = self.lora_rank
        if not (isinstance(r, int) and not isinstance(r, bool) and 0 <= r <= 512):
            raise ValueError(f"LoraConfig.lora_rank={r!r}; expected an int in [0, 512] (0 = LoRA off)")
        a = self.lora_alpha
        if a is not None and not (isinstance(a, (int, float)) and math.isfinite(a) and a > 0):
            raise ValueError(
                f"LoraConfig.lora_alpha={a!r}; expected a finite number > 0 (or unset: 2 × rank)"
            )
        if not (isinstance(self.lora_dropout, (int, float)) and 0.0 <= self.lora_dropout < 1.0):
            raise ValueError(f"LoraConfig.lora_dropout={self.lora_dropout!r}; expected a number in [0, 1)")
        targets = self.lora_target_modules
        if isinstance(targets, str) or not all(isinstance(t, str) and t for t in targets) or not targets:
            raise ValueError(
                f"LoraConfig.lora_target_modules={targets!r}; expected names like ('q_proj', 'v_proj')"
            )
        object.__setattr__(self, "lora_target_modules", tuple(targets))  # a list read back from JSON

    @property
    def enabled(self) -> bool:
        return self.lora_rank > 0

    @property
    def alpha(self) -> float:
        """lora_alpha, or 2 × rank when unset."""
        return float(self.lora_alpha) if self.lora_alpha is not None else 2.0 * self.lora_rank


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
    lora: LoRA (LoraConfig): train and publish low-rank adapters instead of the full model
    replica_dtype: the replicas' weight dtype (their --dtype; the trainer casts its float32 weights to it
        and pushes them in it): auto = the engine's default (float32 on CPU), the trainer's own dtype sent
    weight_deltas: auto = each version after the first is pushed as a sparse delta on the last to the
        replicas serving it (the stream transport; docs/architecture.md flow 4); off = every version whole
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
    lora: LoraConfig = field(default_factory=LoraConfig)
    replica_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    weight_deltas: Literal["auto", "off"] = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.mask, MaskConfig):
            raise TypeError(f"GRPOConfig.mask must be a MaskConfig, got {type(self.mask).__name__}")
        if not isinstance(self.lora, LoraConfig):
            raise TypeError(f"GRPOConfig.lora must be a LoraConfig, got {type(self.lora).__name__}")
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
        if self.replica_dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(
                f"GRPOConfig.replica_dtype={self.replica_dtype!r}; expected auto, float32 or bfloat16"
            )
        if self.weight_deltas not in ("auto", "off"):
            raise ValueError(f"GRPOConfig.weight_deltas={self.weight_deltas!r}; expected auto or off")
        # temperature: SamplingOptions applies the one rule for it (maskroll.proto.sampling) when train starts
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr >= 0):
            raise ValueError(f"GRPOConfig.lr={self.lr!r}; expected a finite number >= 0")

    @property
    def batch_size(self) -> int:
        return self.prompts_per_step * self.n
