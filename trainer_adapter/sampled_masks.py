"""sampled_token_masks: binary-divergence masks from log π_a and log μ_a alone (docs/math.md §2–§4).

For a trainer that hands its policy loss only the sampled tokens' logprobs (verl): no logits, no top-K.
The decision is compute_masks' own (`masks.DECISIONS` on the same `Quantities`), so the two agree on
every binary-divergence mask.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import divergences as dv
from .config import MaskConfig
from .inputs import check_shape, per_token, response_mask_flat
from .masks import DECISIONS, MaskResult, Quantities, mask_result

Tensor = torch.Tensor

# Binary divergence → (D, P̂) from log π_a, log μ_a and Σ π² (docs/math.md §2, §4).
_BINARY: dict[str, tuple[Callable[[Tensor, Tensor], Tensor], Callable[[Tensor, Tensor, Tensor], Tensor]]] = {
    "binary_kl": (dv.binary_kl, dv.binary_kl_direction),
    "binary_tv": (dv.binary_tv, dv.binary_tv_direction),
}


def sampled_token_masks(
    logprobs: Tensor,  # [N] or [B, T] log π_a (its gradient is not used)
    sampled_logprobs: Tensor,  # like logprobs: rollout log μ_a
    advantages: Tensor,  # [N], [B, T] or per sequence [B]
    *,
    config: MaskConfig,
    response_mask: Tensor | None = None,  # bool like logprobs
) -> MaskResult:
    """compute_masks for a binary divergence (`config.divergence` binary_kl / binary_tv), from log π_a and
    log μ_a alone: what a trainer has that hands its loss only the sampled tokens' logprobs (verl).

    Decisions equal compute_masks' on the same tokens. Σ π² is unknown here: π_a², its lower bound, takes
    its place in P̂, which leaves sign(P̂) = sign(π_a − μ_a) exact (docs/math.md §4) but not its magnitude.
    mismatch_kl / mismatch_tv are the bucketed divergences on S = {a}: binary_kl / binary_tv.
    """
    if config.divergence not in _BINARY:
        raise ValueError(
            f"sampled_token_masks needs a binary divergence; divergence={config.divergence!r} needs the "
            "rollout's top-K and the trainer's logits: use compute_masks"
        )
    lead = logprobs.shape
    check_shape(sampled_logprobs, tuple(lead), "sampled_logprobs")
    d_fn, p_fn = _BINARY[config.divergence]
    with torch.no_grad():
        lp = logprobs.detach().reshape(-1)  # [N]
        lm = sampled_logprobs.reshape(-1).to(lp.device, lp.dtype)  # [N]
        valid = response_mask_flat(response_mask, lead, lp.device)  # [N]
        q = Quantities(
            adv=per_token(advantages, lead, "advantages", lp.dtype).to(lp.device),
            logpi_a=lp,
            mu_a_log=lm,
            divergence=d_fn(lp, lm),
            predicted=p_fn(lp, lm, lp.exp().square()),
            ratio_direction=lp.exp() - lm.exp(),
            valid=valid,
        )
        d = DECISIONS[config.method](q, config)
        res = mask_result(q, d, dv.binary_kl(lp, lm), dv.binary_tv(lp, lm), dtype=lp.dtype)
    return res.map(lambda t: t.reshape(lead))
