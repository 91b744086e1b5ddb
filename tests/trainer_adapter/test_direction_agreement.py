"""direction_agreement (MATH §7): a hand-scored batch, empty sets → nan, and the exact P of a full
divergence agreeing with an infinitesimal free-logit step on every token."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from adapter_helpers import free_logit_step

from maskroll.trainer_adapter import direction_agreement, full_kl, full_kl_direction

# token:          0     1     2     3     4     5     6     7
A = [1.0, -1.0, 1.0, -1.0, 0.0, 1.0, -1.0, 1.0]
D_BEFORE = [0.1] * 8
D_AFTER = [0.2, 0.15, 0.05, 0.3, 0.2, 0.2, 0.0, 0.05]  # ΔD: + + − + + + − −
RATIO = [1.0, 1.0, -1.0, 1.0, 1.0, -1.0, 1.0, 1.0]
PRED = [1.0, -1.0, -1.0, -1.0, 1.0, -1.0, 1.0, -1.0]
FAR = [True, True, False, True, False, True, True, True]
RESP = [True, True, True, True, True, False, True, True]  # token 5 is padding
# sign(A·dir):  ratio  + − − − 0 (−) − +      predictive  + + − + 0 (−) − −
# sign(ΔD):            + + − + + (+) − −
# scored tokens (response, A ≠ 0): 0 1 2 3 6 7
#   ratio agrees on 0 2 6 → 3/6;            predictive agrees on all 6 → 1
#   far among them: 0 1 3 6 7: ratio 0 6 → 2/5; predictive 5/5
#   disagreement set (far, rules differ on A·dir > 0): 1 3 7 → ratio 0/3, predictive 3/3
# keeps (¬(far ∧ A·dir > 0)):
#   ratio masks 0 7;       kept ∧ far = 1 3 6: ΔD > 0 on 1 3 → unsafe_keep 2/3; masked ΔD < 0: 7 → 1/2
#   predictive masks 0 1 3; kept ∧ far = 6 7: ΔD > 0 on none → 0;   masked ΔD < 0: none → 0
WANT = {
    "ratio": {
        "agree_all": 0.5,
        "agree_far": 0.4,
        "agree_disagreement": 0.0,
        "unsafe_keep": 2 / 3,
        "wrong_mask": 0.5,
    },
    "predictive": {
        "agree_all": 1.0,
        "agree_far": 1.0,
        "agree_disagreement": 1.0,
        "unsafe_keep": 0.0,
        "wrong_mask": 0.0,
    },
}


def t(x, dtype=torch.float64):
    return torch.tensor(x, dtype=dtype)


def test_hand_scored_batch() -> None:
    got = direction_agreement(
        t(A),
        t(D_BEFORE),
        t(D_AFTER),
        {"ratio": t(RATIO), "predictive": t(PRED)},
        t(FAR, torch.bool),
        pair=("ratio", "predictive"),
        response_mask=t(RESP, torch.bool),
    )
    for rule, want in WANT.items():
        for key, value in want.items():
            assert float(got[rule][key]) == pytest.approx(value, abs=1e-12), (rule, key)


def test_extra_rule_and_pair() -> None:
    # a third rule identical to "ratio", scored on the ratio/predictive disagreement set
    dirs = {"ratio": t(RATIO), "predictive": t(PRED), "copy": t(RATIO)}
    got = direction_agreement(
        t(A), t(D_BEFORE), t(D_AFTER), dirs, t(FAR, torch.bool), response_mask=t(RESP, torch.bool)
    )
    for key, value in WANT["ratio"].items():
        assert float(got["copy"][key]) == pytest.approx(value, abs=1e-12), key
    # pair = (ratio, copy): they never disagree → an empty set → nan
    got = direction_agreement(
        t(A),
        t(D_BEFORE),
        t(D_AFTER),
        dirs,
        t(FAR, torch.bool),
        pair=("ratio", "copy"),
        response_mask=t(RESP, torch.bool),
    )
    assert math.isnan(float(got["ratio"]["agree_disagreement"]))
    assert float(got["ratio"]["agree_all"]) == pytest.approx(0.5, abs=1e-12)


def test_response_mask_none_scores_every_token() -> None:
    # with token 5 scored (A > 0, ratio −, ΔD +: a miss for both rules): ratio 3/7, predictive 6/7
    got = direction_agreement(
        t(A), t(D_BEFORE), t(D_AFTER), {"ratio": t(RATIO), "predictive": t(PRED)}, t(FAR, torch.bool)
    )
    assert float(got["ratio"]["agree_all"]) == pytest.approx(3 / 7, abs=1e-12)
    assert float(got["predictive"]["agree_all"]) == pytest.approx(6 / 7, abs=1e-12)


def test_empty_sets_are_nan() -> None:
    far = torch.zeros(8, dtype=torch.bool)
    got = direction_agreement(
        t(A),
        t(D_BEFORE),
        t(D_AFTER),
        {"ratio": t(RATIO), "predictive": t(PRED)},
        far,
        response_mask=t(RESP, torch.bool),
    )
    for rule in ("ratio", "predictive"):
        assert math.isnan(float(got[rule]["agree_far"]))
        assert math.isnan(float(got[rule]["agree_disagreement"]))
        assert math.isnan(float(got[rule]["unsafe_keep"]))  # nothing far is kept
        assert math.isnan(float(got[rule]["wrong_mask"]))  # nothing is masked
    assert float(got["ratio"]["agree_all"]) == pytest.approx(0.5, abs=1e-12)


def test_exact_direction_agrees_with_an_infinitesimal_step() -> None:
    """MATH §4.2: with the exact P of the full KL and a tiny free-logit step τ = ε·A, every token's
    realised ΔD has the predicted sign (tokens with |P| at rounding level aside)."""
    rng = np.random.default_rng(80)
    n, v = 64, 200
    z = torch.tensor(rng.standard_normal((n, v)) * 2)
    mu_lp = torch.log_softmax(z + torch.tensor(rng.standard_normal((n, v))) * 0.7, -1)
    ids = torch.tensor(rng.integers(0, v, n))
    adv = torch.tensor(rng.choice([-1.0, 1.0], n))
    pi_lp = torch.log_softmax(z, -1)
    p = full_kl_direction(mu_lp, pi_lp, ids)
    assert float(p.abs().min()) > 1e-6
    d0 = full_kl(mu_lp, pi_lp)
    steps = [free_logit_step(z[i : i + 1], ids[i : i + 1], 1.0, 1e-6 * float(adv[i])) for i in range(n)]
    d1 = full_kl(mu_lp, torch.log_softmax(torch.cat(steps), -1))
    far = d0 > float(d0.median())
    got = direction_agreement(
        adv,
        d0,
        d1,
        {
            "exact": p,
            "ratio": pi_lp.gather(1, ids[:, None])[:, 0].exp() - mu_lp.gather(1, ids[:, None])[:, 0].exp(),
        },
        far,
        pair=("ratio", "exact"),
    )
    assert got["exact"]["agree_all"] == 1.0
    assert got["exact"]["agree_far"] == 1.0
    assert got["exact"]["unsafe_keep"] == 0.0 or math.isnan(got["exact"]["unsafe_keep"])
    assert got["exact"]["wrong_mask"] == 0.0
    assert got["ratio"]["agree_all"] < 1.0  # the ratio rule does miss some here
