"""Glue between the numpy reference records and the package's torch API (tests only)."""

from __future__ import annotations

import numpy as np
import torch
from reference_impl import Record

from maskroll.trainer_adapter import MaskConfig, compute_masks


def temperature_arg(rec: Record, per_token: bool = False):
    """A float when the record has one temperature (and per_token is False), else a [N] tensor."""
    if not per_token and np.all(rec.temperature == rec.temperature[0]):
        return float(rec.temperature[0])
    return torch.tensor(rec.temperature, dtype=torch.float64)


def run_masks(
    rec: Record,
    cfg: MaskConfig,
    *,
    dtype: torch.dtype = torch.float64,
    per_token_temperature: bool = False,
    response_mask: np.ndarray | None = None,
    logits: np.ndarray | None = None,
    top_k=None,
    top_p=None,
):
    lg = rec.logits if logits is None else logits
    return compute_masks(
        torch.tensor(lg, dtype=dtype),
        torch.tensor(rec.sampled_ids, dtype=torch.long),
        torch.tensor(rec.sampled_logprobs, dtype=torch.float64),
        torch.tensor(rec.topk_ids, dtype=torch.long),
        torch.tensor(rec.topk_logprobs, dtype=torch.float64),
        torch.tensor(rec.advantages, dtype=torch.float64),
        config=cfg,
        temperature=temperature_arg(rec, per_token_temperature),
        top_k=top_k,
        top_p=top_p,
        response_mask=None if response_mask is None else torch.tensor(response_mask, dtype=torch.bool),
    )


def np_(x: torch.Tensor) -> np.ndarray:
    return x.detach().cpu().to(torch.float64).numpy() if x.is_floating_point() else x.cpu().numpy()


def free_logit_step(logits: torch.Tensor, ids: torch.Tensor, temperature, tau: float) -> torch.Tensor:
    """Raw logits ℓ' with ℓ'/T = ℓ/T + τ(e_a − π), π = softmax(ℓ/T): the MATH §4 idealised step on the
    free logits z = ℓ/T, expressed in the raw logits the adapter takes."""
    t = torch.as_tensor(temperature, dtype=logits.dtype)
    if t.dim() == 1:
        t = t[:, None]
    z = logits / t
    pi = torch.softmax(z, dim=-1)
    e_a = torch.nn.functional.one_hot(ids, logits.shape[-1]).to(logits.dtype)
    return (z + tau * (e_a - pi)) * t
