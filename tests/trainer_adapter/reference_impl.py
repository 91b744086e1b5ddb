"""An independent float64 reference of docs/math.md, written straight from its formulas.

numpy only, one token at a time, on full [V] vectors: nothing here imports maskroll, shares code with
it or is clever. The package's vectorised, chunked torch code is compared against this on random
records. The conventions fixed in the brief are followed literally:

- π = softmax(ℓ / T) (after the replayed top-k / top-p truncation, MATH §6), μ_a = exp(sampled_logprob).
- S = topK ∪ {a}; a's S entry comes from topk_logprobs when a ∈ topK, else from sampled_logprob.
- μ_T = max(0, 1 − Σ_S μ), π_T = max(0, 1 − Σ_S π), n_T = V − |S|, Q_T = max(0, Σ_V π² − Σ_S π²).
- log(max(x, 1e-12)) for clamped tail masses in logs, 0·log 0 = 0.
- P̂ tail terms are 0 when π_T = 0 (also when n_T = 0: the tail is empty, its true mass is 0).

It also holds the synthetic-record generator the tests share (LLM-like: peaked logits, μ a drifted
copy of π, the sampled token sometimes outside the top-K).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

CLAMP = 1e-12
DIVERGENCES = ("binary_tv", "binary_kl", "topk_tv", "topk_kl")
ESTIMATORS = ("aggregated", "uniform", "proportional")
METHODS = ("none", "ppo", "dppo", "predictive")


# ----------------------------------------------------------------------------------------------------
# distributions
# ----------------------------------------------------------------------------------------------------


def logsumexp(x: np.ndarray) -> float:
    m = np.max(x)
    if not np.isfinite(m):
        return float(m)
    return float(m + np.log(np.sum(np.exp(x - m))))


def processed_logprobs(logits: np.ndarray, temperature: float, top_k=None, top_p=None) -> np.ndarray:
    """[V] processed log-distribution, vLLM semantics (MATH §6): temperature, then top-k (ties at the
    k-th value kept), then top-p on the top-k-renormalised probabilities (sorted ascending, drop the
    prefix whose cumulative mass is <= 1 − p, always keep the largest), renormalised; −inf outside."""
    x = np.asarray(logits, dtype=np.float64) / float(temperature)
    v = x.shape[0]
    kept = np.ones(v, dtype=bool)
    if top_k is not None and 0 < top_k < v:
        kth = np.sort(x)[::-1][top_k - 1]
        kept &= x >= kth
    if top_p is not None and top_p < 1.0:
        xk = np.where(kept, x, -np.inf)
        p = np.exp(xk - logsumexp(xk))
        order = np.argsort(xk, kind="stable")  # ascending
        cum = np.cumsum(p[order])
        drop_sorted = cum <= 1.0 - top_p
        drop_sorted[-1] = False
        drop = np.zeros(v, dtype=bool)
        drop[order] = drop_sorted
        kept &= ~drop
    xk = np.where(kept, x, -np.inf)
    return xk - logsumexp(xk)


# ----------------------------------------------------------------------------------------------------
# one token
# ----------------------------------------------------------------------------------------------------


@dataclass
class TokenRef:
    logpi_a: float
    pi_a: float
    mu_a: float  # exp(sampled_logprob)
    ratio: float  # π_a / μ_a
    divergence: dict = field(default_factory=dict)  # name -> D
    predicted: dict = field(default_factory=dict)  # (divergence, estimator) -> P̂
    # bookkeeping, for tests that want the buckets
    mu_T: float = 0.0
    pi_T: float = 0.0
    n_T: int = 0
    Q_T: float = 0.0


def _xlogy_diff(mu: np.ndarray, logmu: np.ndarray, logpi: np.ndarray) -> np.ndarray:
    # μ_i (log μ_i − log π_i), 0 where μ_i = 0 (even when log π_i = −inf)
    out = np.zeros_like(mu)
    pos = mu > 0
    out[pos] = mu[pos] * (logmu[pos] - logpi[pos])
    return out


def token_reference(
    logits: np.ndarray,
    a: int,
    sampled_logprob: float,
    topk_ids: np.ndarray,
    topk_logprobs: np.ndarray,
    temperature: float,
    top_k=None,
    top_p=None,
) -> TokenRef:
    logpi = processed_logprobs(logits, temperature, top_k, top_p)
    pi = np.exp(logpi)
    v = pi.shape[0]
    topk_ids = [int(i) for i in np.asarray(topk_ids)]
    topk_logprobs = np.asarray(topk_logprobs, dtype=np.float64)
    a = int(a)

    # S = topK ∪ {a}; never evict a top-K entry.
    s_ids = list(topk_ids)
    s_logmu = list(topk_logprobs)
    if a not in topk_ids:
        s_ids.append(a)
        s_logmu.append(float(sampled_logprob))
    s_ids = np.array(s_ids)
    s_logmu = np.array(s_logmu, dtype=np.float64)
    s_mu = np.exp(s_logmu)
    s_pi = pi[s_ids]
    s_logpi = logpi[s_ids]
    ia = int(np.where(s_ids == a)[0][0])

    mu_T = max(0.0, 1.0 - float(np.sum(s_mu)))
    pi_T = max(0.0, 1.0 - float(np.sum(s_pi)))
    n_T = v - len(s_ids)
    sum_pi2 = float(np.sum(pi * pi))
    Q_T = max(0.0, sum_pi2 - float(np.sum(s_pi * s_pi)))

    logpi_a = float(logpi[a])
    pi_a = float(pi[a])
    mu_a = float(np.exp(sampled_logprob))
    ref = TokenRef(
        logpi_a=logpi_a, pi_a=pi_a, mu_a=mu_a, ratio=pi_a / mu_a, mu_T=mu_T, pi_T=pi_T, n_T=n_T, Q_T=Q_T
    )

    # ---- divergences (MATH §2) ----
    ref.divergence["binary_tv"] = abs(pi_a - mu_a)
    q = max(1.0 - mu_a, CLAMP)
    pbar = max(1.0 - pi_a, CLAMP)
    ref.divergence["binary_kl"] = mu_a * (float(sampled_logprob) - logpi_a) + q * (np.log(q) - np.log(pbar))
    ref.divergence["topk_tv"] = 0.5 * (float(np.sum(np.abs(s_pi - s_mu))) + abs(pi_T - mu_T))
    tail_kl = mu_T * (np.log(max(mu_T, CLAMP)) - np.log(max(pi_T, CLAMP))) if mu_T > 0 else 0.0
    ref.divergence["topk_kl"] = float(np.sum(_xlogy_diff(s_mu, s_logmu, s_logpi))) + tail_kl

    # ---- predicted directions (MATH §4) ----
    dpi_a = pi_a * (1.0 - 2.0 * pi_a + sum_pi2)  # dπ_a/dτ
    for est in ESTIMATORS:
        ref.predicted[("binary_tv", est)] = float(np.sign(pi_a - mu_a)) * dpi_a
        # 1 − π_a clamped as in D: a one-hot π (truncation replay) has dπ_a/dτ = 0 and P = 0
        ref.predicted[("binary_kl", est)] = (pi_a - mu_a) / (pi_a * pbar) * dpi_a

    q_hat = {
        "aggregated": pi_T**2,
        "uniform": pi_T**2 / n_T if n_T > 0 else 0.0,
        "proportional": Q_T,
    }
    tail_live = pi_T > 0 and n_T > 0
    pi_aS, mu_aS = float(s_pi[ia]), float(s_mu[ia])

    # topk_kl: (π_a − μ_a) − Σ_S π_i(π_i − μ_i) + Q̂_T (μ_T/π_T − 1)
    head_kl = (pi_aS - mu_aS) - float(np.sum(s_pi * (s_pi - s_mu)))
    for est in ESTIMATORS:
        tail = q_hat[est] * (mu_T / pi_T - 1.0) if tail_live else 0.0
        ref.predicted[("topk_kl", est)] = head_kl + tail

    # topk_tv: φ_i = ½ s_i on S, φ_T = ½ s_T on the tail, φ̄ = Σ_S π_i φ_i + π_T φ_T
    phi = 0.5 * np.sign(s_pi - s_mu)
    phi_T = 0.5 * float(np.sign(pi_T - mu_T))
    phibar = float(np.sum(s_pi * phi)) + pi_T * phi_T
    head_tv = pi_aS * (float(phi[ia]) - phibar) - float(np.sum(s_pi**2 * (phi - phibar)))
    for est in ESTIMATORS:
        tail = -q_hat[est] * (phi_T - phibar) if tail_live else 0.0
        ref.predicted[("topk_tv", est)] = head_tv + tail
    return ref


# ----------------------------------------------------------------------------------------------------
# masks (MATH §3)
# ----------------------------------------------------------------------------------------------------


@dataclass
class MaskRef:
    keep: np.ndarray
    far: np.ndarray
    direction: np.ndarray
    divergence: np.ndarray
    predicted: np.ndarray
    ratio_direction: np.ndarray
    mismatch_kl: np.ndarray
    mismatch_tv: np.ndarray
    logprobs: np.ndarray


def masks_reference(
    tokens: list[TokenRef],
    advantages: np.ndarray,
    *,
    method: str,
    divergence: str,
    estimator: str,
    delta_low: float,
    delta_high: float,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    response_mask: np.ndarray | None = None,
) -> MaskRef:
    n = len(tokens)
    adv = np.asarray(advantages, dtype=np.float64)
    resp = np.ones(n, dtype=bool) if response_mask is None else np.asarray(response_mask, dtype=bool)
    keep = np.zeros(n, dtype=bool)
    far = np.zeros(n, dtype=bool)
    direction = np.zeros(n)
    div = np.zeros(n)
    pred = np.zeros(n)
    ratio_dir = np.zeros(n)
    for i, t in enumerate(tokens):
        A = adv[i]
        d = t.divergence[divergence]
        p = t.predicted[(divergence, estimator)]
        div[i], pred[i] = d, p
        ratio_dir[i] = t.pi_a - t.mu_a
        if method == "ppo":
            far[i] = t.ratio > 1.0 + eps_high if A >= 0 else t.ratio < 1.0 - eps_low
            direction[i] = t.ratio - 1.0
        else:
            far[i] = d > delta_high if A >= 0 else d > delta_low
            direction[i] = p if method == "predictive" else t.pi_a - t.mu_a
        if method == "none":
            keep[i] = resp[i]
        else:
            keep[i] = resp[i] and not (far[i] and A * direction[i] > 0)
    return MaskRef(
        keep=keep,
        far=far,
        direction=direction,
        divergence=div,
        predicted=pred,
        ratio_direction=ratio_dir,
        mismatch_kl=np.array([t.divergence["topk_kl"] for t in tokens]),
        mismatch_tv=np.array([t.divergence["topk_tv"] for t in tokens]),
        logprobs=np.array([t.logpi_a for t in tokens]),
    )


# ----------------------------------------------------------------------------------------------------
# full-vocabulary divergences and their exact directions (MATH §2, §4 closed forms)
# ----------------------------------------------------------------------------------------------------


def full_kl(mu_lp: np.ndarray, pi_lp: np.ndarray) -> float:
    mu = np.exp(mu_lp)
    return float(np.sum(_xlogy_diff(mu, mu_lp, pi_lp)))


def full_rkl(mu_lp: np.ndarray, pi_lp: np.ndarray) -> float:
    pi = np.exp(pi_lp)
    return float(np.sum(_xlogy_diff(pi, pi_lp, mu_lp)))


def full_tv(mu_lp: np.ndarray, pi_lp: np.ndarray) -> float:
    return 0.5 * float(np.sum(np.abs(np.exp(pi_lp) - np.exp(mu_lp))))


def full_kl_direction(mu_lp, pi_lp, a: int) -> float:
    mu, pi = np.exp(mu_lp), np.exp(pi_lp)
    return float((pi[a] - mu[a]) - np.sum(pi * (pi - mu)))


def full_rkl_direction(mu_lp, pi_lp, a: int) -> float:
    pi = np.exp(pi_lp)
    d = full_rkl(mu_lp, pi_lp)
    log_r = pi_lp - mu_lp
    return float(pi[a] * (log_r[a] - d) - np.sum(pi**2 * (log_r - d)))


def full_tv_direction(mu_lp, pi_lp, a: int) -> float:
    mu, pi = np.exp(mu_lp), np.exp(pi_lp)
    s = np.sign(pi - mu)
    sbar = float(np.sum(pi * s))
    return float(0.5 * (pi[a] * (s[a] - sbar) - np.sum(pi**2 * (s - sbar))))


# ----------------------------------------------------------------------------------------------------
# synthetic records
# ----------------------------------------------------------------------------------------------------


@dataclass
class Record:
    logits: np.ndarray  # [N, V] raw trainer logits
    temperature: np.ndarray  # [N]
    sampled_ids: np.ndarray  # [N]
    sampled_logprobs: np.ndarray  # [N]
    topk_ids: np.ndarray  # [N, K]
    topk_logprobs: np.ndarray  # [N, K]
    advantages: np.ndarray  # [N]
    mu_logprobs: np.ndarray  # [N, V] the full behaviour distribution (processed)


def make_record(
    seed: int,
    n: int = 48,
    v: int = 300,
    k: int = 10,
    temperature=1.0,
    outside_frac: float = 0.3,
    zero_adv_frac: float = 0.15,
) -> Record:
    """LLM-like synthetic states: peaked logits (a few large, Gumbel-ish bulk), μ = processed
    softmax of a drifted copy of the logits (drift scale varies per token, so some tokens are near
    and some far), top-K of μ as the engine returns it (sorted by rank), the sampled token drawn
    from μ and, for a fraction of tokens, forced from outside the top-K."""
    rng = np.random.default_rng(seed)
    temps = np.broadcast_to(np.asarray(temperature, dtype=np.float64), (n,)).copy()
    logits = rng.standard_normal((n, v)) * 1.5
    # a few dominant tokens per row, like an LM's head
    for i in range(n):
        hot = rng.choice(v, size=rng.integers(1, 6), replace=False)
        logits[i, hot] += rng.uniform(2.0, 6.0, size=hot.shape)
    drift = rng.uniform(0.02, 1.2, size=(n, 1))
    mu_raw = logits + drift * rng.standard_normal((n, v)) * 1.5
    mu_lp = np.stack([processed_logprobs(mu_raw[i], temps[i]) for i in range(n)])
    order = np.argsort(-mu_lp, axis=1, kind="stable")
    topk_ids = order[:, :k].copy()
    topk_lp = np.take_along_axis(mu_lp, topk_ids, axis=1)
    sampled = np.empty(n, dtype=np.int64)
    for i in range(n):
        if rng.random() < outside_frac:
            # outside the top-K, chosen among the next few ranks so μ_a is not absurdly small
            sampled[i] = order[i, min(k + rng.integers(0, 5), v - 1)]
        else:
            p = np.exp(mu_lp[i])
            sampled[i] = rng.choice(v, p=p / p.sum())
    sampled_lp = mu_lp[np.arange(n), sampled]
    adv = rng.choice([-2.0, -1.0, -0.3, 0.4, 1.0, 1.7], size=n)
    adv[rng.random(n) < zero_adv_frac] = 0.0
    return Record(
        logits=logits,
        temperature=temps,
        sampled_ids=sampled,
        sampled_logprobs=sampled_lp,
        topk_ids=topk_ids,
        topk_logprobs=topk_lp,
        advantages=adv,
        mu_logprobs=mu_lp,
    )


def record_reference(rec: Record, top_k=None, top_p=None) -> list[TokenRef]:
    return [
        token_reference(
            rec.logits[i],
            rec.sampled_ids[i],
            rec.sampled_logprobs[i],
            rec.topk_ids[i],
            rec.topk_logprobs[i],
            rec.temperature[i],
            top_k,
            top_p,
        )
        for i in range(rec.logits.shape[0])
    ]
