"""The stream transport's two destinations (server/weights/stream.py), driven by hand-made message
sequences converted as the servicer converts them (no gRPC): into memory (the
torch engine) the tensors come out bit-identical with the manifest's dtypes and shapes; into the spool
(engines that load files: vLLM) the file is a safetensors file of exactly those tensors, and any refused
push — a corrupted chunk, a call cut short, a cancellation — leaves no file behind."""

from __future__ import annotations

import asyncio

import pytest
import torch
from push_helpers import messages

from maskroll.proto import wire
from maskroll.server.errors import InvalidArgument
from maskroll.server.weights import stream

TENSORS = {
    "a": torch.arange(3000, dtype=torch.float32).reshape(30, 100) / 7,
    "empty": torch.zeros(0, 4),
    "b": torch.linspace(-2, 2, 999, dtype=torch.bfloat16),
    "c": torch.tensor([1, -2, 3], dtype=torch.int64),
}


async def _rest(msgs):
    for m in msgs:
        yield wire.push_chunk_from_pb(m)


def _receive(fn, msgs, *args):
    manifest = wire.manifest_from_pb(msgs[0])
    return asyncio.run(fn(manifest, _rest(msgs[1:]), *args))


def test_received_into_memory_bit_identical():
    got = _receive(stream.receive_tensors, messages(TENSORS, 3, chunk_bytes=1000))
    assert list(got) == list(TENSORS)
    for name, t in TENSORS.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape
        assert torch.equal(got[name].view(torch.uint8), t.view(torch.uint8)), name


def test_received_into_the_spool_is_a_safetensors_file_of_the_tensors(tmp_path):
    from safetensors.torch import load_file

    directory = _receive(stream.receive_file, messages(TENSORS, 3, chunk_bytes=1000), tmp_path)
    loaded = load_file(str(directory / stream.FILE_NAME))
    assert sorted(loaded) == sorted(TENSORS)
    for name, t in TENSORS.items():
        assert torch.equal(loaded[name].view(torch.uint8), t.view(torch.uint8)), name
    stream.discard(directory)
    assert list(tmp_path.iterdir()) == []


def _corrupt(msgs):
    data = bytearray(msgs[2].data.data)
    data[5] ^= 1
    msgs[2].data.data = bytes(data)
    return msgs


@pytest.mark.parametrize(
    ("make", "needle"),
    [(_corrupt, "CRC-32 of the received bytes"), (lambda m: m[:-1], "the push ended early: tensor 3 of 4")],
)
def test_a_refused_push_leaves_no_file_in_the_spool(tmp_path, make, needle):
    msgs = make(messages(TENSORS, 3, chunk_bytes=1000))
    for fn, args in ((stream.receive_file, (tmp_path,)), (stream.receive_tensors, ())):
        with pytest.raises(InvalidArgument, match=needle):
            _receive(fn, msgs, *args)
    assert list(tmp_path.iterdir()) == []


def test_a_cancelled_push_leaves_no_file_in_the_spool(tmp_path):
    msgs = messages(TENSORS, 3, chunk_bytes=1000)
    seen = []

    async def stalled():
        for m in msgs[1:3]:
            yield wire.push_chunk_from_pb(m)
        seen.extend(tmp_path.iterdir())
        await asyncio.sleep(60)

    async def main():
        task = asyncio.ensure_future(stream.receive_file(wire.manifest_from_pb(msgs[0]), stalled(), tmp_path))
        while not seen:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert len(seen) == 1  # the half-received file existed...
    assert list(tmp_path.iterdir()) == []  # ...and is gone


def test_a_push_larger_than_free_memory_is_refused_before_any_byte(monkeypatch):
    from maskroll.server.errors import FailedPrecondition

    monkeypatch.setattr(stream, "memory_available", lambda: 1 << 20)
    big = {"w": torch.zeros(1 << 20)}  # 4 MiB
    with pytest.raises(
        FailedPrecondition, match=r"do not fit in this replica's free memory \(1048576 bytes\)"
    ):
        _receive(stream.receive_tensors, messages(big, 1, chunk_bytes=1 << 20)[:1])


@pytest.mark.parametrize(
    ("index", "offset", "size"), [(0, 0, 1), (1, 0, 300), (5, 1 << 33, 1000), (200, 4 << 20, 1 << 21)]
)
def test_the_hand_encoding_and_decoding_of_a_chunk_match_protobuf(index, offset, size):
    import numpy as np

    data = memoryview(np.arange(size, dtype=np.uint8))
    raw = wire.push_chunk_bytes(index, offset, data)
    assert raw == wire.push_chunk_to_pb(index, offset, data).SerializeToString()
    got_index, got_offset, got = wire.push_chunk_from_pb(raw)
    assert (got_index, got_offset, bytes(got)) == (index, offset, bytes(data))
    assert wire.push_chunk_from_pb(wire.push_chunk_to_pb(index, offset, data)) == (index, offset, bytes(data))


def test_a_malformed_raw_chunk_is_refused_with_what_is_wrong():
    raw = wire.push_chunk_bytes(3, 8, b"abcdefgh")
    with pytest.raises(ValueError, match="truncated: field 2 needs"):
        wire.push_chunk_from_pb(raw[:-1])
    with pytest.raises(ValueError, match="a varint runs past its end"):
        wire.push_chunk_from_pb(b"\x12\x80")
    manifest = wire.manifest_to_pb(wire.manifest_from_pb(messages(TENSORS, 3)[0])).SerializeToString()
    with pytest.raises(ValueError, match="carries one manifest, first; got another one mid-stream"):
        wire.push_chunk_from_pb(manifest)
    with pytest.raises(ValueError, match="must start with its manifest, got a data chunk first"):
        wire.manifest_from_pb(raw)


def test_concurrent_pushes_into_the_spool_reserve_its_disk(tmp_path):
    """Item 5 of the hardening issue on the spool (vLLM's path): two pushes that each fit the spool's free
    disk but not together are not both accepted — the second is refused before it receives a byte — and
    the reservation ends with the first push."""
    import shutil

    from maskroll.proto.tensor_push import TensorSpec, WeightsManifest
    from maskroll.server.errors import FailedPrecondition

    n = int(shutil.disk_usage(tmp_path).free * 0.6) // 4
    spec = TensorSpec(name="w", dtype="F32", shape=(n,), nbytes=4 * n, crc32=0)
    manifest = WeightsManifest(version=1, tensors=(spec,))
    receiving = asyncio.Event()

    async def stalled():  # the first push: being received, its bytes still to come
        receiving.set()
        await asyncio.sleep(60)
        yield None

    async def nothing():
        return
        yield

    async def main():
        first = asyncio.ensure_future(stream.receive_file(manifest, stalled(), tmp_path))
        await receiving.wait()
        with pytest.raises(FailedPrecondition, match="reserved by pushes being received now"):
            await stream.receive_file(manifest, nothing(), tmp_path)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        # the first push is gone with its reservation: the same manifest is taken (and ends early)
        with pytest.raises(InvalidArgument, match="ended early"):
            await stream.receive_file(manifest, nothing(), tmp_path)

    asyncio.run(main())
    assert list(tmp_path.iterdir()) == []
