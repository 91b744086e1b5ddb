"""An NCCL update's source on the wire (proto CollectiveSource ⇄ tensor_push.CollectiveSpec, wire_push):
the backend and each tensor's count of (index, value) pairs survive the round trip, "nccl" travels as
proto3's "" (what every trainer sent before the field existed), and `CollectiveSpec.check` refuses by name
what no receiver can take."""

from __future__ import annotations

import pytest

from maskroll.proto._generated import rollout_pb2 as pb
from maskroll.proto.tensor_push import CollectiveSpec, TensorSpec
from maskroll.proto.wire_push import collective_from_pb, collective_request


def _spec(**kw) -> CollectiveSpec:
    fields = dict(group_name="g", master_address="10.0.0.1", master_port=29600, rank_offset=3, world_size=5)
    return CollectiveSpec(**{**fields, **kw})


def _round_trip(c: CollectiveSpec) -> CollectiveSpec:
    raw = collective_request(7, c, run_id="run-a").SerializeToString()
    return collective_from_pb(pb.UpdateWeightsRequest.FromString(raw))


def test_a_sparse_broadcast_round_trips_with_its_backend_and_counts():
    tensors = (
        TensorSpec("model.embed_tokens.weight", "bfloat16", (32, 8), 0, changed=5),
        TensorSpec("lm_head.weight", "bfloat16", (32, 8), 0, changed=256),  # a full patch: every element
    )
    c = _spec(tensors=tensors, packed=False, backend="sparse_nccl")
    back = _round_trip(c)
    assert back == c
    assert [t.changed for t in back.tensors] == [5, 256]
    back.check()


def test_nccl_is_the_empty_string_on_the_wire_and_the_default_on_arrival():
    c = _spec(init=True)
    assert c.backend == "nccl"
    assert collective_request(0, c).collective.backend == ""
    assert _round_trip(c) == c
    bare = pb.UpdateWeightsRequest(version=1, collective=pb.CollectiveSource(group_name="g"))
    assert collective_from_pb(bare).backend == "nccl"


def _sparse(*tensors: TensorSpec) -> dict:
    return {"backend": "sparse_nccl", "packed": False, "tensors": tensors}


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"backend": "nccl_m2n"}, r"backend 'nccl_m2n' is not one of 'nccl', 'sparse_nccl'"),
        ({"backend": "sparse_nccl", "packed": True}, "never packed"),
        (
            _sparse(TensorSpec("w", "float32", (2, 3), 0)),
            r"tensor 'w': a sparse_nccl patch of 0 elements on 6",
        ),
        (
            _sparse(TensorSpec("w", "float32", (2, 3), 0, changed=7)),
            r"tensor 'w': a sparse_nccl patch of 7 elements on 6",
        ),
        (
            _sparse(TensorSpec("w", "bfloat16", (2**16, 2**15), 0, changed=1)),
            r"tensor 'w': 2147483648 elements, past what int32 indices address",
        ),
        (
            {"tensors": (TensorSpec("w", "float32", (2, 3), 0, changed=1),)},
            r"a 'nccl' broadcast sends tensors whole; \['w'\] carry counts",
        ),
    ],
)
def test_check_refuses_what_no_receiver_can_take_by_name(kw, message):
    with pytest.raises(ValueError, match=message):
        _spec(**kw).check()
