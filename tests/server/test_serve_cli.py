"""`maskroll serve` as a subprocess: the ready line, metrics over HTTP, and the SIGTERM drain — in-flight
streams finish (or end with finish_reason "abort" after drain_timeout_s), health reads NOT_SERVING,
new work is refused, the process exits 0. With vLLM: the engine flags reach the engine and GetInfo, and
engine arguments vLLM refuses exit 2 with their names."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest

from maskroll.client import RecordAssembler, RolloutClient, RolloutError, SamplingOptions
from maskroll.local.replica import LocalReplica, descendants, kill_tree

pytestmark = pytest.mark.slow
PROMPT = [256, 83]
HAS_VLLM = importlib.util.find_spec("vllm") is not None


class Serve:
    """A `maskroll serve` child process (LocalReplica); only this PID is ever signalled or killed. env:
    the whole environment (default: this process's)."""

    def __init__(self, model_dir: Path, log: Path, *args: str, engine: str = "torch", env=None) -> None:
        self.log = log
        serve = ["--model", str(model_dir), "--engine", engine, "--port", "0", "--metrics-port", "0", *args]
        self.replica = LocalReplica(serve, env=env, inherit_env=env is None, log=log).start()
        self.proc = self.replica.proc
        try:
            self.replica.wait_ready(120 if engine == "torch" else 600)
        except BaseException:
            self.stop()
            raise
        self.address, self.metrics = self.replica.address, self.replica.metrics

    def stop(self) -> None:
        self.replica.kill()


@pytest.fixture
def serve(tiny_model_dir, tmp_path):
    started = []

    def start(*args: str, **kw) -> Serve:
        s = Serve(tiny_model_dir, tmp_path / f"serve{len(started)}.log", *args, **kw)
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


def test_sigterm_lets_in_flight_streams_finish_and_exits_0(serve):
    s = serve("--drain-timeout-s", "60")
    body = urllib.request.urlopen(f"http://{s.metrics}/metrics", timeout=10).read().decode()
    assert "maskroll_policy_version 0.0" in body

    async def main():
        async with RolloutClient(s.address) as c:
            assembler, rec, during = RecordAssembler(), None, None
            async for ch in c.generate(
                PROMPT, SamplingOptions(max_tokens=300, logprobs_k=2, ignore_eos=True)
            ):
                if during is None:
                    s.proc.send_signal(signal.SIGTERM)
                    await asyncio.sleep(0.2)
                    async with RolloutClient(s.address) as other:
                        with pytest.raises(RolloutError) as refused:
                            await other.generate_record(PROMPT, SamplingOptions(max_tokens=2))
                        during = (await other.health(), refused.value)
                rec = assembler.add(ch) or rec
            return rec, during

    rec, (health, refused) = asyncio.run(main())
    assert rec.finish_reason == "length" and rec.num_tokens == 300
    assert health == "NOT_SERVING"
    assert refused.code == grpc.StatusCode.UNAVAILABLE and "draining" in refused.message
    assert s.proc.wait(30) == 0
    assert "maskroll serve: stopped" in s.log.read_text()


def test_sigterm_past_the_drain_timeout_ends_streams_with_abort_records(serve):
    s = serve("--drain-timeout-s", "0.5")

    async def main():
        async with RolloutClient(s.address) as c:
            assembler, records, signalled = RecordAssembler(), [], False
            async for ch in c.generate(PROMPT, SamplingOptions(max_tokens=1000, n=2, ignore_eos=True)):
                if not signalled:
                    s.proc.send_signal(signal.SIGTERM)
                    signalled = True
                rec = assembler.add(ch)
                if rec is not None:
                    records.append(rec)
            return records

    t0 = time.monotonic()
    records = asyncio.run(main())
    assert sorted(r.sample_index for r in records) == [0, 1]
    assert all(r.finish_reason == "abort" and r.num_tokens < 1000 for r in records)
    assert s.proc.wait(30) == 0
    assert time.monotonic() - t0 < 20


# ---- vLLM: the engine flags -------------------------------------------------------------------------


def _vllm_env(tmp_path: Path) -> dict[str, str]:
    """vLLM's caches and IPC sockets under this test's directory, quieter logs, no usage reports."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MASKROLL_")}
    for var, sub in (
        ("VLLM_CACHE_ROOT", "vllm"),
        ("TORCHINDUCTOR_CACHE_DIR", "ind"),
        ("VLLM_RPC_BASE_PATH", "rpc"),
    ):
        env[var] = str(tmp_path / sub)
    env.update(VLLM_LOGGING_LEVEL="WARNING", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    return env


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")
def test_vllm_engine_flags_reach_the_engine_and_get_info(serve, tmp_path):
    """One vLLM engine of its own (the session's shared one needs the model's full context): a short
    context, a smaller fixed KV cache, a seed, prefix caching and a pass-through argument."""
    s = serve(
        "--enforce-eager", "--max-model-len", "256", "--kv-cache-gb", "0.25", "--seed", "5", "--max-batch",
        "8", "--enable-prefix-caching", "--vllm-arg", "max_num_batched_tokens=512",
        engine="vllm", env=_vllm_env(tmp_path),
    )  # fmt: skip

    async def main():
        async with RolloutClient(s.address) as c:
            info = await c.info()
            rec = await c.generate_record(PROMPT, SamplingOptions(max_tokens=8, seed=1, ignore_eos=True))
            with pytest.raises(RolloutError) as too_long:
                await c.generate_record(PROMPT, SamplingOptions(max_tokens=255))
            return info, rec, too_long.value

    info, rec, too_long = asyncio.run(main())
    assert (info.engine, info.max_model_len, info.max_tokens, info.seed, info.max_batch) == (
        "vllm",
        256,
        255,
        5,
        8,
    )
    assert (info.dtype, info.tensor_parallel_size, info.quantization, info.prefix_caching) == (
        "float32",
        1,
        "",
        True,
    )
    # 0.25 GiB at 2048 bytes per token (2 layers x K, V x 4 heads x 32 dims x float32).
    assert (info.kv_cache_bytes, info.gpu_memory_utilization, info.kv_cache_tokens) == (1 << 28, 0.0, 131072)
    assert rec.num_tokens == 8 and np.all(rec.sampled_logprobs <= 0)
    assert too_long.code == grpc.StatusCode.INVALID_ARGUMENT and "max_model_len 256" in too_long.message


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")
@pytest.mark.parametrize(
    ("args", "needles"),
    [
        # Refused by maskroll against AsyncEngineArgs, before any engine process starts.
        (["--vllm-arg", "max_num_batched_token=512"],
         ["'max_num_batched_token' is not a vLLM engine argument", "did you mean max_num_batched_tokens"]),
        # Refused by vLLM's own config check: longer than the model's 1024 positions.
        (["--max-model-len", "4096"], ["vLLM refused the engine arguments", "max_model_len"]),
    ],
)  # fmt: skip
def test_engine_arguments_vllm_refuses_exit_2_naming_them(tiny_model_dir, tmp_path, args, needles):
    cmd = [sys.executable, "-m", "maskroll.app.cli", "serve", "--model", str(tiny_model_dir),
           "--engine", "vllm", "--port", "0", "--enforce-eager", *args]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_vllm_env(tmp_path))
    assert out.returncode == 2, out.stderr[-3000:]
    for needle in needles:
        assert needle in out.stderr, out.stderr[-3000:]


def test_kill_takes_the_processes_a_replica_started_with_it():
    """A SIGKILLed `maskroll serve` cannot stop what it started (vLLM's engine core and workers, GBs
    each): LocalReplica.kill goes through local.replica.kill_tree, which kills them too. A shell that
    starts two sleepers stands in for the replica: both are gone afterwards, the shell's status is -9."""
    proc = subprocess.Popen(["sh", "-c", "sleep 300 & sleep 300 & wait"])
    deadline = time.monotonic() + 10
    while len(kids := descendants(proc.pid)) < 2:
        assert time.monotonic() < deadline, f"the shell started {kids}"
        time.sleep(0.05)
    assert kill_tree(proc) == -signal.SIGKILL
    for pid in kids:
        deadline = time.monotonic() + 10
        while Path(f"/proc/{pid}").exists() and "Z" not in _state(pid):
            assert time.monotonic() < deadline, f"{pid} survived kill_tree"
            time.sleep(0.05)


def _state(pid: int) -> str:
    """The process's state letter (Z: a zombie, dead and waiting for its new parent to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "Z"
