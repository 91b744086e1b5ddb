"""Shape normalisation shared by the public functions: flat [N, …] or batched [B, T, …] inputs.

Everything downstream works on flat token rows; this module owns the broadcasting rules (a per-sequence
[B] value covers all T tokens of its sequence) and the checks whose messages name the argument.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def per_token(value: float | Tensor, lead: torch.Size, name: str, dtype: torch.dtype | None = None) -> Tensor:
    """Broadcast a scalar, a per-sequence [B] or a per-token [*lead] value to a flat [N] tensor."""
    # A Python float goes straight to `dtype`: via a float32 tensor 0.7 would become 0.699999988.
    t = (
        value.to(dtype)
        if isinstance(value, Tensor) and dtype is not None
        else torch.as_tensor(value, dtype=dtype)
    )
    if t.dim() == 0:
        return t.expand(lead.numel())
    if tuple(t.shape) == tuple(lead):
        return t.reshape(-1)
    if len(lead) == 2 and tuple(t.shape) == (lead[0],):
        return t.unsqueeze(1).expand(lead).reshape(-1)
    raise ValueError(
        f"{name} has shape {tuple(t.shape)}; expected a scalar, {tuple(lead)}"
        + (f" or ({lead[0]},)" if len(lead) == 2 else "")
    )


def check_shape(t: Tensor, expected: tuple[int, ...], name: str) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {tuple(expected)}")


def response_mask_flat(response_mask: Tensor | None, lead: torch.Size, device: torch.device) -> Tensor:
    """[N] bool; all True when no mask is given."""
    if response_mask is None:
        return torch.ones(lead.numel(), dtype=torch.bool, device=device)
    check_shape(response_mask, tuple(lead), "response_mask")
    return response_mask.reshape(-1).to(torch.bool)


def check_ids(ids: Tensor, vocab: int, name: str, valid: Tensor) -> None:
    """Ids at valid positions must index the vocabulary; padding positions may hold anything."""
    if ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name} has dtype {ids.dtype}; expected an integer tensor")
    flat = ids.reshape(valid.shape[0], -1)[valid]
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= vocab):
        raise ValueError(f"{name} holds ids outside [0, {vocab}) at response positions")
