"""compute_masks: per-token trust-region masks from trainer logits and a rollout's top-K (docs/math.md §3–§4).

Three steps: the input checks (`_checked_inputs`), the chunked pass over the vocabulary that yields
log π_a, D and P̂ per token (`_vocab_pass`: one [chunk_tokens, V] float tensor at a time, docs/math.md §8),
and the method's proximity and direction tests (`DECISIONS`, one pure function per method). The
per-token formulas live in `divergences`; π's temperature and truncation in `processed`.

`compute_masks_for` reads the rollout side from a collated `Batch` (or a dict of its tensors);
`sampled_masks.sampled_token_masks` decides with the same table from log π_a and log μ_a alone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, NamedTuple

import torch

from . import divergences as dv
from .config import MaskConfig
from .inputs import check_ids, check_shape, per_token, response_mask_flat
from .kernels import chunk_stats, use_compiled
from .processed import VocabStats, Workspace, compute_dtype, truncation_active, validate_truncation

if TYPE_CHECKING:
    from .collate import Batch

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


# ---- the decision: proximity and direction per method (docs/math.md §3) ----------------------------------


@dataclass(frozen=True)
class Quantities:
    """What a method decides from, per token; all in the working dtype except `valid`."""

    adv: Tensor  # [N] A
    logpi_a: Tensor  # [N] log π_a
    mu_a_log: Tensor  # [N] log μ_a
    divergence: Tensor  # [N] D(μ, π) of config.divergence
    predicted: Tensor  # [N] P̂ of the same D (docs/math.md §4)
    ratio_direction: Tensor  # [N] π_a − μ_a
    valid: Tensor  # [N] bool: response tokens


class Decision(NamedTuple):
    keep: Tensor  # [N] bool: True = the gradient flows; never at padding
    far: Tensor  # [N] bool: proximity test; never at padding
    direction: Tensor  # [N]: A · direction > 0 means the step moves away


Decide = Callable[[Quantities, MaskConfig], Decision]


def _masked(q: Quantities, far: Tensor, direction: Tensor) -> Decision:
    """Masked iff far and moving away; strict: A = 0 or a zero direction keeps the token (docs/math.md §3)."""
    far = far & q.valid  # [N] bool
    away = q.adv * direction > 0  # [N] bool
    return Decision(keep=q.valid & ~(far & away), far=far, direction=direction)


def _far_by_divergence(q: Quantities, config: MaskConfig) -> Tensor:  # [N] bool
    # δ_low guards the tokens a negative advantage pushes down, δ_high those a positive one pushes up.
    return torch.where(q.adv < 0, q.divergence > config.delta_low, q.divergence > config.delta_high)


def decide_ppo(q: Quantities, config: MaskConfig) -> Decision:
    """PPO: r = π_a/μ_a beyond 1 − ε_low (A < 0) or 1 + ε_high (A ≥ 0), direction r − 1 (docs/math.md §3)."""
    r = (q.logpi_a - q.mu_a_log).exp()  # [N]
    far = torch.where(q.adv < 0, r < 1.0 - config.eps_low, r > 1.0 + config.eps_high)  # [N] bool
    return _masked(q, far, r - 1.0)


def decide_dppo(q: Quantities, config: MaskConfig) -> Decision:
    """DPPO: D > δ, direction π_a − μ_a, the ratio rule inherited from PPO (docs/math.md §3)."""
    return _masked(q, _far_by_divergence(q, config), q.ratio_direction)


def decide_predictive(q: Quantities, config: MaskConfig) -> Decision:
    """Predictive: D > δ as dppo, direction P̂, the predicted first-order change of D (docs/math.md §3–§4)."""
    return _masked(q, _far_by_divergence(q, config), q.predicted)


def decide_none(q: Quantities, config: MaskConfig) -> Decision:
    """No mask: every response token is kept; far and direction are dppo's, reported as diagnostics."""
    d = decide_dppo(q, config)
    return Decision(keep=q.valid.clone(), far=d.far, direction=d.direction)


# config.method → its decision, looked up once per call (STYLE.md §3).
DECISIONS: dict[str, Decide] = {
    "none": decide_none,
    "ppo": decide_ppo,
    "dppo": decide_dppo,
    "predictive": decide_predictive,
}


# ---- input checks -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Inputs:
    """compute_masks' arguments, checked and flattened to N token rows."""

    logits: Tensor  # [N, V] raw, as given (upcast per chunk)
    ids: Tensor  # [N] long a; 0 at padding
    top: Tensor  # [N, K] long top-K ids; 0 at padding
    mu_a_log: Tensor  # [N] log μ_a, working dtype
    mu_top_log: Tensor  # [N, K] log μ of the top-K, working dtype
    adv: Tensor  # [N] A, working dtype
    temp: Tensor  # [N] float64 T
    valid: Tensor  # [N] bool: response tokens


def _checked_inputs(
    logits: Tensor,  # [*lead, V]
    sampled_ids: Tensor,  # [*lead]
    sampled_logprobs: Tensor,  # [*lead]
    topk_ids: Tensor,  # [*lead, K]
    topk_logprobs: Tensor,  # [*lead, K]
    advantages: Tensor,  # [*lead] or per sequence [B]
    *,
    temperature: float | Tensor,
    top_k: int | None,
    top_p: float | None,
    replay_truncation: bool,
    response_mask: Tensor | None,  # bool [*lead]
) -> _Inputs:
    """Refuse inputs the masks cannot mean (ValueError; TypeError for a non-int top_k or float ids),
    among them a truncated record whose truncation is not replayed (docs/math.md §6); flatten the rest."""
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
    if truncation_active(top_k, top_p, vocab) and not replay_truncation:
        raise ValueError(
            f"the record was sampled with truncation (top_k={top_k}, top_p={top_p}): its μ is renormalised "
            "over the kept set, so KL(π‖μ) is infinite and KL(μ‖π) is floored (docs/math.md §6). Set "
            "MaskConfig(replay_truncation=True) to replay the truncation on π."
        )
    device = logits.device
    valid = response_mask_flat(response_mask, lead, device)  # [N]
    check_ids(sampled_ids, vocab, "sampled_ids", valid)
    check_ids(topk_ids, vocab, "topk_ids", valid)
    temp = per_token(temperature, lead, "temperature", torch.float64).to(device)  # [N]
    if not bool(torch.isfinite(temp).all()) or bool((temp <= 0).any()):
        raise ValueError("temperature must be finite and > 0")
    dtype = compute_dtype(logits)
    return _Inputs(
        logits=logits.reshape(n, vocab),
        # Padding rows may hold garbage ids: point them at 0 and discard their results.
        ids=torch.where(valid, sampled_ids.reshape(n).long(), 0),
        top=torch.where(valid.unsqueeze(-1), topk_ids.reshape(n, k).long(), 0),
        mu_a_log=sampled_logprobs.reshape(n).to(device, dtype),
        mu_top_log=topk_logprobs.reshape(n, k).to(device, dtype),
        adv=per_token(advantages, lead, "advantages", dtype).to(device),  # may raise: checked last
        temp=temp,
        valid=valid,
    )


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


# ---- the vocabulary pass (docs/math.md §8) ---------------------------------------------------------------

# The per-token columns the pass fills, [N] each in the working dtype.
_COLUMNS = ("logpi_a", "divergence", "predicted", "mismatch_kl", "mismatch_tv")


def _vocab_pass(
    x: _Inputs,
    stats: VocabStats | None,
    token_fn: TokenFn,
    *,
    top_k: int | None,
    top_p: float | None,
    chunk_tokens: int,
    compiled: bool,
) -> dict[str, Tensor]:  # _COLUMNS → [N]
    """log π_a, D and P̂ of config.divergence, and the top-K mismatch on S, chunk by chunk (docs/math.md
    §2, §4).

    With `stats` only the ≤ K+1 logits of S are gathered per token; without, each chunk is processed
    (temperature, replayed truncation) and reduced to its logsumexp and Σ π² by `kernels.chunk_stats`
    (eager: one reused [chunk_tokens, V] buffer; compiled: none). Run under no_grad.
    """
    n, vocab = x.logits.shape
    dtype, device = compute_dtype(x.logits), x.logits.device
    out = {c: torch.zeros(n, dtype=dtype, device=device) for c in _COLUMNS}
    work = Workspace()
    for start in range(0, n, chunk_tokens):
        rows = slice(start, min(start + chunk_tokens, n))
        ids, top = x.ids[rows], x.top[rows]  # [c], [c, K]
        if stats is not None:
            t = x.temp[rows].to(dtype).unsqueeze(-1)  # [c, 1]
            x_top = x.logits[rows].gather(-1, top).to(dtype) / t  # [c, K]
            x_a = x.logits[rows].gather(-1, ids.unsqueeze(-1)).squeeze(-1).to(dtype) / t.squeeze(-1)  # [c]
            lse, sum_sq = stats.lse[rows].to(dtype), stats.sum_sq[rows].to(dtype)  # [c], [c]
        else:
            x_a, x_top, lse, sum_sq = chunk_stats(
                x.logits[rows], x.temp[rows], ids, top, compiled=compiled, top_k=top_k, top_p=top_p, work=work
            )  # [c], [c, K], [c], [c]
        logpi_a = x_a - lse  # [c]
        support = dv.build_support(
            x_top - lse.unsqueeze(-1), logpi_a, top, x.mu_top_log[rows], ids, x.mu_a_log[rows], sum_sq, vocab
        )
        b = dv.buckets(support)
        d, p_hat = token_fn(b, support, logpi_a, x.mu_a_log[rows], sum_sq)  # [c], [c]
        out["logpi_a"][rows] = logpi_a
        out["divergence"][rows] = d
        out["predicted"][rows] = p_hat
        out["mismatch_kl"][rows] = dv.topk_kl(b, support)
        out["mismatch_tv"][rows] = dv.topk_tv(b, support)
    return out


# ---- compute_masks ----------------------------------------------------------------------------------


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
    """Trust-region masks of `config.method` (docs/math.md §3) for every response token.

    π = softmax(ℓ / T) (with the record's truncation replayed if `config.replay_truncation`), μ from the
    record: S = topK ∪ {a}, tail as one bucket. Computed under no_grad; nothing here carries gradient.
    With `vocab_stats` the only work on the logits is gathering the ≤ K+1 entries of S per token.
    """
    config = config or MaskConfig()
    x = _checked_inputs(
        logits,
        sampled_ids,
        sampled_logprobs,
        topk_ids,
        topk_logprobs,
        advantages,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        replay_truncation=config.replay_truncation,
        response_mask=response_mask,
    )
    n, vocab = x.logits.shape
    stats = _usable_stats(vocab_stats, n, x.temp, top_k, top_p, vocab)
    token_fn, decide = _token_fn(config), DECISIONS[config.method]
    with torch.no_grad():
        col = _vocab_pass(
            x,
            stats,
            token_fn,
            top_k=top_k,
            top_p=top_p,
            chunk_tokens=config.chunk_tokens,
            compiled=stats is None and use_compiled(config.compile, x.logits, top_k, top_p),
        )
        q = Quantities(
            adv=x.adv,
            logpi_a=col["logpi_a"],
            mu_a_log=x.mu_a_log,
            divergence=col["divergence"],
            predicted=col["predicted"],
            ratio_direction=col["logpi_a"].exp() - x.mu_a_log.exp(),  # [N] π_a − μ_a
            valid=x.valid,
        )
        d = decide(q, config)

    res = mask_result(q, d, col["mismatch_kl"], col["mismatch_tv"], dtype=compute_dtype(logits))
    return res.map(lambda t: t.reshape(sampled_ids.shape))


def mask_result(
    q: Quantities,
    d: Decision,
    mismatch_kl: Tensor,  # [N]
    mismatch_tv: Tensor,  # [N]
    *,
    dtype: torch.dtype,
) -> MaskResult:  # flat [N]
    """The decision `d` on `q` as a MaskResult; every per-token value 0 at padding (`q.valid` False),
    whatever its garbage ids produced. compute_masks and sampled_token_masks both end here."""
    zero = torch.zeros((), dtype=dtype, device=q.valid.device)

    def padded(t: Tensor) -> Tensor:  # [N]
        return torch.where(q.valid, t, zero)

    return MaskResult(
        keep=d.keep,
        divergence=padded(q.divergence),
        direction=padded(d.direction),
        far=d.far,
        ratio_direction=padded(q.ratio_direction),
        predicted_direction=padded(q.predicted),
        mismatch_kl=padded(mismatch_kl),
        mismatch_tv=padded(mismatch_tv),
        logprobs=padded(q.logpi_a),
        response_mask=q.valid,
    )


def compute_masks_for(
    batch: Batch | Mapping[str, Tensor],
    logits: Tensor,  # [B, T, V] raw logits predicting the completion (batch.completion_logits_slice)
    *,
    config: MaskConfig | None = None,
    vocab_stats: VocabStats | None = None,
    top_k: int | None = None,  # a dict's truncation; a Batch carries its own
    top_p: float | None = None,
) -> MaskResult:
    """compute_masks on a collated batch: completion_ids, sampled_logprobs, topk_ids, topk_logprobs,
    advantages, temperature and response_mask read by name from a `Batch`, or from a dict with the same
    keys (TRL's micro-batches: TRL shuffles and splits dicts of tensors), whose truncation is then given
    as top_k / top_p. A Batch's own top_k / top_p are used; different ones given here are refused."""
    if isinstance(batch, Mapping):
        get = batch.__getitem__
    else:
        given = (top_k, top_p)
        top_k, top_p = batch.top_k, batch.top_p
        if given != (None, None) and given != (top_k, top_p):
            raise ValueError(f"top_k, top_p = {given}, but the batch was collated with {(top_k, top_p)}")

        def get(name: str) -> Tensor:
            return getattr(batch, name)

    return compute_masks(
        logits,
        get("completion_ids"),
        get("sampled_logprobs"),
        get("topk_ids"),
        get("topk_logprobs"),
        get("advantages"),
        config=config,
        temperature=get("temperature"),
        top_k=top_k,
        top_p=top_p,
        response_mask=get("response_mask"),
        vocab_stats=vocab_stats,
    )
