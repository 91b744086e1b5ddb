"""The NCCL transport through vLLM's weight-transfer engine: runs bench/nccl_check.py, which broadcasts
a model from a trainer rank (GPU 0) to a vLLM replica (GPU 1) and checks the replica serves each version,
with vLLM's "nccl" backend (every parameter whole) and its "sparse_nccl" one (the changed elements only,
weight_sync/nccl_sparse.py: version 3 undoes version 2's patch, so the replica must answer as at version
1). Needs two CUDA devices and vLLM with CUDA: skipped elsewhere, with the reason."""

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


needs_two_gpus = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None or _cuda_devices() < 2,
    reason="NCCL weight transfer needs vLLM and two CUDA devices (trainer and replica ranks on two GPUs)",
)


def _check(*args: str) -> str:
    script = Path(__file__).resolve().parents[2] / "bench" / "nccl_check.py"
    out = subprocess.run(
        [sys.executable, str(script), "--layers", "2", "--hidden", "1024", *args],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    return out.stdout


@needs_two_gpus
def test_nccl_broadcast_reaches_a_vllm_replica_and_bumps_its_version():
    stdout = _check("--reps", "2")
    assert "version 2:" in stdout and "replica at 2" in stdout
    assert "output changed: True" in stdout


@needs_two_gpus
def test_sparse_nccl_patches_land_exactly_on_a_vllm_replica():
    stdout = _check("--backend", "sparse_nccl", "--reps", "3", "--port", "29618")
    for v in (1, 2, 3):
        assert f"version {v}:" in stdout and f"replica at {v}, sent" in stdout, stdout[-2000:]
    assert "output changed: True" in stdout
    assert "restored output equals version 1's: True" in stdout, stdout[-2000:]
