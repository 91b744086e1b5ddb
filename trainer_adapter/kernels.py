"""The full-vocabulary arithmetic of one token chunk (docs/math.md §8), eager and `torch.compile`d.

Two kernels on a [c, V] chunk of raw logits, π = softmax(ℓ/T) with the record's truncation replayed:

- `chunk_stats`: the processed logits at a (and at the top-K ids), logsumexp and Σ π² — the forward
  of `token_logprobs` and `compute_masks`' own pass;
- `chunk_grad`: g·(e_a − π)/T written into the chunk of the logits' gradient — the backward of
  `token_logprobs`.

Each has an eager form and a compiled form. The compiled form (Inductor: C++ on CPU, Triton on CUDA) is
one fused loop per kernel that reads the raw chunk in place, upcasting bfloat16 and dividing by T on the
fly: no [c, V] workspace, and the statistics come from m = max x, s₁ = Σ e, s₂ = Σ e² (e = exp(x − m))
in the same loop. Which form runs is decided once per call by `use_compiled`. A compiled kernel that
fails (no C++ compiler, no Triton, an Inductor bug) is reported once with a warning and the eager form
runs from then on in this process; an error the eager form raises too is a real one and propagates.
Replayed truncation (top-k / top-p) always runs eager: its sort dominates the chunk anyway.

Knows nothing of masks, divergences or losses.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Literal, NamedTuple

import torch

from .processed import Workspace, compute_dtype, processed_chunk, truncation_active

Tensor = torch.Tensor
Compile = Literal["auto", True, False]

# "auto" compiles for LLM-sized vocabularies only: below this the chunk is cheap and the first compiled
# call of a process (10–25 s on 2 CPU cores: Dynamo's start-up, Inductor, g++ unless Inductor's disk
# cache has the kernel) would never pay for itself — toy models and the tests stay eager.
AUTO_MIN_VOCAB = 16384


class ChunkStats(NamedTuple):
    x_a: Tensor  # [c] processed logit ℓ_a/T of the sampled token
    x_top: Tensor | None  # [c, K] processed logits of the top-K ids, if asked for
    lse: Tensor  # [c] logsumexp of the processed logits
    sum_sq: Tensor  # [c] Σ_V π²


def check_compile(value: object, name: str) -> None:
    if not (value == "auto" or isinstance(value, bool)):
        raise ValueError(f"{name}={value!r}; expected 'auto', True or False")


def use_compiled(
    setting: Compile, logits: Tensor, top_k: int | None, top_p: float | None
) -> bool:  # logits [N, V]
    """Whether this call runs the compiled kernels. "auto": on CUDA, and on CPU for V ≥ AUTO_MIN_VOCAB;
    never for float64 (tests and references want the eager arithmetic) nor after a compile failed."""
    if setting is False or _broken or truncation_active(top_k, top_p, logits.shape[-1]):
        return False
    if setting is True:
        return True
    return logits.dtype != torch.float64 and (logits.is_cuda or logits.shape[-1] >= AUTO_MIN_VOCAB)


# ---- eager ------------------------------------------------------------------------------------------


def _anchor_floor(dtype: torch.dtype) -> float:
    """Smallest π_a trusted as an anchor of logsumexp: 1/eps above the smallest normal, so log π_a keeps
    full relative precision (≈ 1e-31 in float32)."""
    info = torch.finfo(dtype)
    return info.tiny / info.eps


def _eager_stats(
    raw: Tensor,  # [c, V]
    temp: Tensor,  # [c] float64
    ids: Tensor,  # [c] long
    top: Tensor | None,  # [c, K] long
    top_k: int | None,
    top_p: float | None,
    work: Workspace,
) -> ChunkStats:
    """One softmax and one reduction: lse = x_a − log π_a, anchored at the sampled token (π_a is gathered
    from the softmax, so no separate max pass is needed); rows where π_a is too small to be an exact
    anchor (a far in the tail, outside a replayed truncation, a padding id) take lse = max x − log max π
    instead — max π = exp(max x − lse) ≥ 1/V never underflows."""
    dtype = compute_dtype(raw)
    x = processed_chunk(raw, temp, top_k, top_p, work)  # [c, V]
    x_a = x.gather(-1, ids.unsqueeze(-1)).squeeze(-1)  # [c]
    x_top = x.gather(-1, top) if top is not None else None  # [c, K]
    pi = work.get(x.shape[0], x.shape[1], dtype, x.device)  # may be x itself: gathered already
    torch.softmax(x, dim=-1, out=pi)
    pi_a = pi.gather(-1, ids.unsqueeze(-1)).squeeze(-1)  # [c]
    lse = x_a - pi_a.log()
    low = ~(pi_a >= _anchor_floor(dtype))  # also NaN
    if bool(low.any()):
        rows = low.nonzero().squeeze(-1)
        # x may have been overwritten by π: re-read the max from the raw rows. Truncation always keeps
        # the largest logit and division by T > 0 is monotone, so this is max x exactly.
        m = raw[rows].to(dtype).amax(dim=-1) / temp[rows].to(dtype)
        lse[rows] = m - pi[rows].amax(dim=-1).log()
    sum_sq = torch.linalg.vector_norm(pi, dim=-1).square_()  # no [c, V] temporary
    return ChunkStats(x_a, x_top, lse, sum_sq)


def _eager_grad(
    raw: Tensor,  # [c, V]
    temp: Tensor,  # [c] float64
    ids: Tensor,  # [c] long
    scale: Tensor,  # [c] g/T, compute dtype
    out: Tensor,  # [c, V] the gradient's rows, logits' dtype
    top_k: int | None,
    top_p: float | None,
    work: Workspace,
) -> None:
    # softmax recomputes max and sum; measured faster on CPU than exp(x − lse) from the saved lse,
    # whose unary exp is the slower, more exact one (bench/adapter.py --arith).
    dtype = compute_dtype(raw)
    x = processed_chunk(raw, temp, top_k, top_p, work)  # [c, V]
    direct = out.dtype == dtype  # π can be written straight into the gradient
    pi = out if direct else work.get(x.shape[0], x.shape[1], dtype, x.device)
    torch.softmax(x, dim=-1, out=pi)  # π (0 outside the kept set)
    s = scale.unsqueeze(-1)  # [c, 1]
    pi.mul_(-s).scatter_add_(-1, ids.unsqueeze(-1), s)  # g (e_a − π) / T
    if not direct:
        out.copy_(pi)


# ---- compiled ---------------------------------------------------------------------------------------


def _stats_formula(raw: Tensor, temp: Tensor) -> tuple[Tensor, Tensor]:  # [c, V], [c] -> [c], [c]
    dtype = compute_dtype(raw)
    x = raw.to(dtype) / temp.to(dtype).unsqueeze(-1)
    m = x.amax(dim=-1, keepdim=True)
    e = torch.exp(x - m)
    s1 = e.sum(dim=-1)
    return m.squeeze(-1) + s1.log(), e.square().sum(dim=-1) / s1.square()


def _grad_formula(raw: Tensor, temp: Tensor, lse: Tensor, scale: Tensor, ids: Tensor, out: Tensor) -> None:
    dtype = compute_dtype(raw)
    x = raw.to(dtype) / temp.to(dtype).unsqueeze(-1)  # [c, V]
    pi = torch.exp(x - lse.unsqueeze(-1))
    hit = torch.arange(raw.shape[-1], device=raw.device) == ids.unsqueeze(-1)  # e_a without a scatter
    out.copy_(scale.unsqueeze(-1) * (hit.to(dtype) - pi))


_compiled: dict[str, Callable] = {}
_broken: str | None = None  # the first compile failure; everything runs eager after it
_FORMULAS = {"stats": _stats_formula, "grad": _grad_formula}


def _call_compiled(name: str, *args: Tensor):
    fn = _compiled.get(name)
    if fn is None:
        fn = _compiled[name] = torch.compile(_FORMULAS[name])
    # Rows vary (the last chunk, the batch): one kernel for any row count instead of a recompile each.
    for a in args:
        torch._dynamo.maybe_mark_dynamic(a, 0)
    return fn(*args)


def _disable(exc: Exception) -> None:
    global _broken
    if _broken is None:
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        _broken = f"{type(exc).__name__}: {first}"
        warnings.warn(
            f"maskroll.trainer_adapter: torch.compile of the vocabulary kernels failed ({_broken}); "
            "using the eager kernels for the rest of this process (same results, more arithmetic)",
            RuntimeWarning,
            stacklevel=3,
        )


def compile_failure() -> str | None:
    """The compile error that switched this process to the eager kernels, if any."""
    return _broken


# ---- the two kernels --------------------------------------------------------------------------------


def chunk_stats(
    raw: Tensor,  # [c, V] raw logits, any float dtype
    temp: Tensor,  # [c] float64
    ids: Tensor,  # [c] long
    top: Tensor | None,  # [c, K] long, or None
    *,
    compiled: bool,
    top_k: int | None,
    top_p: float | None,
    work: Workspace,
) -> ChunkStats:
    """x_a, x_top, logsumexp and Σ π² of one chunk (docs/math.md §8); `compiled` from `use_compiled`."""
    if compiled and _broken is None:
        try:
            lse, sum_sq = _call_compiled("stats", raw, temp)
        except Exception as exc:  # the compile fallback rule (module docstring)
            _disable(exc)
        else:
            dtype = compute_dtype(raw)
            t = temp.to(dtype)  # [c]
            # Upcast, then divide: the same two roundings as processed_chunk.
            x_a = raw.gather(-1, ids.unsqueeze(-1)).squeeze(-1).to(dtype) / t
            x_top = raw.gather(-1, top).to(dtype) / t.unsqueeze(-1) if top is not None else None
            return ChunkStats(x_a, x_top, lse, sum_sq)
    return _eager_stats(raw, temp, ids, top, top_k, top_p, work)


def chunk_grad(
    raw: Tensor,  # [c, V] raw logits
    temp: Tensor,  # [c] float64
    ids: Tensor,  # [c] long
    lse: Tensor,  # [c] from chunk_stats
    scale: Tensor,  # [c] g/T in the compute dtype
    out: Tensor,  # [c, V] receives scale·(e_a − π), logits' dtype
    *,
    compiled: bool,
    top_k: int | None,
    top_p: float | None,
    work: Workspace,
) -> None:
    if compiled and _broken is None:
        try:
            _call_compiled("grad", raw, temp, lse, scale, ids, out)
            return
        except Exception as exc:  # the compile fallback rule (module docstring)
            _disable(exc)
    _eager_grad(raw, temp, ids, scale, out, top_k, top_p, work)
