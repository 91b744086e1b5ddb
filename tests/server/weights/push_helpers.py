"""Helpers of the PushWeights tests: state dicts of the tiny model and raw PushWeights calls whose
messages a test controls (to corrupt, reorder or cut them)."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import grpc

from maskroll.client import RolloutClient, RolloutError
from maskroll.proto import wire
from maskroll.proto._generated import rollout_pb2_grpc as pb_grpc
from maskroll.weight_sync.stream import chunks_of, manifest_of


@contextlib.contextmanager
def spool_at(path: Path) -> Iterator[Path]:
    """Pushed weights received under `path` while the block runs (the replica's spool variable; the
    replicas of these tests run in the test process, so the environment applies), restored after."""
    from maskroll.server.weights.stream import SPOOL_ENV

    old = os.environ.get(SPOOL_ENV)
    os.environ[SPOOL_ENV] = str(path)
    try:
        yield path
    finally:
        if old is None:
            del os.environ[SPOOL_ENV]
        else:
            os.environ[SPOOL_ENV] = old


def state_dict(checkpoint: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(checkpoint / "model.safetensors"))


def messages(tensors: dict, version: int, run_id: str = "", chunk_bytes: int = 4096, manifest=None):
    """The PushWeights messages of `tensors`, as a list a test may edit."""
    manifest = manifest or manifest_of(tensors, version, run_id)
    return [wire.manifest_to_pb(manifest)] + [
        wire.push_chunk_to_pb(i, off, data) for i, off, data in chunks_of(tensors, chunk_bytes)
    ]


async def _push(address: str, msgs, token: str | None = None, timeout: float = 60.0):
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    async with grpc.aio.insecure_channel(address) as ch:
        return await pb_grpc.RolloutServiceStub(ch).PushWeights(
            iter(msgs), metadata=metadata, timeout=timeout
        )


def push(address: str, msgs, **kw):
    """The UpdateWeightsResponse, or the RolloutError the call ended with."""
    try:
        return asyncio.run(_push(address, msgs, **kw))
    except grpc.aio.AioRpcError as e:
        return RolloutError.from_rpc(e)


def call(address: str, fn):
    async def main():
        async with RolloutClient(address) as c:
            return await fn(c)

    return asyncio.run(main())


def info(address: str):
    return call(address, lambda c: c.info())


def wait_replicas(q, n: int, timeout: float = 30.0) -> None:
    """Until `n` replicas are registered in the queue's namespace (AssertionError after `timeout` s)."""
    import time

    deadline = time.monotonic() + timeout
    while len(q.replicas()) < n:
        assert time.monotonic() < deadline, f"fewer than {n} replicas registered"
        time.sleep(0.1)


def past_crc(d, edit):
    """The delta `d` with its first sparse patch's bytes changed by `edit(bytearray)` and its CRC made to
    agree: only the replica's own checks (the digest, the indices' range) can tell."""
    import dataclasses
    import zlib

    from maskroll.proto.tensor_push import SPARSE
    from maskroll.weight_sync import delta

    i = next(i for i, t in enumerate(d.manifest.tensors) if t.encoding == SPARSE)
    data = bytearray(d.payloads[i])
    edit(data)
    tensors = list(d.manifest.tensors)
    tensors[i] = dataclasses.replace(tensors[i], crc32=zlib.crc32(data))
    payloads = list(d.payloads)
    payloads[i] = bytes(data)
    return delta.Delta(dataclasses.replace(d.manifest, tensors=tuple(tensors)), tuple(payloads))


def flip_last_byte(data: bytearray) -> None:
    """One value of a patch off by one bit (a patch's values come after its indices)."""
    data[-1] ^= 0x01
