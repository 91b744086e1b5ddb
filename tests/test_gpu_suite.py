"""bench/gpu_suite.py --dry-run: on a CPU, every section's code path starts (the repository's own
benchmark scripts at tiny sizes, no vLLM), a section that cannot run here says why, and the report is
written as JSON and Markdown. The GPU figures themselves come from running the suite on a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def test_dry_run_starts_every_section_and_writes_the_report(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_suite.py"), "--dry-run", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = json.loads((tmp_path / "gpu_suite.json").read_text())
    sections = report["sections"]
    assert list(sections) == ["serving", "adapter", "weight_push", "nccl", "smollm2"]
    errors = {name: row.get("error") for name, row in sections.items() if row["status"] == "error"}
    assert not errors and proc.returncode == 0, (errors, proc.stderr[-3000:])
    assert report["dry_run"] and len(report["load_average_1m"]) == 2

    serving, result = sections["serving"]["figures"], sections["serving"]["result"]
    assert serving["serving µs/token K=20"] == result["k20"]["serving_cpu_us_per_token"]
    assert sections["serving"]["result"]["tokens_per_request"] == 8
    adapter = sections["adapter"]["figures"]
    rows = {r["case"]: r for r in sections["adapter"]["result"]["results"]}
    assert adapter["predictive / plain step time"] == pytest.approx(rows["c"]["time_s"] / rows["a"]["time_s"])
    push = sections["weight_push"]["figures"]
    result = sections["weight_push"]["result"][0]
    assert push["stream GB/s, N=1"] == pytest.approx(result["model_mb"] / 1e3 / result["stream_median_s"])
    assert result["stream"] and result["directory"]  # one timed publish of each transport

    # One CPU here: NCCL needs two GPUs, and the section says so rather than failing.
    assert sections["nccl"]["status"] == "skipped" and "two CUDA devices" in sections["nccl"]["reason"]
    assert sections["smollm2"]["status"] in ("ok", "skipped")
    md = (tmp_path / "gpu_suite.md").read_text()
    assert all(f"## {name}:" in md for name in sections) and "Skipped: needs two CUDA devices" in md
