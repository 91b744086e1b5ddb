"""compute_masks: per-token trust-region masks from trainer logits and a rollout's top-K (MATH.md §3–§4).

Owns the chunked pass over the vocabulary (one [chunk_tokens, V] float tensor at a time, MATH.md §8)
and the assembly of proximity and direction tests. The per-token formulas live in `divergences`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from . import divergences as dv
from .config import MaskConfig
from .inputs import check_ids, check_shape, per_token, response_mask_flat
from .processed import (
    VocabStats,
    Workspace,
    processed_chunk,
    softmax_stats,
    truncation_active,
    validate_truncation,
)

Tensor = torch.Tensor


@dataclass(frozen=True)
class MaskResult:
    """Per-token outputs, each shaped like `sampled_ids` ([N] or [B, T]); all detached."""

    keep: Tensor  # bool: True = the gradient flows (never at padding)
    divergence: Tensor  # D(μ, π) of config.divergence
    direction: Tensor  # sign(A · direction) > 0 means "away": r − 1 (ppo), π_a − μ_a (dppo, none), P̂
    far: Tensor  # bool: proximity test
    ratio_direction: Tensor  # π_a − μ_a, the ratio rule's direction
    predicted_direction: Tensor  # P̂ of config.divergence with config.estimator
    mismatch_kl: Tensor  # topk_kl(μ, π) on S
    mismatch_tv: Tensor  # topk_tv(μ, π) on S
    logprobs: Tensor  # log π_a under the processed trainer policy
    response_mask: Tensor  # bool

    def map(self, fn: Callable[[Tensor], Tensor]) -> MaskResult:
        return MaskResult(**{f.name: fn(getattr(self, f.name)) for f in fields(self)})


# Per-token divergence and its P̂, chosen once per config (STYLE.md §3). Each takes the buckets, the
# support, log π_a, log μ_a (the record's sampled logprob) and Σ π².
TokenFn = Callable[[dv.Buckets, dv.Support, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]


def _token_fn(config: MaskConfig) -> TokenFn:
    est = config.estimator
    table: dict[str, TokenFn] = {
        "binary_tv": lambda b, s, lp, lm, sq: (dv.binary_tv(lp, lm), dv.binary_tv_direction(lp, lm, sq)),
        "binary_kl": lambda b, s, lp, lm, sq: (dv.binary_kl(lp, lm), dv.binary_kl_direction(lp, lm, sq)),
        "topk_tv": lambda b, s, lp, lm, sq: (
            dv.topk_tv(b, s),
            dv.topk_tv_direction(b, dv.tail_concentration(b, est)),
        ),
        "topk_kl": lambda b, s, lp, lm, sq: (
            dv.topk_kl(b, s),
            dv.topk_kl_direction(b, dv.tail_concentration(b, est)),
        ),
    }
    return table[config.divergence]


def compute_masks(
    logits: Tensor,  # [N, V] or [B, T, V] raw trainer logits (any float dtype; upcast per chunk)
    sampled_ids: Tensor,  # [N] or [B, T] long
    sampled_logprobs: Tensor,  # [N] or [B, T] rollout log μ_a (processed)
    topk_ids: Tensor,  # [N, K] or [B, T, K] long
    topk_logprobs: Tensor,  # [N, K] or [B, T, K] rollout log μ of the top-K
    advantages: Tensor,  # [N], [B, T] or per sequence [B]
    *,
    config: MaskConfig | None = None,
    temperature: float | Tensor = 1.0,  # scalar, per token or per sequence
    top_k: int | None = None,
    top_p: float | None = None,
    response_mask: Tensor | None = None,  # bool [N] or [B, T]
    vocab_stats: VocabStats
    | None = None,  # from token_logprobs(..., return_stats=True): skips the vocab pass
) -> MaskResult:
    """Trust-region masks of `config.method` (MATH.md §3) for every response token.

    π = softmax(ℓ / T) (with the record's truncation replayed if `config.replay_truncation`), μ from the
    record: S = topK ∪ {a}, tail as one bucket. Computed under no_grad; nothing here carries gradient.
    With `vocab_stats` the only work on the logits is gathering the ≤ K+1 entries of S per token.
    """
    config = config or MaskConfig()
    lead = sampled_ids.shape
    n, vocab = lead.numel(), logits.shape[-1]
    k = topk_ids.shape[-1]
    check_shape(logits, (*lead, vocab), "logits")
    check_shape(sampled_logprobs, tuple(lead), "sampled_logprobs")
    check_shape(topk_ids, (*lead, k), "topk_ids")
    check_shape(topk_logprobs, (*lead, k), "topk_logprobs")
    if k > vocab:
        raise ValueError(f"topk_ids has K={k} entries per token but the vocabulary has V={vocab}")
    validate_truncation(top_k, top_p)
    if truncation_active(top_k, top_p, vocab) and not config.replay_truncation:
        raise ValueError(
            f"the record was sampled with truncation (top_k={top_k}, top_p={top_p}): its μ is renormalised "
            "over the kept set, so KL(π‖μ) is infinite and KL(μ‖π) is floored (MATH.md §6). Set "
            "MaskConfig(replay_truncation=True) to replay the truncation on π."
        )
    device = logits.device
    valid = response_mask_flat(response_mask, lead, device)  # [N]
    check_ids(sampled_ids, vocab, "sampled_ids", valid)
    check_ids(topk_ids, vocab, "topk_ids", valid)
    temp = per_token(temperature, lead, "temperature", torch.float64).to(device)  # [N]
    if not bool(torch.isfinite(temp).all()) or bool((temp <= 0).any()):
        raise ValueError("temperature must be finite and > 0")

    # Padding rows may hold garbage ids: point them at 0 and discard their results.
    ids = torch.where(valid, sampled_ids.reshape(n).long(), 0)  # [N]
    top = torch.where(valid.unsqueeze(-1), topk_ids.reshape(n, k).long(), 0)  # [N, K]
    logits2d = logits.reshape(n, vocab)
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    mu_a_log = sampled_logprobs.reshape(n).to(device, dtype)  # [N]
    mu_top_log = topk_logprobs.reshape(n, k).to(device, dtype)  # [N, K]
    adv = per_token(advantages, lead, "advantages", dtype).to(device)  # [N]

    stats = _usable_stats(vocab_stats, n, temp, top_k, top_p, vocab)
    token_fn = _token_fn(config)
    cols = ("logpi_a", "divergence", "predicted", "mismatch_kl", "mismatch_tv")
    out = {c: torch.zeros(n, dtype=dtype, device=device) for c in cols}
    work = Workspace()
    with torch.no_grad():
        for start in range(0, n, config.chunk_tokens):
            rows = slice(start, min(start + config.chunk_tokens, n))
            if stats is not None:
                t = temp[rows].to(dtype).unsqueeze(-1)  # [c, 1]
                x_top = logits2d[rows].gather(-1, top[rows]).to(dtype) / t  # [c, K]
                x_a = logits2d[rows].gather(-1, ids[rows].unsqueeze(-1)).squeeze(-1).to(dtype) / t.squeeze(-1)
                lse, sum_sq = stats.lse[rows].to(dtype), stats.sum_sq[rows].to(dtype)
            else:
                x = processed_chunk(logits2d[rows], temp[rows], top_k, top_p, work)  # [c, V]
                x_top = x.gather(-1, top[rows])  # [c, K]
                x_a = x.gather(-1, ids[rows].unsqueeze(-1)).squeeze(-1)  # [c]
                pi = work.get(x.shape[0], vocab, dtype, device)  # may be x itself: gathered already
                lse, sum_sq = softmax_stats(x, out=pi)
            logpi_a = x_a - lse
            support = dv.build_support(
                x_top - lse.unsqueeze(-1),
                logpi_a,
                top[rows],
                mu_top_log[rows],
                ids[rows],
                mu_a_log[rows],
                sum_sq,
                vocab,
            )
            b = dv.buckets(support)
            d, p_hat = token_fn(b, support, logpi_a, mu_a_log[rows], sum_sq)
            out["logpi_a"][rows] = logpi_a
            out["divergence"][rows] = d
            out["predicted"][rows] = p_hat
            out["mismatch_kl"][rows] = dv.topk_kl(b, support)
            out["mismatch_tv"][rows] = dv.topk_tv(b, support)

        ratio_dir = out["logpi_a"].exp() - mu_a_log.exp()  # π_a − μ_a
        if config.method == "ppo":
            r = (out["logpi_a"] - mu_a_log).exp()
            far = torch.where(adv < 0, r < 1.0 - config.eps_low, r > 1.0 + config.eps_high)
            direction = r - 1.0
        else:
            far = torch.where(
                adv < 0, out["divergence"] > config.delta_low, out["divergence"] > config.delta_high
            )
            direction = out["predicted"] if config.method == "predictive" else ratio_dir
        far = far & valid
        away = adv * direction > 0
        keep = valid.clone() if config.method == "none" else valid & ~(far & away)

    zero = torch.zeros((), dtype=dtype, device=device)
    res = MaskResult(
        keep=keep,
        divergence=torch.where(valid, out["divergence"], zero),
        direction=torch.where(valid, direction, zero),
        far=far,
        ratio_direction=torch.where(valid, ratio_dir, zero),
        predicted_direction=torch.where(valid, out["predicted"], zero),
        mismatch_kl=torch.where(valid, out["mismatch_kl"], zero),
        mismatch_tv=torch.where(valid, out["mismatch_tv"], zero),
        logprobs=torch.where(valid, out["logpi_a"], zero),
        response_mask=valid,
    )
    return res.map(lambda t: t.reshape(lead))


def _usable_stats(
    stats: VocabStats | None, n: int, temp: Tensor, top_k: int | None, top_p: float | None, vocab: int
) -> VocabStats | None:
    """The shared normaliser, if it was computed for these tokens with this temperature and truncation."""
    if stats is None:
        return None
    if stats.lse.shape != (n,) or stats.sum_sq.shape != (n,):
        raise ValueError(f"vocab_stats covers {tuple(stats.lse.shape)} tokens; expected ({n},)")
    if (stats.top_k, stats.top_p) != (top_k, top_p) or not torch.equal(stats.temperature, temp):
        raise ValueError("vocab_stats was computed with a different temperature or truncation")
    if truncation_active(top_k, top_p, vocab):
        return None  # membership of S in the kept set needs the processed row: recompute
    return stats
