"""A delta push on a real torch engine behind a real gRPC replica: applied in place, it serves exactly the
weights the digests name (GetInfo's fingerprint is the trainer's) and generates what the same weights
pushed whole generate; a delta on a base the replica does not serve is refused before a byte (FAILED_
PRECONDITION), a patch whose CRC agrees but whose result does not match its digest, or that writes out of
range, is refused (INVALID_ARGUMENT) — each leaving the old version serving the next request."""

from __future__ import annotations

import grpc
import numpy as np
import torch
from push_helpers import call, flip_last_byte, info, messages, past_crc, push, state_dict

from maskroll.client import SamplingOptions
from maskroll.proto import wire
from maskroll.proto.tensor_push import SPARSE
from maskroll.proto.weights_fingerprint import digests_fingerprint
from maskroll.weight_sync import delta
from maskroll.weight_sync.stream import manifest_of

PROMPT = [256, 84, 104, 101]
OPTS = SamplingOptions(max_tokens=12, logprobs_k=5, seed=7, ignore_eos=True)
RUN = "delta-run"


def generate(address: str):
    return call(address, lambda c: c.generate_record(PROMPT, OPTS))


def full(tensors: dict, version: int):
    """A full push with digests (as StreamPublisher sends it) and its fingerprint."""
    m = manifest_of(tensors, version, RUN, digests=True)
    return messages(tensors, version, RUN, manifest=m), digests_fingerprint(
        (t.name, t.digest) for t in m.tensors
    )


def delta_messages(d: delta.Delta) -> list:
    return [wire.manifest_to_pb(d.manifest)] + [wire.push_chunk_to_pb(i, o, b) for i, o, b in d.chunks(4096)]


def changed(tensors: dict, seed: int, fraction: float = 0.01) -> dict:
    """`tensors` with about `fraction` of each 2-D tensor's elements moved."""
    g = torch.Generator().manual_seed(seed)
    out = {k: v.clone() for k, v in tensors.items()}
    for t in out.values():
        if t.dim() == 2:
            flat = t.view(-1)
            idx = torch.randperm(flat.numel(), generator=g)[: max(1, int(fraction * flat.numel()))]
            flat[idx] += 0.5
    return out


def encode(base: dict, new: dict, version: int, base_version: int) -> delta.Delta:
    return delta.encode(base, new, delta.digests(new), version=version, base_version=base_version, run_id=RUN)


def test_a_delta_serves_exactly_what_the_same_weights_pushed_whole_serve(torch_replica, weights_root):
    addr = torch_replica.address
    v = info(addr).policy_version + 1
    base = delta.replica_copy(state_dict(weights_root / "v1"), None)
    target = changed(base, seed=1)
    # the target pushed whole, as a reference
    msgs, fingerprint = full(target, v)
    assert push(addr, msgs).version == v
    reference = generate(addr)
    assert info(addr).weights_fingerprint == fingerprint
    # the base, then the target as a delta on it
    msgs, _ = full(base, v + 1)
    assert push(addr, msgs).version == v + 1
    assert generate(addr).completion_ids.tolist() != reference.completion_ids.tolist()
    d = encode(base, target, v + 2, v + 1)
    kinds = {t.encoding for t in d.manifest.tensors}
    assert SPARSE in kinds and d.manifest.total_bytes < 0.2 * sum(
        t.nbytes for t in manifest_of(target, 0).tensors
    )
    r = push(addr, delta_messages(d))
    assert r.version == v + 2
    got = generate(addr)
    assert got.policy_version_first == v + 2
    assert got.completion_ids.tolist() == reference.completion_ids.tolist()
    np.testing.assert_array_equal(got.sampled_logprobs, reference.sampled_logprobs)
    np.testing.assert_array_equal(got.topk_logprobs, reference.topk_logprobs)
    assert info(addr).weights_fingerprint == fingerprint  # the same weights, bit for bit


def test_a_delta_on_another_base_or_corrupted_past_its_crc_is_refused_and_the_old_version_serves(
    torch_replica, weights_root
):
    addr = torch_replica.address
    v = info(addr).policy_version + 1
    base = delta.replica_copy(state_dict(weights_root / "v2"), None)
    msgs, fingerprint = full(base, v)
    assert push(addr, msgs).version == v
    before = generate(addr)

    def unchanged():
        assert info(addr).policy_version == v and info(addr).weights_fingerprint == fingerprint
        after = generate(addr)
        assert after.completion_ids.tolist() == before.completion_ids.tolist()
        np.testing.assert_array_equal(after.sampled_logprobs, before.sampled_logprobs)

    target = changed(base, seed=2)
    # not the served base: refused on its manifest
    e = push(addr, delta_messages(encode(base, target, v + 2, v - 1)))
    assert e.code == grpc.StatusCode.FAILED_PRECONDITION and "send the full version" in e.message, e
    unchanged()
    # one value flipped, the CRC made to agree: only the digest can tell
    d = encode(base, target, v + 1, v)
    patched = next(t.name for t in d.manifest.tensors if t.encoding == SPARSE)
    e = push(addr, delta_messages(past_crc(d, flip_last_byte)))
    assert e.code == grpc.StatusCode.INVALID_ARGUMENT and "would be" in e.message and patched in e.message, e
    unchanged()

    # an index out of range (the CRC agreeing again): refused before anything is written
    def out_of_range(data: bytearray) -> None:
        data[0:4] = np.array([10**9], "<i4").tobytes()

    e = push(addr, delta_messages(past_crc(d, out_of_range)))
    assert e.code == grpc.StatusCode.INVALID_ARGUMENT and "indices" in e.message, e
    unchanged()
    # and the valid delta still applies
    assert push(addr, delta_messages(d)).version == v + 1
    assert info(addr).weights_fingerprint == digests_fingerprint(
        (t.name, t.digest) for t in d.manifest.tensors
    )
