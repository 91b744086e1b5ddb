"""The per-method decision table of compute_masks (docs/math.md §3), on quantities set by hand.

Seven tokens, thresholds ε = 0.2 / 0.28 and δ_low = 0.05 (A < 0) / δ_high = 0.09 (A ≥ 0):

    tok  π_a   μ_a   A    D     P̂      r = π_a/μ_a  π_a − μ_a   note
    0    0.3   0.2   +1   0.10  +0.02  1.5          +0.1        far and away for every rule
    1    0.1   0.2   −1   0.08  +0.03  0.5          −0.1        P̂ points back: predictive keeps it
    2    0.5   0.45  +1   0.20  −0.01  1.111        +0.05       r near, D far: ppo keeps, dppo masks
    3    0.3   0.2    0   0.20  +0.05  1.5          +0.1        A = 0: never away, always kept
    4    0.9   0.1   +1   1.00  +1.00  9            +0.8        padding: never far, never kept
    5    0.05  0.1   −1   0.01  −0.02  0.5          −0.05       r far, D near: only ppo masks
    6    0.1   0.2   −1   0.05  +0.10  0.5          −0.1        D = δ_low exactly: not far (strict)
"""

from __future__ import annotations

import math
from typing import get_args

import numpy as np
import pytest
import torch

from maskroll.trainer_adapter import MaskConfig
from maskroll.trainer_adapter.config import Method
from maskroll.trainer_adapter.masks import DECISIONS, Quantities

PI = [0.3, 0.1, 0.5, 0.3, 0.9, 0.05, 0.1]
MU = [0.2, 0.2, 0.45, 0.2, 0.1, 0.1, 0.2]
T_, F_ = True, False


def quantities() -> Quantities:
    f64 = lambda xs: torch.tensor(xs, dtype=torch.float64)  # noqa: E731
    logpi, logmu = f64([math.log(p) for p in PI]), f64([math.log(m) for m in MU])
    return Quantities(
        adv=f64([1.0, -1.0, 1.0, 0.0, 1.0, -1.0, -1.0]),
        logpi_a=logpi,
        mu_a_log=logmu,
        divergence=f64([0.10, 0.08, 0.20, 0.20, 1.00, 0.01, 0.05]),
        predicted=f64([0.02, 0.03, -0.01, 0.05, 1.00, -0.02, 0.10]),
        ratio_direction=logpi.exp() - logmu.exp(),
        valid=torch.tensor([T_, T_, T_, T_, F_, T_, T_]),
    )


RATIO_DIRECTION = [0.1, -0.1, 0.05, 0.1, 0.8, -0.05, -0.1]
FAR_BY_D = [T_, T_, T_, T_, F_, F_, F_]
FAR_BY_R = [T_, T_, F_, T_, F_, T_, T_]
EXPECTED = {  # method: (keep, far, direction)
    "ppo": ([F_, F_, T_, T_, F_, F_, F_], FAR_BY_R, [0.5, -0.5, 1 / 9, 0.5, 8.0, -0.5, -0.5]),
    "dppo": ([F_, F_, F_, T_, F_, T_, T_], FAR_BY_D, RATIO_DIRECTION),
    "predictive": ([F_, T_, T_, T_, F_, T_, T_], FAR_BY_D, [0.02, 0.03, -0.01, 0.05, 1.0, -0.02, 0.1]),
    # no mask, but dppo's tests are still reported (the diagnostics stay comparable across runs)
    "none": ([T_, T_, T_, T_, F_, T_, T_], FAR_BY_D, RATIO_DIRECTION),
}


def test_one_decision_per_method() -> None:
    assert set(DECISIONS) == set(get_args(Method)) == set(EXPECTED)


@pytest.mark.parametrize("method", list(EXPECTED))
def test_decision_by_hand(method: str) -> None:
    cfg = MaskConfig(method=method, divergence="topk_kl", delta_low=0.05, delta_high=0.09)
    keep, far, direction = EXPECTED[method]
    d = DECISIONS[method](quantities(), cfg)
    assert d.keep.tolist() == keep
    assert d.far.tolist() == far
    np.testing.assert_allclose(d.direction.numpy(), direction, rtol=0, atol=1e-12)


def test_thresholds_move_the_decision() -> None:
    # ε_high = 0.6 makes tokens 0 and 3 (r = 1.5) near for ppo; δ_high = 0.25 makes tokens 0, 2, 3 near.
    q = quantities()
    ppo = DECISIONS["ppo"](q, MaskConfig(method="ppo", eps_high=0.6))
    assert ppo.far.tolist() == [F_, T_, F_, F_, F_, T_, T_]
    assert ppo.keep.tolist() == [T_, F_, T_, T_, F_, F_, F_]
    dppo = DECISIONS["dppo"](q, MaskConfig(method="dppo", delta_low=0.05, delta_high=0.25))
    assert dppo.far.tolist() == [F_, T_, F_, F_, F_, F_, F_]
    assert dppo.keep.tolist() == [T_, F_, T_, T_, F_, T_, T_]
