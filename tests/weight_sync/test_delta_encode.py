"""weight_sync/delta.py, the trainer's encoder, on its own: which encoding each tensor gets (by bytes), the
bytes of a patch, the digests, the tied tensor sent once, and the manifest a replica checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from maskroll.proto.tensor_push import DENSE, SAME, SPARSE, digest_of
from maskroll.weight_sync import delta


def _bf16(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).to(torch.bfloat16)


def test_each_tensor_is_sent_the_cheapest_way_and_the_patch_bytes_are_indices_then_values():
    base = {"same": _bf16([1.0, 2.0, 3.0]), "few": _bf16([0.0] * 12), "most": _bf16([0.0] * 4)}
    new = {k: v.clone() for k, v in base.items()}
    new["few"][[3, 7]] = _bf16([5.0, -6.0])  # 2 of 12 changed: 2 * (4 + 2) = 12 bytes < 24 dense
    new["most"][[0, 1]] = _bf16([1.0, 1.0])  # 2 of 4: 12 bytes > 8 dense
    d = delta.encode(base, new, delta.digests(new), version=5, base_version=4, run_id="r")
    m = d.manifest
    m.check()
    assert (m.version, m.base_version, m.run_id) == (5, 4, "r")
    enc = {t.name: (t.encoding, t.changed, t.nbytes) for t in m.tensors}
    assert enc == {"same": (SAME, 0, 0), "few": (SPARSE, 2, 12), "most": (DENSE, 0, 8)}
    assert m.total_bytes == 20
    few = bytes(d.payloads[1])
    assert np.frombuffer(few[:8], "<i4").tolist() == [3, 7]
    assert torch.frombuffer(bytearray(few[8:]), dtype=torch.bfloat16).tolist() == [5.0, -6.0]
    assert d.payloads[0] is None
    # every tensor's digest is of its new bytes, sent or not
    for t, (name, v) in zip(m.tensors, new.items(), strict=True):
        assert t.digest == digest_of(v.view(torch.uint8).numpy().tobytes()) and t.name == name
    # chunks: only the sent tensors, cut at chunk_bytes
    assert [(i, off, len(b)) for i, off, b in d.chunks(5)] == [
        (1, 0, 5),
        (1, 5, 5),
        (1, 10, 2),
        (2, 0, 5),
        (2, 5, 3),
    ]


def test_bits_are_compared_not_values():
    base = {"w": _bf16([0.0, 1.0])}
    new = {"w": _bf16([-0.0, 1.0])}  # equal as values, not as bytes: the replica must end with these
    t = delta.encode(base, new, delta.digests(new), version=1, base_version=0, run_id="r").manifest.tensors[0]
    assert t.encoding == DENSE  # 1 of 2 changed: a patch (6 bytes) is larger than the tensor (4)
    assert t.digest != digest_of(base["w"].view(torch.uint8).numpy().tobytes())


def test_replica_copy_casts_floating_tensors_and_keeps_a_tied_tensor_once():
    emb = torch.nn.Parameter(torch.randn(8, 4))
    state = {
        "embed.weight": emb,
        "layer.weight": torch.randn(4, 4),
        "lm_head.weight": emb,
        "steps": torch.tensor([3]),
    }
    out = delta.replica_copy(state, torch.bfloat16)
    assert list(out) == ["embed.weight", "layer.weight", "steps"]
    assert out["embed.weight"].dtype == torch.bfloat16 and out["steps"].dtype == torch.int64
    # round to nearest even, as the replica's own cast of the float32 weights
    assert torch.equal(out["layer.weight"], state["layer.weight"].to(torch.bfloat16))
    assert out["embed.weight"].data_ptr() != emb.data_ptr()  # a copy: the optimiser changes the model


def test_a_layout_change_cannot_be_a_delta():
    base, new = {"w": torch.zeros(4)}, {"w": torch.zeros(5)}
    with pytest.raises(ValueError, match="changed layout"):
        delta.encode(base, new, delta.digests(new), version=1, base_version=0)
    with pytest.raises(ValueError, match="other tensors"):
        delta.encode(base, {"v": torch.zeros(4)}, [""], version=1, base_version=0)


def test_advance_replaces_the_base_tensor_by_tensor_and_sends_what_encode_sends():
    g = torch.Generator().manual_seed(0)
    emb = torch.nn.Parameter(torch.randn(16, 8, generator=g))
    state = {"embed.weight": emb, "w": torch.randn(8, 8, generator=g), "head.weight": emb}
    base = delta.replica_copy(state, torch.bfloat16)
    old_ptrs = {n: t.data_ptr() for n, t in base.items()}
    with torch.no_grad():
        state["w"][0, :3] += 1.0  # 3 of 64 bf16 elements change
    new = delta.replica_copy(state, torch.bfloat16)
    expected = delta.encode(dict(base), new, delta.digests(new), version=2, base_version=1, run_id="r")
    got = delta.advance(base, state, torch.bfloat16, version=2, base_version=1, run_id="r")
    assert got.manifest == expected.manifest
    assert [None if p is None else bytes(p) for p in got.payloads] == [
        None if p is None else bytes(p) for p in expected.payloads
    ]
    assert [t.encoding for t in got.manifest.tensors] == [SAME, SPARSE]
    # base is now the new version, in new tensors (the old copies were dropped one by one)
    assert list(base) == ["embed.weight", "w"] and all(torch.equal(base[n], new[n]) for n in base)
    assert all(base[n].data_ptr() != old_ptrs[n] for n in base)


def test_advance_leaves_the_base_as_it_was_when_the_layout_changed():
    base = delta.replica_copy({"w": torch.zeros(4)}, None)
    before = base["w"]
    with pytest.raises(ValueError, match="changed layout"):
        delta.advance(base, {"w": torch.zeros(4)}, torch.bfloat16, version=1, base_version=0)
    assert base["w"] is before
