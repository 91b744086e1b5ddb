"""bench/fidelity.py: the study's counts follow docs/math.md §7, its paired differences and bootstrap
intervals are right on planted cases computed by hand, and the --quick study runs end to end with sane
numbers."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# bench/ is not a package: its modules import each other plainly, as under `python bench/fidelity.py`.
sys.path.append(str(ROOT / "bench"))

import fidelity  # noqa: E402
import fidelity_report  # noqa: E402
import fidelity_stats as fs  # noqa: E402

from maskroll.trainer_adapter import direction_agreement  # noqa: E402

# Eight planted tokens (the last is padding). "away" = A · direction > 0.
ADV = np.array([1.0, 1.0, -1.0, -1.0, 1.0, 0.0, -1.0, 1.0])
DELTA = np.array([0.2, -0.1, 0.3, -0.2, 0.1, 0.5, 0.4, 0.9])  # realised ΔD
VALID = np.array([1, 1, 1, 1, 1, 1, 1, 0], bool)
FAR = np.array([1, 1, 1, 0, 1, 1, 1, 1], bool)
RATIO = np.array([0.5, 0.5, 0.5, 0.5, -0.5, 0.5, -0.5, 0.5])  # away: T T F F F F T T
PRED = np.array([0.5, -0.5, -0.5, 0.5, 0.5, 0.5, -0.5, 0.5])  # away: T F T F T F T T


def _dppo_like_keep(direction: np.ndarray) -> np.ndarray:
    return ~(FAR & (ADV * direction > 0))


def test_rule_counts_by_hand() -> None:
    keep = _dppo_like_keep(PRED)  # masked: tokens 0, 2, 4, 6 (7 is padding)
    c = fs.rule_counts(ADV, DELTA, VALID, FAR, PRED, keep)
    # scored (valid, A ≠ 0): 0,1,2,3,4,6. sign(A·P̂) = + − + − + +; sign(ΔD) = + − + − + + → all 6 agree
    assert c["agree_all"] == (6, 6)
    assert c["agree_far"] == (5, 5)  # far ∧ scored: 0, 1, 2, 4, 6
    assert c["unsafe_keep"] == (1, 2)  # kept ∧ far: 1 (ΔD < 0), 5 (ΔD > 0, A = 0 keeps)
    assert c["wrong_mask"] == (0, 4)  # masked 0, 2, 4, 6: all ΔD > 0
    assert c["mask_frac"] == (4, 7)
    r = fs.rule_counts(ADV, DELTA, VALID, FAR, RATIO, _dppo_like_keep(RATIO))
    # sign(A·ratio) = + + − − − + vs + − + − + + on 0,1,2,3,4,6 → agree on 0, 3, 6
    assert r["agree_all"] == (3, 6)
    assert r["agree_far"] == (2, 5)
    assert r["unsafe_keep"] == (3, 3)  # kept ∧ far: 2, 4, 5, all ΔD > 0
    assert r["wrong_mask"] == (1, 3)  # masked 0, 1, 6: token 1 has ΔD < 0


def test_disagreement_counts_by_hand() -> None:
    d = fs.disagreement_counts(ADV, DELTA, VALID, FAR, RATIO, PRED)
    # far ∧ valid: 0,1,2,4,5,6; away differs on 1, 2, 4
    assert d["dis_frac"] == (3, 6)
    assert d["pred_right"] == (3, 3)
    assert d["ratio_right"] == (0, 3)
    # each rule against its own step: the ratio rule scored on a ΔD of the opposite sign is right on all 3
    d = fs.disagreement_counts(ADV, DELTA, VALID, FAR, RATIO, PRED, ratio_delta=-DELTA)
    assert (d["pred_right"], d["ratio_right"]) == ((3, 3), (3, 3))


def test_counts_match_the_adapter_direction_agreement() -> None:
    """For rules whose mask is far ∧ away, the study's rates are trainer_adapter's §7 scores."""
    rng = np.random.default_rng(0)
    n = 500
    adv = rng.choice([-1.0, 0.0, 1.0], n)
    before, delta = rng.random(n) * 0.2, rng.normal(0, 0.05, n)
    far = before > 0.05
    dirs = {"ratio": rng.normal(size=n), "predictive": rng.normal(size=n)}
    t = lambda x: torch.as_tensor(x, dtype=torch.float64)  # noqa: E731
    ref = direction_agreement(
        t(adv), t(before), t(before + delta), {k: t(v) for k, v in dirs.items()}, t(far)
    )
    valid = np.ones(n, bool)
    dis = fs.disagreement_counts(adv, delta, valid, far, dirs["ratio"], dirs["predictive"])
    assert fs.rate(dis["dis_frac"]) == pytest.approx(ref["_sets"]["disagreement_frac_far"])
    assert fs.rate(dis["pred_right"]) == pytest.approx(ref["predictive"]["agree_disagreement"])
    assert fs.rate(dis["ratio_right"]) == pytest.approx(ref["ratio"]["agree_disagreement"])
    for name, d in dirs.items():
        keep = ~(far & (adv * d > 0))
        c = fs.rule_counts(adv, delta, valid, far, d, keep)
        for metric in ("agree_all", "agree_far", "unsafe_keep", "wrong_mask", "mask_frac"):
            assert fs.rate(c[metric]) == pytest.approx(ref[name][metric]), (name, metric)


def _binomial_cdf(k: int, n: int) -> float:
    return sum(math.comb(n, i) for i in range(k + 1)) / 2**n


def test_bootstrap_interval_by_hand() -> None:
    assert fs.bootstrap_ci([0.1] * 20) == {
        "mean": pytest.approx(0.1),
        "lo": pytest.approx(0.1),
        "hi": pytest.approx(0.1),
        "n": 20,
    }
    # Ten 0s and ten 1s: a resampled mean is X/20 with X ~ Binomial(20, 1/2). P(X ≤ 5) = 0.021 and
    # P(X ≤ 6) = 0.058 straddle 0.025, P(X ≤ 13) = 0.942 and P(X ≤ 14) = 0.979 straddle 0.975, so the
    # percentile interval is [6/20, 14/20] (10 000 resamples put the empirical CDF within ±0.004).
    assert _binomial_cdf(5, 20) < 0.025 - 0.004 < 0.025 + 0.004 < _binomial_cdf(6, 20)
    assert _binomial_cdf(13, 20) < 0.975 - 0.004 < 0.975 + 0.004 < _binomial_cdf(14, 20)
    ci = fs.bootstrap_ci([0.0] * 10 + [1.0] * 10)
    assert (ci["mean"], ci["lo"], ci["hi"], ci["n"]) == (
        pytest.approx(0.5),
        pytest.approx(0.3),
        pytest.approx(0.7),
        20,
    )
    assert fs.verdict(ci, +1) == "as paper" and fs.verdict(ci, -1) == "opposite"
    assert fs.verdict({"mean": 0.0, "lo": -0.1, "hi": 0.1}, +1) == "inconclusive"


def _planted_run(seed: int, optimizer: str, pred_unsafe: tuple[int, int], dis_right: tuple[int, int]) -> dict:
    """A run whose counts are planted: DPPO unsafe-keep 4/10, predictive `pred_unsafe`; on the
    disagreement set predictive is right `dis_right`, the ratio rule the rest."""
    base = {
        "agree_all": (5, 10),
        "agree_far": (5, 10),
        "unsafe_keep": (4, 10),
        "wrong_mask": (1, 4),
        "mask_frac": (4, 20),
    }
    right, total = dis_right
    dis = {"dis_frac": (total, 10), "pred_right": (right, total), "ratio_right": (total - right, total)}
    return {
        "config": {"seed": seed, "optimizer": optimizer, "lr": 0.1},
        "counts": {
            "own": {"dppo": base, "predictive/proportional": {**base, "unsafe_keep": pred_unsafe}},
            "own_disagreement": {"proportional": dis},
            # the shared-step design planted with no difference at all
            "shared": {"dppo": base, "predictive/proportional": base},
            "shared_disagreement": {"proportional": {**dis, "pred_right": (1, 2), "ratio_right": (1, 2)}},
        },
        "steps": [{"tokens": 20, "far_frac": 0.5}],
        "decomposition": [],
    }


def test_paired_differences_on_a_planted_study() -> None:
    # sgd: predictive keeps 3/10 unsafe on every seed (−0.1); seeds 0–9 right 2/2 on the disagreement set
    # (+1), seeds 10–19 right 1/2 (0), seed 20 has an empty disagreement set and drops out of that metric.
    runs = [_planted_run(s, "sgd", (3, 10), (2, 2) if s < 10 else (1, 2)) for s in range(20)]
    runs.append(_planted_run(20, "sgd", (3, 10), (0, 0)))
    # adam: predictive's unsafe-keep 5/10 (+0.1) on every seed
    runs += [_planted_run(s, "adam", (5, 10), (1, 2)) for s in range(21)]
    out = fs.summarise(runs, reps=10_000)
    sgd, adam = out["settings"]["sgd lr=0.1"], out["settings"]["adam lr=0.1"]
    d = sgd["own"]["diff"]["predictive/proportional"]["unsafe_keep"]
    assert (d["mean"], d["lo"], d["hi"], d["n"]) == (
        pytest.approx(-0.1),
        pytest.approx(-0.1),
        pytest.approx(-0.1),
        21,
    )
    assert sgd["own"]["diff"]["predictive/proportional"]["agree_far"]["mean"] == pytest.approx(0.0)
    assert sgd["shared"]["diff"]["predictive/proportional"]["unsafe_keep"]["mean"] == pytest.approx(0.0)
    dis = sgd["own"]["disagreement"]["proportional"]["pred_minus_ratio"]
    # per seed: 2/2 − 0/2 = +1 (ten seeds), 1/2 − 1/2 = 0 (ten seeds): the Binomial case above
    assert (dis["mean"], dis["lo"], dis["hi"], dis["n"]) == (
        pytest.approx(0.5),
        pytest.approx(0.3),
        pytest.approx(0.7),
        20,
    )
    assert sgd["own"]["rules"]["dppo"]["unsafe_keep"]["mean"] == pytest.approx(0.4)
    assert adam["own"]["diff"]["predictive/proportional"]["unsafe_keep"]["mean"] == pytest.approx(0.1)
    # pooled over settings, per seed: (−0.1 + 0.1) / 2 = 0 for unsafe-keep
    pooled = out["all_settings_diff"]["own:predictive/proportional:unsafe_keep"]
    assert (pooled["mean"], pooled["lo"], pooled["hi"]) == (
        pytest.approx(0.0),
        pytest.approx(0.0),
        pytest.approx(0.0),
    )
    # disagreement pooled: seeds 0–9 (1 + 0)/2, seeds 10–19 (0 + 0)/2, seed 20 only adam's 0 → mean 5/21
    assert out["all_settings_diff"]["own:disagreement/proportional"]["mean"] == pytest.approx(5 / 21)
    assert out["all_settings_diff"]["shared:disagreement/proportional"]["mean"] == pytest.approx(0.0)


def test_decomposition_counts_by_hand() -> None:
    rows = [
        {
            "ratio": 1.0,
            "predictive": 1.0,
            "logit": 1e-6,
            "own": 0.2,
            "batch": -0.1,
            "real": 0.3,
            "kept": True,
        },
        {
            "ratio": 1.0,
            "predictive": -1.0,
            "logit": -1e-6,
            "own": -0.2,
            "batch": -0.1,
            "real": 0.3,
            "kept": False,
        },
        {
            "ratio": -1.0,
            "predictive": 1.0,
            "logit": 1e-6,
            "own": -0.2,
            "batch": 0.1,
            "real": -0.3,
            "kept": True,
        },
    ]
    c = fs.decomposition_counts(rows)
    assert c["predictive~logit"] == (3, 3)
    assert c["ratio~logit"] == (1, 3)
    assert c["logit~own"] == (2, 3)
    assert c["predictive~own"] == (2, 3)
    assert c["ratio~own"] == (2, 3)
    assert c["own~batch"] == (1, 3)
    assert c["own~batch|kept"] == (0, 2)
    assert c["predictive~own|disagree"] == (1, 2)
    assert c["batch~real"] == (0, 3)


@pytest.mark.slow
def test_quick_study_runs(tmp_path: Path) -> None:
    assert fidelity.main(["--quick", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "fidelity.json").read_text())
    assert (tmp_path / "fidelity.png").stat().st_size > 10_000
    assert "predictive/proportional" in (tmp_path / "fidelity.md").read_text()
    runs = result["runs"]
    assert len(runs) == len(fidelity.QUICK.seeds) * len(fidelity.QUICK.settings)
    for r in runs:
        first, *rest = r["steps"]
        # step 1 samples with the trainer's own weights: the engine's μ is the trainer's π, nothing is far
        assert first["staleness"] == 0 and first["divergence_mean"] < 1e-4 and first["far_frac"] == 0
        assert all(s["staleness"] == 1 for s in rest) and any(s["far_frac"] > 0.05 for s in rest)
        for table, by_rule in r["counts"].items():
            for rule, counts in by_rule.items():
                for metric, (num, den) in counts.items():
                    assert 0 <= num <= den, (table, rule, metric)
        # the paired design: every rule is scored on the same far tokens, in both designs
        assert len({c["agree_far"][1] for t in ("own", "shared") for c in r["counts"][t].values()}) == 1
        # the training rule's own step is the real step; the other rules' steps differ from it
        own, shared = r["counts"]["own"], r["counts"]["shared"]
        assert own[fidelity.QUICK.train_rule] == shared[fidelity.QUICK.train_rule]
        assert own != shared
        assert r["decomposition"], "no far token was decomposed"
        # P̂ (proportional) is the exact first-order change of topk_kl for a step of the token's logits
        # alone (docs/math.md §4), so it must call the sign of the decomposition's logit step every time.
        for row in r["decomposition"]:
            assert row["predictive"] == np.sign(row["logit"]) != 0, row
    # the summary's paired difference is the mean over seeds of (rule − DPPO) from the raw counts
    for name, s in result["summary"]["settings"].items():
        mine = [r for r in runs if fs.setting_of(r["config"]) == name]
        for design in ("own", "shared"):
            want = np.mean(
                [
                    fs.rate(r["counts"][design]["predictive/proportional"]["unsafe_keep"])
                    - fs.rate(r["counts"][design]["dppo"]["unsafe_keep"])
                    for r in mine
                ]
            )
            got = s[design]["diff"]["predictive/proportional"]["unsafe_keep"]
            assert got["mean"] == pytest.approx(want) and got["lo"] <= got["mean"] <= got["hi"]
            for rule, rates in s[design]["rules"].items():
                for metric, ci in rates.items():
                    assert 0 <= ci["lo"] <= ci["mean"] <= ci["hi"] <= 1, (name, design, rule, metric)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_counterfactual_step_is_the_real_step(tmp_path: Path, optimizer: str) -> None:
    """The shadow step of the "own" design, given the training rule's gradient, is exactly the real
    optimiser step, and it leaves the trainer's weights and optimiser state untouched."""
    import asyncio
    import copy
    import random

    import fidelity_run as fr
    import transformers

    from maskroll.app.model_init import init_model
    from maskroll.recipes import digits
    from maskroll.recipes.grpo import completion_logits
    from maskroll.server.engines.torch_engine import TorchEngine
    from maskroll.trainer_adapter import collate, policy_loss, token_logprobs

    model_dir = init_model(tmp_path / "m", seed=3)
    cfg = fr.RunConfig(
        seed=3, optimizer=optimizer, lr=0.1 if optimizer == "sgd" else 2e-3, prompts_per_step=2, n=4
    )
    engine = TorchEngine(model_dir, max_logprobs=cfg.logprobs_k, max_batch=cfg.batch_size, threads=1)
    with asyncio.Runner() as runner:
        runner.run(engine.start())
        encode = digits.encoder(model_dir)
        records = fr.sample_batch(
            engine, runner, [encode(p) for p in digits.prompts(random.Random(3), 2)], cfg, 1
        )
        runner.run(engine.close())
    b = collate(
        records,
        [digits.digit_reward(r.completion_ids, cfg.max_tokens) + 0.01 * i for i, r in enumerate(records)],
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    opt = fr.OPTIMIZERS[optimizer](model.parameters(), lr=cfg.lr)
    shadow = copy.deepcopy(model)
    ref = fr.rule_configs()["dppo"]

    def loss_of(m):
        lp = token_logprobs(completion_logits(m, b), b.completion_ids, temperature=b.temperature)
        return policy_loss(
            lp, b.sampled_logprobs, b.advantages, b.response_mask, response_mask=b.response_mask
        )[0]

    for _ in range(2):  # the second step runs with a non-empty Adam state
        grads = torch.autograd.grad(loss_of(model), list(model.parameters()))
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        state = copy.deepcopy(opt.state_dict())
        d_shadow = fr.counterfactual_after(model, opt, shadow, grads, b, cfg)
        assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
        now = opt.state_dict()
        assert now["state"].keys() == state["state"].keys()
        for i, st in state["state"].items():  # Adam's step, exp_avg, exp_avg_sq: untouched
            assert all(torch.equal(v, now["state"][i][k]) for k, v in st.items())
        for p, g in zip(model.parameters(), grads, strict=True):
            p.grad = g.clone()
        opt.step()
        with torch.no_grad():
            d_real = fr.masks(completion_logits(model, b), b, ref).divergence
        assert torch.equal(d_shadow, d_real)
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), shadow.parameters(), strict=True))


@pytest.mark.slow
def test_quick_smollm2_study_runs(tmp_path: Path) -> None:
    """`--model smollm2 --quick`: SmolLM2-135M (4-bit weights, dequantised) on the arithmetic task, one
    seed, two short steps; the same machinery and statistics as the tiny study, checked the same way."""
    from maskroll.app import smollm2

    try:
        smollm2.gguf_path()
    except smollm2.SmolLM2Missing as exc:
        pytest.skip(str(exc))
    assert fidelity.main(["--model", "smollm2", "--quick", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "fidelity.json").read_text())
    study = fidelity.SMOLLM2_QUICK
    assert result["study"]["model"] == "smollm2" and len(result["runs"]) == len(study.seeds)
    (r,) = result["runs"]
    first, second = r["steps"]
    # step 1: the float32 engine samples with the trainer's own weights, so μ = π and nothing is far;
    # 49 152 logits through 30 layers in two code paths (KV-cached decode, one full forward) agree to 1e-4
    assert first["staleness"] == 0 and first["divergence_mean"] < 1e-4 and first["far_frac"] == 0
    assert second["staleness"] == 1
    # The reward is binary and the policy right ~6 % of the time at temperature 1: when every group of
    # step 1 has equal rewards, every advantage is 0, the step is zero and step 2 is still on-policy.
    if first["loss"] != 0:
        assert second["far_frac"] > 0 and second["divergence_mean"] > 1e-4, second
    else:
        assert second["divergence_mean"] < 1e-4 and second["far_frac"] == 0, second
    for table, by_rule in r["counts"].items():
        for rule, counts in by_rule.items():
            for metric, (num, den) in counts.items():
                assert 0 <= num <= den, (table, rule, metric)
    assert len({c["agree_far"][1] for t in ("own", "shared") for c in r["counts"][t].values()}) == 1
    own, shared = r["counts"]["own"], r["counts"]["shared"]
    assert own[study.train_rule] == shared[study.train_rule]
    for row in r["decomposition"]:  # the closed form is exact for a step of the token's logits alone
        assert row["predictive"] == np.sign(row["logit"]) != 0, row
    (s,) = result["summary"]["settings"].values()
    for design in ("own", "shared"):
        got = s[design]["diff"]["predictive/proportional"]["unsafe_keep"]
        want = fs.rate(r["counts"][design]["predictive/proportional"]["unsafe_keep"]) - fs.rate(
            r["counts"][design]["dppo"]["unsafe_keep"]
        )
        if np.isfinite(want):  # one seed: the interval is the point
            assert got["mean"] == pytest.approx(want) and got["lo"] == got["hi"] == pytest.approx(want)


def test_curve_summary_by_hand() -> None:
    """Learning curves: per rule and step the mean over seeds, the gain (last − step 0) and the paired
    difference from DPPO per seed."""

    def run(seed: int, rule: str, accs: list[float]) -> dict:
        return {
            "config": {"seed": seed, "rule": rule},
            "accuracy": [{"step": 5 * i, "accuracy": a} for i, a in enumerate(accs)],
        }

    runs = [
        run(0, "dppo", [0.25, 0.5]),
        run(1, "dppo", [0.25, 0.25]),
        run(0, "predictive/proportional", [0.25, 0.75]),
        run(1, "predictive/proportional", [0.25, 0.5]),
    ]
    out = fs.curve_summary(runs, reps=2000)
    assert out["rules"]["dppo"][5]["mean"] == pytest.approx(0.375)
    assert out["gain"]["predictive/proportional"]["mean"] == pytest.approx(0.375)
    d = out["diff"]["predictive/proportional"][5]
    assert (d["mean"], d["lo"], d["hi"], d["n"]) == (
        pytest.approx(0.25),
        pytest.approx(0.25),
        pytest.approx(0.25),
        2,
    )
    assert out["diff"]["predictive/proportional"][0]["mean"] == pytest.approx(0.0)
    text = fidelity_report.curves_markdown(out, "## curves")
    assert "| dppo | 0.25 [0.25, 0.25] | 0.38 [0.25, 0.50] | +0.12 [+0.00, +0.25] |" in text
