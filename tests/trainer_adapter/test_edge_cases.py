"""Records at the edges of MATH §1's conventions: tail masses clamped at 0 by rounding, a retained
support covering the whole vocabulary, top-K entries with logprob −inf, the sampled token's top-K
entry disagreeing with its sampled logprob. Compared with the reference, and always finite."""

from __future__ import annotations

import numpy as np
import pytest
import reference_impl as ref
from adapter_helpers import np_, run_masks

from maskroll.trainer_adapter import MaskConfig

FIELDS = (
    "divergence",
    "direction",
    "predicted_direction",
    "ratio_direction",
    "mismatch_kl",
    "mismatch_tv",
    "logprobs",
)


def compare_all(rec: ref.Record, *, atol: float = 1e-9, methods=("dppo", "predictive")) -> None:
    tokens = ref.record_reference(rec)
    for method in methods:
        for divergence in ref.DIVERGENCES:
            for estimator in ref.ESTIMATORS:
                cfg = MaskConfig(method=method, divergence=divergence, estimator=estimator)
                res = run_masks(rec, cfg)
                want = ref.masks_reference(
                    tokens,
                    rec.advantages,
                    method=method,
                    divergence=divergence,
                    estimator=estimator,
                    delta_low=cfg.delta_low,
                    delta_high=cfg.delta_high,
                )
                tag = f"{method}/{divergence}/{estimator}"
                for name, w in zip(
                    FIELDS,
                    (
                        want.divergence,
                        want.direction,
                        want.predicted,
                        want.ratio_direction,
                        want.mismatch_kl,
                        want.mismatch_tv,
                        want.logprobs,
                    ),
                    strict=True,
                ):
                    got = np_(getattr(res, name))
                    assert np.isfinite(got).all(), f"{name} not finite {tag}: {got}"
                    np.testing.assert_allclose(got, w, rtol=1e-9, atol=atol, err_msg=f"{name} {tag}")
                np.testing.assert_array_equal(np_(res.keep), want.keep, err_msg=tag)


def test_negative_tail_mass_from_rounding() -> None:
    """Σ_S μ slightly > 1 (the engine rounded its top-K logprobs up) → μ_T = max(0, ·) = 0; the tail
    of π is tiny too, so 1 − Σ_S π is at rounding level and may be negative → π_T = 0."""
    rng = np.random.default_rng(70)
    n, v, k = 12, 50, 45
    rec = ref.make_record(70, n=n, v=v, k=k, outside_frac=0.0)
    # five tokens per row that neither policy ever picks
    dead = np.stack([rng.choice(v, 5, replace=False) for _ in range(n)])
    for i in range(n):
        rec.logits[i, dead[i]] = -60.0
        x = rec.logits[i] + 0.5 * rng.standard_normal(v)
        x[dead[i]] = -60.0
        rec.mu_logprobs[i] = ref.processed_logprobs(x, 1.0)
    order = np.argsort(-rec.mu_logprobs, axis=1, kind="stable")
    rec.topk_ids = order[:, :k].copy()
    rec.topk_logprobs = np.take_along_axis(rec.mu_logprobs, rec.topk_ids, axis=1) + 1e-7  # rounded up
    rec.sampled_ids = rec.topk_ids[np.arange(n), rng.integers(0, 10, n)]
    rec.sampled_logprobs = rec.topk_logprobs[
        np.arange(n), np.argmax(rec.topk_ids == rec.sampled_ids[:, None], 1)
    ]
    tokens = ref.record_reference(rec)
    assert all(t.mu_T == 0.0 for t in tokens)  # the clamp is really active
    assert all(t.pi_T < 1e-15 for t in tokens)
    compare_all(rec)


@pytest.mark.parametrize("a_outside", [False, True])
def test_support_covers_the_whole_vocabulary(a_outside: bool) -> None:
    """|S| = V: n_T = 0 and the tail is empty (π_T, μ_T at rounding level, Q_T = 0). Every estimator,
    uniform's π_T²/n_T included, must give a finite P̂ with a zero tail term."""
    v = 40
    k = v - 1 if a_outside else v
    rec = ref.make_record(71, n=10, v=v, k=k, outside_frac=1.0 if a_outside else 0.0)
    if a_outside:  # the one token not in the top-K is the sampled one
        for i in range(10):
            rec.sampled_ids[i] = np.setdiff1d(np.arange(v), rec.topk_ids[i])[0]
            rec.sampled_logprobs[i] = rec.mu_logprobs[i, rec.sampled_ids[i]]
    assert all(t.n_T == 0 for t in ref.record_reference(rec))
    compare_all(rec)


def test_topk_entries_with_minus_inf_logprob() -> None:
    """μ_i = 0 on some top-K entries (an engine's top-K padded past μ's support): they contribute 0
    to topk_kl and |π_i| to topk_tv, and nothing is nan."""
    rec = ref.make_record(72, n=16, v=120, k=10, outside_frac=0.3)
    rec.topk_logprobs[:, -3:] = -np.inf
    for i in range(16):  # the sampled token always has μ_a > 0
        if rec.sampled_ids[i] in rec.topk_ids[i, -3:]:
            rec.sampled_ids[i] = rec.topk_ids[i, 0]
            rec.sampled_logprobs[i] = rec.topk_logprobs[i, 0]
    compare_all(rec, methods=("dppo", "predictive", "ppo", "none"))


def test_sampled_entry_of_s_comes_from_the_top_k_when_a_is_in_it() -> None:
    """a ∈ topK with a top-K logprob that differs from the sampled logprob (two engine read-outs of
    the same number). Per the brief: S takes the top-K value (D and P̂ use it), while binary_* and
    the ratio use μ_a = exp(sampled_logprob)."""
    rec = ref.make_record(73, n=16, v=150, k=10, outside_frac=0.0)
    inside = np.array([a in row for a, row in zip(rec.sampled_ids, rec.topk_ids, strict=True)])
    assert inside.sum() >= 10
    rec.sampled_logprobs = rec.sampled_logprobs - 0.05 * np.where(inside, 1.0, 0.0)
    compare_all(rec, methods=("dppo", "predictive", "ppo"))
