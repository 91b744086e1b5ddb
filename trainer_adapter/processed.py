"""The training policy π as the engine sampled it: temperature and replayed truncation (docs/math.md §6).

π = softmax(ℓ / T), optionally restricted to the top-k / top-p set exactly as vLLM's sampler builds it
(temperature first, then top-k, then top-p on the top-k-renormalised distribution). Everything here
works on one chunk of rows at a time and returns a fresh float tensor the caller may modify in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .inputs import per_token

Tensor = torch.Tensor


def compute_dtype(logits: Tensor) -> torch.dtype:
    """float64 stays float64 (tests); every other dtype is upcast per chunk to float32."""
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def truncation_active(top_k: int | None, top_p: float | None, vocab_size: int) -> bool:
    """True if the record's sampling truncated the vocabulary (so μ is renormalised over a subset)."""
    return (top_k is not None and 0 < top_k < vocab_size) or (top_p is not None and top_p < 1.0)


def validate_truncation(top_k: int | None, top_p: float | None) -> None:
    if top_k is not None and not isinstance(top_k, int):
        raise TypeError(f"top_k={top_k!r}; expected an int or None")
    if top_p is not None and not (0.0 < float(top_p) <= 1.0):
        raise ValueError(f"top_p={top_p!r}; expected 0 < top_p <= 1")


@dataclass(frozen=True)
class VocabStats:
    """Per-token full-vocabulary reductions of π, computed once and shareable (docs/math.md §8).

    `token_logprobs(..., return_stats=True)` returns them so that `compute_masks(..., vocab_stats=...)`
    needs no second pass over the vocabulary. Valid only for the same logits, temperature and truncation.
    """

    lse: Tensor  # [N] logsumexp of the processed logits ℓ/T
    sum_sq: Tensor  # [N] Σ_V π²
    temperature: Tensor  # [N] float64, the temperature they were computed with
    top_k: int | None = None
    top_p: float | None = None


class Workspace:
    """One reusable [rows, V] buffer: on CPU a fresh chunk-sized tensor per iteration costs page faults
    that are several times the arithmetic, and on GPU it keeps the allocator's peak at one chunk."""

    def __init__(self) -> None:
        self._buf: Tensor | None = None

    def get(self, rows: int, vocab: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        b = self._buf
        if b is None or b.shape[0] < rows or b.shape[1] != vocab or b.dtype != dtype or b.device != device:
            b = self._buf = torch.empty(rows, vocab, dtype=dtype, device=device)
        return b[:rows]


def processed_chunk(
    logits: Tensor,  # [c, V] raw logits of one chunk, any float dtype
    temperature: Tensor,  # [c] temperature per row (float64)
    top_k: int | None,
    top_p: float | None,
    work: Workspace,
) -> Tensor:  # [c, V] processed logits ℓ/T, −inf outside the kept set, in compute_dtype
    """Processed logits of one chunk. Returns `logits` itself when nothing changes them (float32/64,
    T = 1, no truncation) — callers must not modify the result in place — else the workspace."""
    dtype = compute_dtype(logits)
    vocab = logits.shape[-1]
    unit_t = bool((temperature == 1.0).all())
    truncating = truncation_active(top_k, top_p, vocab)
    if logits.dtype == dtype and unit_t and not truncating:
        return logits
    x = work.get(logits.shape[0], vocab, dtype, logits.device)
    x.copy_(logits)
    if not unit_t:
        x.div_(temperature.to(dtype).unsqueeze(-1))
    if top_k is not None and 0 < top_k < vocab:
        # vLLM keeps every logit >= the k-th largest value, so ties at the boundary are all kept.
        kth = x.topk(top_k, dim=-1, sorted=False).values.amin(dim=-1, keepdim=True)  # [c, 1]
        x.masked_fill_(x < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        # vLLM's op sequence, so that ties fall the same way: sort ascending, cumulative probability,
        # drop the prefix whose mass is <= 1 - p, always keep the largest token. (Replay only: this
        # path allocates several [c, V] temporaries.)
        sorted_x, order = x.sort(dim=-1, descending=False)  # [c, V]
        cum = sorted_x.softmax(dim=-1).cumsum_(dim=-1)
        drop = cum <= 1.0 - top_p
        drop[:, -1] = False
        del cum, sorted_x
        x.masked_fill_(torch.zeros_like(drop).scatter_(-1, order, drop), float("-inf"))
    return x


def processed_logprobs(
    logits: Tensor,  # [..., V]
    temperature: float | Tensor = 1.0,  # scalar or one per row of logits[..., 0]
    top_k: int | None = None,
    top_p: float | None = None,
) -> Tensor:  # [..., V] log π (−inf outside the kept set), compute dtype
    """Full processed log-distribution; diagnostics and tests only (materialises [..., V])."""
    validate_truncation(top_k, top_p)
    shape = logits.shape
    flat = logits.reshape(-1, shape[-1])
    temp = per_token(temperature, shape[:-1], "temperature", torch.float64).to(logits.device)
    x = processed_chunk(flat, temp, top_k, top_p, Workspace())
    return x.log_softmax(dim=-1).reshape(shape)
