"""One run of the fidelity study: a seeded tiny model trained on the demo's digits task for a few steps
(or SmolLM2-135M-Instruct on arithmetic word problems, `model="smollm2"`), every mask rule scored against
the realised change of D (docs/math.md §7).

Per step: the in-process torch engine samples a batch (records built by the server's own `records_builder`,
so μ is the engine's processed distribution, temperature 1, no truncation), lagging `staleness` policy
versions behind the trainer as the demo's queue does, in `engine_dtype` (bfloat16: the replicas sample in
lower precision than the learner computes, the paper's precision axis). Every rule's mask is computed on the
same (model, batch). Each rule other than the training rule takes its own step on a shadow copy (same
weights, same optimiser state); ONE rule — `train_rule` — takes the real step. So every rule is scored
twice: against its own step ("own") and against the real step ("shared"). The error decomposition then takes
a few far tokens and measures ΔD under a step of the token's logits alone (what the closed form assumes)
and, in a float64 copy of the pre-step model, under a small step along that token's own loss gradient alone
and under a small step along the whole batch's gradient.

Knows nothing of statistics across seeds (fidelity_stats) or of the report (fidelity_report).
"""

from __future__ import annotations

import asyncio
import copy
import math
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal, get_args

import numpy as np
import torch
from fidelity_stats import Counts, add, disagreement_counts, rule_counts

from maskroll.recipes import arithmetic, digits
from maskroll.recipes.grpo import masks
from maskroll.server.engines.contract import EngineRequest, SamplingParams
from maskroll.server.engines.torch_engine import TorchEngine
from maskroll.server.generation.records_builder import RecordHeader, SampleBuilder, semantics_for
from maskroll.trainer_adapter import MaskConfig, MaskResult, collate, policy_loss, token_logprobs
from maskroll.trainer_adapter.collate import Batch
from maskroll.trainer_adapter.config import Divergence, Estimator
from maskroll.trainer_adapter.forward import completion_logits

Tensor = torch.Tensor
ESTIMATORS: tuple[str, ...] = get_args(Estimator)
REFERENCE = "dppo"  # same proximity test (D > δ) as predictive, ratio direction: the paired reference


def rule_configs(divergence: Divergence = "topk_kl") -> dict[str, MaskConfig]:
    """Every rule at its documented defaults (δ per divergence, PPO's ε 0.2 / 0.28): nothing is tuned."""
    return {
        "ppo": MaskConfig(method="ppo", divergence=divergence),
        "dppo": MaskConfig(method="dppo", divergence=divergence),
        **{
            f"predictive/{e}": MaskConfig(method="predictive", divergence=divergence, estimator=e)
            for e in ESTIMATORS
        },
    }


@dataclass(frozen=True)
class RunConfig:
    seed: int
    optimizer: Literal["sgd", "adam"]
    lr: float
    model: Literal["tiny", "smollm2"] = "tiny"  # tiny: digits task; smollm2: arithmetic word problems
    engine_dtype: Literal["float32", "bfloat16"] = "float32"  # the sampler's; the learner is float32
    steps: int = 8
    prompts_per_step: int = 8  # the demo's batch: 8 prompts × 8 samples × ≤ 16 tokens
    n: int = 8
    max_tokens: int = 16
    logprobs_k: int = 20
    staleness: int = 1  # rollouts of step k come from version k − 1 − staleness (the demo's max_staleness)
    train_rule: str = "predictive/proportional"  # the demo's default mask masks the real step
    divergence: Divergence = "topk_kl"
    decomp_tokens: int = 4  # far tokens per step in the error decomposition
    # Parameter-space length of the decomposition's "small step". transformers' Llama RMSNorm computes in
    # float32 even in a float64 model, so much shorter steps drown in its rounding (at 1e-6, 9 % of the
    # batch signs flip); between 1e-3 and 1e-4, ΔD scales by 10× and no sign changes: first order.
    decomp_eps: float = 1e-4

    @property
    def batch_size(self) -> int:
        return self.prompts_per_step * self.n


def sample_batch(
    engine: TorchEngine, runner: asyncio.Runner, prompts: list[list[int]], cfg: RunConfig, step: int
) -> list:
    """prompts × n RolloutRecords from the engine, all requests in flight at once (one engine batch)."""
    params = SamplingParams(
        max_tokens=cfg.max_tokens,
        temperature=1.0,
        logprobs_k=cfg.logprobs_k,
        stop_token_ids=engine.limits.eos_token_ids,  # as the servicer adds them
    )
    sem = semantics_for(params, engine=engine.name, engine_version=engine.version, model=engine.model_id)

    async def one(header: RecordHeader, j: int, seed: int):
        builder = SampleBuilder(header, j)
        p = SamplingParams(**{**params.__dict__, "seed": seed})
        async for out in engine.generate(EngineRequest(f"{header.request_id}-{j}", header.prompt_ids, p)):
            chunk = builder.add(out, now=time.time())
            if chunk.record is not None:
                return chunk.record
        raise RuntimeError(f"{header.request_id}-{j} ended without a record")

    async def all_samples():
        jobs = []
        for i, prompt in enumerate(prompts):
            rid = f"seed{cfg.seed}-step{step}-p{i}"
            header = RecordHeader(rid, rid, rid, {}, np.asarray(prompt, np.int32), sem, "in-process", cfg.n)
            base = (cfg.seed * 1_000_003 + step * 1009 + i * cfg.n) % 2**62
            jobs += [one(header, j, base + j) for j in range(cfg.n)]
        return await asyncio.gather(*jobs)

    return runner.run(all_samples())


def save_version(state: dict, version: int, root: Path) -> Path:
    """The trainer's weights as policy version `version`, in root/v<version>/model.safetensors. Cloned
    per tensor: a tied model's embed_tokens and lm_head share storage, which safetensors refuses."""
    from safetensors.torch import save_file

    d = root / f"v{version}"
    d.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().clone() for k, v in state.items()}, str(d / "model.safetensors"))
    return d


def drop_versions_before(version: int, root: Path) -> None:
    import shutil

    for d in root.glob("v*"):
        if int(d.name[1:]) < version:
            shutil.rmtree(d)


def rows(b: Batch, idx: list[int]) -> Batch:
    """The sub-batch of rows `idx` (same left padding, so the positions of a row do not change)."""
    i = torch.tensor(idx)
    return Batch(**{k: (v[i] if isinstance(v, Tensor) else v) for k, v in b.__dict__.items()})


def _flat(x: Tensor, valid: Tensor) -> np.ndarray:
    return x[valid].detach().double().cpu().numpy()


def step_counts(
    b: Batch, before: dict[str, MaskResult], d_after: dict[str, Tensor]
) -> tuple[dict[str, Counts], dict[str, Counts]]:
    """Every rule's §7 counts, each against the D after `d_after[rule]` (one shared step, or the rule's
    own step), and the disagreement counts per estimator (predictive/e against its ΔD, the ratio rule
    against DPPO's)."""
    valid = b.response_mask
    adv = _flat(b.advantages[:, None].expand_as(valid), valid)
    d0 = before[REFERENCE].divergence.double()
    delta = {name: _flat(d.double() - d0, valid) for name, d in d_after.items()}
    far, ones = _flat(before[REFERENCE].far, valid).astype(bool), np.ones(int(valid.sum()), bool)
    per_rule = {
        name: rule_counts(adv, delta[name], ones, far, _flat(r.direction, valid), _flat(r.keep, valid) > 0)
        for name, r in before.items()
    }
    ratio = _flat(before[REFERENCE].ratio_direction, valid)
    per_est = {
        e: disagreement_counts(
            adv,
            delta[f"predictive/{e}"],
            ones,
            far,
            ratio,
            _flat(before[f"predictive/{e}"].predicted_direction, valid),
            ratio_delta=delta[REFERENCE],
        )
        for e in ESTIMATORS
    }
    return per_rule, per_est


OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}


def counterfactual_after(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    shadow: torch.nn.Module,  # scratch copy of the model, overwritten
    grads: tuple[Tensor, ...],  # ∇θ of the loss under this rule's mask
    b: Batch,
    cfg: RunConfig,
) -> Tensor:  # -> [B, T] D after the step this rule's mask would have taken from the same state
    """The step `opt` would take with `grads` (same weights, same optimiser state), taken on `shadow`."""
    shadow.load_state_dict(model.state_dict())
    twin = OPTIMIZERS[cfg.optimizer](shadow.parameters(), lr=cfg.lr)
    # deepcopy: load_state_dict may keep the very tensors of the trainer's state, which Adam updates in place
    twin.load_state_dict(copy.deepcopy(opt.state_dict()))
    for p, g in zip(shadow.parameters(), grads, strict=True):
        p.grad = g.clone()
    twin.step()
    with torch.no_grad():
        return masks(completion_logits(shadow, b), b, rule_configs(cfg.divergence)[REFERENCE]).divergence


def _shifted_divergence(
    model: torch.nn.Module, base: list[Tensor], move: list[Tensor], eps: float, b: Batch, cfg: MaskConfig
) -> Tensor:  # -> [B, T] D after θ ← θ + eps · move (move has unit norm), then θ restored
    params = list(model.parameters())
    with torch.no_grad():
        for p, p0, v in zip(params, base, move, strict=True):
            p.copy_(p0 + eps * v)
        d = masks(completion_logits(model, b), b, cfg).divergence
        for p, p0 in zip(params, base, strict=True):
            p.copy_(p0)
    return d


def _unit_descent(grads: list[Tensor]) -> list[Tensor]:
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads))
    return [-g.double() / norm for g in grads]


LOGIT_TAU = 1e-5  # the free-logit step of `maskroll analyze` (docs/math.md §4: z' = z + τ·(e_a − π))


def _logit_step_divergence(logits: Tensor, row: Batch, t: int, tau: float, cfg: MaskConfig) -> Tensor:
    """D at position t after moving that position's logits alone by tau·(e_a − π): the step the closed
    form P̂ assumes (every positive factor, temperature included, drops out of the sign)."""
    z = logits.clone()  # [1, T, V]
    pi = torch.softmax(z[0, t] / row.temperature[0], dim=-1)  # [V]
    z[0, t] -= tau * pi
    z[0, t, row.completion_ids[0, t]] += tau
    return masks(z, row, cfg).divergence[0, t]


def decompose(
    m64: torch.nn.Module,  # float64 copy of the model before the real step
    b: Batch,
    batch_grads: list[Tensor],  # ∇θ of the real (masked) batch loss, before the optimiser step
    d_real: Tensor,  # [B, T] realised ΔD of the real step (float32 model, as the §7 counts)
    picks: list[tuple[int, int]],  # (row, position) of the sampled far tokens
    train_keep: Tensor,  # [B, T] bool the training rule's mask
    cfg: RunConfig,
) -> list[dict]:
    """ΔD of each picked token under (logit) the closed form's own idealisation, a step of its logits
    alone along sign(A)·(e_a − π); (own) a small parameter step on its own loss term; (batch) a small step
    along the whole batch's gradient; (real) the real optimiser step; and each rule's predicted sign."""
    rules = rule_configs(cfg.divergence)
    ref, pred = rules[REFERENCE], rules["predictive/proportional"]
    params = list(m64.parameters())
    base = [p.detach().clone() for p in params]
    sub_rows = sorted({r for r, _ in picks})
    sub = rows(b, sub_rows)
    with torch.no_grad():
        logits0 = completion_logits(m64, sub)
        d0 = masks(logits0, sub, ref).divergence  # [b', T]
        guess = masks(logits0, sub, pred)
    d_batch = _shifted_divergence(m64, base, _unit_descent(batch_grads), cfg.decomp_eps, sub, ref)
    out = []
    for r, t in picks:
        i = sub_rows.index(r)
        row = rows(sub, [i])
        lp = token_logprobs(completion_logits(m64, row), row.completion_ids, temperature=row.temperature)
        only = torch.zeros_like(row.response_mask)
        only[0, t] = True  # the token's own term of the surrogate, unmasked (as if kept)
        loss, _ = policy_loss(lp, row.sampled_logprobs, row.advantages, only, response_mask=row.response_mask)
        own = torch.autograd.grad(loss, params)
        d_own = _shifted_divergence(m64, base, _unit_descent(list(own)), cfg.decomp_eps, row, ref)
        a = float(b.advantages[r])
        d_logit = _logit_step_divergence(logits0[i : i + 1], row, t, math.copysign(LOGIT_TAU, a), ref)
        out.append(
            {
                "logit": float(d_logit - d0[i, t]),
                "ratio": float(np.sign(a * float(guess.ratio_direction[i, t]))),
                "predictive": float(np.sign(a * float(guess.predicted_direction[i, t]))),
                "own": float(d_own[0, t] - d0[i, t]),
                "batch": float(d_batch[i, t] - d0[i, t]),
                "real": float(d_real[r, t]),
                "kept": bool(train_keep[r, t]),
            }
        )
    return out


def _pick_far(b: Batch, far: Tensor, count: int, rng: np.random.Generator) -> list[tuple[int, int]]:
    cand = (far & b.response_mask & (b.advantages[:, None] != 0)).nonzero().tolist()
    if len(cand) <= count:
        return [tuple(c) for c in cand]
    return [tuple(cand[i]) for i in sorted(rng.choice(len(cand), size=count, replace=False))]


def train_step(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    shadow: torch.nn.Module,
    b: Batch,
    cfg: RunConfig,
    step: int,
    rng: np.random.Generator,
) -> tuple[dict[str, dict[str, Counts]], list[dict], dict]:
    """Every rule's mask on the same (model, batch); every other rule's own step taken on a shadow copy
    from the same state; ONE real step with the training rule's mask. Returns the §7 counts of two
    designs — "shared" (every rule against the real step's ΔD) and "own" (every rule against its own
    step's ΔD) — the decomposition rows and the step's log."""
    rules = rule_configs(cfg.divergence)
    logits = completion_logits(model, b)
    lp, stats = token_logprobs(logits, b.completion_ids, temperature=b.temperature, return_stats=True)
    before = {name: masks(logits.detach(), b, c, vocab_stats=stats) for name, c in rules.items()}
    params = list(model.parameters())
    train = before[cfg.train_rule]
    loss, m = policy_loss(lp, b.sampled_logprobs, b.advantages, train.keep, masks=train)
    own_after, stepped = own_steps(model, opt, shadow, b, cfg, before, lp)
    m64 = copy.deepcopy(model).double() if cfg.decomp_tokens else None  # the pre-step state
    opt.zero_grad()
    loss.backward()
    train_grads = [p.grad.detach().clone() for p in params]
    opt.step()
    with torch.no_grad():
        d_after = masks(completion_logits(model, b), b, rules[REFERENCE]).divergence
    own_after[cfg.train_rule] = d_after  # the training rule's own step is the real one
    shared, shared_est = step_counts(b, before, {n: d_after for n in rules})
    own, own_est = step_counts(b, before, own_after)
    far = before[REFERENCE].far  # D > δ: the one far set every rule is scored on
    picks = _pick_far(b, far, cfg.decomp_tokens, rng) if m64 is not None else []
    d_real = d_after - before[REFERENCE].divergence
    rows = decompose(m64, b, train_grads, d_real, picks, train.keep, cfg) if picks else []
    valid = b.response_mask
    log = {
        "step": step,
        "reward": float(b.rewards.mean()),
        "tokens": int(valid.sum()),
        "far_frac": float(far[valid].float().mean()),
        "divergence_mean": float(before[REFERENCE].divergence[valid].mean()),
        "train_mask_frac": float(m["mask_frac"]),
        "staleness": float((step - 1 - b.policy_versions).double().mean()),
        "loss": float(loss.detach()),
        "own_steps": stepped,  # shadow steps taken: distinct masks other than the training rule's
    }
    counts = {"shared": shared, "shared_disagreement": shared_est, "own": own, "own_disagreement": own_est}
    return counts, [{"step": step, **r} for r in rows], log


def own_steps(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    shadow: torch.nn.Module,
    b: Batch,
    cfg: RunConfig,
    before: dict[str, MaskResult],
    lp: Tensor,  # [B, T] log π_a with its graph (retained: one backward per distinct mask)
) -> tuple[dict[str, Tensor], int]:
    """D after the step each rule other than the training rule would take, and the number of shadow
    steps taken. Rules whose mask equals one already stepped share its step (same loss, same gradient)."""
    params = list(model.parameters())
    done: list[tuple[Tensor, Tensor]] = []  # (keep, D after that mask's step)
    out: dict[str, Tensor] = {}
    for name, r in before.items():
        if name == cfg.train_rule:
            continue
        d = next((d for keep, d in done if torch.equal(keep, r.keep)), None)
        if d is None:
            r_loss, _ = policy_loss(lp, b.sampled_logprobs, b.advantages, r.keep, masks=r)
            grads = torch.autograd.grad(r_loss, params, retain_graph=True)
            d = counterfactual_after(model, opt, shadow, grads, b, cfg)
            done.append((r.keep, d))
        out[name] = d
    return out, len(done)


Rewarder = Callable[[np.ndarray], float]


def task_sampler(
    cfg: RunConfig, model_dir: Path
) -> Callable[[random.Random, int], tuple[list, list[Rewarder]]]:
    """(rng, count) -> (prompt ids, one reward function per prompt): the model's task, chosen once."""
    if cfg.model == "tiny":
        encode = digits.encoder(model_dir)

        def draw_digits(rng: random.Random, count: int) -> tuple[list, list[Rewarder]]:
            texts = digits.prompts(rng, count)
            return [encode(t) for t in texts], [lambda ids: digits.digit_reward(ids, cfg.max_tokens)] * count

        return draw_digits
    task = arithmetic.Task(model_dir)

    def draw_arithmetic(rng: random.Random, count: int) -> tuple[list, list[Rewarder]]:
        ps = arithmetic.problems(rng, count)
        return [task.encode(p) for p in ps], [task.rewarder(p) for p in ps]

    return draw_arithmetic


def run(cfg: RunConfig, model_dir: Path) -> dict:
    """Train `cfg.steps` steps; return pooled counts per rule and estimator, per-step logs, decomposition."""
    import transformers

    t_start = time.perf_counter()
    torch.manual_seed(cfg.seed)
    if cfg.train_rule not in rule_configs(cfg.divergence):
        raise ValueError(f"train_rule={cfg.train_rule!r}; expected one of {sorted(rule_configs())}")
    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    opt = OPTIMIZERS[cfg.optimizer](model.parameters(), lr=cfg.lr)
    shadow = copy.deepcopy(model)
    draw = task_sampler(cfg, model_dir)
    rng, pick_rng = random.Random(cfg.seed), np.random.default_rng(cfg.seed)
    counts: dict[str, dict[str, Counts]] = {}
    steps, rows_out = [], []
    engine = TorchEngine(
        model_dir,
        max_logprobs=cfg.logprobs_k,
        max_batch=cfg.batch_size,
        threads=1,
        dtype=getattr(torch, cfg.engine_dtype),
    )
    with asyncio.Runner() as runner, tempfile.TemporaryDirectory(prefix="fidelity-ckpt-") as ckpt:
        runner.run(engine.start())
        try:
            for step in range(1, cfg.steps + 1):
                prompts, rewarders = draw(rng, cfg.prompts_per_step)
                records = sample_batch(engine, runner, prompts, cfg, step)
                # sample_batch returns prompt i's n samples at [i·n, (i + 1)·n)
                b = collate(records, [rewarders[k // cfg.n](r.completion_ids) for k, r in enumerate(records)])
                step_counts_, rows, log = train_step(model, opt, shadow, b, cfg, step, pick_rng)
                for table, by_key in step_counts_.items():
                    pooled = counts.setdefault(table, {})
                    for k, v in by_key.items():
                        pooled[k] = add(pooled.get(k, {}), v)
                rows_out += rows
                steps.append(log)
                # The engine serves version step − staleness for the next batch (the trainer is at `step`).
                # Versions wait on disk, not in RAM (a SmolLM2 state is 0.54 GB; staleness 3 kept four)
                save_version(model.state_dict(), step, Path(ckpt))
                if step - cfg.staleness >= 1:
                    runner.run(
                        engine.update_weights(step - cfg.staleness, Path(ckpt) / f"v{step - cfg.staleness}")
                    )
                    drop_versions_before(step - cfg.staleness, Path(ckpt))
        finally:
            runner.run(engine.close())
    return {
        "config": asdict(cfg),
        "counts": counts,  # table ("shared", "own", + "_disagreement") -> rule or estimator -> counts
        "steps": steps,
        "decomposition": rows_out,
        "seconds": time.perf_counter() - t_start,
    }
