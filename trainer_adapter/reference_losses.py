"""Straightforward float64 references of the distillation losses and the rollout corrections (docs/math.md
§9, §10), for the tests: full-vocabulary log_softmax, one Python loop per token or per sequence, sets
built id by id, no chunking, no shared code with `distill` or `corrections`. Slow by design; the tests
differentiate through them with torch.autograd to check the gradients too.
"""

from __future__ import annotations

import math

import torch

Tensor = torch.Tensor
TINY = 1e-12


def _log(x: Tensor) -> Tensor:
    return torch.log(torch.clamp(x, min=TINY))


def ref_student(
    logits: Tensor, ids: Tensor, topk_ids: Tensor, temperature: float = 1.0
) -> tuple[Tensor, Tensor]:  # [N, V], [N], [N, K] -> log π_a [N], log π at the ids [N, K]
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    lp_a = torch.stack([logp[i, int(ids[i])] for i in range(len(ids))])
    lp_s = torch.stack([torch.stack([logp[i, int(j)] for j in topk_ids[i]]) for i in range(len(ids))])
    return lp_a, lp_s


def ref_buckets(
    logq_full: Tensor,  # [V] the student's log π for one token
    teacher_ids: list[int],  # K
    teacher_lp: Tensor,  # [K]
    a: int,
    teacher_lp_a: Tensor,  # []
) -> tuple[list[Tensor], list[Tensor], Tensor, Tensor]:  # p on S, q on S, p_tail, q_tail
    p: dict[int, Tensor] = {}
    for tid, lp in zip(teacher_ids, teacher_lp, strict=True):
        p[int(tid)] = torch.exp(lp.double())
    if a not in p:
        p[a] = torch.exp(teacher_lp_a.double())
    ids = list(p)
    ps = [p[i] for i in ids]
    qs = [torch.exp(logq_full[i]) for i in ids]
    p_tail = torch.clamp(1 - sum(ps), min=0.0)
    q_tail = torch.clamp(1 - sum(qs), min=0.0)
    return ps, qs, p_tail, q_tail


def ref_forward_kl(ps: list[Tensor], qs: list[Tensor], p_tail: Tensor, q_tail: Tensor) -> Tensor:
    out = torch.zeros((), dtype=torch.float64)
    for p, q in zip(ps, qs, strict=True):
        if float(p.detach()) > 0:
            out = out + p * (torch.log(p) - torch.log(q))
    return out + p_tail * (_log(p_tail) - _log(q_tail))


def ref_jsd(ps: list[Tensor], qs: list[Tensor], p_tail: Tensor, q_tail: Tensor, beta: float) -> Tensor:
    kl_p = torch.zeros((), dtype=torch.float64)
    kl_q = torch.zeros((), dtype=torch.float64)
    for p, q in [*zip(ps, qs, strict=True), (p_tail, q_tail)]:
        m = beta * p + (1 - beta) * q
        if float(p.detach()) > 0:
            kl_p = kl_p + p * (_log(p) - _log(m))
        if float(q.detach()) > 0:
            kl_q = kl_q + q * (_log(q) - _log(m))
    return beta * kl_p + (1 - beta) * kl_q


def ref_aggregate(per_tok: Tensor, valid: Tensor, aggregation: str, max_len: int | None = None) -> Tensor:
    """per_tok, valid: [B, T] (or [N] for token_mean)."""
    if aggregation == "token_mean":
        n = int(valid.sum())
        total = sum((per_tok.reshape(-1)[i] for i in range(valid.numel()) if bool(valid.reshape(-1)[i])), 0.0)
        return torch.as_tensor(total, dtype=torch.float64) / max(n, 1)
    seqs = []
    for b in range(per_tok.shape[0]):
        n_b = int(valid[b].sum())
        if n_b == 0:
            continue
        s = sum(per_tok[b, t] for t in range(per_tok.shape[1]) if bool(valid[b, t]))
        denom = float(max_len or per_tok.shape[1]) if aggregation == "seq_mean_token_sum_norm" else n_b
        seqs.append(s / denom)
    return sum(seqs) / len(seqs) if seqs else torch.zeros((), dtype=torch.float64)


def ref_distill_loss(
    logits: Tensor,  # [B, T, V]
    ids: Tensor,  # [B, T]
    teacher_ids: Tensor,  # [B, T, K]
    teacher_lp: Tensor,  # [B, T, K]
    teacher_lp_a: Tensor,  # [B, T]
    valid: Tensor,  # [B, T] bool
    *,
    kind: str,
    beta: float = 0.5,
    temperature: float = 1.0,
    aggregation: str = "token_mean",
    max_len: int | None = None,
) -> Tensor:
    bsz, t_len, _ = logits.shape
    logq = torch.log_softmax(logits.double() / temperature, dim=-1)
    rows = []
    for b in range(bsz):
        row = []
        for t in range(t_len):
            if not bool(valid[b, t]):
                row.append(torch.zeros((), dtype=torch.float64))
                continue
            bk = ref_buckets(
                logq[b, t], teacher_ids[b, t].tolist(), teacher_lp[b, t], int(ids[b, t]), teacher_lp_a[b, t]
            )
            row.append(ref_forward_kl(*bk) if kind == "forward_kl" else ref_jsd(*bk, beta))
        rows.append(torch.stack(row))
    return ref_aggregate(torch.stack(rows), valid, aggregation, max_len)


def ref_topk_overlap(logits: Tensor, teacher_ids: Tensor, valid: Tensor) -> float:  # [N, V], [N, K], [N]
    fracs = []
    k = teacher_ids.shape[-1]
    for i in range(logits.shape[0]):
        if bool(valid[i]):
            kth = sorted(logits[i].tolist(), reverse=True)[k - 1]
            fracs.append(sum(1 for j in teacher_ids[i].tolist() if float(logits[i, j]) >= kth) / k)
    return sum(fracs) / len(fracs) if fracs else math.nan


# ---- rollout corrections (docs/math.md §9) ------------------------------------------------------------


def ref_correction(
    lp: Tensor, mu_lp: Tensor, valid: Tensor, name: str, cap: float, low: float | None, high: float | None
) -> tuple[list[list[float]], list[list[bool]]]:  # [B, T] lists: w and the correction's keep
    """One sequence at a time, with math on Python floats."""
    weights, keeps = [], []
    for b in range(lp.shape[0]):
        toks = [t for t in range(lp.shape[1]) if bool(valid[b, t])]
        log_r = [float(lp[b, t]) - float(mu_lp[b, t]) for t in range(lp.shape[1])]
        r = [math.exp(min(x, 20.0)) for x in log_r]
        seq_sum = sum(log_r[t] for t in toks)
        rho = math.exp(min(seq_sum, 20.0))
        geo = math.exp(seq_sum / len(toks)) if toks else 1.0
        w_row, k_row = [], []
        for t in range(lp.shape[1]):
            if name == "token_tis":
                w, keep = min(r[t], cap), True
            elif name == "seq_tis":
                w, keep = min(rho, cap), True
            elif name == "token_mis":
                w, keep = min(r[t], cap), low <= r[t] <= high
            elif name == "seq_mis":
                w, keep = min(rho, cap), low <= rho <= high
            elif name == "icepop":
                w, keep = 1.0, low <= r[t] <= high
            elif name == "geo_mask":
                w, keep = min(r[t], cap), low <= geo <= high
            else:
                raise ValueError(name)
            w_row.append(w)
            k_row.append(keep)
        weights.append(w_row)
        keeps.append(k_row)
    return weights, keeps


def ref_corrected_policy_loss(
    lp: Tensor,  # [B, T] log π_a, with grad
    mu_lp: Tensor,  # [B, T]
    adv: Tensor,  # [B] per sequence
    keep: Tensor,  # [B, T] bool: the trust-region mask
    valid: Tensor,  # [B, T] bool
    *,
    name: str,
    cap: float,
    low: float | None = None,
    high: float | None = None,
    aggregation: str = "token_mean",
) -> Tensor:
    """agg(−A · w · M · M_c · log π_a) with w, M_c from ref_correction (constants)."""
    w, kc = ref_correction(lp.detach(), mu_lp, valid, name, cap, low, high)
    rows = []
    for b in range(lp.shape[0]):
        row = []
        for t in range(lp.shape[1]):
            on = bool(valid[b, t]) and bool(keep[b, t]) and kc[b][t] and float(adv[b]) * w[b][t] != 0
            row.append(-float(adv[b]) * w[b][t] * lp[b, t] if on else torch.zeros((), dtype=torch.float64))
        rows.append(torch.stack(row))
    return ref_aggregate(torch.stack(rows), valid, aggregation)
