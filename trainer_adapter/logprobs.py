"""token_logprobs: log π_a with gradient, without materialising the [N, V] log-softmax.

The trainer needs log π_a = ℓ_a/T − logsumexp(ℓ/T) for the loss. `log_softmax(...).gather(...)` keeps a
full [N, V] float32 output alive for backward and its backward allocates another [N, V] for the
gathered gradient; here forward keeps only logsumexp per token and backward recomputes π one chunk at a
time, writing ∂ log π_a/∂ℓ = (e_a − π)/T straight into the gradient (in the logits' dtype: bf16 stays
bf16). The per-chunk arithmetic is `kernels` (eager or torch.compile'd, chosen once per call);
temperature and replayed truncation are those of `processed` (docs/math.md §6).
"""

from __future__ import annotations

import torch

from .inputs import check_shape, per_token
from .kernels import Compile, check_compile, chunk_grad, chunk_stats, use_compiled
from .processed import VocabStats, Workspace, compute_dtype, validate_truncation

Tensor = torch.Tensor


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, ids, temp, top_k, top_p, chunk, compiled):  # [N, V], [N], [N] -> [N] ×3
        n = logits.shape[0]
        dtype = compute_dtype(logits)
        out = torch.empty(n, dtype=dtype, device=logits.device)
        lse = torch.empty_like(out)
        sum_sq = torch.empty_like(out)
        work = Workspace()
        for start in range(0, n, chunk):
            rows = slice(start, min(start + chunk, n))
            st = chunk_stats(
                logits[rows], temp[rows], ids[rows], None,
                compiled=compiled, top_k=top_k, top_p=top_p, work=work,
            )  # fmt: skip
            lse[rows], sum_sq[rows] = st.lse, st.sum_sq
            out[rows] = st.x_a - st.lse
        ctx.save_for_backward(logits, ids, temp, lse)
        ctx.top_k, ctx.top_p, ctx.chunk, ctx.compiled = top_k, top_p, chunk, compiled
        ctx.mark_non_differentiable(lse, sum_sq)
        return out, lse, sum_sq

    @staticmethod
    def backward(ctx, grad_out, _grad_lse, _grad_sum_sq):  # [N] -> [N, V]
        logits, ids, temp, lse = ctx.saved_tensors
        n = logits.shape[0]
        dtype = compute_dtype(logits)
        grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
        work = Workspace()
        for start in range(0, n, ctx.chunk):
            rows = slice(start, min(start + ctx.chunk, n))
            scale = (grad_out[rows] / temp[rows]).to(dtype)  # [c] g/T
            chunk_grad(
                logits[rows], temp[rows], ids[rows], lse[rows], scale, grad[rows],
                compiled=ctx.compiled, top_k=ctx.top_k, top_p=ctx.top_p, work=work,
            )  # fmt: skip
        return grad, None, None, None, None, None, None


def token_logprobs(
    logits: Tensor,  # [N, V] or [B, T, V], requires grad
    ids: Tensor,  # [N] or [B, T] long
    *,
    temperature: float | Tensor = 1.0,  # scalar, per token or per sequence
    top_k: int | None = None,
    top_p: float | None = None,
    chunk_tokens: int = 1024,
    return_stats: bool = False,
    compile: Compile = "auto",
) -> Tensor | tuple[Tensor, VocabStats]:  # [N] or [B, T] log π_a, float32 (float64 for float64 logits)
    """log π_a under π = softmax(ℓ/T) (with top-k/top-p replayed if given), differentiable w.r.t. logits.

    With `return_stats=True` also returns the per-token logsumexp and Σ π² of the same pass, for
    `compute_masks(..., vocab_stats=...)` to reuse instead of reading the logits again (docs/math.md §8).
    `compile`: run the torch.compile'd kernels of `kernels` ("auto": on CUDA and for V ≥ 16384 on CPU;
    eager after a compile failure, with one warning). Eager and compiled agree to float32 rounding.
    """
    lead, vocab = ids.shape, logits.shape[-1]
    check_shape(logits, (*lead, vocab), "logits")
    validate_truncation(top_k, top_p)
    check_compile(compile, "compile")
    if not (isinstance(chunk_tokens, int) and chunk_tokens >= 1):
        raise ValueError(f"chunk_tokens={chunk_tokens!r}; expected an int >= 1")
    n = lead.numel()
    temp = per_token(temperature, lead, "temperature", torch.float64).to(logits.device).contiguous()
    flat_ids = ids.reshape(n).long().clamp(0, vocab - 1)
    flat = logits.reshape(n, vocab)
    compiled = use_compiled(compile, flat, top_k, top_p)
    out, lse, sum_sq = _TokenLogprobs.apply(flat, flat_ids, temp, top_k, top_p, chunk_tokens, compiled)
    out = out.reshape(lead)
    if return_stats:
        return out, VocabStats(lse=lse, sum_sq=sum_sq, temperature=temp, top_k=top_k, top_p=top_p)
    return out
