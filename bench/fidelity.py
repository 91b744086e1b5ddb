"""Does the predictive mask do what the paper claims on real network steps? A paired, multi-seed study.

For every seed (a fresh tiny model, `maskroll init-model --seed s`) and every (optimiser, learning rate)
setting, train the demo's digits task for a few steps with the in-process torch engine one policy
version stale. At every step every rule — PPO, DPPO, predictive with each top-K estimator, all at their
documented defaults — is evaluated on the same model state and the same rollouts, and scored two ways
(docs/math.md §7): against the step its own mask would take from that state ("own", taken on a shadow copy),
and against the one real step, masked by the training rule (default the demo's predictive/proportional;
"shared"). Rates are pooled per run; paired differences from DPPO get 95 % percentile-bootstrap
intervals over seeds. A sample of far tokens per step is decomposed into the change under a step of its
logits alone, its own gradient alone, the batch's plain-gradient step and the real step.
docs/fidelity.md explains the design and states the result.

    .venv/bin/python bench/fidelity.py                 # the full study (docs/fidelity.md: runtime)
    .venv/bin/python bench/fidelity.py --quick         # 2 seeds, 2 settings, 3 steps: CI-sized
    .venv/bin/python bench/fidelity.py --seeds 5 --settings adam:2e-3 --train-rule dppo

Writes <out>/fidelity.json (every run's raw counts and the summary), fidelity.md (the tables, also
printed) and fidelity.png; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import fidelity_report
import fidelity_stats

FULL_SETTINGS = (("sgd", 0.05), ("sgd", 0.1), ("sgd", 0.2), ("adam", 1e-3), ("adam", 2e-3), ("adam", 4e-3))
QUICK_SETTINGS = (("sgd", 0.2), ("adam", 2e-3))


@dataclass(frozen=True)
class Study:
    seeds: tuple[int, ...]
    settings: tuple[tuple[str, float], ...]
    steps: int = 8
    prompts_per_step: int = 8
    n: int = 8
    staleness: int = 1
    train_rule: str = "predictive/proportional"
    decomp_tokens: int = 4
    reps: int = 10_000  # bootstrap resamples


QUICK = Study(
    seeds=(0, 1), settings=QUICK_SETTINGS, steps=3, prompts_per_step=4, n=4, decomp_tokens=2, reps=2000
)
FULL = Study(seeds=tuple(range(20)), settings=FULL_SETTINGS)


def parse_settings(text: str) -> tuple[tuple[str, float], ...]:
    out = []
    for item in text.split(","):
        opt, _, lr = item.strip().partition(":")
        if opt not in ("sgd", "adam") or not lr:
            raise argparse.ArgumentTypeError(f"setting {item!r}: expected sgd:LR or adam:LR")
        out.append((opt, float(lr)))
    return tuple(out)


def study_from_args(a: argparse.Namespace) -> Study:
    s = QUICK if a.quick else FULL
    if a.seeds is not None:
        s = replace(s, seeds=tuple(range(a.seeds)))
    overrides = {
        k: v
        for k, v in {
            "settings": a.settings,
            "steps": a.steps,
            "staleness": a.staleness,
            "train_rule": a.train_rule,
            "decomp_tokens": a.decomp_tokens,
            "reps": a.reps,
        }.items()
        if v is not None
    }
    return replace(s, **overrides)


def run_study(study: Study, workdir: Path, log=print) -> list[dict]:
    """Every seed × setting; one model directory per seed, shared by its settings (paired across them)."""
    import torch
    from fidelity_run import RunConfig, run

    from maskroll.app.model_init import init_model

    torch.set_num_threads(1)  # the box is small and shared; the engine's decode thread takes the other core
    runs, total, t0 = [], len(study.seeds) * len(study.settings), time.perf_counter()
    for seed in study.seeds:
        model_dir = init_model(workdir / f"seed{seed}", seed=seed)
        for opt, lr in study.settings:
            cfg = RunConfig(
                seed=seed,
                optimizer=opt,
                lr=lr,
                steps=study.steps,
                prompts_per_step=study.prompts_per_step,
                n=study.n,
                staleness=study.staleness,
                train_rule=study.train_rule,
                decomp_tokens=study.decomp_tokens,
            )
            out = run(cfg, model_dir)
            runs.append(out)
            far = sum(s["far_frac"] * s["tokens"] for s in out["steps"]) / sum(
                s["tokens"] for s in out["steps"]
            )
            log(
                f"[{len(runs):3d}/{total}] seed {seed:2d} {opt} lr={lr:g}: {out['seconds']:.1f} s, "
                f"far {far:.1%}, elapsed {time.perf_counter() - t0:.0f} s"
            )
    return runs


def machine() -> dict:
    import torch

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "load_avg": os.getloadavg(),
    }


def header(study: Study, seconds: float) -> str:
    settings = ", ".join(f"{o} lr={lr:g}" for o, lr in study.settings)
    return (
        f"## Fidelity study: {len(study.seeds)} seeds × [{settings}], {study.steps} steps, "
        f"{study.prompts_per_step}×{study.n} rollouts/step, staleness {study.staleness}, "
        f"training rule {study.train_rule}, {study.decomp_tokens} decomposed tokens/step — {seconds:.0f} s"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/fidelity.py", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="2 seeds, 2 settings, 3 small steps (CI)")
    p.add_argument("--seeds", type=int, help="seeds 0..N-1 (full: 20)")
    p.add_argument("--settings", type=parse_settings, help="e.g. sgd:0.1,adam:2e-3 (full: 3 lrs each)")
    p.add_argument("--steps", type=int, help="optimiser steps per run (full: 8)")
    p.add_argument("--staleness", type=int, help="policy versions the rollouts lag behind (default 1)")
    p.add_argument(
        "--train-rule", help="the rule whose mask takes the real step (default predictive/proportional)"
    )
    p.add_argument("--decomp-tokens", type=int, help="far tokens decomposed per step (full: 4)")
    p.add_argument("--reps", type=int, help="bootstrap resamples (full: 10000)")
    p.add_argument("--out", type=Path, default=Path("bench/out/fidelity"), help="output directory")
    a = p.parse_args(argv)
    study = study_from_args(a)
    a.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fidelity-models-") as work:
        runs = run_study(study, Path(work), log=lambda line: print(line, file=sys.stderr, flush=True))
    seconds = time.perf_counter() - t0
    summary = fidelity_stats.summarise(runs, reps=study.reps)
    text = fidelity_report.markdown(summary, header(study, seconds))
    result = {
        "study": asdict(study),
        "seconds": seconds,
        "machine": machine(),
        "summary": summary,
        "runs": runs,
    }
    (a.out / "fidelity.json").write_text(json.dumps(result, indent=1, default=float) + "\n")
    (a.out / "fidelity.md").write_text(text)
    fidelity_report.figure(summary, a.out / "fidelity.png")
    print(text)
    print(f"wrote {a.out}/fidelity.json, fidelity.md, fidelity.png ({seconds:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
