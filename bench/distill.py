"""Cost of a distillation term in the trainer adapter's step (docs/math.md §10.4): the adapter step with a
teacher's top-K against the plain adapter step, forward + backward, time and extra peak memory.

    plain    token_logprobs(return_stats) → compute_masks(predictive, topk_kl, vocab_stats) → policy_loss
    distill  student_logprobs(teacher top-K ids) → distill_advantages (A_rl + 0.5 · reverse-KL advantage)
             → compute_masks(vocab_stats) → policy_loss + 0.5 · distill_loss(forward_kl)
    distill_jsd      the same with distill_loss(jsd, β = 0.5)
    distill_norank   distill without the student's top-K ranking (overlap_every=0; distill: every 16th row)

Target: distill ≤ 1.1 × plain in time, extra peak ≤ plain + one [chunk_tokens, V] float32 chunk. Inputs are
bench/adapter.py's (`make_inputs`: logits ~ N(0, 2²), μ a perturbed copy); the teacher is another
perturbed copy (its top-K ids and logprobs, its logprob of the sampled token), built chunk by chunk.
Each case runs in a fresh child process (this script re-invoked with --one), so peaks do not mix; the
peak is bench/adapter.py's PeakMeter (VmHWM after clear_refs, above the RSS at the step's start). On a
shared machine the neighbours' load moves the per-child medians, so the time ratio is also measured in
one more child that interleaves the cases rep by rep (`--one interleaved`): the median of per-rep ratios.

    .venv/bin/python bench/distill.py                          # N = 2048, K = 20, V = 32768, float32
    .venv/bin/python bench/distill.py --vocab 151936 --tokens 2048 --reps 3
    .venv/bin/python bench/distill.py --compile auto           # the compiled vocabulary kernels
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

import adapter
import common

CASES = ("plain", "distill", "distill_jsd", "distill_norank")
COMPILE = {"auto": "auto", "true": True, "false": False}
MIB = 2**20


def teacher_inputs(inp: dict, k: int, chunk: int, seed: int) -> dict:
    """A teacher = softmax(ℓ + 0.5·ℓ''), ℓ'' the logits of rows a third of the batch away."""
    import torch

    logits = inp["logits"].detach()
    n = logits.shape[0]
    t_ids = torch.empty(n, k, dtype=torch.long)
    t_lp = torch.empty(n, k)
    t_a = torch.empty(n)
    for start in range(0, n, chunk):
        rows = torch.arange(start, min(start + chunk, n))
        x = logits[rows].to(torch.float32, copy=True).add_(logits[(rows + n // 3) % n], alpha=0.5)
        log_t = x.log_softmax(-1)  # [c, V]
        t_lp[rows], t_ids[rows] = log_t.topk(k, dim=-1)
        t_a[rows] = log_t.gather(-1, inp["ids"][rows, None]).squeeze(-1)
        del x, log_t
    return {"t_ids": t_ids, "t_lp": t_lp, "t_a": t_a}


def step_fn(case: str, inp: dict, chunk: int, compile):
    import torch

    from maskroll.trainer_adapter import (
        MaskConfig,
        compute_masks,
        distill_advantages,
        distill_loss,
        policy_loss,
        student_logprobs,
        token_logprobs,
    )

    logits, ids, slp, adv = inp["logits"], inp["ids"], inp["slp"], inp["adv"]
    cfg = MaskConfig(
        method="predictive", divergence="topk_kl", delta=0.05, chunk_tokens=chunk, compile=compile
    )

    def plain() -> dict:
        lp, stats = token_logprobs(logits, ids, chunk_tokens=chunk, return_stats=True, compile=compile)
        res = compute_masks(
            logits.detach(), ids, slp, inp["tid"], inp["tlp"], adv, config=cfg, vocab_stats=stats
        )
        loss, m = policy_loss(lp, slp, adv, res.keep, masks=res)
        loss.backward()
        return {"loss": loss.item(), "mask_frac": m["mask_frac"].item()}

    def distill() -> dict:
        s = student_logprobs(
            logits,
            ids,
            inp["t_ids"],
            chunk_tokens=chunk,
            compile=compile,
            overlap_every=0 if case == "distill_norank" else 16,
        )
        a = distill_advantages(s.logprobs, inp["t_a"], adv, weight=0.5)
        res = compute_masks(
            logits.detach(), ids, slp, inp["tid"], inp["tlp"], a, config=cfg, vocab_stats=s.stats
        )
        pg, m = policy_loss(s.logprobs, slp, a, res.keep, masks=res)
        kind = "jsd" if case == "distill_jsd" else "forward_kl"
        d, dm = distill_loss(s, ids, inp["t_ids"], inp["t_lp"], inp["t_a"], kind=kind)
        loss = pg + 0.5 * d
        loss.backward()
        out = {
            "loss": loss.item(),
            "mask_frac": m["mask_frac"].item(),
            **{k: v.item() for k, v in dm.items()},
        }
        return out

    del torch
    return plain if case == "plain" else distill


def _inputs(args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    inp = adapter.make_inputs(args.tokens, args.vocab, args.topk, torch.float32, args.chunk_tokens, args.seed)
    inp.update(teacher_inputs(inp, args.topk, args.chunk_tokens, args.seed))
    return inp


def run_interleaved(args: argparse.Namespace) -> dict:
    """Every case once per round, rounds repeated; time ratios to plain per round, then their median."""
    inp = _inputs(args)
    cases = [c for c in args.cases.split(",") if c in CASES]
    steps = {c: step_fn(c, inp, args.chunk_tokens, COMPILE[args.compile]) for c in cases}
    times: dict[str, list[float]] = {c: [] for c in cases}
    cpu: dict[str, list[float]] = {c: [] for c in cases}
    for rnd in range(args.reps + 1):  # round 0 warms up
        for c in cases:
            inp["logits"].grad = None
            t, p = time.perf_counter(), time.process_time()
            steps[c]()
            if rnd:
                times[c].append(time.perf_counter() - t)
                cpu[c].append(time.process_time() - p)
    # Process CPU time as well: on a loaded machine wall time includes waiting for a core.
    ok = "plain" in times
    return {
        "case": "interleaved",
        "ratio_to_plain": {c: common.median_ratio(times[c], times["plain"]) for c in cases if ok},
        "cpu_ratio_to_plain": {c: common.median_ratio(cpu[c], cpu["plain"]) for c in cases if ok},
        # the least-disturbed repetition of each case: preemption only ever adds time
        "min_cpu_ratio_to_plain": {c: min(cpu[c]) / min(cpu["plain"]) for c in cases if ok},
        "times_s": times,
        "cpu_s": cpu,
    }


def run_one(args: argparse.Namespace) -> dict:
    if args.one == "interleaved":
        return run_interleaved(args)
    inp = _inputs(args)
    step = step_fn(args.one, inp, args.chunk_tokens, COMPILE[args.compile])
    meter = adapter.PeakMeter()
    times, peaks, info = [], [], {}
    for rep in range(args.reps + 1):  # rep 0 warms up (and compiles, with --compile auto / true)
        inp["logits"].grad = None
        out: dict = {}

        def timed(out: dict = out) -> None:
            t = time.perf_counter()
            out.update(step())
            out["s"] = time.perf_counter() - t

        peak = meter.measure(timed)
        seconds = out.pop("s")
        print(f"    ({args.one}) rep {rep}: {seconds:.2f}s, extra peak {peak / MIB:.0f} MiB", file=sys.stderr)
        if rep:
            times.append(seconds)
            peaks.append(peak)
            info = out
    return {
        "case": args.one,
        "time_s": statistics.median(times),
        "times_s": times,
        "extra_peak_bytes": max(peaks),
        "peak_method": meter.method,
        **info,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=2048, help="N response tokens")
    p.add_argument("--topk", type=int, default=20, help="K: the rollout's and the teacher's top-K")
    p.add_argument("--vocab", type=int, default=32768, help="V")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--chunk-tokens", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--compile", choices=tuple(COMPILE), default="false")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.add_argument("--one", choices=(*CASES, "interleaved"), help=argparse.SUPPRESS)  # child mode
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.one:
        print(json.dumps(run_one(args)))
        return 0
    rows = []
    for case in [*args.cases.split(","), "interleaved"]:
        flags = [
            f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("one", "json", "cases")
        ]
        cmd = [sys.executable, os.path.abspath(__file__), f"--one={case}", *flags]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        if proc.returncode:
            rows.append({"case": case, "error": f"child exited with status {proc.returncode}"})
            continue
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    plain = next((r for r in rows if r["case"] == "plain" and "error" not in r), None)
    chunk_bytes = args.chunk_tokens * args.vocab * 4
    info = adapter.machine()
    inter = rows.pop()
    if args.json:
        out = {
            "args": vars(args),
            "machine": info,
            "chunk_bytes": chunk_bytes,
            "results": rows,
            "interleaved": inter,
        }
        print(json.dumps(out))
        return 0
    head = f"N={args.tokens} V={args.vocab} K={args.topk} chunk={args.chunk_tokens} compile={args.compile}"
    print(f"{head} threads={args.threads} reps={args.reps}; one f32 chunk = {chunk_bytes / MIB:.0f} MiB")
    print(f"machine: {info.get('cpu')}, {info.get('cores')} cores, load {info.get('loadavg')}")
    ratios, cpu_ratios = inter.get("ratio_to_plain", {}), inter.get("cpu_ratio_to_plain", {})
    min_ratios = inter.get("min_cpu_ratio_to_plain", {})
    print(
        f"{'case':<16}{'time (s)':>10}{'× plain':>9}{'× interl.':>10}{'cpu × i.':>9}{'min cpu ×':>10}"
        f"{'extra peak':>12}"
        f"{'Δ vs plain':>12}  metrics"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['case']:<16}{r['error']}")
            continue
        ratio = r["time_s"] / plain["time_s"] if plain else float("nan")
        d_mem = (r["extra_peak_bytes"] - plain["extra_peak_bytes"]) / MIB if plain else float("nan")
        extra = {k: round(v, 4) for k, v in r.items() if k.startswith(("distill_", "topk_", "mask_frac"))}
        inter_ratio = ratios.get(r["case"], float("nan"))
        print(f"{r['case']:<16}{r['time_s']:>10.3f}{ratio:>9.3f}{inter_ratio:>10.3f}"
              f"{cpu_ratios.get(r['case'], math.nan):>9.3f}{min_ratios.get(r['case'], math.nan):>10.3f}"
              f"{r['extra_peak_bytes'] / MIB:>9.0f} MiB"
              f"{d_mem:>8.0f} MiB  {extra}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
