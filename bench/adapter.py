"""Cost of the trainer adapter's loss step against the log_softmax + gather + PPO-clip baseline
(docs/math.md §8).

Measures forward + backward of one policy-loss step on N response tokens with [N, V] logits (float32 or
bfloat16), for five cases:

    (a)  baseline: log_softmax(ℓ, dtype=float32).gather(a), PPO-clip loss (ε = 0.2 / 0.28), backward
    (b)  token_logprobs(return_stats=True) → compute_masks(dppo, topk_kl, vocab_stats) → policy_loss
    (b') the same without vocab_stats: compute_masks makes its own chunked pass over the logits
    (c)  as (b) with predictive + topk_kl + proportional
    (c') as (c) without vocab_stats

Each (case, V, dtype) runs in a fresh child process (this script re-invoked with --one), so peaks do not
mix and RSS starts clean. The child builds its inputs chunk-wise (no [N, V] temporaries), runs one
warm-up step, then `--reps` timed steps; time is their median. Peak memory: before each timed step the
kernel's RSS high-water mark is reset (write "5" to /proc/self/clear_refs) and VmHWM is read after it;
the figure is VmHWM − VmRSS-before-the-step, so the inputs count in neither case. If clear_refs is not
permitted a thread samples VmRSS every 2 ms instead (reported as the method). The gradient of the
logits is set to None before every step (as zero_grad(set_to_none=True) does), so every case pays for
allocating its [N, V] gradient.

Inputs (same seed in every child): logits ~ N(0, 2²); μ = softmax(ℓ + 0.25·ℓ') computed per chunk with
ℓ' the logits of other rows (noise of σ = 0.5: top-K KL(μ‖π) ≈ 0.017 at V = 32768, 0.008 at
V = 151936; a few tokens per thousand masked at δ = 0.05); a sampled from μ; top-K ids and logprobs
of μ. So sampled and top-K logprobs are those of a slightly perturbed policy, as a rollout engine
returns them; advantages ~ N(0, 1).

`--compile auto|true|false` is handed to token_logprobs and MaskConfig (trainer_adapter/kernels.py).
`--device cuda` runs the same cases on a GPU: inputs are built on the CPU (the same numbers) and moved,
the clock starts and stops after torch.cuda.synchronize(), and the extra peak is
torch.cuda.max_memory_allocated() above the allocation at the step's start (reset before each step).

`--arith` measures instead the arithmetic of one [chunk_tokens, V] chunk, part by part (forward,
backward, mask + loss), for the baseline and for the predictive step with the eager and the compiled
kernels, on buffers allocated once (no page faults): process CPU time, 1 thread, minimum of 5
interleaved rounds (see `arith_parts`).

    .venv/bin/python bench/adapter.py                  # N = 8192, K = 20, V ∈ {32768, 151936}, f32 + bf16
    .venv/bin/python bench/adapter.py --quick          # N = 2048, V = 32768
    .venv/bin/python bench/adapter.py --vocab 32768 --dtype bfloat16 --json
    .venv/bin/python bench/adapter.py --arith          # per-chunk arithmetic, V = 32768, f32 + bf16
    .venv/bin/python bench/adapter.py --device cuda --threads 8
    .venv/bin/python bench/adapter.py --arith --device cuda --vocab 151936
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import common

CASES = {
    "a": "baseline: log_softmax + gather + PPO-clip",
    "b": "dppo + topk_kl, vocab_stats shared",
    "b'": "dppo + topk_kl, own vocab pass",
    "c": "predictive + topk_kl + proportional, vocab_stats shared",
    "c'": "predictive + topk_kl + proportional, own vocab pass",
}
COMPILE = {"auto": "auto", "true": True, "false": False}  # --compile → token_logprobs(compile=)
TARGET_TIME_RATIO = 1.3  # issue: (b)/(a) and (c)/(a) time
TARGET_EXTRA_CHUNKS = 1.0  # issue: extra peak over (a) ≤ one [chunk_tokens, V] float32 chunk
GIB = 1024**3


# ---- child: one (case, V, dtype) ------------------------------------------------------------------


def _proc_status() -> dict[str, int]:  # bytes
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(rest.split()[0]) * 1024
    return out


class PeakMeter:
    """Peak RSS of a block above the RSS at its start.

    clear_refs "5" resets VmHWM to the current RSS (Linux ≥ 4.0); where it is refused (some containers)
    a 2 ms sampling thread stands in, which can miss a peak shorter than that. glibc serves blocks under
    its mmap threshold (≤ 32 MiB) from a heap it keeps, so peaks of toy sizes (V = 4096) mean little;
    at the benchmark's sizes every [chunk, V] tensor is ≥ 128 MiB, mmap'd and unmapped on free."""

    def __init__(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.method = "clear_refs+VmHWM"
        except OSError:
            self.method = "VmRSS sampled every 2 ms"
        self.log: list[dict[str, int]] = []

    def measure(self, fn: Callable[[], None]) -> int:
        before = _proc_status()["VmRSS"]
        if self.method.startswith("clear_refs"):
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            reset = _proc_status()
            fn()
            after = _proc_status()
            peak = after["VmHWM"]
            self.log.append({"rss_before": before, "hwm_after_reset": reset["VmHWM"], **after})
        else:
            peak, done = before, threading.Event()

            def sample() -> None:
                nonlocal peak
                while not done.wait(0.002):
                    peak = max(peak, _proc_status()["VmRSS"])

            t = threading.Thread(target=sample, daemon=True)
            t.start()
            fn()
            done.set()
            t.join()
            peak = max(peak, _proc_status()["VmRSS"])
        return peak - before


class CudaPeakMeter:
    """Peak of torch's CUDA caching allocator during a block above what was allocated at its start
    (torch.cuda.max_memory_allocated after reset_peak_memory_stats): the tensors' own bytes, not the
    allocator's reserved pool. The block is followed by a synchronize so its kernels have run."""

    method = "torch.cuda.max_memory_allocated"

    def __init__(self) -> None:
        self.log: list[dict[str, int]] = []

    def measure(self, fn: Callable[[], None]) -> int:
        import torch

        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        self.log.append({"allocated_before": before, "max_allocated": peak})
        return peak - before


def make_inputs(n: int, vocab: int, k: int, dtype, chunk: int, seed: int, device: str = "cpu") -> dict:
    """The benchmark's inputs, built on the CPU (the same numbers for every device), then moved."""
    import torch

    g = torch.Generator().manual_seed(seed)
    # normal_ in place: no float32 temporary of the full size even for bf16 logits.
    logits = torch.empty(n, vocab, dtype=dtype).normal_(0.0, 2.0, generator=g)  # [N, V]
    ids = torch.empty(n, dtype=torch.long)
    sampled_lp = torch.empty(n)
    topk_ids = torch.empty(n, k, dtype=torch.long)
    topk_lp = torch.empty(n, k)
    for start in range(0, n, chunk):
        rows = torch.arange(start, min(start + chunk, n))
        # μ = softmax(ℓ + 0.25·ℓ'), ℓ' the logits of other rows: i.i.d. N(0, 4) noise independent of ℓ, so
        # the perturbation (σ = 0.5) costs no random draws; at V = 151936 fresh [c, V] draws would make
        # the set-up slower than the benchmark.
        x = logits[rows].to(torch.float32, copy=True)  # [c, V]
        x.add_(logits[(rows + n // 2) % n], alpha=0.25)
        log_mu = x.log_softmax(-1)  # [c, V]
        topk_lp[rows], topk_ids[rows] = log_mu.topk(k, dim=-1)
        # a ~ μ by inverse CDF: one uniform per token instead of V Gumbel draws.
        cdf = torch.exp(log_mu, out=x).cumsum_(-1)  # [c, V]
        u = torch.rand(len(rows), 1, generator=g) * cdf[:, -1:]
        ids[rows] = torch.searchsorted(cdf, u).squeeze(-1).clamp_max_(vocab - 1)
        sampled_lp[rows] = log_mu.gather(-1, ids[rows, None]).squeeze(-1)
        del x, cdf, log_mu
    adv = torch.randn(n, generator=g)
    out = {"ids": ids, "slp": sampled_lp, "tid": topk_ids, "tlp": topk_lp, "adv": adv}
    out = {key: t.to(device) for key, t in out.items()}
    out["logits"] = logits.to(device).requires_grad_()
    return out


def step_fn(case: str, inp: dict, chunk: int, compile: str | bool = "auto") -> Callable[[], dict]:
    """One forward + backward of `case`; returns a few metrics as floats (sanity, not timing)."""
    import torch

    from maskroll.trainer_adapter import MaskConfig, compute_masks, policy_loss, token_logprobs

    logits, ids, slp, adv = inp["logits"], inp["ids"], inp["slp"], inp["adv"]
    if case == "a":

        def baseline() -> dict:
            lp = torch.log_softmax(logits, -1, dtype=torch.float32).gather(-1, ids[:, None]).squeeze(-1)
            r = torch.exp(lp - slp)
            loss = -torch.mean(torch.minimum(r * adv, torch.clamp(r, 1 - 0.2, 1 + 0.28) * adv))
            loss.backward()
            return {"loss": loss.item()}

        return baseline

    method = {"b": "dppo", "c": "predictive"}[case[0]]
    cfg = MaskConfig(
        method=method,
        divergence="topk_kl",
        estimator="proportional",
        delta=0.05,
        chunk_tokens=chunk,
        compile=compile,
    )
    share = not case.endswith("'")

    def adapter() -> dict:
        if share:
            lp, stats = token_logprobs(
                logits, ids, temperature=1.0, chunk_tokens=chunk, return_stats=True, compile=compile
            )
        else:
            lp = token_logprobs(logits, ids, temperature=1.0, chunk_tokens=chunk, compile=compile)
            stats = None
        res = compute_masks(
            logits.detach(), ids, slp, inp["tid"], inp["tlp"], adv, config=cfg, vocab_stats=stats
        )
        loss, metrics = policy_loss(lp, slp, adv, res.keep, is_cap=10.0, masks=res)
        loss.backward()
        return {
            "loss": loss.item(),
            "mask_frac": metrics["mask_frac"].item(),
            "mismatch_kl": metrics["mismatch_kl"].item(),
        }

    return adapter


def run_one(args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    t0 = time.perf_counter()
    inp = make_inputs(args.tokens, args.vocab, args.topk, dtype, args.chunk_tokens, args.seed, args.device)
    setup_s = time.perf_counter() - t0
    step = step_fn(args.one, inp, args.chunk_tokens, COMPILE[args.compile])
    cuda = args.device.startswith("cuda")
    meter = CudaPeakMeter() if cuda else PeakMeter()
    logits = inp["logits"]
    times, peaks, cpu, info = [], [], [], {}
    for rep in range(args.reps + 1):  # rep 0 warms up (first-touch of allocator pools, lazy init)
        logits.grad = None
        out: dict = {}

        def timed(out: dict = out) -> None:
            # CPU time split and minor page faults: on CPU every fresh [N, V] tensor is mmap'd and
            # faulted in page by page, which shows up as system time, not as arithmetic.
            # On CUDA the clock starts and stops on an idle device: kernels are asynchronous.
            if cuda:
                torch.cuda.synchronize()
            r0, t = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            out.update(step())
            if cuda:
                torch.cuda.synchronize()
            out["s"] = time.perf_counter() - t
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            out["cpu"] = (r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime, r1.ru_minflt - r0.ru_minflt)

        peak = meter.measure(timed)
        seconds, (user, system, faults) = out.pop("s"), out.pop("cpu")
        if rep:
            times.append(seconds)
            peaks.append(peak)
            cpu.append((user, system, faults))
            info = out
        print(
            f"    ({args.one}) rep {rep}{' (warm-up)' if not rep else ''}: {seconds:.2f}s "
            f"(user {user:.2f}s, sys {system:.2f}s, {faults / 1e6:.2f}M faults), "
            f"extra peak {peak / GIB:.2f} GiB",
            file=sys.stderr,
            flush=True,
        )
    spread = common.spread(times)
    return {
        "case": args.one,
        "vocab": args.vocab,
        "dtype": args.dtype,
        "tokens": args.tokens,
        "device": args.device,
        "compile": args.compile,
        "time_s": spread["median"],
        "time_min_s": spread["min"],
        "time_max_s": spread["max"],
        "times_s": times,
        "user_s": statistics.median(c[0] for c in cpu),
        "sys_s": statistics.median(c[1] for c in cpu),
        "minor_faults": statistics.median(c[2] for c in cpu),
        "extra_peak_bytes": max(peaks),
        "grad_bytes": logits.numel() * logits.element_size(),
        "input_rss_bytes": meter.log[0].get("rss_before") if meter.log else None,
        "setup_s": setup_s,
        "peak_method": meter.method,
        "loadavg": os.getloadavg(),  # a shared machine: the neighbours' load at the end of the case
        "proc_log": meter.log,
        **info,
    }


# ---- --arith: the arithmetic of one chunk, without page faults -------------------------------------

ARITH_KERNELS = ("baseline", "eager", "compiled")


def arith_parts(vocab: int, dtype_name: str, args: argparse.Namespace) -> dict:
    """Per-chunk cost of each part of one loss step, for the baseline and for the predictive step with
    the eager and the compiled kernels (trainer_adapter/kernels.py).

    One [chunk_tokens, V] chunk; every [c, V] buffer is allocated once and reused, so no part pays
    for page faults (the step mode's wall clock is dominated by them on CPU). Parts:
      baseline  fwd: (upcast,) log_softmax(out=), gather;  bwd: zero + scatter (gather's backward),
                _log_softmax_backward_data(out=), (cast to bf16);  loss: PPO-clip on [c], fwd + bwd
      ours      fwd: kernels.chunk_stats;  bwd: kernels.chunk_grad into the gradient's rows;
                loss: compute_masks(predictive, topk_kl, proportional, vocab_stats) + policy_loss, fwd + bwd
    CPU: process CPU time (all threads; equal to the thread's with --threads 1). CUDA: wall time between
    two torch.cuda.synchronize(). Each part's figure is the minimum over --reps rounds in which the
    parts run interleaved, after one warm-up round (and, for compiled, the first call that compiles).
    """
    import torch

    from maskroll.trainer_adapter import MaskConfig, VocabStats, compute_masks, kernels, policy_loss
    from maskroll.trainer_adapter.processed import Workspace

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    c = args.chunk_tokens
    inp = make_inputs(c, vocab, args.topk, dtype, c, args.seed, args.device)
    raw = inp["logits"].detach()  # [c, V]
    ids, slp, adv = inp["ids"], inp["slp"], inp["adv"]
    temp = torch.ones(c, dtype=torch.float64, device=device)
    g = torch.full((c,), -1.0 / c, device=device)  # d loss / d log π_a of a token-mean loss
    f32 = torch.float32
    up = torch.empty(c, vocab, device=device) if dtype != f32 else None
    lp, gz, gin = (torch.empty(c, vocab, device=device) for _ in range(3))
    grad_base = torch.empty(c, vocab, dtype=dtype, device=device)
    grad_ours = {k: torch.empty(c, vocab, dtype=dtype, device=device) for k in ("eager", "compiled")}
    work = {k: Workspace() for k in ("eager", "compiled")}
    stats: dict[str, kernels.ChunkStats] = {}
    cfg = MaskConfig(method="predictive", divergence="topk_kl", estimator="proportional", delta=0.05)

    def base_fwd() -> None:
        src = up.copy_(raw) if up is not None else raw
        torch.log_softmax(src, -1, out=lp)
        stats["baseline_lp"] = lp.gather(-1, ids.unsqueeze(-1)).squeeze(-1)

    def base_bwd() -> None:
        gz.zero_().scatter_(-1, ids.unsqueeze(-1), g.unsqueeze(-1))
        torch._log_softmax_backward_data(gz, lp, -1, f32, out=gin)
        if dtype != f32:
            grad_base.copy_(gin)

    def base_loss() -> None:
        lp_a = stats["baseline_lp"].detach().requires_grad_()
        r = torch.exp(lp_a - slp)
        loss = -torch.mean(torch.minimum(r * adv, torch.clamp(r, 1 - 0.2, 1 + 0.28) * adv))
        loss.backward()

    def ours(kind: str) -> dict[str, Callable[[], None]]:
        compiled = kind == "compiled"

        def fwd() -> None:
            stats[kind] = kernels.chunk_stats(
                raw, temp, ids, None, compiled=compiled, top_k=None, top_p=None, work=work[kind]
            )

        def bwd() -> None:
            kernels.chunk_grad(
                raw, temp, ids, stats[kind].lse, g.to(f32), grad_ours[kind],
                compiled=compiled, top_k=None, top_p=None, work=work[kind],
            )  # fmt: skip

        def loss() -> None:
            st = stats[kind]
            vs = VocabStats(lse=st.lse, sum_sq=st.sum_sq, temperature=temp)
            res = compute_masks(raw, ids, slp, inp["tid"], inp["tlp"], adv, config=cfg, vocab_stats=vs)
            lp_a = (st.x_a - st.lse).requires_grad_()
            policy_loss(lp_a, slp, adv, res.keep, is_cap=10.0, masks=res)[0].backward()

        return {"fwd": fwd, "bwd": bwd, "loss": loss}

    parts = {"baseline": {"fwd": base_fwd, "bwd": base_bwd, "loss": base_loss}}
    parts["eager"] = ours("eager")
    parts["compiled"] = ours("compiled")

    def clock() -> float:
        if cuda:
            torch.cuda.synchronize()
            return time.perf_counter()
        return time.process_time()

    compile_s = {}
    for name in ("fwd", "bwd"):  # the first calls compile (or load Inductor's on-disk cache)
        t = time.perf_counter()
        parts["compiled"][name]()
        compile_s[name] = time.perf_counter() - t
    broken = kernels.compile_failure()
    times: dict[str, dict[str, list[float]]] = {k: {p: [] for p in v} for k, v in parts.items()}
    for rnd in range(args.reps + 1):
        for kind, fns in parts.items():
            for name, fn in fns.items():
                t = clock()
                fn()
                dt = clock() - t
                if rnd:
                    times[kind][name].append(dt)
    best = {k: {p: min(v) for p, v in d.items()} for k, d in times.items()}
    total = {k: sum(d.values()) for k, d in best.items()}
    se, sc = stats["eager"], stats["compiled"]
    return {
        "vocab": vocab,
        "dtype": dtype_name,
        "chunk_tokens": c,
        "device": args.device,
        "threads": torch.get_num_threads(),
        "clock": "wall between cuda syncs" if cuda else "process CPU time",
        "ms": {k: {p: v * 1e3 for p, v in d.items()} for k, d in best.items()},
        "step_ms": {k: v * 1e3 for k, v in total.items()},
        "eager_vs_baseline": total["eager"] / total["baseline"],
        "compiled_vs_baseline": total["compiled"] / total["baseline"],
        "compile_s": compile_s,
        "compile_failure": broken,
        # How far the two kernels' outputs are apart on this chunk (tolerances: tests/trainer_adapter).
        "max_abs_diff": {
            "lse": (se.lse - sc.lse).abs().max().item(),
            "sum_sq_rel": ((se.sum_sq - sc.sum_sq) / se.sum_sq).abs().max().item(),
            "grad": (grad_ours["eager"].float() - grad_ours["compiled"].float()).abs().max().item(),
            "grad_vs_baseline": (grad_ours["eager"].float() - grad_base.float()).abs().max().item()
            if dtype != f32
            else (grad_ours["eager"] - gin).abs().max().item(),
        },
        "loadavg": os.getloadavg(),
    }


def arith_table(rows: list[dict]) -> str:
    lines = [
        "| V | dtype | baseline fwd / bwd / loss (ms) | eager fwd / bwd / mask+loss (ms) "
        "| compiled fwd / bwd / mask+loss (ms) | eager ÷ baseline | compiled ÷ baseline | compile (s) |",
        "|" + "---|" * 8,
    ]
    for r in rows:
        ms = r["ms"]
        cells = [" / ".join(f"{ms[k][p]:.1f}" for p in ("fwd", "bwd", "loss")) for k in ARITH_KERNELS]
        comp = f"{r['compile_s']['fwd']:.1f} + {r['compile_s']['bwd']:.1f}"
        if r["compile_failure"]:
            comp += f" (FAILED, eager ran: {r['compile_failure'][:60]})"
        lines.append(
            f"| {r['vocab']} | {r['dtype']} | {' | '.join(cells)} | {r['eager_vs_baseline']:.2f} "
            f"| {r['compiled_vs_baseline']:.2f} | {comp} |"
        )
    return "\n".join(lines)


def arith_main(args: argparse.Namespace, vocabs: list[int], dtypes: list[str]) -> int:
    import torch

    torch.set_num_threads(args.threads)
    info = machine()
    print(
        f"bench/adapter.py --arith: [{args.chunk_tokens}, V] chunk, V={vocabs} {dtypes}, device "
        f"{args.device}, {args.threads} thread(s), min of {args.reps} | {info['cpu']}, GPU {info['gpu']}, "
        f"torch {info['torch']}, load {info['loadavg'][0]:.2f}",
        file=sys.stderr,
        flush=True,
    )
    rows = []
    for vocab in vocabs:
        for dtype in dtypes:
            rows.append(arith_parts(vocab, dtype, args))
            r = rows[-1]
            print(
                f"  V={vocab} {dtype}: eager ×{r['eager_vs_baseline']:.2f}, "
                f"compiled ×{r['compiled_vs_baseline']:.2f}",
                file=sys.stderr,
                flush=True,
            )
    if args.json:
        print(json.dumps({"machine": info, "args": vars(args), "arith": rows}, indent=1))
    else:
        print(arith_table(rows))
    return 0


# ---- parent: run the matrix, one child at a time ------------------------------------------------


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def estimated_need(case: str, n: int, vocab: int, dtype: str) -> int:
    """Rough resident bytes at the case's peak: the logits plus its [N, V] tensors (small inputs ignored)."""
    nv, el = n * vocab, 4 if dtype == "float32" else 2
    if case == "a":
        # In log_softmax's backward three float32 [N, V] live at once: the saved output, gather's
        # zero-filled gradient and the input gradient (the bf16 cast of it comes after the first two die).
        return nv * el + 3 * nv * 4
    return nv * el + nv * el + 2 * 1024 * vocab * 4  # gradient + two workspace chunks at most


def run_child(case: str, vocab: int, dtype: str, args: argparse.Namespace) -> dict:
    base = {"case": case, "vocab": vocab, "dtype": dtype, "tokens": args.tokens}
    # On CUDA the [N, V] tensors live in device memory; a case that does not fit reports its OOM.
    need, avail = estimated_need(case, args.tokens, vocab, dtype), mem_available()
    if args.device == "cpu" and need > avail:
        return {**base, "error": f"skipped: needs ~{need / GIB:.1f} GiB, MemAvailable {avail / GIB:.1f} GiB"}
    flags = {"--one": case, "--vocab": vocab, "--dtype": dtype, "--tokens": args.tokens, "--topk": args.topk,
             "--reps": args.reps, "--chunk-tokens": args.chunk_tokens, "--threads": args.threads,
             "--seed": args.seed, "--device": args.device, "--compile": args.compile}  # fmt: skip
    cmd = [sys.executable, os.path.abspath(__file__), *(str(x) for kv in flags.items() for x in kv)]
    # The child's stderr (progress, tracebacks) passes through; its last stdout line is the result.
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode == 0 and lines:
        return {**base, **json.loads(lines[-1])}
    if proc.returncode < 0:
        return {**base, "error": f"killed by signal {-proc.returncode} (the OOM killer?)"}
    return {**base, "error": f"child exited with status {proc.returncode}"}


def summarise(results: list[dict], chunk_tokens: int) -> list[dict]:
    """Per (V, dtype): each case's figures plus ratios to (a)."""
    rows = []
    for r in results:
        a = next(
            (
                x
                for x in results
                if x["case"] == "a" and x["vocab"] == r["vocab"] and x["dtype"] == r["dtype"]
            ),
            None,
        )
        chunk_bytes = chunk_tokens * r["vocab"] * 4
        row = dict(r)
        row["chunk_bytes"] = chunk_bytes
        if "error" not in r:
            # Everything above the [N, V] gradient, which every case must produce.
            row["beyond_grad_chunks"] = (r["extra_peak_bytes"] - r["grad_bytes"]) / chunk_bytes
            if a is not None and "error" not in a:
                row["time_ratio"] = r["time_s"] / a["time_s"]
                # Ratio of the fastest repetitions: less sensitive to a neighbour's load on a shared machine.
                row["time_ratio_min"] = r["time_min_s"] / a["time_min_s"]
                row["extra_vs_a_chunks"] = (r["extra_peak_bytes"] - a["extra_peak_bytes"]) / chunk_bytes
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| V | dtype | case | median (s) | ×(a) | min (s) | ×(a) min | max (s) | user (s) | sys (s) "
        "| faults (M) | extra peak (GiB) | peak − (a) (chunks) | peak − grad (chunks) | mask frac |",
        "|" + "---|" * 15,
    ]
    for r in rows:
        lead = f"| {r['vocab']} | {r['dtype']} | ({r['case']}) |"
        if "error" in r:
            lines.append(f"{lead} {r['error']} |" + " |" * 11)
            continue
        ratio = (
            f"{r['time_ratio']:.2f} | {r['time_min_s']:.2f} | {r['time_ratio_min']:.2f}"
            if "time_ratio" in r
            else f"– | {r['time_min_s']:.2f} | –"
        )
        vs_a = f"{r['extra_vs_a_chunks']:+.2f}" if "extra_vs_a_chunks" in r else "–"
        mf = f"{r['mask_frac']:.3f}" if "mask_frac" in r else "–"
        lines.append(
            f"{lead} {r['time_s']:.2f} | {ratio} | {r.get('time_max_s', float('nan')):.2f} "
            f"| {r['user_s']:.2f} | {r['sys_s']:.2f} "
            f"| {r['minor_faults'] / 1e6:.2f} | {r['extra_peak_bytes'] / GIB:.2f} | {vs_a} "
            f"| {r['beyond_grad_chunks']:+.2f} | {mf} |"
        )
    return "\n".join(lines)


def verdict(rows: list[dict]) -> list[str]:
    out = []
    for r in rows:
        if r["case"] not in ("b", "c") or "time_ratio" not in r:
            continue
        t_ok = r["time_ratio"] <= TARGET_TIME_RATIO
        m_ok = r["extra_vs_a_chunks"] <= TARGET_EXTRA_CHUNKS
        out.append(
            f"V={r['vocab']} {r['dtype']} ({r['case']}): time ×{r['time_ratio']:.2f} "
            f"{'meets' if t_ok else 'MISSES'} ≤ {TARGET_TIME_RATIO}; extra peak "
            f"{r['extra_vs_a_chunks']:+.2f} chunks vs (a) {'meets' if m_ok else 'MISSES'} "
            f"≤ {TARGET_EXTRA_CHUNKS:.0f}"
        )
    return out


def machine() -> dict:
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {
        "cpu": common.cpu_model(),
        "cores": os.cpu_count(),
        "gpu": gpu,
        "torch": torch.__version__,
        "loadavg": os.getloadavg(),
    }


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """The options and the cases to run."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8192, help="N response tokens")
    p.add_argument("--topk", type=int, default=20, help="K top logprobs per token")
    p.add_argument("--vocab", type=int, action="append", help="V (repeatable); default 32768 and 151936")
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        action="append",
        help="logits dtype (repeatable); default both",
    )
    p.add_argument("--cases", default="a,b,b',c,c'", help="comma-separated subset of a,b,b',c,c'")
    common.add_reps(p, None, help="timed repetitions after one warm-up; default 3, with --arith 5")
    common.add_baseline(p)
    p.add_argument("--chunk-tokens", type=int, default=1024, help="MaskConfig / token_logprobs chunk")
    p.add_argument("--threads", type=int, help="torch.set_num_threads; default 2, with --arith 1")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i]: where the logits and the step live")
    p.add_argument(
        "--compile",
        default="auto",
        choices=tuple(COMPILE),
        help="token_logprobs / MaskConfig compile: auto (default), true or false",
    )
    p.add_argument(
        "--arith",
        action="store_true",
        help="per-chunk arithmetic of each part (baseline, eager, compiled) with warm buffers, "
        "min of --reps; default V = 32768",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="N = 2048, V = 32768 only")
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    p.add_argument("--one", choices=tuple(CASES), help=argparse.SUPPRESS)  # child mode
    args = p.parse_args(argv)
    if args.threads is None:
        args.threads = 1 if args.arith else 2
    if args.reps is None:
        args.reps = 5 if args.arith else 3
    cases = [c.strip() for c in args.cases.split(",")]
    if unknown := set(cases) - set(CASES):
        p.error(f"unknown cases {sorted(unknown)}; expected some of {list(CASES)}")
    return args, cases


def child_main(args: argparse.Namespace) -> int:
    """--one: measure one (case, V, dtype) and print its result as the last stdout line, as JSON."""
    args.vocab, args.dtype = args.vocab[0], args.dtype[0]
    try:
        print(json.dumps(run_one(args)))
    except MemoryError as e:  # Python-side allocation failure
        print(json.dumps({"error": f"MemoryError: {e}"}))
    except RuntimeError as e:  # torch's "DefaultCPUAllocator: can't allocate memory"
        if "allocate" not in str(e):
            raise
        print(json.dumps({"error": f"out of memory: {str(e).splitlines()[0][:120]}"}))
    return 0


def run_matrix(
    args: argparse.Namespace, vocabs: list[int], dtypes: list[str], cases: list[str]
) -> list[dict]:
    """Every (V, dtype, case) in its own child, strictly one at a time: V = 151936 float32 needs ~20 GiB
    for (a)."""
    results = []
    for vocab in vocabs:
        for dtype in dtypes:
            for case in cases:
                t = time.perf_counter()
                print(f"  ({case}) V={vocab} {dtype} ...", file=sys.stderr, flush=True)
                r = run_child(case, vocab, dtype, args)
                results.append(r)
                msg = r.get("error") or (
                    f"{r['time_s']:.2f}s, extra peak {r['extra_peak_bytes'] / GIB:.2f} GiB"
                )
                print(
                    f"  ({case}) V={vocab} {dtype}: {msg} [{time.perf_counter() - t:.0f}s wall]",
                    file=sys.stderr,
                    flush=True,
                )
    return results


def main(argv: list[str] | None = None) -> int:
    args, cases = parse_args(argv)
    if args.one:
        return child_main(args)
    if args.baseline:
        return common.run_baseline(__file__, argv, args, headline, digits=3)
    if args.arith:
        return arith_main(args, args.vocab or [32768], args.dtype or ["float32", "bfloat16"])
    if args.quick:
        args.tokens, args.vocab = 2048, args.vocab or [32768]
    vocabs = args.vocab or [32768, 151936]
    dtypes = args.dtype or ["float32", "bfloat16"]
    info = machine()
    print(
        f"bench/adapter.py: N={args.tokens} K={args.topk} V={vocabs} {dtypes} cases={cases} "
        f"reps={args.reps} | {info['cpu']}, {info['cores']} cores, torch {info['torch']}, "
        f"load {info['loadavg'][0]:.2f}",
        file=sys.stderr,
        flush=True,
    )
    rows = summarise(run_matrix(args, vocabs, dtypes, cases), args.chunk_tokens)
    info["load_average_1m"] = [round(info["loadavg"][0], 2), common.load_1m()]
    if args.json:
        args_out = {k: v for k, v in vars(args).items() if k != "one"}
        print(
            json.dumps(
                {"machine": info, "args": args_out, "results": rows, "verdict": verdict(rows)}, indent=1
            )
        )
    else:
        print(table(rows))
        print("\n" + "\n".join(verdict(rows)))
        print(
            f"times: median, min and max of {args.reps} repetitions; 1-min load average "
            f"{info['load_average_1m'][0]} -> {info['load_average_1m'][1]}"
        )
    return 0


def headline(result: dict) -> dict[str, float]:
    """The figures `--baseline` compares, from one run's JSON: each case's seconds and ratio to (a)."""
    out = {}
    for r in result["results"]:
        if "error" in r:
            continue
        name = f"V={r['vocab']} {r['dtype']} ({r['case']})"
        out[f"{name} s"] = r["time_s"]
        if "time_ratio" in r and r["case"] != "a":
            out[f"{name} ×(a)"] = r["time_ratio"]
    return out


if __name__ == "__main__":
    sys.exit(main())
