"""The rollout corrections (docs/math.md §9) through maskroll's verl losses: chosen by name in the actor's
policy_loss section, the gradient equals the trainer adapter's policy_loss with the same MaskConfig."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from verl.trainer.ppo.core_algos import get_policy_loss_fn

from maskroll.trainer_adapter import policy_loss, sampled_token_masks

B, T = 4, 6


def _case():
    g = torch.Generator().manual_seed(2)
    lp = torch.log(torch.rand(B, T, generator=g, dtype=torch.float64) * 0.8 + 0.1)
    mu = lp + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.0, -0.6, 0.3, -1.1], dtype=torch.float64)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[2, 4:] = False
    return lp, mu, adv, mask


@pytest.mark.parametrize(
    "name,band",
    [("token_tis", None), ("seq_tis", None), ("token_mis", (0.7, 1.5)), ("seq_mis", (0.3, 3.0)),
     ("icepop", (0.8, 1.25)), ("geo_mask", (0.9, 1.1))],
)  # fmt: skip
def test_correction_by_name_matches_the_adapter(name, band):
    import maskroll.integrations.verl as plugin

    lp, mu, adv, mask = _case()
    section = {"maskroll_correction": name, "maskroll_is_cap": 2.0}
    if band:
        section |= {"maskroll_correction_low": band[0], "maskroll_correction_high": band[1]}
    actor = OmegaConf.create(
        {"clip_ratio": 0.2, "clip_ratio_low": 0.02, "clip_ratio_high": 0.03, "clip_ratio_c": 3.0,
         "global_batch_info": {}, "policy_loss": section}
    )  # fmt: skip
    cfg, cap = plugin.mask_config(actor, "dppo", "binary_kl")
    assert (cfg.correction, cap) == (name, 2.0)
    assert (cfg.correction_low, cfg.correction_high) == (band or (None, None))

    x = lp.clone().requires_grad_()
    loss, metrics = get_policy_loss_fn("maskroll_dppo_kl")(
        old_log_prob=mu, log_prob=x, advantages=adv[:, None].expand(B, T), response_mask=mask.long(),
        loss_agg_mode="token-mean", config=actor, rollout_is_weights=None,
    )  # fmt: skip
    loss.backward()
    y = lp.clone().requires_grad_()
    res = sampled_token_masks(y, mu, adv, config=cfg, response_mask=mask)
    ref, m = policy_loss(y, mu, adv, res.keep, is_cap=2.0, response_mask=mask, config=cfg)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-10, atol=1e-14)
    assert metrics["actor/maskroll/correction_mask_frac"] == pytest.approx(m["correction_mask_frac"].item())
    if band and name != "seq_mis":
        assert metrics["actor/maskroll/correction_mask_frac"] > 0
