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
    assert sum(kl[-4:]) < 0.8 * sum(kl[:4]), kl  # the KL to the teacher falls (measured: 0.6x at 20 steps)
    assert d["reward_last"] > d["reward_first"] + 0.1, d
    assert student["reward_after"] > student["reward_before"] + 0.03
    assert "maskroll teacher: ready" in (tmp_path / "student" / "logs" / "teacher-stage.log").read_text()
    assert student["queue"]["dead_lettered"] == 0
