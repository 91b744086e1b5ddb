"""`maskroll serve` as a subprocess: the ready line, metrics over HTTP, and the SIGTERM drain — in-flight
streams finish (or end with finish_reason "abort" after drain_timeout_s), health reads NOT_SERVING,
new work is refused, the process exits 0."""

from __future__ import annotations

import asyncio
import re
import select
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from maskroll.client import RecordAssembler, RolloutClient, RolloutError, SamplingOptions

pytestmark = pytest.mark.slow
PROMPT = [256, 83]


class Serve:
    """A `maskroll serve` child process; only this PID is ever signalled or killed."""

    def __init__(self, model_dir: Path, log: Path, *args: str) -> None:
        self.log = log
        cmd = [sys.executable, "-m", "maskroll.server.cli", "serve", "--model", str(model_dir),
               "--engine", "torch", "--port", "0", "--metrics-port", "0", *args]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log.open("w"), text=True)
        line = self._readline(timeout=120)
        m = re.search(r"ready on (\S+) .*metrics http://(\S+)/metrics", line)
        assert m, f"unexpected ready line {line!r}; log:\n{log.read_text()}"
        self.address, self.metrics = m.group(1), m.group(2)

    def _readline(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if select.select([self.proc.stdout], [], [], 0.5)[0]:
                return self.proc.stdout.readline()
            if self.proc.poll() is not None:
                break
        raise AssertionError(f"no ready line (exit {self.proc.poll()}); log:\n{self.log.read_text()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def serve(tiny_model_dir, tmp_path):
    started = []

    def start(*args: str) -> Serve:
        s = Serve(tiny_model_dir, tmp_path / f"serve{len(started)}.log", *args)
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
