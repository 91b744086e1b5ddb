"""The fidelity study's statistics: docs/math.md §7 counts per rule, per-seed rates, paired differences and
percentile-bootstrap confidence intervals over seeds. Pure numpy; knows nothing of models or torch.

Rates are pooled within one run (one seed at one setting): Σ numerators / Σ denominators over its steps,
so a step with few far tokens weighs less than one with many. Seeds are the unit of replication: a paired
difference is (rule − reference) per seed, and its interval resamples seeds, never tokens (tokens of one
run share the model state and are far from independent).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

# (name, what the rate means) — docs/math.md §7
RULE_METRICS = {
    "agree_all": "sign(A·P̂) = sign(ΔD), over response tokens with A ≠ 0",
    "agree_far": "the same, over far tokens (D > δ)",
    "unsafe_keep": "ΔD > 0, over kept ∧ far tokens",
    "wrong_mask": "ΔD < 0, over masked tokens",
    "mask_frac": "masked, over response tokens",
}
DISAGREEMENT_METRICS = {
    "dis_frac": "far tokens where the ratio and this estimator's direction differ, over far tokens",
    "pred_right": "predictive sign = sign(ΔD), over that disagreement set",
    "ratio_right": "ratio sign = sign(ΔD), over that disagreement set",
}

Counts = dict[str, tuple[int, int]]  # metric -> (numerator, denominator)


def _count(hit: np.ndarray, where: np.ndarray) -> tuple[int, int]:
    return int((hit & where).sum()), int(where.sum())


def rule_counts(
    adv: np.ndarray,  # [N] token advantage A
    delta: np.ndarray,  # [N] realised ΔD = D(μ, π') − D(μ, π)
    valid: np.ndarray,  # [N] bool response token
    far: np.ndarray,  # [N] bool D > δ (the same set for every rule)
    direction: np.ndarray,  # [N] the rule's coefficient: "away" iff A · direction > 0
    keep: np.ndarray,  # [N] bool the rule's own mask (True = kept)
) -> Counts:
    """One rule's counts (docs/math.md §7) on one step. `keep` is the rule's real mask, so PPO (whose
    proximity is the ratio clip, not D > δ) is scored by what it keeps; for DPPO and predictive
    keep = ¬(far ∧ away)."""
    far = far & valid
    scored = valid & (adv != 0)
    agree = np.sign(adv * direction) == np.sign(delta)
    kept = keep & valid
    masked = valid & ~keep
    return {
        "agree_all": _count(agree, scored),
        "agree_far": _count(agree, scored & far),
        "unsafe_keep": _count(delta > 0, kept & far),
        "wrong_mask": _count(delta < 0, masked),
        "mask_frac": _count(masked, valid),
    }


def disagreement_counts(
    adv: np.ndarray,  # [N]
    delta: np.ndarray,  # [N]
    valid: np.ndarray,  # [N] bool
    far: np.ndarray,  # [N] bool
    ratio_direction: np.ndarray,  # [N] π_a − μ_a
    predicted_direction: np.ndarray,  # [N] P̂ of one estimator
    *,
    ratio_delta: np.ndarray | None = None,  # [N] the ΔD the ratio rule is scored against; default `delta`
) -> Counts:
    """Who is right where the ratio and the predictive rule disagree (far tokens only, docs/math.md §7)."""
    far = far & valid
    away_r, away_p = adv * ratio_direction > 0, adv * predicted_direction > 0
    dis = far & (away_r != away_p)
    scored = dis & (adv != 0)
    ratio_delta = delta if ratio_delta is None else ratio_delta
    return {
        "dis_frac": _count(dis, far),
        "pred_right": _count(np.sign(adv * predicted_direction) == np.sign(delta), scored),
        "ratio_right": _count(np.sign(adv * ratio_direction) == np.sign(ratio_delta), scored),
    }


def add(total: Counts, more: Counts) -> Counts:
    """Pool counts: numerators and denominators add."""
    return {k: (total.get(k, (0, 0))[0] + n, total.get(k, (0, 0))[1] + d) for k, (n, d) in more.items()}


def rate(counts: tuple[int, int]) -> float:
    n, d = counts
    return n / d if d else float("nan")


def paired_differences(rule: Sequence[float], reference: Sequence[float]) -> np.ndarray:  # -> [S']
    """rule − reference per seed; seeds where either rate is undefined (empty set) are dropped."""
    a, b = np.asarray(rule, np.float64), np.asarray(reference, np.float64)
    if a.shape != b.shape:
        raise ValueError(f"paired rates need one value per seed for both rules: {a.shape} vs {b.shape}")
    ok = np.isfinite(a) & np.isfinite(b)
    return a[ok] - b[ok]


def bootstrap_ci(
    values: Sequence[float], *, reps: int = 10_000, level: float = 0.95, seed: int = 0
) -> dict[str, float]:
    """Mean of `values` (one per seed) and its percentile-bootstrap interval: resample the seeds with
    replacement `reps` times, take the (1 ± level)/2 quantiles of the resampled means."""
    x = np.asarray(values, np.float64)
    if x.size == 0:
        return {"mean": float("nan"), "lo": float("nan"), "hi": float("nan"), "n": 0}
    idx = np.random.default_rng(seed).integers(0, x.size, size=(reps, x.size))  # [reps, S]
    means = x[idx].mean(axis=1)  # [reps]
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return {"mean": float(x.mean()), "lo": float(lo), "hi": float(hi), "n": int(x.size)}


def verdict(ci: Mapping[str, float], better: int) -> str:
    """'as paper' if the interval excludes 0 on the side the paper claims (`better` = +1: higher is
    better, −1: lower is better), 'opposite' if it excludes 0 on the other side, else 'inconclusive'."""
    lo, hi = ci.get("lo", float("nan")), ci.get("hi", float("nan"))
    if not (np.isfinite(lo) and np.isfinite(hi)):
        return "n/a"
    if lo > 0 or hi < 0:
        return "as paper" if (lo > 0) == (better > 0) else "opposite"
    return "inconclusive"


# ---- the error decomposition: sign agreement between predictions and realised changes ---------------

# (a, b): how often sign(a) = sign(b) on the sampled far tokens. "ratio"/"predictive" are the rules'
# predicted signs (±1, "away" = +1); "logit", "own", "batch", "real" are ΔD under a step of the token's
# logits alone (the closed form's idealisation), a small parameter step on its own loss term, the batch's
# small step along its plain gradient, and the real optimiser step.
DECOMPOSITION_SIGNS = ("ratio", "predictive", "logit", "own", "batch", "real")
DECOMPOSITION_PAIRS = (
    ("predictive", "logit"),
    ("ratio", "logit"),
    ("logit", "own"),
    ("predictive", "own"),
    ("ratio", "own"),
    ("own", "batch"),
    ("batch", "real"),
    ("own", "real"),
    ("predictive", "real"),
    ("ratio", "real"),
)


def decomposition_counts(rows: Sequence[Mapping[str, float]]) -> Counts:
    """Agreement counts of every pair, plus predictive-vs-own on the tokens where the two rules disagree."""
    if not rows:
        return {}
    col = {k: np.sign(np.array([r[k] for r in rows], np.float64)) for k in DECOMPOSITION_SIGNS}
    every = np.ones(len(rows), bool)
    out = {f"{a}~{b}": _count(col[a] == col[b], every) for a, b in DECOMPOSITION_PAIRS}
    dis = col["ratio"] != col["predictive"]
    out["predictive~own|disagree"] = _count(col["predictive"] == col["own"], dis)
    # Only tokens the training rule kept put their own gradient into the batch step.
    out["own~batch|kept"] = _count(col["own"] == col["batch"], np.array([bool(r["kept"]) for r in rows]))
    return out


# ---- across runs: per-seed rates, paired differences, intervals -------------------------------------


def setting_of(cfg: Mapping) -> str:
    return f"{cfg['optimizer']} lr={cfg['lr']:g}"


def _by_seed(runs: Sequence[Mapping]) -> list[Mapping]:
    seeds = [r["config"]["seed"] for r in runs]
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"one run per seed and setting expected; seeds {sorted(seeds)}")
    return sorted(runs, key=lambda r: r["config"]["seed"])


def seed_rates(tables: Sequence[Mapping], key: str, metric: str | None = None) -> np.ndarray:  # -> [S]
    """Per seed, the pooled rate of table[key][metric] (or table[key] when metric is None); nan if absent
    or empty. `tables` holds one counts table per seed, in seed order."""
    out = []
    for t in tables:
        c = t.get(key)
        c = c.get(metric) if (c is not None and metric is not None) else c
        out.append(rate(c) if c is not None else np.nan)
    return np.array(out, np.float64)


def _ci(x: np.ndarray, reps: int) -> dict[str, float]:
    return bootstrap_ci(x[np.isfinite(x)], reps=reps)


DESIGNS = {
    "own": "every rule scored against the step its own mask would take from the same state",
    "shared": "every rule scored against the one real step, taken with the training rule's mask",
}


def _design(runs: Sequence[Mapping], design: str, reps: int, reference: str) -> tuple[dict, dict]:
    """One design's block (rule rates, differences from `reference`, disagreement sets) and the per-seed
    differences behind it."""
    counts = [r["counts"][design] for r in runs]
    dis = [r["counts"][f"{design}_disagreement"] for r in runs]
    block: dict = {"rules": {}, "diff": {}, "disagreement": {}}
    per_seed: dict[str, list[float]] = {}
    for rule in counts[0]:
        block["rules"][rule] = {m: _ci(seed_rates(counts, rule, m), reps) for m in RULE_METRICS}
        if rule == reference:
            continue
        for m in RULE_METRICS:
            a, b = seed_rates(counts, rule, m), seed_rates(counts, reference, m)
            block["diff"].setdefault(rule, {})[m] = bootstrap_ci(paired_differences(a, b), reps=reps)
            per_seed[f"{rule}:{m}"] = (a - b).tolist()
    for est in dis[0]:
        row = {m: _ci(seed_rates(dis, est, m), reps) for m in DISAGREEMENT_METRICS}
        a, b = seed_rates(dis, est, "pred_right"), seed_rates(dis, est, "ratio_right")
        row["pred_minus_ratio"] = bootstrap_ci(paired_differences(a, b), reps=reps)
        per_seed[f"disagreement/{est}"] = (a - b).tolist()
        block["disagreement"][est] = row
    return block, per_seed


def summarise_setting(runs: Sequence[Mapping], *, reps: int = 10_000, reference: str = "dppo") -> dict:
    """For one setting (one run per seed), for each design: the mean over seeds of every rule's rates
    with intervals, each rule's paired difference from `reference`, the disagreement sets (predictive −
    ratio, paired); then the decomposition and the per-seed differences (for the pooled row)."""
    runs = _by_seed(runs)
    tokens = sum(s["tokens"] for r in runs for s in r["steps"])
    far = sum(s["far_frac"] * s["tokens"] for r in runs for s in r["steps"])
    out: dict = {
        "seeds": [r["config"]["seed"] for r in runs],
        "tokens": tokens,
        "far_frac": far / tokens if tokens else float("nan"),
        "per_seed_diff": {},
    }
    for design in DESIGNS:
        out[design], per_seed = _design(runs, design, reps, reference)
        out["per_seed_diff"].update({f"{design}:{k}": v for k, v in per_seed.items()})
    dec = [decomposition_counts(r["decomposition"]) for r in runs]
    keys = [*dict.fromkeys(k for d in dec for k in d)]
    out["decomposition"] = {k: _ci(seed_rates(dec, k), reps) for k in keys}
    out["decomposition_tokens"] = sum(len(r["decomposition"]) for r in runs)
    return out


def summarise(runs: Sequence[Mapping], *, reps: int = 10_000, reference: str = "dppo") -> dict:
    """Every setting, and an "all settings" row: per seed, the mean of its paired differences over the
    settings, with an interval over seeds (needs the same seeds in every setting)."""
    groups: dict[str, list[Mapping]] = {}
    for r in runs:
        groups.setdefault(setting_of(r["config"]), []).append(r)
    settings = {k: summarise_setting(g, reps=reps, reference=reference) for k, g in groups.items()}
    seed_sets = {tuple(s["seeds"]) for s in settings.values()}
    pooled: dict[str, dict[str, float]] = {}
    if len(seed_sets) == 1:
        keys = set.intersection(*(set(s["per_seed_diff"]) for s in settings.values()))
        for k in sorted(keys):
            x = np.array([s["per_seed_diff"][k] for s in settings.values()], np.float64)  # [settings, S]
            x = x[:, np.isfinite(x).any(axis=0)]  # seeds where no setting has the rate drop out
            per_seed = np.nanmean(x, axis=0) if x.size else x[0]
            pooled[k] = bootstrap_ci(per_seed, reps=reps)
    return {"settings": settings, "all_settings_diff": pooled}


# ---- learning curves: held-out accuracy per rule and step, paired by seed ---------------------------


def curve_summary(runs: Sequence[Mapping], *, reps: int = 10_000, reference: str = "dppo") -> dict:
    """Per rule and evaluation step: mean held-out accuracy over seeds with its interval, and the paired
    difference from `reference` (per seed, at the same step); plus each rule's gain (last − step 0)."""
    by_rule: dict[str, dict[int, dict[int, float]]] = {}  # rule -> step -> seed -> accuracy
    for r in runs:
        per_step = by_rule.setdefault(r["config"]["rule"], {})
        for e in r["accuracy"]:
            per_step.setdefault(e["step"], {})[r["config"]["seed"]] = e["accuracy"]
    out: dict = {"rules": {}, "diff": {}, "gain": {}}
    for rule, per_step in by_rule.items():
        out["rules"][rule] = {
            s: bootstrap_ci(list(v.values()), reps=reps) for s, v in sorted(per_step.items())
        }
        first, last = min(per_step), max(per_step)
        common = sorted(set(per_step[first]) & set(per_step[last]))
        out["gain"][rule] = bootstrap_ci([per_step[last][k] - per_step[first][k] for k in common], reps=reps)
    ref = by_rule.get(reference, {})
    for rule, per_step in by_rule.items():
        if rule == reference:
            continue
        for s, v in sorted(per_step.items()):
            common = sorted(set(v) & set(ref.get(s, {})))
            diffs = [v[k] - ref[s][k] for k in common]
            out["diff"].setdefault(rule, {})[s] = bootstrap_ci(diffs, reps=reps)
    return out
