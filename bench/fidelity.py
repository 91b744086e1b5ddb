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
    .venv/bin/python bench/fidelity.py --model smollm2 --quick   # SmolLM2-135M, one seed, few tokens: CI
    .venv/bin/python bench/fidelity.py --model smollm2 --engine-dtype bfloat16 --staleness 3
    .venv/bin/python bench/fidelity.py --model smollm2 --curves  # held-out accuracy vs step per rule

With --model smollm2 the model is SmolLM2-135M-Instruct (`maskroll init-model --from smollm2`, its
weights dequantised from 4-bit GGUF) and the task recipes/arithmetic.py; every seed starts from the same
pretrained weights (the seed draws the prompts and the samples).

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
# SmolLM2: Adam (the demo's optimiser) at 1e-4, a rate that moves a pretrained 135M model one policy
# version far enough for the masks to matter (docs/fidelity.md gives its far-token share).
SMOLLM2_SETTINGS = (("adam", 1e-4),)


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
    model: str = "tiny"  # "tiny": a fresh init-model per seed, digits; "smollm2": arithmetic problems
    engine_dtype: str = "float32"  # the sampler's dtype; the learner computes in float32
    max_tokens: int = 16


QUICK = Study(
    seeds=(0, 1), settings=QUICK_SETTINGS, steps=3, prompts_per_step=4, n=4, decomp_tokens=2, reps=2000
)
FULL = Study(seeds=tuple(range(20)), settings=FULL_SETTINGS)
# Sized for 2 shared CPU cores: a SmolLM2 step is ~300× the tiny model's (135 M parameters, 49 152 logits)
# and a run holds ~7 GB (model, shadow, Adam and its copy, grads); the float64 copy of the error
# decomposition would add 2 GB, so it is off (0 tokens). Groups of 8: the policy answers ~6 % of the
# problems right at temperature 1, and a group whose rewards are all equal has no advantage to score
# (with 2 × 4 rollouts every far token had A = 0). On a bigger machine raise --seeds, --steps.
SMOLLM2 = Study(
    seeds=(0, 1),
    settings=SMOLLM2_SETTINGS,
    steps=3,
    prompts_per_step=4,
    n=8,
    decomp_tokens=0,
    model="smollm2",
    max_tokens=8,
)
SMOLLM2_QUICK = replace(
    SMOLLM2, seeds=(0,), settings=(("adam", 3e-4),), steps=2, prompts_per_step=2, n=4, max_tokens=6, reps=1000
)


def parse_settings(text: str) -> tuple[tuple[str, float], ...]:
    out = []
    for item in text.split(","):
        opt, _, lr = item.strip().partition(":")
        if opt not in ("sgd", "adam") or not lr:
            raise argparse.ArgumentTypeError(f"setting {item!r}: expected sgd:LR or adam:LR")
        out.append((opt, float(lr)))
    return tuple(out)


def study_from_args(a: argparse.Namespace) -> Study:
    presets = {"tiny": (FULL, QUICK), "smollm2": (SMOLLM2, SMOLLM2_QUICK)}
    s = presets[a.model][a.quick]
    if a.seeds is not None:
        s = replace(s, seeds=tuple(range(a.first_seed, a.first_seed + a.seeds)))
    overrides = {
        k: v
        for k, v in {
            "settings": a.settings,
            "steps": a.steps,
            "staleness": a.staleness,
            "train_rule": a.train_rule,
            "decomp_tokens": a.decomp_tokens,
            "reps": a.reps,
            "engine_dtype": a.engine_dtype,
            "max_tokens": a.max_tokens,
            "prompts_per_step": a.prompts_per_step,
            "n": a.n,
        }.items()
        if v is not None
    }
    return replace(s, **overrides)


def run_study(study: Study, workdir: Path, log=print, partial: Path | None = None) -> list[dict]:
    """Every seed × setting; one model directory per seed, shared by its settings (paired across them)."""
    import torch
    from fidelity_run import RunConfig, run

    from maskroll.app import smollm2
    from maskroll.app.model_init import init_model

    torch.set_num_threads(1)  # the box is small and shared; the engine's decode thread takes the other core
    runs, total, t0 = [], len(study.seeds) * len(study.settings), time.perf_counter()
    for seed in study.seeds:
        if study.model == "smollm2":  # one pretrained model: the seed draws prompts and samples
            model_dir = smollm2.cached("float32")
        else:
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
                model=study.model,
                engine_dtype=study.engine_dtype,
                max_tokens=study.max_tokens,
            )
            out = run(cfg, model_dir)
            runs.append(out)
            if partial is not None:  # a study cut short still leaves every finished run's raw counts
                partial.write_text(json.dumps({"study": asdict(study), "runs": runs}, default=float) + "\n")
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
    model = (
        "" if study.model == "tiny" else f"{study.model} (sampler {study.engine_dtype}, learner float32), "
    )
    return (
        f"## Fidelity study: {model}{len(study.seeds)} seeds × [{settings}], {study.steps} steps, "
        f"{study.prompts_per_step}×{study.n} rollouts/step, ≤ {study.max_tokens} tokens, "
        f"staleness {study.staleness}, "
        f"training rule {study.train_rule}, {study.decomp_tokens} decomposed tokens/step — {seconds:.0f} s"
    )


def curves_main(a: argparse.Namespace) -> int:
    """Learning curves: every rule × seed trained from the same pretrained SmolLM2; one JSON, one table."""
    import torch
    from fidelity_curves import CurveConfig, curve

    from maskroll.app import smollm2

    torch.set_num_threads(1)
    seeds = tuple(range(a.seeds if a.seeds is not None else 2))
    rules = [r.strip() for r in a.rules.split(",") if r.strip()]
    model_dir = smollm2.cached("float32")
    a.out.mkdir(parents=True, exist_ok=True)
    runs, t0 = [], time.perf_counter()
    for seed in seeds:  # seed-major: a partial study still pairs every rule on its first seeds
        for rule in rules:
            cfg = CurveConfig(
                seed=seed,
                rule=rule,
                steps=a.curve_steps,
                eval_every=a.eval_every,
                lr=a.lr,
                staleness=a.staleness or 1,
                engine_dtype=a.engine_dtype or "float32",
                **{
                    k: v
                    for k, v in (
                        ("max_tokens", a.max_tokens),
                        ("prompts_per_step", a.prompts_per_step),
                        ("n", a.n),
                    )
                    if v is not None
                },
            )
            out = curve(cfg, model_dir)
            runs.append(out)
            acc = " ".join(f"{e['step']}:{e['accuracy']:.2f}" for e in out["accuracy"])
            print(
                f"[{len(runs)}/{len(seeds) * len(rules)}] seed {seed} {rule}: {acc} ({out['seconds']:.0f} s, "
                f"elapsed {time.perf_counter() - t0:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
            (a.out / "curves.json").write_text(json.dumps({"runs": runs}, indent=1) + "\n")  # partial
    seconds = time.perf_counter() - t0
    summary = fidelity_stats.curve_summary(runs, reps=a.reps or 10_000)
    text = fidelity_report.curves_markdown(
        summary,
        f"## Learning curves: SmolLM2, {len(seeds)} seeds, "
        f"{a.curve_steps} steps, Adam lr {a.lr:g} — {seconds:.0f} s",
    )
    result = {"seconds": seconds, "machine": machine(), "summary": summary, "runs": runs}
    (a.out / "curves.json").write_text(json.dumps(result, indent=1, default=float) + "\n")
    (a.out / "curves.md").write_text(text)
    fidelity_report.curves_figure(summary, a.out / "curves.png")
    print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/fidelity.py", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="2 seeds, 2 settings, 3 small steps (CI)")
    p.add_argument("--seeds", type=int, help="seeds 0..N-1 (full: 20)")
    p.add_argument(
        "--first-seed", type=int, default=0, help="with --seeds N: seeds S..S+N-1 (a study in parts)"
    )
    p.add_argument("--settings", type=parse_settings, help="e.g. sgd:0.1,adam:2e-3 (full: 3 lrs each)")
    p.add_argument("--steps", type=int, help="optimiser steps per run (full: 8)")
    p.add_argument("--staleness", type=int, help="policy versions the rollouts lag behind (default 1)")
    p.add_argument(
        "--train-rule", help="the rule whose mask takes the real step (default predictive/proportional)"
    )
    p.add_argument("--decomp-tokens", type=int, help="far tokens decomposed per step (full: 4)")
    p.add_argument("--reps", type=int, help="bootstrap resamples (full: 10000)")
    p.add_argument("--model", choices=("tiny", "smollm2"), default="tiny", help="tiny (digits) or smollm2")
    p.add_argument(
        "--engine-dtype", choices=("float32", "bfloat16"), help="the sampler's dtype (learner: float32)"
    )
    p.add_argument("--max-tokens", type=int, help="completion tokens per sample")
    p.add_argument("--prompts-per-step", type=int, help="prompts per step (GRPO groups)")
    p.add_argument("--n", type=int, help="samples per prompt")
    p.add_argument(
        "--curves", action="store_true", help="smollm2: learning curves per rule (fidelity_curves)"
    )
    p.add_argument("--rules", default="dppo,predictive/proportional,ppo", help="--curves: the rules trained")
    p.add_argument("--curve-steps", type=int, default=6, help="--curves: steps per run")
    p.add_argument("--eval-every", type=int, default=3, help="--curves: held-out evaluation every N steps")
    p.add_argument("--lr", type=float, default=2e-5, help="--curves: Adam learning rate (the demo's)")
    p.add_argument(
        "--out", type=Path, default=None, help="output directory (default bench/out/fidelity[...])"
    )
    a = p.parse_args(argv)
    if a.out is None:
        a.out = Path("bench/out/fidelity" + ("" if a.model == "tiny" else f"-{a.model}"))
    if a.curves:
        if a.model != "smollm2":
            p.error("--curves needs --model smollm2 (the tiny model's curves are the demo's --compare)")
        return curves_main(a)
    study = study_from_args(a)
    a.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fidelity-models-") as work:
        log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
        runs = run_study(study, Path(work), log=log, partial=a.out / "partial.json")
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
