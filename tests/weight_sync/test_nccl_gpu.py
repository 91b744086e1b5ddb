"""The NCCL transport through vLLM's weight-transfer engine: runs bench/nccl_check.py, which broadcasts
a model from a trainer rank (GPU 0) to a vLLM replica (GPU 1) and checks the replica serves each version.
Needs two CUDA devices and vLLM with CUDA: skipped elsewhere, with the reason."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def _cuda_devices() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # no torch CUDA build
        return 0


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None or _cuda_devices() < 2,
    reason="NCCL weight transfer needs vLLM and two CUDA devices (trainer and replica ranks on two GPUs)",
)
def test_nccl_broadcast_reaches_a_vllm_replica_and_bumps_its_version():
    script = Path(__file__).resolve().parents[2] / "bench" / "nccl_check.py"
    out = subprocess.run(
        [sys.executable, str(script), "--layers", "2", "--hidden", "1024", "--reps", "2"],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "version 2:" in out.stdout and "replica at 2" in out.stdout
    assert "output changed: True" in out.stdout
