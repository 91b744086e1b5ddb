"""On-policy distillation from a teacher's top-K, on the records the masks already use (docs/math.md §10).

Three terms, each a plain function of tensors:

- `distill_advantages`: the sampled-token reverse KL as a per-token advantage,
  A = A_rl + λ · (log π_teacher(a) − log π_a), detached — the on-policy distillation form; it goes
  through policy_loss, so the trust-region masks and the rollout correction apply to it as to A_rl;
- `distill_loss(kind="forward_kl")`: KL(π_teacher ‖ π) on the buckets S = teacher top-K ∪ {a} plus one
  tail bucket, by autograd;
- `distill_loss(kind="jsd", beta=β)`: the generalised Jensen–Shannon divergence on the same buckets.

`student_logprobs` is the one pass over the vocabulary: log π_a, log π on the teacher's top-K ids (both
with gradient), the normaliser for `compute_masks(..., vocab_stats=...)` and the student's top-K
membership of the teacher's ids, chunk by chunk (`kernels`), so a distillation step keeps the plain
step's memory: one [chunk_tokens, V] buffer and the [N, V] gradient. Knows nothing of the teacher's
transport (the Score RPC) or of the masks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal, NamedTuple

import torch

from .distributed import World
from .inputs import check_shape, per_token, response_mask_flat
from .kernels import Compile, check_compile, chunk_grad, chunk_stats, use_compiled
from .loss import AGGREGATIONS, Aggregation
from .processed import VocabStats, Workspace, compute_dtype

Tensor = torch.Tensor
DistillKind = Literal["forward_kl", "jsd"]
TINY = 1e-12  # docs/math.md §1: log(max(x, 1e-12)) for clamped tail masses


# ---- the student's side: one chunked pass (docs/math.md §8, §10) -----------------------------------------


class _SupportLogprobs(torch.autograd.Function):
    """log π at J ids per row, and log π_a, with the gradient of both in one backward pass per chunk."""

    @staticmethod
    def forward(ctx, logits, ids, support, temp, chunk, compiled, every):  # [N, V], [N], [N, J], [N]
        n, j = support.shape
        dtype = compute_dtype(logits)
        out = torch.empty(n, j, dtype=dtype, device=logits.device)  # log π at support
        lp_a = torch.empty(n, dtype=dtype, device=logits.device)
        lse, sum_sq = torch.empty_like(lp_a), torch.empty_like(lp_a)
        hit = torch.zeros(n, j, dtype=torch.bool, device=logits.device)
        ranked = torch.zeros(n, dtype=torch.bool, device=logits.device)
        if every:
            ranked[::every] = True
        work = Workspace()
        for start in range(0, n, chunk):
            rows = slice(start, min(start + chunk, n))
            st = chunk_stats(
                logits[rows], temp[rows], ids[rows], support[rows],
                compiled=compiled, top_k=None, top_p=None, work=work,
            )  # fmt: skip
            lse[rows], sum_sq[rows] = st.lse, st.sum_sq
            out[rows] = st.x_top - st.lse.unsqueeze(-1)
            lp_a[rows] = st.x_a - st.lse
            first = start + (-start) % every if every else rows.stop
            if first < rows.stop:
                # The student's top-K membership on raw logits (T > 0 and no truncation keep the order).
                # A top-K over V costs about as much per row as a softmax on CPU: hence only the rows
                # 0, every, 2·every, … — a strided view, no copy.
                sel = slice(first, rows.stop, every)
                raw = logits[sel]  # [c', V]
                kth = raw.topk(j, dim=-1, sorted=False).values.amin(-1, keepdim=True)  # [c', 1]
                hit[sel] = raw.gather(-1, support[sel]) >= kth
        ctx.save_for_backward(logits, ids, support, temp, lse)
        ctx.chunk, ctx.compiled = chunk, compiled
        ctx.mark_non_differentiable(lse, sum_sq, hit, ranked)
        return out, lp_a, lse, sum_sq, hit, ranked

    @staticmethod
    def backward(ctx, g_support, g_a, _g_lse, _g_sum_sq, _g_hit, _g_ranked):  # [N, J], [N] -> [N, V]
        logits, ids, support, temp, lse = ctx.saved_tensors
        n = logits.shape[0]
        dtype = compute_dtype(logits)
        grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
        work = Workspace()
        for start in range(0, n, ctx.chunk):
            rows = slice(start, min(start + ctx.chunk, n))
            t = temp[rows].to(dtype)  # [c]
            gs = g_support[rows].to(dtype) / t.unsqueeze(-1)  # [c, J] g_j / T
            s_sum = gs.sum(-1)  # [c]
            # Σ_j g_j (e_{i_j} − π)/T + g_a (e_a − π)/T
            #   = (g_a/T + Σ_j g_j/T)(e_a − π) + Σ_j g_j/T (e_{i_j} − e_a):
            # the one-id kernel (eager or compiled) writes the first part, two [c, J] scatters the rest.
            chunk_grad(
                logits[rows], temp[rows], ids[rows], lse[rows], g_a[rows].to(dtype) / t + s_sum, grad[rows],
                compiled=ctx.compiled, top_k=None, top_p=None, work=work,
            )  # fmt: skip
            g = grad[rows]
            g.scatter_add_(-1, support[rows], gs.to(grad.dtype))
            g.scatter_add_(-1, ids[rows].unsqueeze(-1), (-s_sum).unsqueeze(-1).to(grad.dtype))
        return grad, None, None, None, None, None, None


class StudentLogprobs(NamedTuple):
    """student_logprobs' outputs; `logprobs` and `support` carry the gradient."""

    logprobs: Tensor  # [N] or [B, T] log π_a
    support: Tensor  # [..., K] log π at the teacher's top-K ids
    stats: VocabStats  # for compute_masks(..., vocab_stats=...)
    in_student_topk: Tensor  # [..., K] bool: the teacher's id is among the student's K largest (ties in)
    ranked: Tensor  # [...] bool: the token rows whose top-K was ranked (in_student_topk False elsewhere)


def student_logprobs(
    logits: Tensor,  # [N, V] or [B, T, V], requires grad
    ids: Tensor,  # [N] or [B, T] long: the sampled tokens a
    teacher_topk_ids: Tensor,  # [..., K] long: the teacher's top-K ids per token
    *,
    temperature: float | Tensor = 1.0,  # the record's: π = softmax(ℓ/T)
    chunk_tokens: int = 1024,
    compile: Compile = "auto",
    overlap_every: int = 16,  # rank the teacher's ids among the student's top-K on every n-th row; 0: off
) -> StudentLogprobs:
    """log π_a and log π at the teacher's top-K ids under π = softmax(ℓ/T), differentiable w.r.t. the
    logits, in the one chunked pass of token_logprobs (docs/math.md §8, §10). No truncation replay: a
    distillation target needs π over the whole vocabulary. Padding ids may hold anything (clamped).

    The top-K overlap metric needs the student's K-th largest logit, a top-K over V that costs about as
    much per row as a softmax on CPU: it is measured on token rows 0, n, 2n, … (`overlap_every` = n,
    default 16; 1: all; 0: off)."""
    lead, vocab = ids.shape, logits.shape[-1]
    k = teacher_topk_ids.shape[-1]
    check_shape(logits, (*lead, vocab), "logits")
    check_shape(teacher_topk_ids, (*lead, k), "teacher_topk_ids")
    check_compile(compile, "compile")
    if not (isinstance(chunk_tokens, int) and chunk_tokens >= 1):
        raise ValueError(f"chunk_tokens={chunk_tokens!r}; expected an int >= 1")
    if not (isinstance(overlap_every, int) and overlap_every >= 0):
        raise ValueError(f"overlap_every={overlap_every!r}; expected an int >= 0")
    if not 1 <= k <= vocab:
        raise ValueError(f"teacher_topk_ids has K={k} entries per token; expected 1 <= K <= V={vocab}")
    n = lead.numel()
    temp = per_token(temperature, lead, "temperature", torch.float64).to(logits.device).contiguous()
    if not bool(torch.isfinite(temp).all()) or bool((temp <= 0).any()):
        raise ValueError("temperature must be finite and > 0")
    flat = logits.reshape(n, vocab)
    flat_ids = ids.reshape(n).long().clamp(0, vocab - 1)
    support = teacher_topk_ids.reshape(n, k).long().clamp(0, vocab - 1).contiguous()
    compiled = use_compiled(compile, flat, None, None)
    out, lp_a, lse, sum_sq, hit, ranked = _SupportLogprobs.apply(
        flat, flat_ids, support, temp, chunk_tokens, compiled, overlap_every
    )
    return StudentLogprobs(
        logprobs=lp_a.reshape(lead),
        support=out.reshape(*lead, k),
        stats=VocabStats(lse=lse, sum_sq=sum_sq, temperature=temp),
        in_student_topk=hit.reshape(*lead, k),
        ranked=ranked.reshape(lead),
    )


# ---- (a) the sampled-token reverse KL as an advantage --------------------------------------------------


def distill_advantages(
    logprobs: Tensor,  # [N] or [B, T] log π_a (its gradient is not used)
    teacher_sampled_logprobs: Tensor,  # like logprobs: log π_teacher(a)
    advantages: Tensor | float | None = None,  # A_rl: [N], [B, T], per sequence [B], a scalar; None = 0
    *,
    weight: float = 1.0,  # λ
    response_mask: Tensor | None = None,  # bool like logprobs
) -> Tensor:  # like logprobs, detached; 0 off the response
    """A = A_rl + λ · (log π_teacher(a) − log π_a) per token (docs/math.md §10.1): minus the sampled-token
    (k1) estimate of KL(π‖π_teacher), detached, for policy_loss (and compute_masks' direction tests)."""
    if not math.isfinite(weight):
        raise ValueError(f"weight={weight}; expected a finite number")
    lead = logprobs.shape
    check_shape(teacher_sampled_logprobs, tuple(lead), "teacher_sampled_logprobs")
    valid = response_mask_flat(response_mask, lead, logprobs.device).reshape(lead)
    with torch.no_grad():
        lp = logprobs.detach()
        a_rl = 0.0 if advantages is None else advantages
        base = per_token(a_rl, lead, "advantages", lp.dtype).to(lp.device).reshape(lead)
        gap = teacher_sampled_logprobs.to(lp.dtype) - lp
        return torch.where(valid, base + weight * gap, 0.0)


# ---- (b, c) top-K forward KL and generalised JSD on buckets --------------------------------------------


class TeacherBuckets(NamedTuple):
    """The teacher's support S = topK ∪ {a} per token (docs/math.md §10.2); column K is a when a ∉ topK."""

    logp: Tensor  # [n, K+1] teacher log p on S (column K: log π_teacher(a))
    logq: Tensor  # [n, K+1] student log q on S, with grad
    member: Tensor  # [n, K+1] bool
    p_tail: Tensor  # [n] max(0, 1 − Σ_S p)
    q_tail: Tensor  # [n] max(0, 1 − Σ_S q), with grad


def teacher_buckets(
    student_support: Tensor,  # [n, K] log q at the teacher's top-K ids, with grad
    student_logprobs: Tensor,  # [n] log q_a, with grad
    teacher_topk_ids: Tensor,  # [n, K]
    teacher_topk_logprobs: Tensor,  # [n, K]
    teacher_sampled_logprobs: Tensor,  # [n]
    sampled_ids: Tensor,  # [n]
    valid: Tensor,  # [n] bool
) -> TeacherBuckets:
    dtype = student_support.dtype
    hit = teacher_topk_ids == sampled_ids.unsqueeze(-1)  # [n, K]
    member = torch.cat([torch.ones_like(hit), (~hit.any(-1)).unsqueeze(-1)], dim=-1)  # [n, K+1]
    logp = torch.cat([teacher_topk_logprobs, teacher_sampled_logprobs.unsqueeze(-1)], dim=-1).to(dtype)
    # Padding rows may carry garbage (−inf, nan): give them p = 1/(K+1) so nothing non-finite reaches
    # autograd; their values are dropped by the caller.
    logp = torch.where(valid.unsqueeze(-1), logp, -math.log(logp.shape[-1]))
    logq = torch.cat([student_support, student_logprobs.unsqueeze(-1)], dim=-1)  # [n, K+1]
    p = torch.where(member, logp.exp(), 0.0)
    q = torch.where(member, logq.exp(), 0.0)
    return TeacherBuckets(
        logp=logp,
        logq=logq,
        member=member,
        p_tail=(1.0 - p.sum(-1)).clamp_min(0.0),
        q_tail=(1.0 - q.sum(-1)).clamp_min(0.0),
    )


def _log_clamped(x: Tensor) -> Tensor:
    return x.clamp_min(TINY).log()


def forward_kl(b: TeacherBuckets, beta: float) -> Tensor:  # [n]
    """KL(p‖q) on the buckets: Σ_S p_i (log p_i − log q_i) + p_T (log p_T − log q_T); p = 0 terms are 0."""
    p = torch.where(b.member, b.logp.exp(), 0.0)
    terms = torch.where(p > 0, p * (b.logp - b.logq), 0.0).sum(-1)
    return terms + b.p_tail * (_log_clamped(b.p_tail) - _log_clamped(b.q_tail))


def jsd(b: TeacherBuckets, beta: float) -> Tensor:  # [n]
    """β KL(p‖m) + (1−β) KL(q‖m), m = β p + (1−β) q, on the buckets (docs/math.md §10.3)."""
    lb, l1b = math.log(beta), math.log1p(-beta)
    logm = torch.logaddexp(b.logp + lb, b.logq + l1b)  # [n, K+1]
    p = torch.where(b.member, b.logp.exp(), 0.0)
    q = torch.where(b.member, b.logq.exp(), 0.0)
    kl_p = torch.where(p > 0, p * (b.logp - logm), 0.0).sum(-1)
    kl_q = torch.where(q > 0, q * (b.logq - logm), 0.0).sum(-1)
    m_tail = beta * b.p_tail + (1.0 - beta) * b.q_tail
    log_mt = _log_clamped(m_tail)
    kl_p = kl_p + b.p_tail * (_log_clamped(b.p_tail) - log_mt)
    kl_q = kl_q + b.q_tail * (_log_clamped(b.q_tail) - log_mt)
    return beta * kl_p + (1.0 - beta) * kl_q


# distill_loss(kind=...) → its per-token divergence, looked up once per call (STYLE.md §3).
DISTILL_LOSSES: dict[str, Callable[[TeacherBuckets, float], Tensor]] = {"forward_kl": forward_kl, "jsd": jsd}


def distill_loss(
    student: StudentLogprobs,  # from student_logprobs on the same tokens and the teacher's top-K ids
    sampled_ids: Tensor,  # [N] or [B, T] long
    teacher_topk_ids: Tensor,  # [..., K] long
    teacher_topk_logprobs: Tensor,  # [..., K] log π_teacher of its top-K
    teacher_sampled_logprobs: Tensor,  # [N] or [B, T] log π_teacher(a)
    *,
    kind: DistillKind = "forward_kl",
    beta: float = 0.5,  # jsd only: 0 < β < 1
    aggregation: Aggregation = "token_mean",
    response_mask: Tensor | None = None,  # bool like sampled_ids
    max_len: int | None = None,  # seq_mean_token_sum_norm's constant
    world: World | None = None,  # the trainer ranks: global denominators, as policy_loss's `world`
) -> tuple[Tensor, dict[str, Tensor]]:
    """Scalar distillation loss agg(D_kind(π_teacher, π)) over the response tokens (docs/math.md §10), and
    metrics: `distill_kl_sampled` = mean of log π_a − log π_teacher(a) (the k1 estimate of KL(π‖π_teacher)
    on the sampled tokens), `distill_forward_kl` = mean bucketed KL(π_teacher‖π), `distill_jsd` (kind
    "jsd"), `topk_overlap` = mean fraction of the teacher's top-K ids among the student's top-K over the
    response rows student_logprobs ranked (nan if none).

    With `world` the aggregation's denominator is the global one and the loss W · (this rank's sum) /
    (global denominator), exactly as policy_loss's (docs/math.md "Across ranks"); the metrics stay
    this rank's."""
    if kind not in DISTILL_LOSSES:
        raise ValueError(f"kind={kind!r}; expected one of {tuple(DISTILL_LOSSES)}")
    if kind == "jsd" and not 0.0 < beta < 1.0:
        raise ValueError(
            f"beta={beta}; the generalised JSD needs 0 < beta < 1 (forward_kl is its β → 0 shape)"
        )
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation={aggregation!r}; expected one of {tuple(AGGREGATIONS)}")
    lead = sampled_ids.shape
    k = teacher_topk_ids.shape[-1]
    n = lead.numel()
    check_shape(student.logprobs, tuple(lead), "student.logprobs")
    check_shape(student.support, (*lead, k), "student.support")
    check_shape(teacher_topk_logprobs, (*lead, k), "teacher_topk_logprobs")
    check_shape(teacher_sampled_logprobs, tuple(lead), "teacher_sampled_logprobs")
    device = student.logprobs.device
    valid = response_mask_flat(response_mask, lead, device)  # [N]
    b = teacher_buckets(
        student.support.reshape(n, k),
        student.logprobs.reshape(n),
        teacher_topk_ids.reshape(n, k).to(device).long(),
        teacher_topk_logprobs.reshape(n, k).to(device),
        teacher_sampled_logprobs.reshape(n).to(device),
        sampled_ids.reshape(n).to(device).long(),
        valid,
    )
    div = DISTILL_LOSSES[kind](b, beta)  # [N]
    per_tok = torch.where(valid, div, 0.0)
    loss = AGGREGATIONS[aggregation](per_tok.reshape(lead), valid.reshape(lead), max_len, world)

    with torch.no_grad():
        vf = valid.to(per_tok.dtype)
        count = vf.sum()

        def mean(x: Tensor) -> Tensor:  # nan over no response tokens
            return torch.where(valid, x, 0.0).sum() / count

        member_a = b.member[:, -1]  # a ∉ topK: its own column; else its top-K column holds log p(a)
        metrics = {
            "distill_kl_sampled": mean(student.logprobs.detach().reshape(n) - b.logp[:, -1]),
            "distill_forward_kl": mean((div if kind == "forward_kl" else forward_kl(b, beta)).detach()),
            "distill_sampled_in_teacher_topk": mean((~member_a).to(vf.dtype)),
        }
        if kind == "jsd":
            metrics["distill_jsd"] = mean(per_tok.detach())
        rk = valid & student.ranked.reshape(n)
        frac = student.in_student_topk.reshape(n, k).to(vf.dtype).mean(-1)
        metrics["topk_overlap"] = torch.where(rk, frac, 0.0).sum() / rk.sum()
    return loss, metrics
