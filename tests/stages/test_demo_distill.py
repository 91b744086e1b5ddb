"""`maskroll demo` writes its final policy as a Hugging Face model directory, and `maskroll demo --distill
TEACHER_DIR` trains a fresh student from it by on-policy distillation with a teacher replica and a
`maskroll teacher` process attached: the KL to the teacher falls, the reward rises, summary.json says so
(`distill`), and nothing is left running."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from test_demo_reward_workers import SHORT, _processes_mentioning

pytestmark = pytest.mark.slow


def _demo(out, *args: str) -> dict:
    cmd = [sys.executable, "-m", "maskroll.app.cli", "demo", "--out", str(out), *SHORT, "--lr", "4e-3", *args]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert not _processes_mentioning(str(out)), "the demo left processes running"
    return json.loads((out / "summary.json").read_text())


def test_a_student_distilled_from_the_demos_final_policy_learns(tmp_path):
    import transformers

    teacher = _demo(tmp_path / "teacher", "--steps", "16", "--namespace", "teacher")
    final = tmp_path / "teacher" / "final"
    assert teacher["final"] == str(final) and (final / "tokenizer.json").is_file()
    transformers.AutoModelForCausalLM.from_pretrained(final)  # a Hugging Face model directory
    student = _demo(tmp_path / "student", "--steps", "20", "--namespace", "student", "--distill", str(final))
    d = student["distill"]
    assert d["teacher"] == str(final) and d["weight"] is None  # pure distillation
    kl = [s["distill_kl"] for s in student["steps"]]
    assert d["kl_first"] == kl[0] and d["kl_last"] == kl[-1]
    # The KL to the teacher falls: measured 0.6x over 20 steps on a quiet machine; under CI load the async
    # run's staleness makes the late steps noisy (one run: 4.5 at step 0, ~3.0-3.9 from step 2 on, 0.9x
    # by the sums of 4), so the test asks for the best of the second half against the start.
    assert min(kl[len(kl) // 2 :]) < 0.8 * kl[0], kl
    assert d["reward_last"] > d["reward_first"] + 0.1, d
    assert student["reward_after"] > student["reward_before"] + 0.03
    assert "maskroll teacher: ready" in (tmp_path / "student" / "logs" / "teacher-stage.log").read_text()
    assert student["queue"]["dead_lettered"] == 0
