"""vLLM's engine core dies under a running `maskroll serve --engine vllm` (its process SIGKILLed, as an
OOM kill or a crashed GPU kernel would): the replica's health turns NOT_SERVING within seconds and
requests fail with UNAVAILABLE naming the dead engine core, instead of hanging or answering INTERNAL.
vLLM's own EngineDeadError is what reaches the health status (issue 11)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
from pathlib import Path

import grpc
import pytest
from hardening_fixtures import NORMAL, Serve, raw_generate, request, served

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
]


def _descendants(pid: int) -> dict[int, str]:
    """{pid: command line} of every process below `pid` (from /proc): what the replica started."""
    parents, cmdlines = {}, {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                cmdlines[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    out, frontier = {}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, p in parents.items():
            if p == parent and child not in out:
                out[child] = cmdlines.get(child, "")
                frontier.append(child)
    return out


def test_a_dead_engine_core_is_not_serving_and_unavailable(model_dir, tmp_path):
    env = {
        "VLLM_CACHE_ROOT": str(tmp_path / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "ind"),
        "VLLM_RPC_BASE_PATH": str(tmp_path / "rpc"),
        "VLLM_LOGGING_LEVEL": "WARNING",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    s = Serve(model_dir, tmp_path / "serve.log", "--kv-cache-gb", "0.25", env=env, engine="vllm")
    started = _descendants(s.proc.pid)  # the replica's own processes, to clean up whatever happens
    try:
        assert served(s.address) == NORMAL.max_tokens and s.health() == "SERVING"
        cores = [pid for pid, cmd in started.items() if "EngineCore" in cmd]
        assert len(cores) == 1, f"one vLLM engine core process below the replica: {started}"
        os.kill(cores[0], signal.SIGKILL)
        took = s.wait_health("NOT_SERVING", timeout=15)
        err = raw_generate(s.address, request())
        assert isinstance(err, grpc.aio.AioRpcError) and err.code() == grpc.StatusCode.UNAVAILABLE, err
        assert "vLLM's engine core is dead" in err.details(), err.details()
        assert "health: NOT_SERVING: vLLM's engine core is dead" in s.log_text()
        print(f"engine core killed: NOT_SERVING after {took:.1f} s")
    finally:
        started.update(_descendants(s.proc.pid))
        s.proc.kill()
        s.proc.wait(30)
        for pid in started:  # orphans of the replica (its worker processes): never leak one
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
