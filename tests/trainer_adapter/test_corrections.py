"""Rollout corrections (docs/math.md §9): MaskConfig validation, hand-computed weights and masks, every
correction's loss and gradient against the float64 reference (`reference_losses.py`), composition with
the trust-region masks, sequence-level edge cases, and the all-masked batch."""

from __future__ import annotations

import math

import pytest
import torch

from maskroll.trainer_adapter import MaskConfig, compute_masks, policy_loss, rollout_correction, token_loss
from maskroll.trainer_adapter.reference_losses import ref_corrected_policy_loss, ref_correction

F64 = torch.float64
L = math.log

# ---- hand case, B = 2 × T = 3 -------------------------------------------------------------------------
#   π_a  seq0 (0.4, 0.2, 0.8)  seq1 (0.3, 0.5, 0.45)
#   μ_a  seq0 (0.2, 0.4, 0.2)  seq1 (0.3, 0.5, 0.5)
#   r    seq0 (2, 0.5, 4)      seq1 (1, 1, 0.9; padding)
#   ρ = Π r over the response: seq0 4, seq1 1;  geometric mean: seq0 4^(1/3) ≈ 1.587, seq1 1
PI_A = [[0.4, 0.2, 0.8], [0.3, 0.5, 0.45]]
MU_A = [[0.2, 0.4, 0.2], [0.3, 0.5, 0.5]]
RESP = [[True, True, True], [True, True, False]]
ADV = [1.0, -1.0]
CAP = 3.0
# name, band → w (padding: whatever), the correction's keep
HAND = {
    "token_tis": (None, [[2, 0.5, 3], [1, 1]], [[1, 1, 1], [1, 1]]),
    "seq_tis": (None, [[3, 3, 3], [1, 1]], [[1, 1, 1], [1, 1]]),
    "token_mis": ((0.5, 2.0), [[2, 0.5, 3], [1, 1]], [[1, 1, 0], [1, 1]]),
    "seq_mis": ((0.5, 2.0), [[3, 3, 3], [1, 1]], [[0, 0, 0], [1, 1]]),
    "icepop": ((0.6, 5.0), [[1, 1, 1], [1, 1]], [[1, 0, 1], [1, 1]]),
    "geo_mask": ((0.99, 1.01), [[2, 0.5, 3], [1, 1]], [[0, 0, 0], [1, 1]]),
}


def _hand():
    lp = torch.log(torch.tensor(PI_A, dtype=F64)).requires_grad_(True)
    return lp, torch.log(torch.tensor(MU_A, dtype=F64)), torch.tensor(ADV, dtype=F64), torch.tensor(RESP)


def _cfg(name: str, band) -> MaskConfig:
    if band is None:
        return MaskConfig(method="none", correction=name)
    return MaskConfig(method="none", correction=name, correction_low=band[0], correction_high=band[1])


@pytest.mark.parametrize("name", list(HAND))
def test_weights_and_masks_by_hand(name: str) -> None:
    band, w_want, keep_want = HAND[name]
    lp, mu, adv, resp = _hand()
    cfg = _cfg(name, band)
    c = rollout_correction(
        lp.detach() - mu, resp, name=name, is_cap=CAP, low=cfg.correction_low, high=cfg.correction_high
    )
    for b in range(2):
        n = len(w_want[b])
        torch.testing.assert_close(c.weight[b, :n], torch.tensor(w_want[b], dtype=F64), rtol=1e-14, atol=0)
        assert c.keep[b, :n].tolist() == [bool(k) for k in keep_want[b]]
    # the loss: −A · w · M_c · log π_a over the 5 response tokens
    want = 0.0
    for b in range(2):
        for t in range(len(w_want[b])):
            want += -ADV[b] * w_want[b][t] * keep_want[b][t] * L(PI_A[b][t]) / 5
    loss, m = policy_loss(
        lp, mu, adv, torch.ones(2, 3, dtype=torch.bool), response_mask=resp, is_cap=CAP, config=cfg
    )
    assert loss.item() == pytest.approx(want, abs=1e-14)
    dropped = sum(1 - k for row in keep_want for k in row)
    assert m["correction_mask_frac"].item() == pytest.approx(dropped / 5, abs=1e-15)
    assert m["mask_frac"].item() == pytest.approx(dropped / 5, abs=1e-15)


def test_default_is_todays_token_tis() -> None:
    lp, mu, adv, resp = _hand()
    keep = torch.tensor([[True, False, True], [True, True, True]])
    a, ma = policy_loss(lp, mu, adv, keep, response_mask=resp, is_cap=CAP)
    b, mb = policy_loss(lp, mu, adv, keep, response_mask=resp, is_cap=CAP, config=MaskConfig())
    assert a.item() == b.item() and ma["is_weight_mean"].item() == mb["is_weight_mean"].item()
    assert mb["correction_mask_frac"].item() == 0.0


def _random_case(seed: int, bsz: int = 6, t_len: int = 7, scale: float = 0.3):
    g = torch.Generator().manual_seed(seed)
    lp = torch.log(torch.rand(bsz, t_len, generator=g, dtype=F64) * 0.9 + 0.05)
    mu = lp + scale * torch.randn(bsz, t_len, generator=g, dtype=F64)
    adv = torch.randn(bsz, generator=g, dtype=F64)
    valid = torch.rand(bsz, t_len, generator=g) < 0.8
    valid[0] = True
    valid[1] = False  # a sequence of padding only
    keep = torch.rand(bsz, t_len, generator=g) < 0.85
    return lp, mu, adv, valid, keep


BANDS = {"token_mis": (0.7, 1.4), "seq_mis": (0.3, 3.0), "icepop": (0.8, 1.25), "geo_mask": (0.9, 1.1)}


@pytest.mark.parametrize("name", list(HAND))
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_loss_and_gradient_match_the_reference(name: str, aggregation: str, seed: int) -> None:
    lp, mu, adv, valid, keep = _random_case(seed)
    band = BANDS.get(name)
    cfg = _cfg(name, band)
    x = lp.clone().requires_grad_(True)
    loss, _ = policy_loss(
        x, mu, adv, keep, response_mask=valid, is_cap=2.0, aggregation=aggregation, config=cfg
    )
    loss.backward()
    y = lp.clone().requires_grad_(True)
    low, high = band if band else (None, None)
    want = ref_corrected_policy_loss(
        y, mu, adv, keep, valid, name=name, cap=2.0, low=low, high=high, aggregation=aggregation
    )
    want.backward()
    assert loss.item() == pytest.approx(want.item(), rel=1e-12, abs=1e-15)
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("name", list(HAND))
def test_weights_match_the_reference_at_response_tokens(name: str) -> None:
    lp, mu, _, valid, _ = _random_case(3, scale=0.6)
    band = BANDS.get(name, (None, None))
    c = rollout_correction(lp - mu, valid, name=name, is_cap=2.0, low=band[0], high=band[1])
    w, k = ref_correction(lp, mu, valid, name, 2.0, *band)
    on = valid
    torch.testing.assert_close(c.weight[on], torch.tensor(w, dtype=F64)[on], rtol=1e-13, atol=0)
    assert torch.equal(c.keep[on], torch.tensor(k)[on])


@pytest.mark.parametrize("method", ["ppo", "dppo", "predictive"])
@pytest.mark.parametrize("name", ["token_mis", "icepop", "geo_mask", "seq_mis"])
def test_corrections_compose_with_the_trust_region_masks(method: str, name: str) -> None:
    """M = trust-region keep ∧ correction keep, token by token; the trust region's decisions are unchanged."""
    g = torch.Generator().manual_seed(11)
    bsz, t_len, v, k = 4, 6, 12, 3
    logits = torch.randn(bsz, t_len, v, generator=g, dtype=F64)
    mu_logp = (logits + 0.7 * torch.randn(bsz, t_len, v, generator=g, dtype=F64)).log_softmax(-1)
    ids = torch.multinomial(mu_logp.exp().reshape(-1, v), 1, generator=g).reshape(bsz, t_len)
    mu_a = mu_logp.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    tlp, tid = mu_logp.topk(k, -1)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.3], dtype=F64)
    cfg = MaskConfig(method=method, divergence="topk_kl", delta=0.05, correction=name,
                     correction_low=BANDS[name][0], correction_high=BANDS[name][1])  # fmt: skip
    res = compute_masks(logits, ids, mu_a, tid, tlp, adv, config=cfg)
    lp = logits.log_softmax(-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    t = token_loss(lp, mu_a, adv, res.keep, config=cfg)
    c = rollout_correction(lp - mu_a, res.response_mask, name=name, low=BANDS[name][0], high=BANDS[name][1])
    assert torch.equal(t.kept, res.keep & c.keep)
    assert bool((~res.keep).any()) and bool((~c.keep).any())  # both masks act in this case


@pytest.mark.parametrize("name", ["seq_tis", "seq_mis", "geo_mask"])
def test_sequence_level_corrections_need_batched_inputs(name: str) -> None:
    lp = torch.log(torch.tensor([0.5, 0.4], dtype=F64))
    with pytest.raises(
        ValueError, match=rf"correction '{name}' is sequence-level: it needs batched \[B, T\]"
    ):
        policy_loss(
            lp, lp, torch.ones(2), torch.ones(2, dtype=torch.bool), config=MaskConfig(correction=name)
        )


def test_a_token_removed_by_replayed_truncation_zeroes_its_sequence() -> None:
    """log π_a = −inf at one token: ρ = 0 (seq_tis weight 0, seq_mis / geo_mask drop the sequence), the
    other sequence is untouched, and no nan reaches the gradient."""
    lp = torch.log(torch.tensor([[0.5, 0.0, 0.3], [0.4, 0.4, 0.4]], dtype=F64)).requires_grad_(True)
    mu = torch.log(torch.tensor([[0.5, 0.1, 0.3], [0.4, 0.4, 0.4]], dtype=F64))
    keep = torch.tensor([[True, False, True], [True, True, True]])
    for name in ("seq_tis", "seq_mis", "geo_mask"):
        c = rollout_correction(
            lp.detach() - mu, torch.ones(2, 3, dtype=torch.bool), name=name, low=0.5, high=2.0
        )
        if name == "seq_tis":
            assert c.weight[0].tolist() == [0.0, 0.0, 0.0] and c.weight[1].tolist() == [1.0, 1.0, 1.0]
        else:
            assert c.keep.tolist() == [[False] * 3, [True] * 3]
        lp.grad = None
        loss, _ = policy_loss(lp, mu, torch.tensor([1.0, 1.0]), keep, config=MaskConfig(correction=name))
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
        assert lp.grad[0].abs().max() == 0
        assert lp.grad[1].tolist() == pytest.approx([-1 / 6] * 3, abs=1e-15)


def test_all_tokens_masked() -> None:
    lp, mu, adv, _, keep = _random_case(4)
    none = torch.zeros_like(keep)
    for name in HAND:
        x = lp.clone().requires_grad_(True)
        loss, m = policy_loss(x, mu, adv, keep, response_mask=none, config=_cfg(name, BANDS.get(name)))
        loss.backward()
        assert loss.item() == 0.0 and x.grad.abs().max() == 0.0
        assert math.isnan(m["correction_mask_frac"].item())


def test_config_validation() -> None:
    assert (
        MaskConfig(correction="icepop").correction_low,
        MaskConfig(correction="icepop").correction_high,
    ) == (
        0.5,
        5.0,
    )
    assert MaskConfig(correction="geo_mask", correction_high=1.05).correction_low == 0.99
    assert (
        MaskConfig(correction="token_mis", correction_low=0.0, correction_high=math.inf).correction_high
        == math.inf
    )
    assert MaskConfig().correction == "token_tis" and MaskConfig().correction_low is None
    with pytest.raises(ValueError, match=r"MaskConfig.correction='tis'; expected one of"):
        MaskConfig(correction="tis")
    with pytest.raises(ValueError, match=r"correction='seq_tis' takes no band .*correction_high=2.0"):
        MaskConfig(correction="seq_tis", correction_high=2.0)
    with pytest.raises(
        ValueError, match=r"needs a finite correction_low < correction_high; got \[2.0, 1.0\]"
    ):
        MaskConfig(correction="icepop", correction_low=2.0, correction_high=1.0)
    with pytest.raises(ValueError, match=r"MaskConfig.correction_low=-0.1; expected a number >= 0"):
        MaskConfig(correction="seq_mis", correction_low=-0.1)
    with pytest.raises(ValueError, match=r"MaskConfig.correction_high=nan"):
        MaskConfig(correction="seq_mis", correction_high=math.nan)
