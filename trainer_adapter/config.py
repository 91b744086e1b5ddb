"""MaskConfig: the one frozen choice of trust-region mask for a training run (docs/math.md §3, §4.1).

Variants are picked here, once, and validated; the hot path only reads the resolved fields.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

Method = Literal["none", "ppo", "dppo", "predictive"]
Divergence = Literal["binary_tv", "binary_kl", "topk_tv", "topk_kl"]
Estimator = Literal["aggregated", "uniform", "proportional"]

# DPPO's typical thresholds (docs/math.md §2): KL δ = 0.05, TV δ = 0.15–0.20.
DEFAULT_DELTA = {"binary_tv": 0.15, "topk_tv": 0.15, "binary_kl": 0.05, "topk_kl": 0.05}


@dataclass(frozen=True)
class MaskConfig:
    """Which mask to apply and its thresholds.

    method: "none" keeps every response token; "ppo" uses the sampled ratio r = π_a/μ_a for both
        tests; "dppo" uses D(μ, π) > δ for proximity and the ratio direction; "predictive" uses
        D(μ, π) > δ and the predicted first-order change P̂ of the same D.
    divergence: the D of the proximity test (and of P̂ for "predictive").
    estimator: the tail-concentration estimator Q̂_T used by P̂ for top-K divergences.
    delta: the trust-region δ; sets delta_low and delta_high together (default per divergence: 0.05 for KL,
        0.15 for TV).
    delta_low / delta_high: δ for tokens with A < 0 / A > 0. Default: 0.05 for KL, 0.15 for TV.
    eps_low / eps_high: PPO clip range (method "ppo" only): masked if r < 1 − eps_low (A < 0) or
        r > 1 + eps_high (A > 0), moving away.
    replay_truncation: replay the record's top-k / top-p truncation on π (docs/math.md §6). When False,
        records sampled with truncation are refused.
    chunk_tokens: tokens processed per full-vocabulary chunk; bounds the extra memory to one
        [chunk_tokens, V] float32 tensor. Results do not depend on it.
    compile: run compute_masks' own vocabulary pass (without vocab_stats) with the torch.compile'd
        kernel of `kernels`: "auto" on CUDA and for V ≥ 16384 on CPU, True always (except replayed
        truncation), False never. A compile failure warns once and falls back to eager.
    """

    method: Method = "predictive"
    divergence: Divergence = "topk_kl"
    estimator: Estimator = "proportional"
    delta: float | None = None
    delta_low: float | None = None
    delta_high: float | None = None
    eps_low: float = 0.2
    eps_high: float = 0.28
    replay_truncation: bool = False
    chunk_tokens: int = 1024
    compile: Literal["auto", True, False] = "auto"

    def __post_init__(self) -> None:
        for name, value, allowed in (
            ("method", self.method, Method),
            ("divergence", self.divergence, Divergence),
            ("estimator", self.estimator, Estimator),
        ):
            if value not in get_args(allowed):
                raise ValueError(f"MaskConfig.{name}={value!r}; expected one of {get_args(allowed)}")
        if self.delta is not None:
            for name in ("delta_low", "delta_high"):
                given = getattr(self, name)
                if given is not None and given != self.delta:
                    raise ValueError(f"MaskConfig: delta={self.delta} conflicts with {name}={given}")
            object.__setattr__(self, "delta_low", self.delta)
            object.__setattr__(self, "delta_high", self.delta)
        default = DEFAULT_DELTA[self.divergence]
        if self.delta_low is None:
            object.__setattr__(self, "delta_low", default)
        if self.delta_high is None:
            object.__setattr__(self, "delta_high", default)
        for name in ("delta_low", "delta_high", "eps_low", "eps_high"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"MaskConfig.{name}={value!r}; expected a finite number >= 0")
        if self.eps_low >= 1:
            raise ValueError(f"MaskConfig.eps_low={self.eps_low}; must be < 1 (r < 1 - eps_low)")
        if not (isinstance(self.chunk_tokens, int) and self.chunk_tokens >= 1):
            raise ValueError(f"MaskConfig.chunk_tokens={self.chunk_tokens!r}; expected an int >= 1")
        if not (self.compile == "auto" or isinstance(self.compile, bool)):
            raise ValueError(f"MaskConfig.compile={self.compile!r}; expected 'auto', True or False")
