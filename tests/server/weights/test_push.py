"""PushWeights on a real torch engine behind a real gRPC replica: pushed weights generate exactly what
the same weights loaded from a directory generate; a corrupted chunk, a wrong shape, a NaN, a version
that does not increase, a call cut short or dropped are refused with a clear error while the old weights
keep serving; concurrent pushes keep versions monotone; the spool never keeps a file."""

from __future__ import annotations

import asyncio
import threading

import grpc
import numpy as np
import pytest
from push_helpers import call, info, messages, push, state_dict

from maskroll.client import SamplingOptions
from maskroll.proto._generated import rollout_pb2 as pb
from maskroll.weight_sync.stream import manifest_of

PROMPT = [256, 84, 104, 101]
OPTS = SamplingOptions(max_tokens=12, logprobs_k=5, seed=7, ignore_eos=True)


def generate(address: str):
    rec = call(address, lambda c: c.generate_record(PROMPT, OPTS))
    return rec


def next_version(address: str) -> int:
    return info(address).policy_version + 1


def assert_unchanged(address: str, version: int, before) -> None:
    """The replica still serves `version` and generates exactly what it did (old weights kept)."""
    assert info(address).policy_version == version
    after = generate(address)
    assert after.completion_ids.tolist() == before.completion_ids.tolist()
    np.testing.assert_array_equal(after.sampled_logprobs, before.sampled_logprobs)


def test_a_push_generates_exactly_what_the_same_weights_from_a_directory_generate(
    torch_replica, weights_root, spool
):
    addr = torch_replica.address
    v = next_version(addr)
    call(addr, lambda c: c.update_weights(v, str(weights_root / "v1")))
    from_dir = generate(addr)
    r = push(addr, messages(state_dict(weights_root / "v2"), v + 1))
    assert r.version == v + 1
    other = generate(addr)
    assert other.completion_ids.tolist() != from_dir.completion_ids.tolist()  # the push changed the weights
    r = push(addr, messages(state_dict(weights_root / "v1"), v + 2))
    assert r.version == v + 2 and info(addr).policy_version == v + 2
    pushed = generate(addr)
    assert pushed.policy_version_first == v + 2
    assert pushed.completion_ids.tolist() == from_dir.completion_ids.tolist()
    np.testing.assert_array_equal(pushed.sampled_logprobs, from_dir.sampled_logprobs)
    np.testing.assert_array_equal(pushed.topk_logprobs, from_dir.topk_logprobs)
    assert list(spool.iterdir()) == []  # the received file is deleted once loaded


def _corrupt(msgs):
    data = bytearray(msgs[3].data.data)
    data[10] ^= 0xFF
    msgs[3].data.data = bytes(data)
    return msgs


def _nan(tensors):
    name = next(n for n, t in tensors.items() if t.dim() == 2)
    tensors[name][0, 0] = float("nan")
    return tensors


def _reshape(tensors):  # same bytes, another shape: passes the manifest check, not the model's
    name = next(n for n, t in tensors.items() if t.dim() == 2)
    tensors[name] = tensors[name].reshape(-1).contiguous()
    return tensors


def _wrong_crc(tensors, v):
    m = manifest_of(tensors, v)
    specs = list(m.tensors)
    specs[0] = type(specs[0])(**{**specs[0].__dict__, "crc32": specs[0].crc32 ^ 1})
    return messages(tensors, v, manifest=type(m)(version=v, tensors=tuple(specs)))


CASES = {
    "corrupted chunk": (lambda t, v: _corrupt(messages(t, v)), grpc.StatusCode.INVALID_ARGUMENT, "CRC-32"),
    "wrong checksum": (_wrong_crc, grpc.StatusCode.INVALID_ARGUMENT, "CRC-32"),
    "wrong shape": (lambda t, v: messages(_reshape(t), v), grpc.StatusCode.INVALID_ARGUMENT, "shape of"),
    "NaN": (lambda t, v: messages(_nan(t), v), grpc.StatusCode.INVALID_ARGUMENT, "non-finite"),
    "cut short": (lambda t, v: messages(t, v)[:-2], grpc.StatusCode.INVALID_ARGUMENT, "ended early"),
    "out of order": (
        lambda t, v: (lambda m: [m[0], m[2], m[1], *m[3:]])(messages(t, v)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "out of order",
    ),
    "no manifest": (lambda t, v: messages(t, v)[1:], grpc.StatusCode.INVALID_ARGUMENT, "manifest"),
    "empty call": (lambda t, v: [], grpc.StatusCode.INVALID_ARGUMENT, "before its manifest"),
    "same version": (lambda t, v: messages(t, v - 1), grpc.StatusCode.FAILED_PRECONDITION, "must be greater"),
    "older version": (
        lambda t, v: messages(t, v - 2),
        grpc.StatusCode.FAILED_PRECONDITION,
        "must be greater",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_push_is_refused_and_the_old_weights_keep_serving(torch_replica, weights_root, spool, case):
    addr = torch_replica.address
    make, code, needle = CASES[case]
    v = next_version(addr)
    if v < 3:  # the version cases need a current version >= 2
        push(addr, messages(state_dict(weights_root / "v1"), 2))
        v = 3
    before = generate(addr)
    err = push(addr, make(state_dict(weights_root / "v2"), v))
    assert err.code == code, err
    assert needle in err.message, err.message
    assert_unchanged(addr, v - 1, before)
    assert list(spool.iterdir()) == []


def test_a_dropped_connection_mid_push_changes_nothing(torch_replica, weights_root, spool):
    """The client goes away after half the chunks (its deadline expires while the rest is withheld). The
    torch engine receives into memory: nothing ever reaches the spool, and the half-received tensors
    are dropped with the refused push (tests/server/weights/test_stream.py: the spool path)."""
    addr = torch_replica.address
    v = next_version(addr)
    before = generate(addr)
    msgs = messages(state_dict(weights_root / "v2"), v)
    half = len(msgs) // 2
    seen_spool = []

    async def main():
        async def slow():
            for m in msgs[:half]:
                yield m
            seen_spool.extend(spool.iterdir())  # (an engine that loads files would have one here)
            await asyncio.sleep(30)  # ...and the rest never comes
            yield msgs[half]

        from maskroll.proto._generated import rollout_pb2_grpc as pb_grpc

        async with grpc.aio.insecure_channel(addr) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await pb_grpc.RolloutServiceStub(ch).PushWeights(slow(), timeout=2.0)
        return err.value

    err = asyncio.run(main())
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert seen_spool == []
    assert_unchanged(addr, v - 1, before)
    assert push(addr, msgs).version == v  # nothing of the dropped push is left in the way
    assert list(spool.iterdir()) == []


def test_concurrent_pushes_keep_versions_monotone(torch_replica, weights_root):
    addr = torch_replica.address
    v = next_version(addr)
    tensors = state_dict(weights_root / "v1")
    results: dict[int, object] = {}

    def one(version):
        results[version] = push(addr, messages(tensors, version, chunk_bytes=1024))

    threads = [threading.Thread(target=one, args=(version,)) for version in (v + 1, v, v + 2, v + 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    loaded = sorted(r.version for r in results.values() if isinstance(r, pb.UpdateWeightsResponse))
    refused = [r for r in results.values() if not isinstance(r, pb.UpdateWeightsResponse)]
    assert loaded and loaded == sorted(set(loaded))  # each version at most once
    assert all(
        r.code == grpc.StatusCode.FAILED_PRECONDITION and "must be greater" in r.message for r in refused
    )
    assert info(addr).policy_version == v + 2 == max(loaded)


def test_push_needs_the_token_like_every_rpc(loop, model_dir, weights_root, spool):
    from grpc_fixtures import replica, server_config, start_torch_engine

    engine = start_torch_engine(loop, model_dir, max_logprobs=5, max_batch=2, threads=1)
    try:
        with replica(loop, server_config(model_dir, auth_token="s3cret-token-xyz"), engine) as r:
            msgs = messages(state_dict(weights_root / "v1"), 1)
            err = push(r.address, msgs)
            assert err.code == grpc.StatusCode.UNAUTHENTICATED and "bearer token" in err.message
            assert engine.policy_version == 0
            assert push(r.address, msgs, token="s3cret-token-xyz").version == 1
    finally:
        loop.run(engine.close())
