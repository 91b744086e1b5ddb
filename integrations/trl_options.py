"""What MaskrollGRPOTrainer adds to TRL's GRPOConfig (`MaskrollConfig`) and what it refuses, by name.

TRL's options whose meaning maskroll replaces or cannot honour are refused at construction
(`UnsupportedOption`, the reasons from `refusals`), never ignored; TRL's `loss_type` chooses one of
maskroll's aggregations (`LOSS_TYPES`). Plain data and checks: importing this module loads neither torch
nor TRL (`refusals` imports TRL's GRPOConfig when it is called).
"""

from __future__ import annotations

import math
import os
import typing
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Literal

from maskroll.client.runs import RunMode
from maskroll.trainer_adapter.config import MaskConfig
from maskroll.weight_sync import CpuTransport

if TYPE_CHECKING:
    from trl import GRPOConfig

# TRL loss_type → how maskroll's per-token loss is aggregated (TRL's normalisations, docs/integrations.md).
LOSS_TYPES = {
    "dapo": "token_mean",  # then rescaled to the generation batch's token count, as TRL does
    "bnpo": "token_mean",
    "grpo": "seq_mean_token_mean",
    "dr_grpo": "seq_mean_token_sum_norm",
}


class UnsupportedOption(ValueError):
    """A TRL option MaskrollGRPOTrainer would otherwise have to ignore."""


@dataclass(frozen=True)
class MaskrollConfig:
    """What MaskrollGRPOTrainer adds to TRL's GRPOConfig.

    redis_url / namespace: the queue the pull-mode replicas serve (`maskroll serve --pull`); a URL of any
        node of a Redis Cluster works. partitions: the namespace's partitions (the replicas'
        `--partitions`; docs/scaling.md).
    run: "new" starts a new training run on the namespace, "resume" continues its current run (the
        model is loaded from the run's latest checkpoint); None starts one only on an empty namespace.
    replicas: "host:port" of replicas to call directly over gRPC, used when `redis_url` is None.
    weight_transport: how each new policy version reaches the replicas. "stream" (queue mode only):
        PushWeights over gRPC, no shared filesystem; `weights_root`, if given, is only the trainer's own
        copy for resuming. "directory": a checkpoint under `weights_root`, which must be the directory
        the replicas were started with as `--weights-root` (a shared volume across machines). Default:
        "stream" with redis_url, "directory" with direct gRPC addresses (a push needs the run's registry).
    weights_root: see weight_transport.
    weight_deltas: with the stream transport, "auto" pushes each version after the first as a sparse
        delta on the last, in the replicas' dtype, checked by digest on arrival (docs/architecture.md flow
        4); "off" pushes every version whole.
    mask: the trust-region mask (method, divergence, estimator, δ); its top-K divergences use the
        records' top-K logprobs.
    logprobs_k: K top-K logprobs per sampled token (the replicas' `--max-logprobs` bounds it).
    max_staleness: generation may run this many policy versions ahead of the optimiser.
    publish_every: optimiser steps per published policy version.
    is_cap: the truncated-IS cap C of maskroll's policy loss (docs/math.md §5).
    generation_timeout_s: how long one generation batch may take before the trainer gives up.
    min_replicas: replicas that must be registered before training starts (queue mode).
    token / root_certs: the replicas' bearer token and TLS roots (PEM).
    direction_diagnostics: after each optimiser step, score each rule's predicted direction of D
        against the realised change on the last micro-batch (`maskroll/agree_*`; one more forward).
    rewards_from_records: leave scoring to the reward stage (`maskroll reward`, `maskroll serve --reward`;
        queue mode): jobs go through it, records arrive scored, and their reward is one more TRL reward
        function, `record_reward` (last, after any `reward_funcs` given, which keep working as before;
        `reward_weights` then has one weight per function, record_reward's last). The dataset's scalar
        columns travel to the stage as the job's metadata (e.g. the reference answer).
    resume_from_base: with run="resume" and the stream transport, when `weights_root` holds no copy of
        the run's current version N: publish the model as a new version N + 1 instead of refusing
        (the default refuses: the model is not version N, and calling it so would be a silent mismatch).
    """

    redis_url: str | None = None
    namespace: str = "default"
    partitions: int = 1
    run: RunMode | None = None
    replicas: tuple[str, ...] = ()
    weight_transport: CpuTransport | None = None
    weights_root: str | os.PathLike | None = None
    weight_deltas: Literal["auto", "off"] = "auto"
    mask: MaskConfig = field(default_factory=MaskConfig)
    logprobs_k: int = 20
    max_staleness: int = 1
    publish_every: int = 1
    is_cap: float = 10.0
    generation_timeout_s: float = 600.0
    min_replicas: int = 1
    token: str | None = None
    root_certs: bytes | None = None
    direction_diagnostics: bool = False
    resume_from_base: bool = False
    rewards_from_records: bool = False

    def publisher_options(self, held: tuple[str, int] | None) -> dict[str, Any]:
        """make_publisher's keywords of this transport beyond the common ones: the stream's resume rule,
        what the model holds (`held`, an earlier publisher's) and deltas."""
        if self.weight_transport != "stream":
            return {}
        return {"resume_from_base": self.resume_from_base, "held": held, "deltas": self.weight_deltas}

    def __post_init__(self) -> None:
        if self.redis_url is None and not self.replicas:
            raise ValueError(
                "MaskrollConfig needs redis_url (queue mode) or replicas (direct gRPC addresses)"
            )
        if self.weight_transport is None:  # frozen: set the default as the field's value
            object.__setattr__(self, "weight_transport", "stream" if self.redis_url else "directory")
        if self.weight_transport not in typing.get_args(CpuTransport):
            raise ValueError(
                f"MaskrollConfig.weight_transport={self.weight_transport!r}; expected 'stream' or 'directory'"
            )
        if self.weight_deltas not in ("auto", "off"):
            raise ValueError(f"MaskrollConfig.weight_deltas={self.weight_deltas!r}; expected 'auto' or 'off'")
        if self.weight_transport == "stream" and self.redis_url is None:
            raise ValueError(
                "MaskrollConfig.weight_transport='stream' needs redis_url: the push goes to the replicas of "
                "the queue's registry; with direct gRPC addresses use weight_transport='directory'"
            )
        if self.rewards_from_records and self.redis_url is None:
            raise ValueError(
                "MaskrollConfig.rewards_from_records=True needs redis_url: the reward stage reads the "
                "queue's finished records"
            )
        if self.weight_transport == "directory" and self.weights_root is None:
            raise ValueError(
                "MaskrollConfig.weights_root is required with weight_transport='directory': the directory "
                "the replicas were started with as --weights-root, where each new policy version is written "
                "for them to load"
            )
        if not isinstance(self.mask, MaskConfig):
            raise TypeError(f"MaskrollConfig.mask must be a MaskConfig, got {type(self.mask).__name__}")
        for name, low in (
            ("logprobs_k", 1),
            ("max_staleness", 0),
            ("publish_every", 1),
            ("min_replicas", 1),
            ("partitions", 1),
        ):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= low):
                raise ValueError(f"MaskrollConfig.{name}={value!r}; expected an int >= {low}")
        for name in ("is_cap", "generation_timeout_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"MaskrollConfig.{name}={value!r}; expected a finite number > 0")


# ---- what is refused, and why -----------------------------------------------------------------------

_GEN = "generation runs on the maskroll replicas, which sample with temperature, top_p and top_k only"
_LOSS = "maskroll's trust-region mask and truncated IS replace TRL's clipped objective"
# GRPOConfig fields that must keep TRL's default, with the reason and what to use instead.
_MUST_BE_DEFAULT = {
    "use_vllm": _GEN + " (start the replicas with `maskroll serve --engine vllm`)",
    "use_transformers_continuous_batching": _GEN,
    "min_p": _GEN,
    "repetition_penalty": _GEN,
    "generation_kwargs": _GEN,
    "epsilon": _LOSS + ": set MaskConfig(method='ppo', eps_low=...) or MaskConfig(delta=...)",
    "epsilon_high": _LOSS + ": set MaskConfig(method='ppo', eps_high=...)",
    "delta": _LOSS + ": the IS cap is MaskrollConfig.is_cap",
    "importance_sampling_level": _LOSS + ": masks and IS weights are per token",
    "off_policy_mask_threshold": _LOSS + ": the mask is MaskrollConfig.mask",
    "top_entropy_quantile": _LOSS,
    "entropy_coef": "the entropy bonus is not part of maskroll's loss",
    "use_adaptive_entropy": "the entropy bonus is not part of maskroll's loss",
    "max_tool_calling_iterations": "tool calling is not supported",
}
_CTOR_REFUSED = {
    "tools": "tool calling is not supported",
    "rollout_func": "generation is maskroll's (MaskrollConfig)",
    "environment_factory": "environments are not supported",
}


def _peft_kind(peft_config: Any) -> str:
    kind = getattr(peft_config, "peft_type", None)
    return str(getattr(kind, "value", kind))  # PeftType is a str Enum: its value, "LORA"


def peft_refusals(peft_config: Any, config: MaskrollConfig, *, peft_model: bool = False) -> list[str]:
    """Why a LoRA run — `peft_config` given (TRL wraps the model) or a PeftModel as the model — cannot train
    with `config` (empty: it can). The replicas apply LoRA adapters on their base, sent by PushWeights;
    which LoRA options they apply is checked on the wrapped model (`weight_sync.lora.adapter_of`)."""
    if peft_config is None and not peft_model:
        return []
    out = []
    kind = _peft_kind(peft_config)
    if peft_config is not None and kind != "LORA":
        out.append(
            f"peft_config: a {type(peft_config).__name__} (peft_type {kind}); the replicas apply LoRA "
            "adapters only (peft.LoraConfig)"
        )
    if config.weight_transport != "stream":
        what = "peft_config" if peft_config is not None else "model: a PeftModel"
        out.append(
            f"{what} with weight_transport={config.weight_transport!r}: an adapter reaches the replicas by "
            "PushWeights only (the stream transport: redis_url and weight_transport='stream')"
        )
    return out


def refusals(args: GRPOConfig | None, mask: MaskConfig, **ctor: Any) -> list[str]:
    """Every reason to refuse this configuration, each naming the option (empty: supported)."""
    out = [f"{name}: {why}" for name, why in _CTOR_REFUSED.items() if ctor.get(name) not in (None, [], {})]
    if args is None:
        return out
    from trl import GRPOConfig

    defaults = {f.name: f.default for f in fields(GRPOConfig)}
    for name, why in _MUST_BE_DEFAULT.items():
        if name in defaults and getattr(args, name) != defaults[name]:
            out.append(f"{name}={getattr(args, name)!r}: {why}")
    if args.loss_type not in LOSS_TYPES:
        out.append(
            f"loss_type={args.loss_type!r}: a different policy objective; {_LOSS}. The loss types that "
            f"choose maskroll's aggregation are {sorted(LOSS_TYPES)}"
        )
    if (args.top_k or args.top_p < 1.0) and not mask.replay_truncation:
        out.append(
            f"top_k={args.top_k}, top_p={args.top_p}: truncated sampling renormalises μ over the kept set; "
            "set MaskConfig(replay_truncation=True) to replay it on π (docs/math.md §6)"
        )
    return out
