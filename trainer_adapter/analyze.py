"""`maskroll analyze`: the paper's direction analysis on synthetic LLM-like states (docs/math.md §4.2, §7).

Each state is one token position: Zipf-shaped trainer logits z over V tokens, a behaviour policy μ that
is a noisy, drifted copy of π = softmax(z), a token a ~ μ, an advantage A = ±1 and the engine's record
(top-K of μ, log μ_a). Every rule predicts whether a gradient step on this token increases D(μ, π);
an infinitesimal free-logit step z' = z + τ·sign(A)·(e_a − π) realises the change, and the report
scores each rule against it. Every number printed is computed here, from the seed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass

import torch

from . import divergences as dv
from .reference import direction_agreement

RULES = ("ratio", "exact", "aggregated", "uniform", "proportional")
METRICS = ("agree_all", "agree_far", "agree_disagreement", "unsafe_keep", "wrong_mask", "mask_frac")


@dataclass(frozen=True)
class AnalyzeConfig:
    states: int = 4096  # token positions
    vocab: int = 32768
    k: int = 20  # top-K logprobs in the record
    delta: float = 0.05  # δ on topk_kl
    zipf_low: float = 1.7  # per-state Zipf exponent range: top-20 mass ≈ 0.98 on average
    zipf_high: float = 3.0
    noise_low: float = 0.05  # per-state std of μ's logit noise (engine mismatch + staleness)
    noise_high: float = 0.6
    drift: float = 0.3  # std of a per-state shift of μ's logits on its top tokens (stale weights)
    tau: float = 1e-5  # step length of the "infinitesimal" free-logit step
    chunk: int = 512
    seed: int = 0


def _states(cfg: AnalyzeConfig, n: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """n synthetic states in float64 (ids are ranks: the analysis is permutation-invariant)."""
    f64 = torch.float64
    log_rank = torch.log(torch.arange(1, cfg.vocab + 1, dtype=f64))  # [V]
    s = cfg.zipf_low + (cfg.zipf_high - cfg.zipf_low) * torch.rand(n, 1, generator=gen, dtype=f64)
    z = torch.randn(n, cfg.vocab, generator=gen, dtype=f64).mul_(0.3).sub_(s * log_rank)  # [n, V]
    sigma = cfg.noise_low + (cfg.noise_high - cfg.noise_low) * torch.rand(n, 1, generator=gen, dtype=f64)
    mu_logits = torch.randn(n, cfg.vocab, generator=gen, dtype=f64).mul_(sigma).add_(z)
    head = 64  # drift moves the head, where staleness shows
    mu_logits[:, :head] += cfg.drift * torch.randn(n, head, generator=gen, dtype=f64)
    mu_lp = torch.log_softmax(mu_logits, dim=-1)
    del mu_logits
    mu = mu_lp.exp()
    a = torch.multinomial(mu, 1, generator=gen).squeeze(-1)  # [n]: a ~ μ
    topk_lp, topk_ids = mu_lp.topk(cfg.k, dim=-1)
    adv = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0).to(f64)
    return {
        "z": z,
        "mu_lp": mu_lp,
        "mu": mu,
        "a": a,
        "topk_ids": topk_ids,
        "topk_lp": topk_lp,
        "adv": adv,
        "mu_a": mu_lp.gather(-1, a.unsqueeze(-1)).squeeze(-1),
    }


def _support(cfg: AnalyzeConfig, st: dict[str, torch.Tensor], pi_lp: torch.Tensor, sum_sq: torch.Tensor):
    """The record's view of (μ, π): what compute_masks sees, built from the same divergences module."""
    s = dv.build_support(
        pi_lp.gather(-1, st["topk_ids"]),
        pi_lp.gather(-1, st["a"].unsqueeze(-1)).squeeze(-1),
        st["topk_ids"],
        st["topk_lp"],
        st["a"],
        st["mu_a"],
        sum_sq,
        cfg.vocab,
    )
    return s, dv.buckets(s)


def _chunk_rules(cfg: AnalyzeConfig, st: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # Full-vocabulary work is kept to a few fused passes (vecdot/vector_norm make no [n, V] temporaries):
    # the run must fit in a minute on two cores.
    z, a, adv, mu, mu_lp = st["z"], st["a"], st["adv"], st["mu"], st["mu_lp"]
    pi_lp = torch.log_softmax(z, dim=-1)
    pi = pi_lp.exp()
    sum_sq = torch.linalg.vector_norm(pi, dim=-1).square()  # Σ π²
    mu_self = torch.linalg.vecdot(mu, mu_lp)  # Σ μ log μ
    support, b = _support(cfg, st, pi_lp, sum_sq)
    d_topk = dv.topk_kl(b, support)
    pi_a = pi.gather(-1, a.unsqueeze(-1)).squeeze(-1)
    rules = {
        "ratio": pi_a - st["mu_a"].exp(),
        # full_kl_direction without its [n, V] temporaries: (π_a − μ_a) − (Σ π² − Σ π μ)
        "exact": pi_a - st["mu_a"].exp() - (sum_sq - torch.linalg.vecdot(pi, mu)),
        **{
            est: dv.topk_kl_direction(b, dv.tail_concentration(b, est))
            for est in ("aggregated", "uniform", "proportional")
        },
    }
    d_full = mu_self - torch.linalg.vecdot(mu, pi_lp)
    # The step z' = z + τ·sign(A)·(e_a − π), in place on z (not needed afterwards).
    scale = (cfg.tau * adv).unsqueeze(-1)  # [n, 1]
    z.addcmul_(pi, scale, value=-1.0).scatter_add_(-1, a.unsqueeze(-1), scale)
    del pi
    pi_lp_after = torch.log_softmax(z, dim=-1)
    support_after, b_after = _support(cfg, st, pi_lp_after, sum_sq)  # Σ π² is unused by D itself
    return {
        **rules,
        "adv": adv,
        "far": d_topk > cfg.delta,
        "d_topk": d_topk,
        "d_topk_after": dv.topk_kl(b_after, support_after),
        "d_full": d_full,
        "d_full_after": mu_self - torch.linalg.vecdot(mu, pi_lp_after),
        "top_mass": st["topk_lp"].exp().sum(-1),
    }


def run(cfg: AnalyzeConfig, progress: bool = False) -> dict:
    gen = torch.Generator().manual_seed(cfg.seed)
    parts: dict[str, list[torch.Tensor]] = {}
    t0 = time.perf_counter()
    for start in range(0, cfg.states, cfg.chunk):
        n = min(cfg.chunk, cfg.states - start)
        for key, val in _chunk_rules(cfg, _states(cfg, n, gen)).items():
            parts.setdefault(key, []).append(val)
        if progress:
            done = start + n
            print(
                f"\ranalyze: {done}/{cfg.states} states, {time.perf_counter() - t0:.1f} s",
                end="",
                file=sys.stderr,
                flush=True,
            )
    if progress:
        print(file=sys.stderr)
    c = {k: torch.cat(v) for k, v in parts.items()}
    directions = {r: c[r] for r in RULES}
    scores = {
        target: direction_agreement(
            c["adv"],
            c[f"d_{target}"],
            c[f"d_{target}_after"],
            directions,
            c["far"],
            pair=("ratio", "proportional"),
        )
        for target in ("topk", "full")
    }
    sets = scores["topk"].pop("_sets")
    scores["full"].pop("_sets")
    return {
        "config": asdict(cfg),
        "states": {
            "top_k_mass_mean": float(c["top_mass"].mean()),
            "far_frac": sets["far_frac"],
            "disagreement_frac_far": sets["disagreement_frac_far"],
            "mean_topk_kl": float(c["d_topk"].mean()),
            "mean_full_kl": float(c["d_full"].mean()),
        },
        "scores": scores,
        "seconds": time.perf_counter() - t0,
    }


def _fmt(x: float) -> str:
    return "    n/a" if math.isnan(x) else f"{x:7.4f}"


def format_report(out: dict) -> str:
    cfg, st = out["config"], out["states"]
    lines = [
        f"maskroll analyze: {cfg['states']} synthetic states, V={cfg['vocab']}, K={cfg['k']}, "
        f"δ={cfg['delta']} on topk_kl, seed={cfg['seed']}",
        f"  top-{cfg['k']} mass of μ: {st['top_k_mass_mean']:.4f}   far (D>δ): {st['far_frac']:.3f}   "
        f"ratio≠proportional on far: {st['disagreement_frac_far']:.3f}   "
        f"mean topk_kl {st['mean_topk_kl']:.4f}, full KL {st['mean_full_kl']:.4f}",
    ]
    names = {
        "ratio": "ratio rule (DPPO)",
        "exact": "exact full P",
        "aggregated": "top-K aggregated",
        "uniform": "top-K uniform",
        "proportional": "top-K proportional",
    }
    titles = {
        "topk": "realised ΔD of topk_kl (the divergence the mask uses)",
        "full": "realised ΔD of the full KL(μ‖π) (needs the full μ)",
    }
    for target in ("topk", "full"):
        lines += [
            "",
            f"sign agreement with the {titles[target]}:",
            f"  {'rule':<20} {'all':>7} {'far':>7} {'disagr':>7} {'unsafe':>7} {'wrong':>7} {'masked':>7}",
        ]
        for rule in RULES:
            s = out["scores"][target][rule]
            lines.append(f"  {names[rule]:<20} " + " ".join(_fmt(s[m]) for m in METRICS))
    lines += [
        "",
        "  all/far/disagr: agreement on all tokens, far tokens, far tokens where ratio and proportional",
        "  disagree; unsafe: P(ΔD>0 | kept, far); wrong: P(ΔD<0 | masked); masked: mask fraction.",
        f"  ({out['seconds']:.1f} s)",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="maskroll analyze", description=__doc__.split("\n\n")[0])
    d = AnalyzeConfig()
    p.add_argument("--states", type=int, default=d.states, help="number of token states")
    p.add_argument("--vocab", type=int, default=d.vocab, help="vocabulary size V")
    p.add_argument("--k", type=int, default=d.k, help="top-K logprobs per record")
    p.add_argument("--delta", type=float, default=d.delta, help="trust-region δ on topk_kl")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    args = p.parse_args(argv)
    if args.states < 1 or args.vocab < args.k + 2 or args.k < 1 or args.delta < 0:
        p.error("need states >= 1, k >= 1, vocab >= k + 2, delta >= 0")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    out = run(
        AnalyzeConfig(states=args.states, vocab=args.vocab, k=args.k, delta=args.delta, seed=args.seed),
        progress=not args.json,
    )
    print(json.dumps(out, indent=2) if args.json else format_report(out))
    return 0
