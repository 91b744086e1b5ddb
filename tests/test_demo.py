"""`maskroll demo` end to end, as a user runs it: real Redis, two pull-mode replicas (torch engine),
the trainer loop with predictive masks, weight sync. A short run must learn, really use both
replicas, move the policy version on every replica, and leave no process behind (Ctrl-C included).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SHORT = ["--steps", "8", "--prompts-per-step", "6", "--n", "6", "--max-tokens", "12", "--engine", "torch"]


def _processes_mentioning(text: str) -> list[tuple[int, str]]:
    """Live processes whose command line contains `text` (the demo's private output directory)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd:
            found.append((int(entry.name), cmd))
    return found


def _demo(out: Path, *args: str, **kw) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "maskroll.app.cli", "demo", "--out", str(out), *args]
    # Ctrl-C's default action in the demo, whatever this process inherited: a shell that starts pytest in
    # the background ignores SIGINT for it, and a Python started so never raises KeyboardInterrupt.
    kw.setdefault("preexec_fn", lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def test_short_demo_learns_across_processes_and_cleans_up(tmp_path):
    out = tmp_path / "demo"
    # A doubled learning rate: at the default (2e-3) eight steps moved held-out reward by 0.03–0.10, so
    # the learning check below failed about one run in ten on timing noise alone; at 4e-3 it is 0.08–0.16.
    # bf16 replicas, the weights pushed as deltas (the default) on the last version, verified on arrival
    proc = _demo(out, *SHORT, "--lr", "4e-3", "--replica-dtype", "bfloat16")
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, log[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    steps = summary["steps"]
    # records came from both replicas
    replicas = set().union(*(s["replicas"] for s in steps))
    assert replicas == {"demo-replica-0", "demo-replica-1"}
    # the policy version advanced every step and reached every replica
    assert [s["policy_version"] for s in steps] == list(range(1, 9))
    assert summary["replica_versions"] == {"demo-replica-0": 8, "demo-replica-1": 8}
    # generation overlapped training: batches after the first were sampled by an older version
    assert max(s["staleness"] for s in steps[1:]) >= 1.0
    # it learned: held-out reward clearly above its starting (chance) level
    assert summary["reward_after"] > summary["reward_before"] + 0.03, (
        summary["reward_before"],
        summary["reward_after"],
    )
    assert summary["queue"]["acked"] == sum(6 * 6 for _ in steps)
    # every update after version 0 reached both replicas as a delta; their weights are the trainer's
    assert summary["weight_updates"] == {"delta": 16, "full": 0}
    assert summary["replicas_match_trainer"] is True
    from safetensors import safe_open

    with safe_open(str(out / "model" / "model.safetensors"), "pt") as f:  # the tied head stored once
        numel = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118 (not a dict)
    assert summary["model_bytes"] == 2 * numel  # bf16
    assert 0 < summary["weight_bytes_per_update"] <= summary["model_bytes"] * 1.001
    assert (out / "demo.png").stat().st_size > 10_000
    for key in ("mask_frac", "divergence_mean", "mismatch_kl", "tokens_per_s", "agree_predictive_far"):
        assert key in steps[-1]
    assert "held-out reward" in log and "step   8/8" in log
    assert not _processes_mentioning(str(out)), "the demo left processes running"


def test_trl_trainer_demo_learns_with_the_same_summary(tmp_path):
    """`--trainer trl`: the same task through TRL's GRPOTrainer (MaskrollGRPOTrainer), same outputs."""
    out = tmp_path / "demo-trl"
    # lr 4e-3 as in the test above: at the default the held-out gain over 8 steps (0.03-0.07 in some
    # runs) sat at the check's edge; at 4e-3 it was 0.09-0.13.
    proc = _demo(out, *SHORT, "--trainer", "trl", "--lr", "4e-3")
    try:
        log, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # the demo stops every process it started, then exits
        proc.communicate(timeout=120)
        raise
    assert proc.returncode == 0, log[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    steps = summary["steps"]
    assert summary["config"]["trainer"] == "trl"
    assert [s["policy_version"] for s in steps] == list(range(1, 9))
    assert summary["replica_versions"] == {"demo-replica-0": 8, "demo-replica-1": 8}
    assert set().union(*(s["replicas"] for s in steps)) == {"demo-replica-0", "demo-replica-1"}
    assert max(s["staleness"] for s in steps[1:]) >= 1.0
    assert summary["reward_after"] > summary["reward_before"] + 0.03, (
        summary["reward_before"],
        summary["reward_after"],
    )
    assert summary["queue"]["acked"] == 8 * 6 * 6
    assert (out / "demo.png").stat().st_size > 10_000
    assert "held-out reward" in log and "step   8/8" in log
    assert not _processes_mentioning(str(out)), "the demo left processes running"


def test_ctrl_c_stops_every_process(tmp_path):
    out = tmp_path / "demo"
    proc = _demo(out, *SHORT)
    deadline = time.monotonic() + 300
    for line in proc.stdout:
        if "replicas ready" in line:
            break
        assert time.monotonic() < deadline, "the demo did not start"
    assert _processes_mentioning(str(out)), "expected the demo's replicas and Redis to be running"
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, rest[-2000:]
    deadline = time.monotonic() + 30
    while left := _processes_mentioning(str(out)):
        assert time.monotonic() < deadline, f"left behind: {left}"
        time.sleep(0.2)


def test_compare_runs_every_method_with_the_same_seed(tmp_path):
    out = tmp_path / "cmp"
    args = ["--compare", "--steps", "2", "--prompts-per-step", "3", "--n", "3", "--max-tokens", "8"]
    proc = _demo(out, *args, "--engine", "torch")
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, log[-3000:]
    summaries = json.loads((out / "summary.json").read_text())
    assert set(summaries) == {"ppo", "dppo", "predictive"}
    assert {s["mask_config"]["method"] for s in summaries.values()} == {"ppo", "dppo", "predictive"}
    # the same seed: every method starts from the same model and the same held-out reward
    assert len({s["reward_before"] for s in summaries.values()}) == 1
    assert (out / "demo.png").stat().st_size > 10_000
    assert not _processes_mentioning(str(out))
