"""Real processes for the adversarial tests: `maskroll serve` subprocesses (torch engine) on a private
Redis, and the helpers every case uses — a raw Generate that bypasses the SDK's own checks, the health
status as an orchestrator reads it, and a normal request that must still be served after each attack.

Only processes started here are ever signalled (by their Popen object, never by name).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np

from maskroll.client import RolloutClient, SamplingOptions
from maskroll.local.replica import LocalReplica
from maskroll.proto import wire
from maskroll.proto._generated import rollout_pb2 as pb
from maskroll.proto._generated import rollout_pb2_grpc as pb_grpc
from maskroll.server.healthcheck import check

# The pull-mode namespace of the shared hardening replica (conftest.py), named here so every test
# module imports it from one uniquely named module (a bare `conftest` import resolves to whichever
# conftest pytest loaded first when several test folders run together).
NAMESPACE = "hard"

PROMPT = np.array([256, 72, 105], "<i4")  # <bos> "Hi"
NORMAL = SamplingOptions(max_tokens=3, logprobs_k=2, ignore_eos=True)


class Serve:
    """One `maskroll serve` child process (LocalReplica): its address, metrics address and log (stdout and
    stderr) on disk."""

    def __init__(
        self, model_dir: Path, log: Path, *args: str, env: dict[str, str] | None = None, engine: str = "torch"
    ) -> None:
        self.log = log
        engine_args = ["--threads", "1"] if engine == "torch" else ["--enforce-eager"]
        serve = [
            "--model", str(model_dir), "--engine", engine, *engine_args, "--port", "0", "--metrics-port", "0",
            "--drain-timeout-s", "5", *args,
        ]  # fmt: skip
        self.replica = LocalReplica(serve, env={"OMP_NUM_THREADS": "1", **(env or {})}, log=log).start()
        self.proc = self.replica.proc
        try:
            self.replica.wait_ready(180 if engine == "torch" else 600)
        except BaseException:
            self.replica.stop()
            raise
        self.address, self.metrics = self.replica.address, self.replica.metrics

    def log_text(self) -> str:
        return self.replica.log_text()

    def health(self) -> str:
        answered, status = check(self.address, timeout=3.0)
        return status if answered else f"no answer: {status}"

    def wait_health(self, want: str, timeout: float) -> float:
        """Seconds until the health status reads `want`; fails after `timeout`."""
        t0 = time.monotonic()
        while (status := self.health()) != want:
            assert self.proc.poll() is None, f"the replica exited with {self.proc.returncode}"
            assert time.monotonic() - t0 < timeout, f"health still {status} after {timeout} s, want {want}"
            time.sleep(0.2)
        return time.monotonic() - t0

    def stop(self) -> int:
        return self.replica.stop(timeout=30)

    def adopt_run(self, run_id: str = "probe-run") -> None:
        """Serve version 0 of `run_id` on the starting weights (AdoptSource, as a trainer's
        publisher.start does), so that the records this replica publishes belong to a run."""

        async def go() -> None:
            async with RolloutClient(self.address) as c:
                info = await c.info()
                await c.adopt_weights(info.weights_fingerprint, run_id=run_id)

        asyncio.run(go())


def request(prompt=PROMPT, **options) -> pb.GenerateRequest:
    """A raw GenerateRequest; fields other than options go through `extra` of raw_generate."""
    base = {"max_tokens": 4, "logprobs_k": 2}
    return pb.GenerateRequest(
        prompt_token_ids=np.asarray(prompt, "<i4").tobytes(),
        options=pb.SamplingOptions(**{**base, **options}),
    )


async def _raw(address: str, req: pb.GenerateRequest, timeout: float) -> grpc.aio.AioRpcError | int:
    """The error of a raw Generate, or the number of tokens streamed (all samples) when it succeeds."""
    options = [("grpc.max_send_message_length", 64 << 20)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        tokens = 0
        try:
            async for chunk in pb_grpc.RolloutServiceStub(channel).Generate(req, timeout=timeout):
                tokens += len(wire.chunk_from_pb(chunk).token_ids)
        except grpc.aio.AioRpcError as exc:
            return exc
    return tokens


def raw_generate(address: str, req: pb.GenerateRequest, timeout: float = 30) -> grpc.aio.AioRpcError | int:
    return asyncio.run(_raw(address, req, timeout))


def served(address: str, options: SamplingOptions = NORMAL, timeout: float = 30) -> int:
    """A normal request, through the SDK: the number of tokens of its record."""

    async def main():
        async with RolloutClient(address) as c:
            return await c.generate_record(PROMPT, options, timeout=timeout)

    return asyncio.run(main()).num_tokens


def assert_refused_then_served(
    address: str, req: pb.GenerateRequest, code: grpc.StatusCode, needle: str, timeout: float = 30
) -> str:
    """The bad request fails with `code` and a message containing `needle`; a normal request right
    after is served in full. Returns the message."""
    err = raw_generate(address, req, timeout)
    assert isinstance(err, grpc.aio.AioRpcError), f"the bad request was served ({err} chunks)"
    assert err.code() == code, (err.code(), err.details())
    assert needle in err.details(), err.details()
    assert served(address) == NORMAL.max_tokens, "the next request was not served normally"
    return err.details()


def wait_for(predicate: Callable[[], object], timeout: float, what: str) -> object:
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.1)
    return value
