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
    assert list(sections) == ["serving", "adapter", "weight_push", "nccl", "sparse_nccl", "smollm2"]
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
    for name in ("nccl", "sparse_nccl"):
        assert sections[name]["status"] == "skipped" and "two CUDA devices" in sections[name]["reason"]
    assert "--backend sparse_nccl" in sections["sparse_nccl"]["command"]
    assert sections["smollm2"]["status"] in ("ok", "skipped")
    md = (tmp_path / "gpu_suite.md").read_text()
    assert all(f"## {name}:" in md for name in sections) and "Skipped: needs two CUDA devices" in md


def test_the_sparse_nccl_figures_come_from_nccl_checks_lines_and_refuse_an_unrestored_output():
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_suite

    stdout = "\n".join(
        [
            "version 1: 2.000 s, 0.50 GB/s, replica at 1, sent 1000 elements, {'gpu-1': 'ok'}",
            "version 2: 0.100 s, 10.00 GB/s, replica at 2, sent 12 elements, {'gpu-1': 'ok'}",
            "version 3: 0.200 s, 5.00 GB/s, replica at 3, sent 10 elements, {'gpu-1': 'ok'}",
            "output changed: True; median 5.00 GB/s",
            "restored output equals version 1's: True ([True])",
        ]
    )
    figures = gpu_suite.sparse_nccl_figures(stdout)
    assert figures == {
        "sparse NCCL effective GB/s median (model bytes / s)": 5.0,
        "versions": 3,
        "elements sent, full version": 1000,
        "elements sent, sparse versions (median)": 12,  # of [12, 10]: the upper median, as nccl_figures'
    }
    with pytest.raises(RuntimeError, match="did not restore version 1's output"):
        gpu_suite.sparse_nccl_figures(stdout.replace("1's: True", "1's: False"))
