"""token_logprobs: log π_a with gradient, without materialising the [N, V] log-softmax.

The trainer needs log π_a = ℓ_a/T − logsumexp(ℓ/T) for the loss. `log_softmax(...).gather(...)` keeps a
full [N, V] float32 output alive for backward and its backward allocates another [N, V] for the
gathered gradient; here forward keeps only logsumexp per token and backward recomputes π one chunk at a
time, writing ∂ log π_a/∂ℓ = (e_a − π)/T straight into the gradient (in the logits' dtype: bf16 stays
bf16). Temperature and replayed truncation are those of `processed` (docs/math.md §6).
"""

from __future__ import annotations

import torch

from .inputs import check_shape, per_token
from .processed import (
    VocabStats,
    Workspace,
    compute_dtype,
    processed_chunk,
    softmax_stats,
    validate_truncation,
)

Tensor = torch.Tensor


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, ids, temp, top_k, top_p, chunk):  # [N, V], [N], [N] -> [N], [N], [N]
        n, vocab = logits.shape
        dtype = compute_dtype(logits)
        out = torch.empty(n, dtype=dtype, device=logits.device)
        lse = torch.empty_like(out)
        sum_sq = torch.empty_like(out)
        work = Workspace()
        for start in range(0, n, chunk):
            rows = slice(start, min(start + chunk, n))
            x = processed_chunk(logits[rows], temp[rows], top_k, top_p, work)  # [c, V]
            x_a = x.gather(-1, ids[rows].unsqueeze(-1)).squeeze(-1)
            lse[rows], sum_sq[rows] = softmax_stats(x, out=work.get(x.shape[0], vocab, dtype, x.device))
            out[rows] = x_a - lse[rows]
        ctx.save_for_backward(logits, ids, temp)
        ctx.top_k, ctx.top_p, ctx.chunk = top_k, top_p, chunk
        ctx.mark_non_differentiable(lse, sum_sq)
        return out, lse, sum_sq

    @staticmethod
    def backward(ctx, grad_out, _grad_lse, _grad_sum_sq):  # [N] -> [N, V]
        logits, ids, temp = ctx.saved_tensors
        n, vocab = logits.shape
        dtype = compute_dtype(logits)
        grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
        direct = grad.dtype == dtype  # π can be written straight into the gradient
        work = Workspace()
        for start in range(0, n, ctx.chunk):
            rows = slice(start, min(start + ctx.chunk, n))
            x = processed_chunk(logits[rows], temp[rows], ctx.top_k, ctx.top_p, work)  # [c, V]
            pi = grad[rows] if direct else work.get(x.shape[0], vocab, dtype, x.device)
            torch.softmax(x, dim=-1, out=pi)  # π (0 outside the kept set)
            scale = (grad_out[rows] / temp[rows]).to(dtype).unsqueeze(-1)  # [c, 1]
            pi.mul_(-scale).scatter_add_(-1, ids[rows].unsqueeze(-1), scale)  # g (e_a − π) / T
            if not direct:
                grad[rows] = pi
        return grad, None, None, None, None, None


def token_logprobs(
    logits: Tensor,  # [N, V] or [B, T, V], requires grad
    ids: Tensor,  # [N] or [B, T] long
    *,
    temperature: float | Tensor = 1.0,  # scalar, per token or per sequence
    top_k: int | None = None,
    top_p: float | None = None,
    chunk_tokens: int = 1024,
    return_stats: bool = False,
) -> Tensor | tuple[Tensor, VocabStats]:  # [N] or [B, T] log π_a, float32 (float64 for float64 logits)
    """log π_a under π = softmax(ℓ/T) (with top-k/top-p replayed if given), differentiable w.r.t. logits.

    With `return_stats=True` also returns the per-token logsumexp and Σ π² of the same pass, for
    `compute_masks(..., vocab_stats=...)` to reuse instead of reading the logits again (docs/math.md §8).
    """
    lead, vocab = ids.shape, logits.shape[-1]
    check_shape(logits, (*lead, vocab), "logits")
    validate_truncation(top_k, top_p)
    if not (isinstance(chunk_tokens, int) and chunk_tokens >= 1):
        raise ValueError(f"chunk_tokens={chunk_tokens!r}; expected an int >= 1")
    n = lead.numel()
    temp = per_token(temperature, lead, "temperature", torch.float64).to(logits.device).contiguous()
    flat_ids = ids.reshape(n).long().clamp(0, vocab - 1)
    out, lse, sum_sq = _TokenLogprobs.apply(
        logits.reshape(n, vocab), flat_ids, temp, top_k, top_p, chunk_tokens
    )
    out = out.reshape(lead)
    if return_stats:
        return out, VocabStats(lse=lse, sum_sq=sum_sq, temperature=temp, top_k=top_k, top_p=top_p)
    return out
