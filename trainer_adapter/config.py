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
Correction = Literal["token_tis", "seq_tis", "token_mis", "seq_mis", "icepop", "geo_mask"]

# DPPO's typical thresholds (docs/math.md §2): KL δ = 0.05, TV δ = 0.15–0.20.
DEFAULT_DELTA = {"binary_tv": 0.15, "topk_tv": 0.15, "binary_kl": 0.05, "topk_kl": 0.05}
# The band [low, high] of the masking corrections (docs/math.md §9): TRL's / verl's token and sequence
# masks around 1, IcePop's α = 0.5, β = 5, a geometric-mean band of ±1 % (SkyRL's geo_mask default).
# token_tis / seq_tis have no band: their cap is policy_loss's IS cap C.
DEFAULT_BAND = {
    "token_mis": (0.5, 2.0),
    "seq_mis": (0.5, 2.0),
    "icepop": (0.5, 5.0),
    "geo_mask": (0.99, 1.01),
}


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
    correction: the rollout correction of the policy-gradient term (docs/math.md §9), applied by
        token_loss / policy_loss on top of the trust-region mask: "token_tis" w = min(r, C) (the default,
        today's loss); "seq_tis" w = min(ρ_seq, C), ρ_seq = Π_t r_t over the sequence's response tokens;
        "token_mis" drops tokens with r outside [low, high], w = min(r, C); "seq_mis" drops sequences with
        ρ_seq outside [low, high], w = min(ρ_seq, C); "icepop" drops tokens with r outside [low, high],
        w = 1 (masked, never reweighted); "geo_mask" drops sequences whose geometric mean
        exp(mean_t log r_t) leaves [low, high], w = min(r, C). Sequence-level ones need [B, T] inputs.
    correction_low / correction_high: the band of token_mis, seq_mis, icepop and geo_mask (defaults
        0.5–2, 0.5–2, 0.5–5, 0.99–1.01); 0 <= low < high, high may be inf. Refused for token_tis / seq_tis.
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
    correction: Correction = "token_tis"
    correction_low: float | None = None
    correction_high: float | None = None

    def __post_init__(self) -> None:
        for name, value, allowed in (
            ("method", self.method, Method),
            ("divergence", self.divergence, Divergence),
            ("estimator", self.estimator, Estimator),
            ("correction", self.correction, Correction),
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
        self._check_band()

    def _check_band(self) -> None:
        given = (self.correction_low, self.correction_high)
        if self.correction not in DEFAULT_BAND:
            if given != (None, None):
                raise ValueError(
                    f"MaskConfig.correction={self.correction!r} takes no band (its cap is policy_loss's "
                    f"is_cap); got correction_low={given[0]}, correction_high={given[1]}"
                )
            return
        low, high = (d if g is None else g for g, d in zip(given, DEFAULT_BAND[self.correction], strict=True))
        for name, value in (("correction_low", low), ("correction_high", high)):
            if not (isinstance(value, (int, float)) and not math.isnan(value) and value >= 0):
                raise ValueError(f"MaskConfig.{name}={value!r}; expected a number >= 0")
        if not (math.isfinite(low) and low < high):
            raise ValueError(
                f"MaskConfig: correction {self.correction!r} needs a finite correction_low < "
                f"correction_high; got [{low}, {high}]"
            )
        object.__setattr__(self, "correction_low", float(low))
        object.__setattr__(self, "correction_high", float(high))
