"""Distillation from a teacher's top-K (docs/math.md §10): hand-computed bucketed forward KL and JSD, the
closed-form gradient, the chunked student pass and every loss against the float64 reference
(`trainer_adapter/reference_losses.py`), values and gradients, with padding and a ∈ / ∉ teacher top-K;
the sampled-token reverse-KL advantage and its policy gradient; the all-masked edge."""

from __future__ import annotations

import math

import pytest
import torch

from maskroll.trainer_adapter import (
    MaskConfig,
    compute_masks,
    distill_advantages,
    distill_loss,
    policy_loss,
    student_logprobs,
    token_loss,
)
from maskroll.trainer_adapter.reference_losses import (
    ref_distill_loss,
    ref_student,
    ref_topk_overlap,
)

L = math.log
F64 = torch.float64

# ---- hand case: V = 4, π = (0.4, 0.3, 0.2, 0.1), teacher top-2 = ids (1, 0) with p = (0.5, 0.3) ---------
PI = [0.4, 0.3, 0.2, 0.1]
T_IDS = [1, 0]
T_LP = [L(0.5), L(0.3)]


def _one(a: int, teacher_lp_a: float, kind: str = "forward_kl", beta: float = 0.5):
    logits = torch.log(torch.tensor([PI], dtype=F64)).requires_grad_(True)  # [1, V]
    ids = torch.tensor([a])
    tids = torch.tensor([T_IDS])
    s = student_logprobs(logits, ids, tids)
    loss, m = distill_loss(
        s,
        ids,
        tids,
        torch.tensor([T_LP], dtype=F64),
        torch.tensor([teacher_lp_a], dtype=F64),
        kind=kind,
        beta=beta,
    )
    loss.backward()
    return loss, m, logits.grad[0]


def test_forward_kl_by_hand_sampled_token_outside_the_teacher_top_k() -> None:
    # S = {1, 0, 2}: p = (0.5, 0.3, 0.1), p_T = 0.1; q = (0.3, 0.4, 0.2), q_T = 0.1
    loss, m, grad = _one(a=2, teacher_lp_a=L(0.1))
    want = 0.5 * L(0.5 / 0.3) + 0.3 * L(0.3 / 0.4) + 0.1 * L(0.1 / 0.2) + 0.1 * L(0.1 / 0.1)
    assert loss.item() == pytest.approx(want, abs=1e-14)
    assert want == pytest.approx(0.0997935, abs=1e-7)
    # ∇_ℓ = q − p̃, p̃ = p on S and p_T · q_j / q_T on the tail (docs/math.md §10.2)
    p_tilde = torch.tensor([0.3, 0.5, 0.1, 0.1 * 0.1 / 0.1], dtype=F64)
    torch.testing.assert_close(grad, torch.tensor(PI, dtype=F64) - p_tilde, rtol=0, atol=1e-14)
    assert m["distill_sampled_in_teacher_topk"].item() == 0.0


def test_forward_kl_by_hand_sampled_token_inside_the_teacher_top_k() -> None:
    # a = 0 ∈ topK: S = {1, 0}, p_T = 0.2, q_T = 0.3; log π_teacher(a) is read from the top-K column
    loss, m, grad = _one(a=0, teacher_lp_a=L(0.3))
    want = 0.5 * L(0.5 / 0.3) + 0.3 * L(0.3 / 0.4) + 0.2 * L(0.2 / 0.3)
    assert loss.item() == pytest.approx(want, abs=1e-14)
    assert want == pytest.approx(0.0880152, abs=1e-7)
    p_tilde = torch.tensor([0.3, 0.5, 0.2 * 0.2 / 0.3, 0.2 * 0.1 / 0.3], dtype=F64)
    torch.testing.assert_close(grad, torch.tensor(PI, dtype=F64) - p_tilde, rtol=0, atol=1e-14)
    assert m["distill_sampled_in_teacher_topk"].item() == 1.0
    assert m["distill_kl_sampled"].item() == pytest.approx(L(0.4) - L(0.3), abs=1e-14)
    # student top-2 = ids {0, 1} = the teacher's: full overlap
    assert m["topk_overlap"].item() == 1.0


@pytest.mark.parametrize("beta", [0.1, 0.5, 0.9])
def test_jsd_by_hand(beta: float) -> None:
    loss, m, _ = _one(a=0, teacher_lp_a=L(0.3), kind="jsd", beta=beta)
    p, q = [0.5, 0.3, 0.2], [0.3, 0.4, 0.3]  # buckets: id 1, id 0, tail

    def kl_to_mix(x, y):
        return sum(xi * L(xi / (beta * pi + (1 - beta) * qi)) for xi, pi, qi in zip(x, p, q, strict=True))

    want = beta * kl_to_mix(p, q) + (1 - beta) * kl_to_mix(q, q)
    assert loss.item() == pytest.approx(want, abs=1e-14)
    assert m["distill_jsd"].item() == pytest.approx(want, abs=1e-14)
    # JSD_β ≤ H(β) = −β log β − (1−β) log(1−β)
    assert 0 < want <= -beta * L(beta) - (1 - beta) * L(1 - beta)


# ---- against the reference ---------------------------------------------------------------------------

B, T, V, K = 3, 5, 17, 4


def _case(seed: int = 0, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(B, T, V, generator=g, dtype=F64)
    t_logp = (logits + 1.5 * torch.randn(B, T, V, generator=g, dtype=F64)).log_softmax(-1)
    t_lp, t_ids = t_logp.topk(K, dim=-1)  # [B, T, K]
    ids = torch.randint(0, V, (B, T), generator=g)
    ids[0, :3] = t_ids[0, :3, 1]  # some sampled tokens inside the teacher's top-K, some outside
    t_lp_a = t_logp.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[1, 3:] = False
    valid[2, 1:] = False
    return logits.to(dtype), ids, t_ids, t_lp, t_lp_a, valid


def _garbage_padding(ids, t_ids, t_lp, t_lp_a, valid):
    """What a collated batch may hold at padding: ids out of range, −inf and nan logprobs."""
    pad = ~valid
    ids, t_ids, t_lp, t_lp_a = ids.clone(), t_ids.clone(), t_lp.clone(), t_lp_a.clone()
    ids[pad] = 10_000
    t_ids[pad] = -1
    t_lp[pad] = float("nan")
    t_lp_a[pad] = float("-inf")
    return ids, t_ids, t_lp, t_lp_a


@pytest.mark.parametrize("kind,beta", [("forward_kl", 0.5), ("jsd", 0.5), ("jsd", 0.2)])
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_distill_loss_matches_the_reference_values_and_gradients(
    kind, beta, aggregation, temperature
) -> None:
    logits, ids, t_ids, t_lp, t_lp_a, valid = _case()
    x = logits.clone().requires_grad_(True)
    g_ids, g_tids, g_tlp, g_tlpa = _garbage_padding(ids, t_ids, t_lp, t_lp_a, valid)
    s = student_logprobs(x, g_ids, g_tids, temperature=temperature, chunk_tokens=4, overlap_every=1)
    loss, m = distill_loss(
        s,
        g_ids,
        g_tids,
        g_tlp,
        g_tlpa,
        kind=kind,
        beta=beta,
        aggregation=aggregation,
        response_mask=valid,
        max_len=7,
    )
    loss.backward()
    y = logits.clone().requires_grad_(True)
    want = ref_distill_loss(
        y, ids, t_ids, t_lp, t_lp_a, valid, kind=kind, beta=beta, temperature=temperature,
        aggregation=aggregation, max_len=7,
    )  # fmt: skip
    want.backward()
    assert loss.item() == pytest.approx(want.item(), rel=1e-12, abs=1e-14)
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-10, atol=1e-14)
    assert torch.isfinite(x.grad).all()
    assert x.grad[~valid].abs().max() == 0  # padding rows get no gradient
    flat = valid.reshape(-1)
    assert m["topk_overlap"].item() == pytest.approx(
        ref_topk_overlap(logits.reshape(-1, V), t_ids.reshape(-1, K), flat), abs=1e-14
    )


def test_student_pass_matches_log_softmax_values_and_gradients() -> None:
    logits, ids, t_ids, *_ = _case(1)
    x = logits.clone().requires_grad_(True)
    s = student_logprobs(x, ids, t_ids, temperature=0.8, chunk_tokens=2)
    y = logits.clone().requires_grad_(True)
    lp_a, lp_s = ref_student(y.reshape(-1, V), ids.reshape(-1), t_ids.reshape(-1, K), temperature=0.8)
    torch.testing.assert_close(s.logprobs.reshape(-1), lp_a, rtol=0, atol=1e-13)
    torch.testing.assert_close(s.support.reshape(-1, K), lp_s, rtol=0, atol=1e-13)
    # any linear functional of both outputs: the fused backward against autograd through log_softmax
    g = torch.Generator().manual_seed(5)
    wa, ws = torch.randn(B * T, generator=g, dtype=F64), torch.randn(B * T, K, generator=g, dtype=F64)
    ((s.logprobs.reshape(-1) * wa).sum() + (s.support.reshape(-1, K) * ws).sum()).backward()
    ((lp_a * wa).sum() + (lp_s * ws).sum()).backward()
    torch.testing.assert_close(x.grad, y.grad, rtol=0, atol=1e-12)
    # the stats are the normaliser compute_masks expects
    lse = torch.logsumexp(logits.reshape(-1, V) / 0.8, -1)
    torch.testing.assert_close(s.stats.lse, lse, rtol=0, atol=1e-12)


def test_float32_chunked_pass_is_close_to_the_float64_reference() -> None:
    logits, ids, t_ids, t_lp, t_lp_a, valid = _case(2)
    x = logits.float().requires_grad_(True)
    s = student_logprobs(x, ids, t_ids, chunk_tokens=3, compile=False)
    loss, _ = distill_loss(s, ids, t_ids, t_lp.float(), t_lp_a.float(), response_mask=valid)
    loss.backward()
    y = logits.clone().requires_grad_(True)
    want = ref_distill_loss(y, ids, t_ids, t_lp, t_lp_a, valid, kind="forward_kl")
    want.backward()
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    torch.testing.assert_close(x.grad.double(), y.grad, rtol=1e-4, atol=1e-6)


def test_identical_teacher_gives_zero_divergences() -> None:
    logits, ids, t_ids, *_, valid = _case(3)
    logp = logits.log_softmax(-1)
    t_lp, t_ids = logp.topk(K, -1)
    t_lp_a = logp.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    for kind in ("forward_kl", "jsd"):
        x = logits.clone().requires_grad_(True)
        s = student_logprobs(x, ids, t_ids, overlap_every=1)
        loss, m = distill_loss(s, ids, t_ids, t_lp, t_lp_a, kind=kind, response_mask=valid)
        loss.backward()
        assert abs(loss.item()) < 1e-14 and x.grad.abs().max() < 1e-14
        assert m["topk_overlap"].item() == 1.0 and abs(m["distill_kl_sampled"].item()) < 1e-14


def test_bucketed_forward_kl_is_a_lower_bound_of_the_full_kl() -> None:
    logits, ids, t_ids, t_lp, t_lp_a, _ = _case(4)
    g = torch.Generator().manual_seed(4)
    t_logp = (logits + 1.5 * torch.randn(B, T, V, generator=g, dtype=F64)).log_softmax(-1)
    t_lp, t_ids = t_logp.topk(K, -1)
    t_lp_a = t_logp.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    ones = torch.ones(B, T, dtype=torch.bool)
    for b in range(B):
        for t in range(T):
            sl = (slice(b, b + 1), slice(t, t + 1))
            bucketed = ref_distill_loss(
                logits[sl], ids[sl], t_ids[sl], t_lp[sl], t_lp_a[sl], ones[sl], kind="forward_kl"
            ).item()
            full = (t_logp[b, t].exp() * (t_logp[b, t] - logits[b, t].log_softmax(-1))).sum().item()
            assert 0 <= bucketed <= full + 1e-12


def test_all_tokens_masked() -> None:
    logits, ids, t_ids, t_lp, t_lp_a, _ = _case(5)
    none = torch.zeros(B, T, dtype=torch.bool)
    g_ids, g_tids, g_tlp, g_tlpa = _garbage_padding(ids, t_ids, t_lp, t_lp_a, none)
    for aggregation in ("token_mean", "seq_mean_token_mean"):
        x = logits.clone().requires_grad_(True)
        s = student_logprobs(x, g_ids, g_tids)
        loss, m = distill_loss(
            s, g_ids, g_tids, g_tlp, g_tlpa, kind="jsd", aggregation=aggregation, response_mask=none
        )
        loss.backward()
        assert loss.item() == 0.0 and x.grad.abs().max() == 0.0
        assert math.isnan(m["distill_forward_kl"].item()) and math.isnan(m["topk_overlap"].item())
    adv = distill_advantages(s.logprobs, g_tlpa, torch.ones(B), response_mask=none)
    assert adv.abs().max() == 0.0


def test_invalid_arguments_are_refused() -> None:
    logits, ids, t_ids, t_lp, t_lp_a, _ = _case()
    s = student_logprobs(logits, ids, t_ids)
    with pytest.raises(ValueError, match=r"beta=1.0; the generalised JSD needs 0 < beta < 1"):
        distill_loss(s, ids, t_ids, t_lp, t_lp_a, kind="jsd", beta=1.0)
    with pytest.raises(ValueError, match=r"kind='rkl'"):
        distill_loss(s, ids, t_ids, t_lp, t_lp_a, kind="rkl")
    with pytest.raises(ValueError, match=r"teacher_topk_logprobs has shape \(3, 5, 3\)"):
        distill_loss(s, ids, t_ids, t_lp[..., :3], t_lp_a)
    with pytest.raises(ValueError, match=r"teacher_topk_ids has shape"):
        student_logprobs(logits, ids, t_ids[:2])
    with pytest.raises(ValueError, match=r"weight=inf"):
        distill_advantages(s.logprobs, t_lp_a, weight=math.inf)


# ---- (a) the sampled-token reverse KL as an advantage ----------------------------------------------------


def test_distill_advantages_by_hand() -> None:
    lp = torch.log(torch.tensor([[0.5, 0.25], [0.1, 0.2]], dtype=F64))
    teacher = torch.log(torch.tensor([[0.25, 0.25], [0.4, 0.9]], dtype=F64))
    mask = torch.tensor([[True, True], [True, False]])
    adv = distill_advantages(
        lp, teacher, torch.tensor([1.0, -1.0], dtype=F64), weight=2.0, response_mask=mask
    )
    want = torch.tensor([[1 + 2 * L(0.5), 1.0], [-1 + 2 * L(4.0), 0.0]], dtype=F64)
    torch.testing.assert_close(adv, want, rtol=0, atol=1e-15)
    pure = distill_advantages(lp, teacher)  # pure distillation: A_rl = 0, λ = 1
    torch.testing.assert_close(pure, teacher - lp, rtol=0, atol=0)


def test_reverse_kl_advantage_is_the_on_policy_gradient_of_kl_to_the_teacher() -> None:
    """Σ_a π_a · ∇ℓ_token(a) with A = log π_teacher(a) − log π_a and μ = π (w = 1) equals
    ∇ KL(π‖π_teacher) exactly: the advantage's sign and scale are those of on-policy distillation."""
    g = torch.Generator().manual_seed(7)
    v = 6
    z = torch.randn(v, generator=g, dtype=F64).requires_grad_(True)
    teacher = torch.randn(v, generator=g, dtype=F64).log_softmax(-1)
    lp = torch.log_softmax(z, -1)  # [V]: one token per possible a
    adv = distill_advantages(lp, teacher)
    t = token_loss(lp, lp.detach(), adv, torch.ones(v, dtype=torch.bool), token_weights=lp.detach().exp())
    (grad_pg,) = torch.autograd.grad(t.loss.sum(), z, retain_graph=True)
    (grad_kl,) = torch.autograd.grad((lp.exp() * (lp - teacher)).sum(), z)
    torch.testing.assert_close(grad_pg, grad_kl, rtol=0, atol=1e-14)


def test_mixed_step_with_masks_and_shared_stats() -> None:
    """The recipe of docs/math.md §10.4: one student pass, A = A_rl + λ·A_distill through compute_masks
    (with the pass's vocab_stats) and policy_loss, plus λ_fkl · forward KL; the policy-gradient part is
    masked, the distillation term is not."""
    logits, ids, t_ids, t_lp, t_lp_a, valid = _case(6)
    g = torch.Generator().manual_seed(6)
    mu_logp = (logits + 0.8 * torch.randn(B, T, V, generator=g, dtype=F64)).log_softmax(-1)
    mu_lp, mu_ids = mu_logp.topk(K, -1)
    mu_a = mu_logp.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    a_rl = torch.tensor([1.0, -0.5, 0.3], dtype=F64)
    cfg = MaskConfig(method="predictive", divergence="topk_kl", delta=0.02)
    x = logits.clone().requires_grad_(True)
    s = student_logprobs(x, ids, t_ids, chunk_tokens=4)
    adv = distill_advantages(s.logprobs, t_lp_a, a_rl, weight=0.5, response_mask=valid)
    res = compute_masks(x.detach(), ids, mu_a, mu_ids, mu_lp, adv, config=cfg, response_mask=valid,
                        vocab_stats=s.stats)  # fmt: skip
    fresh = compute_masks(logits, ids, mu_a, mu_ids, mu_lp, adv, config=cfg, response_mask=valid)
    assert torch.equal(res.keep, fresh.keep) and 0 < int((~res.keep & valid).sum()) < int(valid.sum())
    pg, _ = policy_loss(s.logprobs, mu_a, adv, res.keep, masks=res, config=cfg)
    d, _ = distill_loss(s, ids, t_ids, t_lp, t_lp_a, response_mask=valid)
    (pg + 0.25 * d).backward()

    y = logits.clone().requires_grad_(True)
    lp = torch.log_softmax(y, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    w = torch.exp(lp.detach() - mu_a).clamp(max=10.0)
    a_ref = a_rl[:, None] + 0.5 * (t_lp_a - lp.detach())
    on = res.keep & valid
    pg_ref = -(a_ref * w * lp * on).sum() / valid.sum()
    d_ref = ref_distill_loss(y, ids, t_ids, t_lp, t_lp_a, valid, kind="forward_kl")
    (pg_ref + 0.25 * d_ref).backward()
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-10, atol=1e-14)


def test_overlap_is_measured_on_every_nth_row() -> None:
    logits, ids, t_ids, t_lp, t_lp_a, valid = _case(8)
    s = student_logprobs(logits, ids, t_ids, overlap_every=4, chunk_tokens=3)
    rows = torch.arange(B * T)
    assert torch.equal(s.ranked.reshape(-1), rows % 4 == 0)
    _, m = distill_loss(s, ids, t_ids, t_lp, t_lp_a, response_mask=valid)
    on = valid.reshape(-1) & (rows % 4 == 0)
    assert m["topk_overlap"].item() == pytest.approx(
        ref_topk_overlap(logits.reshape(-1, V), t_ids.reshape(-1, K), on), abs=1e-14
    )
    off = student_logprobs(logits, ids, t_ids, overlap_every=0)
    assert not off.ranked.any()
    assert math.isnan(distill_loss(off, ids, t_ids, t_lp, t_lp_a)[1]["topk_overlap"].item())


def test_bfloat16_logits_keep_their_dtype_and_stay_close_to_the_reference() -> None:
    logits, ids, t_ids, t_lp, t_lp_a, valid = _case(9)
    x = logits.to(torch.bfloat16).requires_grad_(True)
    s = student_logprobs(x, ids, t_ids, chunk_tokens=4, compile=False)
    loss, _ = distill_loss(s, ids, t_ids, t_lp.float(), t_lp_a.float(), response_mask=valid)
    loss.backward()
    assert x.grad.dtype == torch.bfloat16
    y = x.detach().double().requires_grad_(True)  # the same bf16-rounded logits, in float64
    want = ref_distill_loss(y, ids, t_ids, t_lp, t_lp_a, valid, kind="forward_kl")
    want.backward()
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    torch.testing.assert_close(x.grad.double(), y.grad, rtol=2e-2, atol=2e-3)


@pytest.mark.slow
def test_compiled_kernels_agree_with_eager() -> None:
    """The torch.compile'd vocabulary kernels under student_logprobs (forward stats, backward one-id
    kernel + scatters) against the eager ones, float32, several chunks, T ≠ 1."""
    from maskroll.trainer_adapter import kernels

    g = torch.Generator().manual_seed(0)
    n, v, k = 37, 300, 5
    x = 2.0 * torch.randn(n, v, generator=g)
    ids = torch.randint(0, v, (n,), generator=g)
    t_logp = (x + torch.randn(n, v, generator=g)).log_softmax(-1)
    t_lp, t_ids = t_logp.topk(k, -1)
    t_a = t_logp.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    out = {}
    for compiled in (False, True):
        y = x.clone().requires_grad_(True)
        s = student_logprobs(y, ids, t_ids, compile=compiled, chunk_tokens=16, temperature=0.9)
        loss, _ = distill_loss(s, ids, t_ids, t_lp, t_a, kind="jsd", beta=0.3)
        loss.backward()
        out[compiled] = (loss.item(), y.grad)
    if kernels.compile_failure() is not None:
        pytest.skip(f"torch.compile unavailable here: {kernels.compile_failure()}")
    assert out[True][0] == pytest.approx(out[False][0], rel=1e-5)
    torch.testing.assert_close(out[True][1], out[False][1], rtol=1e-4, atol=1e-7)
