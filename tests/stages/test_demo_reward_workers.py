"""`maskroll demo --reward-workers 2`: the demo's task scored by two `maskroll reward` processes instead of
in the trainer — the same summary (plus reward_workers), and it learns like the in-trainer demo
(tests/test_demo.py: same short run, same learning check); nothing left running."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SHORT = ["--steps", "8", "--prompts-per-step", "6", "--n", "6", "--max-tokens", "12", "--engine", "torch"]


def _processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line contains `text` (the demo's private output directory)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if text in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_the_demo_learns_with_its_rewards_scored_by_two_reward_workers(tmp_path):
    out = tmp_path / "demo"
    cmd = [sys.executable, "-m", "maskroll.app.cli", "demo", "--out", str(out), *SHORT, "--lr", "4e-3"]
    cmd += ["--reward-workers", "2"]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    steps = summary["steps"]
    assert summary["reward_workers"] == 2
    assert [s["policy_version"] for s in steps] == list(range(1, 9))
    assert summary["reward_after"] > summary["reward_before"] + 0.03, (
        summary["reward_before"],
        summary["reward_after"],
    )
    assert summary["queue"]["acked"] == 8 * 6 * 6 and summary["queue"]["dead_lettered"] == 0
    # both workers scored: their logs say ready, and the records' rewards came from them
    for i in range(2):
        assert "maskroll reward: ready" in (out / "logs" / f"reward-{i}.log").read_text()
    assert "reward workers" in proc.stdout and "step   8/8" in proc.stdout
    assert not _processes_mentioning(str(out)), "the demo left processes running"
