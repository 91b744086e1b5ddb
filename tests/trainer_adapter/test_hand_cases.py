"""Small cases worked out by hand: every divergence, every P̂, every mask method.

V = 6, K = 2, one trainer distribution for every token:
    π = (0.4, 0.2, 0.1, 0.15, 0.1, 0.05),   Σ_V π² = 0.16 + 0.04 + 0.01 + 0.0225 + 0.01 + 0.0025 = 0.245
and three records:
    α: topK = (0, 1) with μ = (0.5, 0.1); a = 2 ∉ topK, μ_a = 0.2.
       S = {0, 1, 2}: Σ_S μ = 0.8 → μ_T = 0.2; Σ_S π = 0.7 → π_T = 0.3; tail π = (0.15, 0.1, 0.05),
       n_T = 3, Q_T = 0.0225 + 0.01 + 0.0025 = 0.035.
    β: topK = (0, 1) with μ = (0.6, 0.21); a = 1 ∈ topK, μ_a = 0.21.
       S = {0, 1}: μ_T = 0.19, π_T = 0.4, tail π = (0.1, 0.15, 0.1, 0.05), n_T = 4, Q_T = 0.045.
    δ: topK = (0, 1) with μ = (0.7, 0.1); a = 0, μ_a = 0.7. μ_T = 0.2, π_T = 0.4, n_T = 4, Q_T = 0.045.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from adapter_helpers import np_

from maskroll.trainer_adapter import MaskConfig, compute_masks

L = math.log
PI = torch.tensor([0.4, 0.2, 0.1, 0.15, 0.1, 0.05], dtype=torch.float64)
RECORDS = {  # a, μ_a, topK μ
    "alpha": (2, 0.2, (0.5, 0.1)),
    "beta": (1, 0.21, (0.6, 0.21)),
    "delta": (0, 0.7, (0.7, 0.1)),
}

# ---- D, worked out ----
DIVERGENCE = {
    "alpha": {
        "binary_tv": 0.1,  # |0.1 − 0.2|
        # 0.2 log(0.2/0.1) + 0.8 log(0.8/0.9) = 0.1386294 − 0.0942264 ≈ 0.0444030
        "binary_kl": 0.2 * L(2) + 0.8 * L(0.8 / 0.9),
        "topk_tv": 0.2,  # ½(|0.4−0.5| + |0.2−0.1| + |0.1−0.2| + |0.3−0.2|)
        # 0.5 log(0.5/0.4) + 0.1 log(0.1/0.2) + 0.2 log(0.2/0.1) + 0.2 log(0.2/0.3) ≈ 0.0997935
        "topk_kl": 0.5 * L(1.25) + 0.1 * L(0.5) + 0.2 * L(2) + 0.2 * L(2 / 3),
    },
    "beta": {
        "binary_tv": 0.01,
        # 0.21 log(0.21/0.2) + 0.79 log(0.79/0.8) = 0.0102459 − 0.0099373 ≈ 0.0003087
        "binary_kl": 0.21 * L(1.05) + 0.79 * L(0.79 / 0.8),
        "topk_tv": 0.21,  # ½(0.2 + 0.01 + |0.4 − 0.19|)
        # 0.6 log(0.6/0.4) + 0.21 log(0.21/0.2) + 0.19 log(0.19/0.4) ≈ 0.1120813
        "topk_kl": 0.6 * L(1.5) + 0.21 * L(1.05) + 0.19 * L(0.19 / 0.4),
    },
    "delta": {
        "binary_tv": 0.3,
        "binary_kl": 0.7 * L(1.75) + 0.3 * L(0.5),  # ≈ 0.1837869
        "topk_tv": 0.3,  # ½(0.3 + 0.1 + 0.2)
        "topk_kl": 0.7 * L(1.75) + 0.1 * L(0.5) + 0.2 * L(0.5),  # ≈ 0.1837869 (same number here)
    },
}

# ---- P̂, worked out ----
# binary: dπ_a/dτ = π_a(1 − 2π_a + 0.245): α 0.1·1.045 = 0.1045, β 0.2·0.845 = 0.169, δ 0.4·0.445 = 0.178.
#   binary_tv P = sign(π_a − μ_a)·dπ_a/dτ; binary_kl P = (π_a − μ_a)/(π_a(1 − π_a))·dπ_a/dτ.
# topk_kl P̂ = (π_a − μ_a) − Σ_S π_i(π_i − μ_i) + Q̂_T(μ_T/π_T − 1):
#   α: −0.1 − (0.4·(−0.1) + 0.2·0.1 + 0.1·(−0.1)) + Q̂(0.2/0.3 − 1) = −0.07 − Q̂/3
#      Q̂: prop 0.035, aggregated 0.3² = 0.09, uniform 0.09/3 = 0.03
#   β: −0.01 − (0.4·(−0.2) + 0.2·(−0.01)) + Q̂(0.19/0.4 − 1) = 0.072 − 0.525 Q̂
#      Q̂: prop 0.045, aggregated 0.16, uniform 0.04   (aggregated flips the sign)
#   δ: −0.3 − (0.4·(−0.3) + 0.2·0.1) + Q̂(0.5 − 1) = −0.2 − 0.5 Q̂, Q̂ as for β
# topk_tv P̂ = π_a(φ_a − φ̄) − Σ_S π_i²(φ_i − φ̄) − Q̂(φ_T − φ̄), φ = ½ sign(π − μ):
#   α: φ = (−½, ½, −½), φ_T = ½, φ̄ = −0.2 + 0.1 − 0.05 + 0.15 = 0
#      0.1·(−½) − (0.16·(−½) + 0.04·½ + 0.01·(−½)) − ½Q̂ = 0.015 − ½Q̂
#   β: φ = (−½, −½), φ_T = ½, φ̄ = −0.2 − 0.1 + 0.2 = −0.1
#      0.2·(−0.4) − (0.16·(−0.4) + 0.04·(−0.4)) − 0.6 Q̂ = −0.6 Q̂
#   δ: φ = (−½, ½), φ_T = ½, φ̄ = −0.2 + 0.1 + 0.2 = 0.1
#      0.4·(−0.6) − (0.16·(−0.6) + 0.04·0.4) − 0.4 Q̂ = −0.16 − 0.4 Q̂
Q = {"alpha": (0.035, 0.09, 0.03), "beta": (0.045, 0.16, 0.04), "delta": (0.045, 0.16, 0.04)}
EST = ("proportional", "aggregated", "uniform")


def predicted(name: str, divergence: str, estimator: str) -> float:
    q = dict(zip(EST, Q[name], strict=True))[estimator]
    binary = {
        "alpha": (-0.1045, -0.1 / (0.1 * 0.9) * 0.1045),
        "beta": (-0.169, -0.01 / (0.2 * 0.8) * 0.169),
        "delta": (-0.178, -0.3 / (0.4 * 0.6) * 0.178),
    }[name]
    if divergence == "binary_tv":
        return binary[0]
    if divergence == "binary_kl":
        return binary[1]
    if divergence == "topk_kl":
        return {"alpha": -0.07 - q / 3, "beta": 0.072 - 0.525 * q, "delta": -0.2 - 0.5 * q}[name]
    return {"alpha": 0.015 - 0.5 * q, "beta": -0.6 * q, "delta": -0.16 - 0.4 * q}[name]


# the batch: (record, advantage)
BATCH = [("alpha", 1.0), ("alpha", -1.0), ("beta", 1.0), ("beta", -1.0), ("delta", -1.0), ("beta", 0.0)]


def run(cfg: MaskConfig, temperature=1.0, per_token_t: torch.Tensor | None = None):
    n = len(BATCH)
    t = per_token_t if per_token_t is not None else torch.full((n,), float(temperature), dtype=torch.float64)
    logits = torch.log(PI).repeat(n, 1) * t[:, None]  # softmax(ℓ/T) = π for every T
    ids = torch.tensor([RECORDS[r][0] for r, _ in BATCH])
    sampled = torch.log(torch.tensor([RECORDS[r][1] for r, _ in BATCH], dtype=torch.float64))
    topk_ids = torch.tensor([[0, 1]] * n)
    topk_lp = torch.log(torch.tensor([RECORDS[r][2] for r, _ in BATCH], dtype=torch.float64))
    adv = torch.tensor([a for _, a in BATCH], dtype=torch.float64)
    temp = per_token_t if per_token_t is not None else temperature
    return compute_masks(logits, ids, sampled, topk_ids, topk_lp, adv, config=cfg, temperature=temp)


@pytest.mark.parametrize("divergence", ["binary_tv", "binary_kl", "topk_tv", "topk_kl"])
@pytest.mark.parametrize("estimator", EST)
def test_divergence_and_predicted_direction(divergence: str, estimator: str) -> None:
    res = run(MaskConfig(method="predictive", divergence=divergence, estimator=estimator))
    want_d = [DIVERGENCE[r][divergence] for r, _ in BATCH]
    want_p = [predicted(r, divergence, estimator) for r, _ in BATCH]
    np.testing.assert_allclose(np_(res.divergence), want_d, rtol=0, atol=1e-12)
    np.testing.assert_allclose(np_(res.predicted_direction), want_p, rtol=0, atol=1e-12)
    np.testing.assert_allclose(np_(res.direction), want_p, rtol=0, atol=1e-12)
    # mismatch_* are always the top-K divergences, whatever D the config masks with
    np.testing.assert_allclose(np_(res.mismatch_kl), [DIVERGENCE[r]["topk_kl"] for r, _ in BATCH], atol=1e-12)
    np.testing.assert_allclose(np_(res.mismatch_tv), [DIVERGENCE[r]["topk_tv"] for r, _ in BATCH], atol=1e-12)
    # ratio direction π_a − μ_a: α −0.1, β −0.01, δ −0.3
    np.testing.assert_allclose(np_(res.ratio_direction), [-0.1, -0.1, -0.01, -0.01, -0.3, -0.01], atol=1e-12)
    np.testing.assert_allclose(np_(res.logprobs), np.log([0.1, 0.1, 0.2, 0.2, 0.4, 0.2]), atol=1e-12)


T_, F_ = True, False
# Default δ: 0.05 (KL), 0.15 (TV). far: binary_* only δ (0.3 and 0.184); topk_* every token.
# ppo (ε 0.2 / 0.28): r = α 0.5, β 0.952, δ 0.571; far for A<0 when r < 0.8 (tokens 1, 4).
KEEP = {
    ("none", "topk_kl", "proportional"): [T_, T_, T_, T_, T_, T_],
    ("ppo", "topk_kl", "proportional"): [T_, F_, T_, T_, F_, T_],
    # dppo: every ratio direction is negative: A < 0 and far is masked
    ("dppo", "binary_tv", "proportional"): [T_, T_, T_, T_, F_, T_],
    ("dppo", "binary_kl", "proportional"): [T_, T_, T_, T_, F_, T_],
    ("dppo", "topk_tv", "proportional"): [T_, F_, T_, F_, F_, T_],
    ("dppo", "topk_kl", "proportional"): [T_, F_, T_, F_, F_, T_],
    # predictive on binary divergences ≡ dppo
    ("predictive", "binary_tv", "proportional"): [T_, T_, T_, T_, F_, T_],
    ("predictive", "binary_kl", "proportional"): [T_, T_, T_, T_, F_, T_],
    # topk_kl: β's P̂ is positive for proportional / uniform (mask when A > 0, keep when A < 0)
    ("predictive", "topk_kl", "proportional"): [T_, F_, F_, T_, F_, T_],
    ("predictive", "topk_kl", "uniform"): [T_, F_, F_, T_, F_, T_],
    ("predictive", "topk_kl", "aggregated"): [T_, F_, T_, F_, F_, T_],
    ("predictive", "topk_tv", "proportional"): [T_, F_, T_, F_, F_, T_],
    ("predictive", "topk_tv", "aggregated"): [T_, F_, T_, F_, F_, T_],
}
FAR = {
    "binary_tv": [F_, F_, F_, F_, T_, F_],
    "binary_kl": [F_, F_, F_, F_, T_, F_],
    "topk_tv": [T_] * 6,
    "topk_kl": [T_] * 6,
}


@pytest.mark.parametrize(("method", "divergence", "estimator"), list(KEEP))
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_masks(method: str, divergence: str, estimator: str, temperature: float) -> None:
    res = run(MaskConfig(method=method, divergence=divergence, estimator=estimator), temperature=temperature)
    assert np_(res.keep).tolist() == KEEP[(method, divergence, estimator)]
    if method == "ppo":
        assert np_(res.far).tolist() == [F_, T_, F_, F_, T_, F_]
        np.testing.assert_allclose(
            np_(res.direction),
            [-0.5, -0.5, 0.2 / 0.21 - 1, 0.2 / 0.21 - 1, 0.4 / 0.7 - 1, 0.2 / 0.21 - 1],
            atol=1e-12,
        )
    else:
        assert np_(res.far).tolist() == FAR[divergence]
    if method in ("dppo", "none"):
        np.testing.assert_allclose(np_(res.direction), [-0.1, -0.1, -0.01, -0.01, -0.3, -0.01], atol=1e-12)


def test_topk_tv_uniform_on_a_zero_prediction() -> None:
    # α's uniform topk_tv P̂ is 0.015 − ½·0.03 = 0 exactly on paper; tokens 2–5 are clear-cut.
    res = run(MaskConfig(method="predictive", divergence="topk_tv", estimator="uniform"))
    assert abs(float(res.predicted_direction[0])) < 1e-12
    assert np_(res.keep).tolist()[2:] == [T_, F_, F_, T_]


def test_asymmetric_thresholds() -> None:
    # δ_low = 0.15 applies to A < 0: α (0.0998) and β (0.112) are no longer far, δ (0.184) still is;
    # δ_high = 0.05 for A ≥ 0 keeps every A ≥ 0 token far.
    res = run(MaskConfig(method="dppo", divergence="topk_kl", delta_low=0.15, delta_high=0.05))
    assert np_(res.far).tolist() == [T_, F_, T_, F_, T_, T_]
    assert np_(res.keep).tolist() == [T_, T_, T_, T_, F_, T_]
    # swapped: δ_high = 0.15 for A ≥ 0 makes α (A=+1) and β (A=+1, A=0) near
    res = run(MaskConfig(method="dppo", divergence="topk_kl", delta_low=0.05, delta_high=0.15))
    assert np_(res.far).tolist() == [F_, T_, F_, T_, T_, F_]


def test_per_token_temperature_tensor() -> None:
    t = torch.tensor([0.5, 1.0, 1.5, 2.0, 0.7, 1.3], dtype=torch.float64)
    res = run(MaskConfig(method="predictive", divergence="topk_kl"), per_token_t=t)
    assert np_(res.keep).tolist() == KEEP[("predictive", "topk_kl", "proportional")]
    want = [predicted(r, "topk_kl", "proportional") for r, _ in BATCH]
    np.testing.assert_allclose(np_(res.predicted_direction), want, atol=1e-12)
    np.testing.assert_allclose(np_(res.logprobs), np.log([0.1, 0.1, 0.2, 0.2, 0.4, 0.2]), atol=1e-12)
