"""maskroll's verl policy losses against the real verl package: its registry, its call convention
(`verl.workers.utils.losses.ppo_loss` calls exactly these keywords), its `agg_loss` and ActorConfig; the
gradient equals the trainer adapter's (compute_masks + policy_loss on full logits) on the same tokens.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
from verl.trainer.ppo.core_algos import get_policy_loss_fn
from verl.workers.config import ActorConfig

from maskroll.trainer_adapter import MaskConfig, compute_masks, policy_loss, token_logprobs

B, T, V = 4, 8, 11


def _actor(**kw) -> ActorConfig:
    base = dict(strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, rollout_n=2)
    return ActorConfig(**{**base, **kw})


def _case(seed: int = 0):
    """π from trainer logits, μ a perturbed copy (some tokens far), per-token advantages, padding."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64)
    mu_logits = logits + 2.5 * torch.randn(B, T, V, generator=g, dtype=torch.float64)
    ids = torch.multinomial(mu_logits.softmax(-1).reshape(-1, V), 1, generator=g).reshape(B, T)
    mu_logp = mu_logits.log_softmax(-1)
    topk_lp, topk_ids = mu_logp.topk(4, dim=-1)
    mu_a = mu_logp.gather(-1, ids[..., None]).squeeze(-1)
    adv = torch.tensor([1.0, -0.7, 0.4, -1.2], dtype=torch.float64)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 5:] = False
    return logits, ids, mu_a, topk_ids, topk_lp, adv, mask


def test_importing_the_plugin_registers_every_mode_in_verls_registry():
    import maskroll.integrations.verl as plugin

    for name in plugin.LOSS_MODES:
        fn = get_policy_loss_fn(name)
        assert fn.keywords == {"method": plugin.LOSS_MODES[name][0], "divergence": plugin.LOSS_MODES[name][1]}


def test_verls_external_module_mechanism_loads_the_plugin():
    """VERL_USE_EXTERNAL_MODULES, as set for Ray workers: `import verl` alone registers the losses."""
    code = (
        "import verl\nfrom verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY as R\n"
        "print(sorted(k for k in R if k.startswith('maskroll')))"
    )
    env = {**os.environ, "VERL_USE_EXTERNAL_MODULES": "maskroll.integrations.verl"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "'maskroll_dppo'" in out.stdout and "'maskroll_predictive_tv'" in out.stdout, out.stdout


AGGREGATIONS = {
    "token-mean": "token_mean",
    "seq-mean-token-mean": "seq_mean_token_mean",
    "seq-mean-token-sum-norm": "seq_mean_token_sum_norm",
}


@pytest.mark.parametrize(
    "mode", ["maskroll_ppo", "maskroll_dppo_kl", "maskroll_dppo_tv", "maskroll_predictive"]
)
@pytest.mark.parametrize("agg", sorted(AGGREGATIONS))
def test_gradient_equals_the_adapters(mode, agg):
    import maskroll.integrations.verl as plugin

    method, divergence = plugin.LOSS_MODES[mode]
    logits, ids, mu_a, topk_ids, topk_lp, adv, mask = _case()
    # δ from verl's DPPO convention (clip_ratio_low / _high), the IS cap from clip_ratio_c
    actor = _actor(clip_ratio_low=0.02, clip_ratio_high=0.03, clip_ratio_c=4.0, loss_agg_mode=agg)
    if method == "ppo":
        cfg = MaskConfig(method="ppo", eps_low=0.02, eps_high=0.03)
    else:
        cfg = MaskConfig(method=method, divergence=divergence, delta_low=0.02, delta_high=0.03)

    x = logits.clone().requires_grad_()
    lp = token_logprobs(x, ids)
    res = compute_masks(x.detach(), ids, mu_a, topk_ids, topk_lp, adv, config=cfg, response_mask=mask)
    ref, _ = policy_loss(lp, mu_a, adv, res.keep, is_cap=4.0, aggregation=AGGREGATIONS[agg], masks=res)
    ref.backward()
    assert 0 < int((~res.keep & mask).sum()) < int(mask.sum()), "the case must mask some tokens, not all"

    y = logits.clone().requires_grad_()
    loss, metrics = get_policy_loss_fn(mode)(
        old_log_prob=mu_a,
        log_prob=token_logprobs(y, ids),
        advantages=adv[:, None].expand(B, T),
        response_mask=mask.long(),
        loss_agg_mode=agg,
        config=actor,
        rollout_is_weights=None,
    )
    loss.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(y.grad, x.grad, rtol=1e-10, atol=1e-13)
    masked = float(((~res.keep) & mask).sum() / mask.sum())
    assert metrics["actor/pg_clipfrac"] == pytest.approx(masked)
    assert set(metrics) >= {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"}
    assert all(isinstance(v, float) and math.isfinite(v) for v in metrics.values())


def test_rollout_is_weights_scale_each_token_and_thresholds_come_from_policy_loss_section():
    """verl's rollout correction weights multiply the per-token loss; a DictConfig policy_loss section
    may carry maskroll_delta / maskroll_is_cap, which win over clip_ratio_* / clip_ratio_c."""
    from omegaconf import OmegaConf

    import maskroll.integrations.verl as plugin

    logits, ids, mu_a, _, _, adv, mask = _case(1)
    lp = token_logprobs(logits, ids)
    base = dict(
        clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=3.0, global_batch_info={}
    )
    cfg = OmegaConf.create({**base, "policy_loss": {"maskroll_delta": 0.01, "maskroll_is_cap": 7.0}})
    mc, cap = plugin.mask_config(cfg, "dppo", "binary_tv")
    assert (mc.delta_low, mc.delta_high, cap) == (0.01, 0.01, 7.0)
    mc, cap = plugin.mask_config(OmegaConf.create(base), "dppo", "binary_tv")
    assert (mc.delta_low, mc.delta_high, cap) == (0.2, 0.2, 3.0)

    w = torch.rand(B, T, dtype=torch.float64, generator=torch.Generator().manual_seed(3)) + 0.5
    kw = dict(advantages=adv[:, None].expand(B, T), response_mask=mask, loss_agg_mode="token-sum", config=cfg)
    fn = get_policy_loss_fn("maskroll_dppo_tv")
    x = lp.clone().requires_grad_()
    fn(old_log_prob=mu_a, log_prob=x, rollout_is_weights=w, **kw)[0].backward()
    y = lp.clone().requires_grad_()
    fn(old_log_prob=mu_a, log_prob=y, rollout_is_weights=None, **kw)[0].backward()
    torch.testing.assert_close(x.grad, y.grad * w)
